"""Speed of the two dispatches of a routed mixture of experts (`tevjax.models.SparseMoE`).

"dense" runs every expert on every token (E / k times the FLOPs, three batched matmuls); "ragged"
groups the N * k (token, expert) pairs by expert and multiplies each group by its own expert
(`jax.lax.ragged_dot`). `SparseMoE`'s "auto" takes dense on CPU and ragged elsewhere; this script
is what that choice rests on, and what to rerun on an accelerator.

For each token count N (a decoding round's tree at small N, a prefill chunk at large N) both
jitted calls run interleaved, `--repeats` rounds of `--iters` calls each; a round's figure is its
median call, and the report gives the median over rounds of each dispatch and of the same-round
ratio ragged / dense, with the ratio's range over rounds (the host is shared and noisy, so only
same-round ratios are compared). Both outputs are checked equal first.

    python experiments/moe_dispatch.py                          # 8 experts, 2 per token, D 512, I 1024
    python experiments/moe_dispatch.py --experts 128 --top-k 8 --hidden 2048 --width 768   # Qwen3-30B-A3B's layer
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tevjax.models import SparseMoE
from report import save  # experiments/report.py (scripts run from this folder)


def positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def measure(experts: int, top_k: int, hidden: int, width: int, dtype: str, tokens, iters: int, repeats: int,
            on_row=None) -> list[dict]:
    """For each token count: both dispatches' times per call (the median of `iters` calls, for each
    of `repeats` interleaved rounds) and their outputs' largest difference; raises SystemExit when
    the outputs disagree. `on_row(row)` sees each row as it is done."""
    moe = SparseMoE(hidden, width, experts, top_k, norm_topk_prob=True, dtype=dtype, param_dtype=dtype,
                    rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(moe)
    calls = {d: jax.jit(lambda st, x, d=d: nnx.merge(graphdef, st)(x, dispatch=d)) for d in ("dense", "ragged")}
    rows = []
    for n in tokens:
        x = jax.random.normal(jax.random.key(n), (n, hidden), jnp.dtype(dtype))
        outs = {d: np.asarray(jax.block_until_ready(f(state, x)), np.float32) for d, f in calls.items()}  # compiles
        err = float(np.max(np.abs(outs["dense"] - outs["ragged"])))
        tol = 1e-4 if dtype == "float32" else 5e-2
        if not err <= tol * max(1.0, float(np.max(np.abs(outs["dense"])))):
            raise SystemExit(f"dispatches disagree at N={n}: max |dense - ragged| = {err:.3g}")
        per = {d: [] for d in calls}
        for _ in range(repeats):
            for d, f in calls.items():
                times = []
                for _ in range(iters):
                    t0 = time.perf_counter()
                    jax.block_until_ready(f(state, x))
                    times.append(time.perf_counter() - t0)
                per[d].append(float(np.median(times)))
        rows.append(dict(tokens=n, dense_s=per["dense"], ragged_s=per["ragged"], max_abs_diff=err))
        if on_row is not None:
            on_row(rows[-1])
    return rows


TABLE_HEAD = ("| tokens | dense ms | ragged ms | ragged / dense | max abs diff |", "|---:|---:|---:|---:|---:|")


def table_row(r: dict, prefix: str = "") -> str:
    """One `measure` row as a line of the table under TABLE_HEAD (after `prefix` cells)."""
    ratio = np.asarray(r["ragged_s"]) / np.asarray(r["dense_s"])
    return (f"| {prefix}{r['tokens']} | {np.median(r['dense_s']) * 1e3:.3f} | {np.median(r['ragged_s']) * 1e3:.3f} | "
            f"{np.median(ratio):.2f}x [{ratio.min():.2f}, {ratio.max():.2f}] | {r['max_abs_diff']:.1e} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=positive, nargs="+", default=[16, 64, 512])
    for name, default in (("experts", 8), ("top-k", 2), ("hidden", 512), ("width", 1024), ("iters", 10),
                          ("repeats", 5)):
        ap.add_argument(f"--{name}", type=positive, default=default)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "moe_dispatch.md"))
    args = ap.parse_args()
    start = time.time()
    if args.top_k > args.experts:
        ap.error(f"--top-k {args.top_k} is more than --experts {args.experts}")

    rows, payload = [], dict(vars(args), backend=jax.default_backend(), device=str(jax.devices()[0]), results=[])
    for r in measure(args.experts, args.top_k, args.hidden, args.width, args.dtype, args.tokens, args.iters,
                     args.repeats):
        rows.append(table_row(r))
        payload["results"].append(r)

    lines = [
        "# Mixture-of-experts dispatch: every expert on every token vs grouped by expert",
        "",
        f"`python experiments/moe_dispatch.py {' '.join(sys.argv[1:])}`".replace(" `", "`"),
        "",
        f"{args.experts} experts of width {args.width}, {args.top_k} per token, model width {args.hidden}, "
        f"{args.dtype}; backend {jax.default_backend()} ({jax.devices()[0].device_kind}, "
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs), "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(start))}, {time.time() - start:.0f} s in all. Median call "
        f"of each round, median over {args.repeats} interleaved rounds of {args.iters} calls; the ratio is per "
        f"round, its range in brackets.",
        "",
        *TABLE_HEAD,
        *rows,
    ]
    save(lines, args.out, payload)


if __name__ == "__main__":
    main()
