"""Truncated sampling (top-k, top-p, min-p): what the cut costs, and what it does to tau and speed.

Part 1 times `tevjax.truncate_logits`, which finds its cuts by bisection over float32 bit
patterns, against the two obvious implementations of the same cut, a full sort (top-p) and
`lax.top_k` (top-k), jitted, on random logits of SmolLM2's vocabulary at the row counts of an
autoregressive step (1) and of a tree pass at budgets 8 and 16 (9, 17). The methods run round-robin
so that machine noise hits all alike; medians and the 10-90% spread are reported.

Part 2 decodes the same held-out prompts at temperature 1 with the shipped drafter and its lookup
chains (`tevjax.evaluate.evaluate`, the code of `tevjax eval`), once per setting, each with its own
autoregressive baseline measured in the same call: tau (output-block length, bonus included, with a
95% interval over prompts) and the speedup over AR. Every setting is a different target law, so its
tau is not paired with the others'.

    python experiments/truncation.py                      # 32 prompts, budgets 4 and 8
    python experiments/truncation.py --quick              # a smoke run (-> /tmp)
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import emit, require_positive  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "truncation.md"
QUICK_RESULTS = Path("/tmp/truncation_quick.md")
VOCAB = 49152  # SmolLM2's
SETTINGS = {"none": {}, "top-p 0.9": {"top_p": 0.9}, "top-k 20": {"top_k": 20},
            "min-p 0.1": {"min_p": 0.1}}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS),
                   help="truncation settings to decode with, one evaluation each")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--budgets", type=int, nargs="+", default=[4, 8])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iters", type=int, default=30, help="round-robin repeats of the cost benchmark")
    p.add_argument("--quick", action="store_true", help="2 prompts, 16 tokens, 5 repeats; writes to /tmp")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.max_new_tokens, args.iters, args.budgets = 2, 16, 5, [4]
    require_positive(p, args, "num_prompts", "max_new_tokens", "iters")
    if not all(b >= 1 for b in args.budgets):
        p.error(f"--budgets must all be >= 1, got {args.budgets}")
    if not args.temperature >= 1e-5 or args.temperature == float("inf"):
        p.error(f"--temperature must be a finite number >= 1e-5 (truncation changes nothing when greedy), "
                f"got {args.temperature}")
    args.out = args.out or (QUICK_RESULTS if args.quick else RESULTS)
    return args


def time_cuts(iters: int) -> list[dict]:
    """Median and 10-90% ms of each implementation of the same cut, per row count."""
    import jax
    import jax.numpy as jnp

    from tevjax.sampling import truncate_logits

    def sort_top_p(x, top_p=0.9):
        s = -jnp.sort(-x, axis=-1)
        q = jax.nn.softmax(s, axis=-1)
        before = jnp.cumsum(q, axis=-1) - q
        cut = jnp.min(jnp.where(before < top_p, s, jnp.inf), axis=-1, keepdims=True)
        return jnp.where(x >= cut, x, -jnp.inf)

    def lax_top_k(x, k=20):
        return jnp.where(x >= jax.lax.top_k(x, k)[0][..., -1:], x, -jnp.inf)

    methods = {
        "top-p 0.9, bisection (truncate_logits)": jax.jit(lambda x: truncate_logits(x, 1.0, top_p=0.9)),
        "top-p 0.9, full sort": jax.jit(sort_top_p),
        "top-k 20, bisection (truncate_logits)": jax.jit(lambda x: truncate_logits(x, 1.0, top_k=20)),
        "top-k 20, lax.top_k": jax.jit(lax_top_k),
        "min-p 0.1 (one pass)": jax.jit(lambda x: truncate_logits(x, 1.0, min_p=0.1)),
    }
    rows = []
    for n in (1, 9, 17):
        x = jnp.asarray(np.random.default_rng(n).normal(size=(n, VOCAB)).astype(np.float32) * 3)
        kept = {}
        for name, fn in methods.items():
            kept[name] = np.isfinite(np.asarray(fn(x)))  # compiles
        # The bisection and the reference implementations must agree on the kept set.
        assert (kept["top-p 0.9, bisection (truncate_logits)"] == kept["top-p 0.9, full sort"]).all()
        assert (kept["top-k 20, bisection (truncate_logits)"] == kept["top-k 20, lax.top_k"]).all()
        times = {name: [] for name in methods}
        for _ in range(iters):
            for name, fn in methods.items():
                t0 = time.perf_counter()
                fn(x).block_until_ready()
                times[name].append(1e3 * (time.perf_counter() - t0))
        for name, ms in times.items():
            rows.append({"rows": n, "method": name, "median_ms": float(np.median(ms)),
                         "p10_ms": float(np.percentile(ms, 10)), "p90_ms": float(np.percentile(ms, 90)),
                         "kept_per_row": float(kept[name].sum(-1).mean())})
    return rows


def decode(args) -> list[dict]:
    """One `evaluate` per setting: its AR baseline and a row per budget."""
    from tevjax.evaluate import evaluate, load_eval_prompts
    from tevjax.loading import load_models

    models = load_models("smollm2")
    texts = load_eval_prompts("heldout", args.num_prompts)
    out = []
    for name in args.settings:
        t0 = time.perf_counter()
        result = evaluate(models, texts, budgets=tuple(args.budgets), temperature=args.temperature,
                          max_new_tokens=args.max_new_tokens, seed=args.seed, log=lambda line: None,
                          **SETTINGS[name])
        result["setting"], result["wall_s"] = name, time.perf_counter() - t0
        out.append(result)
        print(f"{name}: " + ", ".join(f"budget {r['budget']} tau {r['tau']:.3f} SR {r['sr']:.3f}"
                                      for r in result["budgets"]), flush=True)
    return out


def report(args, cuts, runs, seconds: float, facts: str) -> list[str]:
    from tevjax.stats import q95

    lines = ["# Truncated sampling: the cost of the cut, and tau and speed on SmolLM2", "",
             f"Command: `python experiments/truncation.py{' --quick' if args.quick else ''}` "
             f"({datetime.date.today().isoformat()}, {seconds / 60:.1f} min in all). Machine: {facts}.", "",
             f"## The cut alone ([rows, {VOCAB}] float32 logits, jitted, {args.iters} round-robin repeats)", "",
             "| rows | method | median ms | 10-90% ms | tokens kept per row |", "|---:|---|---:|---|---:|"]
    for r in cuts:
        lines.append(f"| {r['rows']} | {r['method']} | {r['median_ms']:.2f} | {r['p10_ms']:.2f}-{r['p90_ms']:.2f} "
                     f"| {r['kept_per_row']:.1f} |")
    lines += ["", "Each bisection's kept set was checked equal to its reference's on these logits.", "",
              f"## Decoding ({args.num_prompts} held-out prompts, {args.max_new_tokens} new tokens, temperature "
              f"{args.temperature}, TEV, the shipped drafter with its lookup chains, batch 1)", "",
              "Each setting is its own `tevjax eval` run with its own AR baseline (the speedup's denominator).", "",
              "| setting | AR tok/s | budget | tau [95% over prompts] | tok/s | speedup vs AR [10-90% over prompts] |",
              "|---|---:|---:|---|---:|---|"]
    for run in runs:
        for r in run["budgets"]:
            se = r["tau_se"]
            q = q95(run["num_prompts"])  # t with n - 1 df: the SE comes from these prompts
            band = "" if se is None else f" [{r['tau'] - q * se:.2f}, {r['tau'] + q * se:.2f}]"
            lo, hi = r["sr_range"]
            lines.append(f"| {run['setting']} | {run['ar']['tokens_per_s']:.2f} | {r['budget']} | {r['tau']:.3f}{band} "
                         f"| {r['tokens_per_s']:.2f} | {r['sr']:.3f} [{lo:.2f}-{hi:.2f}] |")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    from real_trees import machine_facts, versions

    t0 = time.perf_counter()
    cuts = time_cuts(args.iters)
    runs = decode(args)
    seconds = time.perf_counter() - t0
    facts = machine_facts()
    emit(report(args, cuts, runs, seconds, facts), args.out)
    raw = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "cuts": cuts,
           "runs": runs, "seconds": seconds, "machine": facts, "versions": versions()}
    args.out.with_suffix(".json").write_text(json.dumps(raw, indent=1))
    plot(runs, args.out.with_suffix(".png"))
    return 0


def plot(runs, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = [r["budget"] for r in runs[0]["budgets"]]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    width = 0.8 / len(runs)
    for i, run in enumerate(runs):
        xs = np.arange(len(budgets)) + (i - (len(runs) - 1) / 2) * width
        axes[0].bar(xs, [r["tau"] for r in run["budgets"]], width, label=run["setting"])
        axes[1].bar(xs, [r["sr"] for r in run["budgets"]], width, label=run["setting"])
    axes[1].axhline(1.0, color="k", lw=0.8)
    for ax, label in zip(axes, ("tau (mean output block)", "speedup vs AR (same run)")):
        ax.set_xticks(range(len(budgets)), [f"budget {b}" for b in budgets])
        ax.set_ylabel(label, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"SmolLM2-135M, temperature {runs[0]['temperature']}, {runs[0]['num_prompts']} held-out prompts",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
