"""What the GPU stages share: the results stamp, a soft deadline, models drawn on the device, shapes.

Every stage (`correctness`, `verifier_stage`, `engine_costs`, `train_stage`, `moe_stage`) is a script run by
`experiments/gpu/run.sh` with `--out FILE.md --budget-s SECONDS [--tiny]`. It rewrites its markdown
file after every finished cell, so a stage stopped by run.sh's hard timeout still leaves the cells
it finished; its soft `Deadline` skips the cells that no longer fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Qwen3's DFlash mask token: the first spare embedding row past the tokenizer (as released).
QWEN3_MASK_TOKEN = 151669


class Deadline:
    """A soft time budget: `fits(seconds)` says whether work of that length still fits."""

    def __init__(self, budget_s: float, reserve_s: float = 10.0):
        # The reserve keeps time for writing the results before run.sh's hard timeout.
        self.end = time.monotonic() + budget_s - reserve_s

    def left(self) -> float:
        return self.end - time.monotonic()

    def fits(self, seconds: float = 0.0) -> bool:
        return self.left() > seconds


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + (" (with uncommitted changes)" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def describe_device() -> str:
    """E.g. '1 x GPU NVIDIA H200 (139 GiB)'; initialises jax's default backend."""
    import jax

    devices = jax.devices()
    d = devices[0]
    text = f"{len(devices)} x {d.platform.upper()} {d.device_kind}"
    try:
        limit = (d.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 - memory_stats is optional per backend
        limit = None
    return text + (f" ({limit / 2**30:.0f} GiB usable)" if limit else "")


def stamp(title: str, argv: list[str], notes: list[str] = ()) -> list[str]:
    """The header every results file starts with: date, jax version, device, host, commit, command."""
    import jax
    import jaxlib

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return [
        f"# {title}",
        "",
        f"- Date: {now}",
        f"- jax {jax.__version__} (jaxlib {jaxlib.__version__}), Python {platform.python_version()}",
        f"- Device: {describe_device()}; host: {os.cpu_count()} CPU cores, {platform.machine()}",
        f"- tevjax commit: {git_commit()}",
        f"- Command: `python {Path(sys.argv[0]).name} {' '.join(argv)}`",
        *notes,
        "",
    ]


def stage_parser(doc: str, budget_s: float, *, budget_help: str = "soft time budget of the whole stage",
                 tiny_help: str = "tiny shapes (the CPU dry run)") -> argparse.ArgumentParser:
    """The command line every stage shares (`--out`, `--budget-s`, `--tiny`); a stage adds its own."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=budget_s, help=budget_help)
    ap.add_argument("--tiny", action="store_true", help=tiny_help)
    return ap


def finish(path: str | os.PathLike, lines: list[str], skipped: list[str]) -> int:
    """Writes a stage's final results, naming the cells its time budget left out, and prints them."""
    if skipped:
        lines = lines + ["", "Not run (the stage's time budget ran out): " + "; ".join(skipped) + "."]
    write(path, lines)
    print("\n".join(lines))
    return 0


def write(path: str | os.PathLike, lines: list[str]) -> None:
    """Writes a results file (whole, so a later stop never leaves half a table)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("\n".join(lines).rstrip("\n") + "\n")
    tmp.replace(path)


def device_init(module_cls, cfg, seed: int):
    """`module_cls(cfg, rngs=...)` (an nnx.Module) with its parameters drawn on the device inside one
    jit: nothing is built on the host, so an 8B-parameter bf16 model takes seconds, not minutes of
    host initialisation and transfer. The keys are "unsafe_rbg": random benchmark weights need no
    cryptographic-quality splits, and its generator compiles about twice as fast as threefry."""
    import jax
    from flax import nnx

    make = lambda: module_cls(cfg, rngs=nnx.Rngs(jax.random.key(seed, impl="unsafe_rbg")))  # noqa: E731
    graphdef = nnx.graphdef(nnx.eval_shape(make))
    state = jax.jit(lambda: nnx.state(make()))()
    return nnx.merge(graphdef, state)


def targets(tiny: bool):
    """[(name, ModelConfig)]: Qwen3-4B and Qwen3-8B shapes in bf16 (the public configs, as in
    `tevjax.models.config.PRESETS`), or two tiny bf16 Qwen3-style configs for the CPU dry run."""
    from tevjax.models.config import PRESETS
    from tevjax.testing import tiny_config

    if tiny:
        small = tiny_config("qwen3", vocab_size=8192, num_layers=6, max_position_embeddings=2048,
                            dtype="bfloat16", param_dtype="bfloat16")
        return [("tiny-a", small), ("tiny-b", dataclasses.replace(small, hidden_size=96, num_layers=8))]
    return [("Qwen3-4B", PRESETS["qwen3-4b"]), ("Qwen3-8B", PRESETS["qwen3-8b"])]


def drafter_config(target_cfg, tiny: bool):
    """A DFlash drafter for `target_cfg`: 5 layers, block 16 (the released Qwen3-4B/8B drafters), or
    2 layers, block 8 in the tiny dry run; bf16 like the target."""
    from tevjax.models.dflash import DFlashConfig

    if tiny:
        return DFlashConfig.for_target(target_cfg, num_layers=2, block_size=8, mask_token_id=target_cfg.vocab_size - 1)
    return DFlashConfig.for_target(target_cfg, num_layers=5, block_size=16, mask_token_id=QWEN3_MASK_TOKEN)


def ms_cell(times_ms) -> str:
    """'median (p10-p90)' of a list of milliseconds."""
    import numpy as np

    t = np.asarray(times_ms)
    return f"{np.median(t):.3f} ({np.percentile(t, 10):.3f}-{np.percentile(t, 90):.3f})"
