"""Exit-law propagation: `lax.scan` over depth levels vs the ancestor-matrix product.

`tevjax.law` propagates prefix probabilities P (and the children's mass in rho) in one of two ways:
"matrix", a masked product over the [N, N] ancestor matrix (O(N^2) work, no loop), or "scan", one
`lax.scan` step per depth level 1..N-1 (O(N) work each, no [N, N] array). For every tree size N and
shape this times both, jitted and compiled ahead of time, on the same tree and logits:

    propagation alone   `law_from_edges(tree, edge_prob, propagation)` (P, rho, w, C_p), one tree
                        and `vmap`ped over a batch of copies of it (as the batched decoder runs it)
    whole exit law      `exit_law(tree, logits, 1.0, propagation)` with [N, V] float32 logits

Shapes: "ddtree", the DDTree builder's tree from random peaked drafter marginals (G = 15 draft rows,
a 4,096-token drafter vocabulary; real depth about 8), as the decoder builds it; "chain", one path
of depth N - 1 (the deepest tree of N nodes). The two propagations are timed round-robin (one call
of each per round, in alternating order) so that machine noise hits both alike; medians, the 10-90%
spread and the geometric mean of the scan/matrix ratios at the decoder's sizes (N <= 65) are reported.

    python experiments/exit_law_scan.py            # the full grid, writes the results table + .json
    python experiments/exit_law_scan.py --quick    # two small cells, no results file
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tevjax.builder import build_ddtree
from tevjax.law import PROPAGATION, edge_stats, exit_law, law_from_edges
from tevjax.tree import DraftTree
from report import emit  # experiments/report.py (scripts run from this folder)

RESULTS = Path(__file__).resolve().parent / "results" / "exit_law_scan.md"
PROPAGATIONS = ("matrix", "scan")
SHAPES = ("ddtree", "chain")
DEPTH = 15  # G: DFlash block size 16 -> 15 draft rows
DRAFT_VOCAB = 4_096


def make_tree(shape: str, n: int, seed: int) -> DraftTree:
    key = jax.random.key(seed)
    if shape == "ddtree":
        draft = jax.nn.log_softmax(8.0 * jax.random.normal(key, (DEPTH, DRAFT_VOCAB)), axis=-1)
        tree, _ = jax.jit(build_ddtree, static_argnums=2)(draft, jnp.int32(1), n - 1)
        return tree
    tokens = jax.random.randint(key, (n,), 0, DRAFT_VOCAB)
    return DraftTree.from_parents(tokens, jnp.arange(n, dtype=jnp.int32) - 1)


def make_logits(tree: DraftTree, vocab: int, seed: int) -> jax.Array:
    # Target logits that favour the drafted tokens (an only child gets p of about 0.5 at V = 49k),
    # so that P stays well above 0 along paths and C_p is of order 1.
    logits = 2.0 * jax.random.normal(jax.random.key(seed), (tree.num_nodes, vocab))
    return logits.at[jnp.maximum(tree.parents, 0), tree.tokens].add(jnp.where(tree.parents >= 0, 13.0, 0.0))


def compiled(fn, *args):
    """`fn` jitted and compiled ahead of time for `args` (no compile inside the timed calls)."""
    return jax.jit(fn).lower(*args).compile()


def time_round_robin(fns: dict, args: tuple, calls: int, warmup: int = 3) -> dict[str, np.ndarray]:
    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(calls):
        # Alternate which propagation goes first, so neither always runs on a warmer cache.
        for name, fn in list(fns.items())[:: 1 if i % 2 == 0 else -1]:
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append(time.perf_counter() - t0)
    return {name: np.array(ts) * 1e3 for name, ts in times.items()}


def summary(ms: np.ndarray) -> list[float]:
    """[median, p10, p90] in ms."""
    return [float(np.median(ms)), float(np.percentile(ms, 10)), float(np.percentile(ms, 90))]


def run_cell(shape: str, n: int, vocab: int, batch: int, calls: int, law_calls: int) -> dict:
    tree = make_tree(shape, n, seed=n)
    logits = make_logits(tree, vocab, seed=n + 1)
    edge_prob = edge_stats(tree, logits, 1.0).edge_prob
    trees, edge_probs = jax.tree.map(lambda x: jnp.broadcast_to(x, (batch, *x.shape)), (tree, edge_prob))
    alone = {p: compiled(lambda t, e, p=p: law_from_edges(t, e, p), tree, edge_prob) for p in PROPAGATIONS}
    batched = {
        p: compiled(jax.vmap(lambda t, e, p=p: law_from_edges(t, e, p)), trees, edge_probs)
        for p in PROPAGATIONS
    }
    whole = {p: compiled(lambda t, l, p=p: exit_law(t, l, 1.0, p), tree, logits) for p in PROPAGATIONS}
    laws = {p: jax.tree.map(np.asarray, fn(tree, logits)) for p, fn in whole.items()}
    t_alone = time_round_robin(alone, (tree, edge_prob), calls)
    t_batched = time_round_robin(batched, (trees, edge_probs), calls)
    t_whole = time_round_robin(whole, (tree, logits), law_calls)
    return {
        "shape": shape,
        "N": n,
        "depth": int(jnp.max(tree.depth)),
        "coverage": float(laws["matrix"].coverage),
        "max_abs_diff_w": float(np.max(np.abs(laws["scan"].exit_prob - laws["matrix"].exit_prob))),
        "alone": {p: summary(t) for p, t in t_alone.items()},
        "batched": {p: summary(t) for p, t in t_batched.items()},
        "exit_law": {p: summary(t) for p, t in t_whole.items()},
    }


def fmt(cell) -> str:
    med, lo, hi = cell
    return f"{med:.3f} ({lo:.3f}-{hi:.3f})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[9, 17, 33, 65, 129, 257, 513])
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    parser.add_argument("--vocab", type=int, default=49_152, help="target vocabulary of the whole exit law")
    parser.add_argument("--batch", type=int, default=32, help="trees per vmapped propagation call")
    parser.add_argument("--calls", type=int, default=100, help="timed calls of the propagation alone (>= 50)")
    parser.add_argument("--law-calls", type=int, default=50, help="timed calls of the whole exit law (>= 50)")
    parser.add_argument("--quick", action="store_true", help="two small cells, no results file")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.calls, args.law_calls = [17, 65], 20, 10

    started = time.perf_counter()
    rows = []
    for shape in args.shapes:
        for n in args.sizes:
            row = run_cell(shape, n, args.vocab, args.batch, args.calls, args.law_calls)
            rows.append(row)
            print(
                f"{shape:>6} N={n:>3}: alone matrix {row['alone']['matrix'][0]:.3f} ms, "
                f"scan {row['alone']['scan'][0]:.3f} ms; batch {args.batch} matrix "
                f"{row['batched']['matrix'][0]:.3f} ms, scan {row['batched']['scan'][0]:.3f} ms; "
                f"exit law matrix "
                f"{row['exit_law']['matrix'][0]:.2f} ms, scan {row['exit_law']['scan'][0]:.2f} ms",
                flush=True,
            )
    elapsed = time.perf_counter() - started

    device = jax.devices()[0]
    command = "python experiments/exit_law_scan.py" + (" " + " ".join(argv) if argv else "")
    lines = [
        "# Exit-law propagation: `lax.scan` over depth levels vs ancestor-matrix product",
        "",
        f"Device: {device.platform} ({device.device_kind}), {os.cpu_count()} CPU cores, "
        f"jax {jax.__version__}, {platform.python_version()}; float32; each function jitted and "
        f"compiled ahead of time; {args.calls} timed calls of the propagation alone and "
        f"{args.law_calls} of the whole exit law (V = {args.vocab:,}, temperature 1) per cell, round-robin in "
        f"alternating order after warm-up; host load average at end {os.getloadavg()[0]:.1f}; "
        f"run time {elapsed:.0f} s.",
        f"Command: `{command}`",
        "",
        "Times are median ms (10th-90th percentile). *alone* = `law_from_edges` (P, rho, w, C_p from "
        f"given edge probabilities) on one tree; *batch {args.batch}* = the same `vmap`ped over "
        f"{args.batch} copies of the tree; *exit law* = `exit_law` on [N, V] logits (log-sum-exp + "
        "gather + propagation). ddtree: DDTree builder's tree, G = 15 (depth column = its real depth); chain: "
        "depth N - 1. The scan runs N - 1 levels (static bound) on either shape. "
        f"max |dw| = largest difference in w between the two propagations. Library default: "
        f"`{PROPAGATION}`.",
        "",
        f"| shape | N | depth | C_p | alone: matrix | alone: scan | scan/matrix | batch {args.batch}: matrix "
        f"| batch {args.batch}: scan | scan/matrix | exit law: matrix | exit law: scan | scan/matrix "
        "| max abs dw |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = []
        for kind in ("alone", "batched", "exit_law"):
            m, sc = r[kind]["matrix"], r[kind]["scan"]
            cells += [fmt(m), fmt(sc), f"{sc[0] / m[0]:.2f}x"]
        lines.append(
            f"| {r['shape']} | {r['N']} | {r['depth']} | {r['coverage']:.2f} | "
            + " | ".join(cells)
            + f" | {r['max_abs_diff_w']:.1e} |"
        )
    small = [r for r in rows if r["N"] <= 65]
    if small:
        means = {
            kind: float(np.exp(np.mean([np.log(r[kind]["scan"][0] / r[kind]["matrix"][0]) for r in small])))
            for kind in ("alone", "batched", "exit_law")
        }
        lines += [
            "",
            f"Geometric mean of scan/matrix over the {len(small)} cells with N <= 65 (the decoder's sizes): "
            f"alone {means['alone']:.2f}x, batch {args.batch} {means['batched']:.2f}x, "
            f"exit law {means['exit_law']:.2f}x.",
        ]
    out = None if args.quick else args.out
    emit(lines, out)
    if out is not None:
        raw = {"command": command, "device": str(device), "jax": jax.__version__, "seconds": elapsed,
               "batch": args.batch, "rows": rows}
        out.with_suffix(".json").write_text(json.dumps(raw, indent=1) + "\n")
        print(f"wrote {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
