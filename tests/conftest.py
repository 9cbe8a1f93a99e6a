"""Settings for the whole test session, its xdist workers and the subprocesses tests start."""

import os
import tempfile
from pathlib import Path

# Many tests build decoders and trainers whose programs equal ones compiled earlier: every new
# `Decoder` or `train()` call traces again and XLA would compile again. JAX's persistent
# compilation cache turns those repeats into disk reads (test_train.py: 227 s -> 109 s). Set in
# the environment, before jax is imported, so that both workers and every subprocess (the CLI,
# the forced-device runs) share it. Cache every program, however small or quick to compile.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(tempfile.gettempdir()) / "tevjax-test-xla-cache"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
# Tests compile far more than they compute (tiny models), and LLVM's optimisation is most of
# XLA's CPU compile time: level 0 halves it (test_prefill + test_interrupt: 113 s -> 66 s). The
# HLO programs are the same; only their machine code is less optimised.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()
