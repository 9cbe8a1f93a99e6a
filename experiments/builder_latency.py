"""Latency of the jitted DDTree builder (`tevjax.builder.build_ddtree`).

For each budget and vocabulary V (G = 15 draft rows by default) it times the jitted builder on
random log-marginals: median (and p10/p90) over >= 50 calls (default 100) after warm-up, float32
and bfloat16 inputs, plus the per-depth top-k alone (the part that reads all G x V entries) to
show where time goes.
The minimum is listed too: on a shared host it is the figure least disturbed by other processes.
Prints a markdown table and writes it to experiments/results/builder_latency.md.

    python experiments/builder_latency.py                 # the default grid, batch 1
    python experiments/builder_latency.py --batch 128     # vmapped over a batch (GPU runs)
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

from tevjax.builder import build_ddtree
from report import emit  # experiments/report.py (scripts run from this folder)


def time_calls(fn, *args, iters: int) -> np.ndarray:
    """Seconds per call, after two warm-up calls (the first compiles)."""
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    out = np.empty(iters)
    for i in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out[i] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--budgets", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--vocabs", type=int, nargs="+", default=[49152, 151936])
    ap.add_argument("--depth", type=int, default=15)
    ap.add_argument("--batch", type=int, default=1, help="1: a single tree; >1: vmapped batch")
    ap.add_argument("--iters", type=int, default=100)
    default_out = pathlib.Path(__file__).parent / "results" / "builder_latency.md"
    ap.add_argument("--out", default=str(default_out))
    args = ap.parse_args()
    if args.iters < 50:
        raise SystemExit("--iters must be >= 50 (medians over fewer calls are too noisy)")

    rows = []
    for vocab in args.vocabs:
        key = jax.random.key(vocab)
        shape = (args.depth, vocab) if args.batch == 1 else (args.batch, args.depth, vocab)
        lm32 = jax.nn.log_softmax(3.0 * jax.random.normal(key, shape, jnp.float32), axis=-1)
        lm16 = lm32.astype(jnp.bfloat16)
        roots = jnp.zeros(shape[:-2], jnp.int32)
        for budget in args.budgets:
            def one(lm, root, budget=budget):
                return build_ddtree(lm, root, budget)

            def topk(lm, budget=budget):
                return jax.lax.top_k(lm.astype(jnp.float32), min(budget, vocab))

            if args.batch > 1:
                one, topk = jax.vmap(one), jax.vmap(topk)
            build, topk = jax.jit(one), jax.jit(topk)
            t32 = time_calls(build, lm32, roots, iters=args.iters)
            t16 = time_calls(build, lm16, roots, iters=args.iters)
            tk = time_calls(topk, lm32, iters=args.iters)
            rows.append((budget, vocab, t32, t16, tk))
            print(f"budget {budget} V={vocab}: f32 {np.median(t32) * 1e3:.2f} ms", flush=True)

    dev = jax.devices()[0]
    lines = [
        "# DDTree builder latency (jitted `build_ddtree`)",
        "",
        f"Device: {dev.platform} ({dev.device_kind}), {os.cpu_count()} host cores,"
        f" {platform.processor() or platform.machine()}; jax {jax.__version__}; G = {args.depth};"
        f" batch = {args.batch}; {args.iters} timed calls after warm-up; host load average"
        f" at end: {os.getloadavg()[0]:.1f}.",
        "",
        "| budget | V | f32 input median ms (p10-p90) | f32 min ms | bf16 input median ms |"
        " top-k alone median ms |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for budget, vocab, t32, t16, tk in rows:
        p10, p50, p90 = np.percentile(t32, [10, 50, 90]) * 1e3
        lines.append(
            f"| {budget} | {vocab} | {p50:.2f} ({p10:.2f}-{p90:.2f}) | {np.min(t32) * 1e3:.2f} |"
            f" {np.median(t16) * 1e3:.2f} |"
            f" {np.median(tk) * 1e3:.2f} |"
        )
    emit(lines, args.out)


if __name__ == "__main__":
    main()
