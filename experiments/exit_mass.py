"""Where target mass leaves real draft trees: the exit law w(v) by depth and sibling rank.

The canonical exit law (paper Lemma 1) says where a target continuation leaves a fixed tree:
w(v) = P(v) rho(v), summing to 1 over the tree. ExitTrain (paper Sec. 5) spends its loss on
exactly this mass. This script measures it on REAL trees: it decodes held-out ShareGPT prompts with
the embedded SmolLM2-135M-Instruct target, each given DFlash drafter and DDTree (the unchanged
`Decoder`, TEV, decoding at each temperature), and captures every round's trees with the engine's
own stage functions (`real_trees.capture_rounds`). Per round it reports

* the exit mass by (depth, rank among siblings), rank by the drafter's probability of the
  node's token (equivalently its DDTree score: siblings share the prefix), at the heat-map budget;
  the depth and rank marginals; the drafted nodes per cell (where the budget went);
* the exit mass by where it leaves: at the root (no depth-1 token matched), at another internal
  node (the residual next to its drafted children), at a leaf below the draft horizon (the budget
  ran out) or at a leaf at the horizon (depth G); the law gives both leaf kinds rho = 1, paper
  Sec. 5 treats them differently;
* coverage C_p (mean over rounds) against the budget, every budget's DDTree built from the same
  round's draft (same contexts).

Several drafters can be compared side by side (e.g. token-only vs ExitTrain): repeat
`--drafter DIR` and give `--label NAME` in the same order. Each drafter decodes the same prompts with
the same seeds; at temperature 0 they decode the same text (exactness), at temperature > 0 texts
of the same distribution.

    python experiments/exit_mass.py                                  # full run (~10-15 min, 2 cores)
    python experiments/exit_mass.py --quick                          # ~1-2 min smoke run, writes to /tmp
    python experiments/exit_mass.py --drafter A --label token-only --drafter B --label ExitTrain
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np

from tevjax.law import exit_law
from tevjax.loading import load_models

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_trees import capture_rounds, describe_drafter, load_prompt_ids, machine_facts, versions  # noqa: E402
from tree_stats import EXIT_KINDS, exit_kind, mass_by_depth_rank, sibling_ranks  # noqa: E402
from report import drafters_and_labels, require_positive  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "exit_mass.md"
QUICK_RESULTS = Path("/tmp/exit_mass_quick.md")


@functools.lru_cache(maxsize=None)
def law_fn(temperature: float):
    return jax.jit(lambda tree, logits: exit_law(tree, logits, temperature))


def round_stats(rnd, temperature: float, budgets, heat_budget: int, ranks: int) -> dict:
    """One round reduced to numbers: C_p per budget; at `heat_budget` the exit mass and node
    count by (depth, sibling rank) and the exit mass by exit kind."""
    coverage = {}
    for b in budgets:
        coverage[b] = float(law_fn(temperature)(rnd.trees[b], rnd.logits[b]).coverage)
    tree = rnd.trees[heat_budget]
    law = law_fn(temperature)(tree, rnd.logits[heat_budget])
    parents, depth, valid = (np.asarray(x) for x in (tree.parents, tree.depth, tree.valid))
    w = np.asarray(law.exit_prob, np.float64)
    rank = sibling_ranks(parents, valid, rnd.draft_logprob[heat_budget])
    kind = exit_kind(parents, depth, valid, rnd.horizon)
    return {
        "prompt": rnd.prompt,
        "coverage": coverage,
        "exit_mass": mass_by_depth_rank(depth, rank, w, valid, rnd.horizon, ranks - 1),
        "nodes": mass_by_depth_rank(depth, rank, np.ones_like(w), valid, rnd.horizon, ranks - 1),
        "kinds": [float(w[kind == k].sum()) for k in range(len(EXIT_KINDS))],
    }


def coverage_se(coverage, prompt) -> float:
    """SE of the mean of per-round `coverage` over rounds, with prompts as the units: the rounds of one
    prompt share its text (an easy answer gives every round high C_p), so they are not independent draws,
    and std / sqrt(rounds) understated the SE. The mean over rounds is a ratio of per-prompt sums (C_p
    summed over a prompt's rounds / its rounds), whose delta-method SE `tevjax.stats.tau_se` gives; nan
    below 2 prompts, 0 where no round covers anything."""
    from tevjax.stats import tau_se

    coverage, prompt = np.asarray(coverage, np.float64), np.asarray(prompt)
    ids = np.unique(prompt)
    if len(ids) < 2:
        return math.nan
    sums = [float(coverage[prompt == i].sum()) for i in ids]
    if sum(sums) <= 0:
        return 0.0
    return tau_se(sums, [int(np.sum(prompt == i)) for i in ids])[1]


def aggregate(stats: list[dict], budgets) -> dict:
    """Means over rounds (and, for C_p, SEs with prompts as the units: `coverage_se`)."""
    k = len(stats)
    cov = {b: np.array([s["coverage"][b] for s in stats]) for b in budgets}
    prompt = [s["prompt"] for s in stats]
    heat = np.mean([s["exit_mass"] for s in stats], axis=0)
    nodes = np.mean([s["nodes"] for s in stats], axis=0)
    return {
        "rounds": k,
        "prompts": len(set(prompt)),
        "coverage": {str(b): {"mean": float(c.mean()), "se": coverage_se(c, prompt)} for b, c in cov.items()},
        # Per round, so that other statistics can be computed from the results file.
        "round_prompt": prompt,
        "round_coverage": {str(b): c.tolist() for b, c in cov.items()},
        "exit_mass": heat.tolist(),
        "nodes": nodes.tolist(),
        "by_depth": heat.sum(axis=1).tolist(),
        "by_rank": heat.sum(axis=0).tolist(),
        "nodes_by_depth": nodes.sum(axis=1).tolist(),
        "kinds": dict(zip(EXIT_KINDS, np.mean([s["kinds"] for s in stats], axis=0).tolist())),
    }


def plot(results: dict, labels: list[str], temperatures, budgets, ranks: int, heat_budget: int, path: Path,
         title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    from report import budget_axes

    nrow, ncol = len(temperatures), len(labels) + 1
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 4.4 * nrow + 0.8), squeeze=False, layout="constrained")
    norm = LogNorm(vmin=1e-4, vmax=1.0)  # one scale for every panel: side by side stays comparable
    image = None
    rank_names = [str(r) for r in range(ranks - 1)] + [f"{ranks - 1}+"]
    for i, t in enumerate(temperatures):
        for j, label in enumerate(labels):
            ax = axes[i, j]
            agg = results[label][str(t)]
            heat = np.asarray(agg["exit_mass"])
            image = ax.imshow(np.maximum(heat, 1e-4), norm=norm, cmap="magma", aspect="auto")
            for (d, r), v in np.ndenumerate(heat):
                if v >= 0.005:
                    ax.text(r, d, f"{100 * v:.0f}" if v >= 0.095 else f"{100 * v:.1f}", ha="center",
                            va="center", fontsize=6, color="white" if v < 0.1 else "black")
            ax.set_xticks(range(ranks), rank_names, fontsize=7)
            ax.set_yticks(range(heat.shape[0]), [str(d) for d in range(heat.shape[0])], fontsize=7)
            ax.set_xlabel("rank among siblings (by draft probability)", fontsize=8)
            ax.set_ylabel("depth", fontsize=8)
            kinds = agg["kinds"]
            ax.set_title(f"{label}, T={t:g}: exit mass % (budget {heat_budget})\nroot {kinds['root']:.2f}, internal "
                         f"{kinds['internal']:.2f}, leaf<horizon {kinds['leaf below horizon']:.2f}, leaf@horizon "
                         f"{kinds['leaf at horizon']:.2f}", fontsize=8)
        ax = axes[i, -1]
        for label in labels:
            cov = results[label][str(t)]["coverage"]
            mean = np.array([cov[str(b)]["mean"] for b in budgets])
            se = np.array([cov[str(b)]["se"] for b in budgets])
            ax.errorbar(budgets, 1 + mean, yerr=se, marker="o", capsize=3, label=label)
        budget_axes(ax, budgets, "1 + C_p (mean over rounds)", f"coverage vs budget, T={t:g} (same contexts)")
    if image is not None:
        fig.colorbar(image, ax=axes[:, :-1], location="bottom", shrink=0.7, label="mean exit probability per round")
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=130)
    plt.close(fig)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", action="append", default=None,
                   help="DFlash checkpoint directory; repeat to compare (default: load_models('smollm2')'s)")
    p.add_argument("--label", action="append", default=None, help="a name per --drafter, in the same order")
    p.add_argument("--prompts", default="heldout", help="prompt set (tevjax eval --prompts syntax; default heldout)")
    p.add_argument("--num-prompts", type=int, default=12)
    p.add_argument("--rounds-per-prompt", type=int, default=8, help="decoding rounds captured per prompt (at most)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    p.add_argument("--heat-budget", type=int, default=None,
                   help="budget of the decoding rounds and of the heat map (default: the largest budget)")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--ranks", type=int, default=8, help="heat-map rank columns; the last one holds that rank or worse")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smoke run (2 prompts x 2 rounds, budgets 4 8 16); "
                   f"writes {QUICK_RESULTS} unless --out is given")
    p.add_argument("--out", type=Path, default=None, help=f"results markdown (default {RESULTS}); .json and .png "
                   "go next to it")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.rounds_per_prompt, args.max_new_tokens, args.budgets = 2, 2, 16, [4, 8, 16]
    if args.out is None:
        args.out = QUICK_RESULTS if args.quick else RESULTS
    require_positive(p, args, "num_prompts", "rounds_per_prompt", "max_new_tokens", "ranks")
    if any(b < 1 for b in args.budgets):
        p.error("--budgets must be >= 1")
    args.budgets = sorted(set(args.budgets))
    if args.heat_budget is None:
        args.heat_budget = max(args.budgets)
    elif args.heat_budget not in args.budgets:
        args.budgets = sorted(set(args.budgets) | {args.heat_budget})
    if any(not 0 <= t < math.inf for t in args.temperatures):
        p.error("--temperatures must be finite and >= 0")
    drafters_and_labels(p, args)
    return args


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    started, cpu_started = time.perf_counter(), time.process_time()
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    load_start = os.getloadavg()

    results: dict = {}
    described: dict = {}
    engine: dict = {}
    texts = None
    total = len(args.drafters) * len(args.temperatures) * args.num_prompts * args.rounds_per_prompt
    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="round", desc="exit mass", dynamic_ncols=True)
    for label, drafter in zip(args.label, args.drafters):
        models = load_models("smollm2", drafter, dtype="float32")
        described[label] = {"drafter": describe_drafter(models, drafter), "dir": drafter,
                            "trained": models.drafter_trained, "horizon": models.drafter.cfg.block_size - 1}
        texts, prompts = load_prompt_ids(models.tokenizer, args.prompts, args.num_prompts)
        results[label] = {}
        for t in args.temperatures:
            stats, log = [], []
            for rnd in capture_rounds(models, prompts, decode_budget=args.heat_budget, budgets=args.budgets,
                                      temperature=t, max_new_tokens=args.max_new_tokens, seed=args.seed,
                                      max_rounds=args.rounds_per_prompt, engine_log=log):
                stats.append(round_stats(rnd, t, args.budgets, args.heat_budget, args.ranks))
                if bar is not None:
                    bar.set_postfix_str(f"{label} T={t:g} C_p@{args.heat_budget} {stats[-1]['coverage'][args.heat_budget]:.2f}")
                    bar.update(1)
            if not stats:
                raise SystemExit(f"{label}, temperature {t:g}: no rounds captured (every prompt stopped at once)")
            results[label][str(t)] = aggregate(stats, args.budgets)
            engine[(label, t)] = log
        del models
    if bar is not None:
        bar.close()
    minutes = (time.perf_counter() - started) / 60
    cpu_minutes = (time.process_time() - cpu_started) / 60
    load_end = os.getloadavg()
    inconsistent = sum(not e["follows_tree"] for log in engine.values() for e in log)
    engine_rounds = sum(len(log) for log in engine.values())

    # ------------------------------------------------------------------ report
    command = "python experiments/exit_mass.py" + (" " + " ".join(argv) if argv else "")
    lines = [
        "# Where target mass leaves real draft trees (exit law by depth and sibling rank)",
        "",
        f"- Date: {date}; wall time {minutes:.1f} min, process CPU time {cpu_minutes:.1f} min (on a shared "
        "machine the CPU time is the steadier measure of the work).",
        f"- Command: `{command}`",
        f"- Machine: {machine_facts()}. Load average (1/5/15 min) at start "
        f"{'/'.join(f'{x:.1f}' for x in load_start)}, at end {'/'.join(f'{x:.1f}' for x in load_end)}.",
        "- Target: SmolLM2-135M-Instruct (embedded default), float32, SmolLM2 chat template.",
    ]
    lines += [f"- Drafter `{label}`: {d['drafter']}." for label, d in described.items()]
    lines += [
        f"- Rounds: TEV decoding of {args.num_prompts} `{args.prompts}` prompts at each temperature with DDTree budget "
        f"{args.heat_budget} (seed {args.seed} + prompt index), at most {args.rounds_per_prompt} rounds per prompt and "
        f"{args.max_new_tokens} new tokens; per round the DDTree of every budget {args.budgets} is built from the "
        "same draft and scored by one target pass each.",
        f"- Engine check: {engine_rounds - inconsistent} of {engine_rounds} rounds emitted a block that follows "
        "the captured tree.",
        "",
        "Exit mass = w(v) = P(v) rho(v), averaged over rounds (each round's w sums to 1). Sibling rank 0 = the "
        "drafter's most probable token among the node's siblings.",
        "",
        "## Coverage against budget (mean 1 + C_p over rounds, +- SE with prompts as the units)",
        "",
        "| drafter | T | rounds | " + " | ".join(f"budget {b}" for b in args.budgets) + " |",
        "|---|---:|---:|" + "---:|" * len(args.budgets),
    ]
    for label in args.label:
        for t in args.temperatures:
            agg = results[label][str(t)]
            lines.append(f"| {label} | {t:g} | {agg['rounds']} | " + " | ".join(
                f"{1 + agg['coverage'][str(b)]['mean']:.3f} +- {agg['coverage'][str(b)]['se']:.3f}"
                for b in args.budgets) + " |")
    lines += [
        "",
        f"## Where the mass leaves (budget {args.heat_budget})",
        "",
        "| drafter | T | root | internal | leaf below horizon | leaf at horizon | rank 0 | rank 1 | rank >= 2 "
        "| C_p (mean exit depth) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label in args.label:
        for t in args.temperatures:
            agg = results[label][str(t)]
            by_rank, by_depth = agg["by_rank"], np.array(agg["by_depth"])
            k = agg["kinds"]
            lines.append(f"| {label} | {t:g} | {k['root']:.3f} | {k['internal']:.3f} | {k['leaf below horizon']:.3f} | "
                         f"{k['leaf at horizon']:.3f} | {by_rank[0] - by_depth[0]:.3f} | "
                         f"{by_rank[1] if len(by_rank) > 1 else 0.0:.3f} | {sum(by_rank[2:]):.3f} | "
                         f"{float(np.sum(by_depth * np.arange(len(by_depth)))):.3f} |")
    lines += ["", "The first four columns split each round's exit law (they sum to 1); the rank columns split the "
              "non-root part by the exit node's rank among its siblings (the root has none).", ""]
    lines += ["## Exit mass and drafted nodes by depth", ""]
    for label in args.label:
        for t in args.temperatures:
            agg = results[label][str(t)]
            lines.append(f"- `{label}`, T={t:g}: exit mass by depth "
                         + ", ".join(f"{d}: {m:.3f}" for d, m in enumerate(agg["by_depth"]) if m >= 5e-4 or d == 0)
                         + "; nodes by depth " + ", ".join(f"{d}: {n:.1f}" for d, n in enumerate(agg["nodes_by_depth"])
                                                           if n >= 0.05) + ".")
    lines += ["", f"![exit-mass heat maps and coverage vs budget]({args.out.with_suffix('.png').name})", ""]
    if any(not d["trained"] and d["dir"] is None for d in described.values()):
        lines += ["An untrained drafter's trees hold almost no target mass: nearly all of it exits at the root. "
                  "Pass `--drafter DIR` (repeatable, with `--label`) to measure trained drafters.", ""]
    text = "\n".join(lines)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    title = f"SmolLM2-135M: exit law on real DDTree trees, {args.num_prompts} prompts x <= {args.rounds_per_prompt} rounds"
    plot(results, args.label, args.temperatures, args.budgets, args.ranks, args.heat_budget,
         args.out.with_suffix(".png"), title)
    raw = {
        "date": date, "command": command, "machine": machine_facts(), "versions": versions(),
        "wall_minutes": minutes, "cpu_minutes": cpu_minutes, "drafters": described,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "seeds": {"decode": f"{args.seed} + prompt index"}, "prompts": texts, "exit_kinds": list(EXIT_KINDS),
        "results": results,
        "engine_log": [{"drafter": lab, "temperature": t, **e} for (lab, t), log in engine.items() for e in log],
    }
    args.out.with_suffix(".json").write_text(json.dumps(raw, indent=1) + "\n")
    print()
    print(text)
    print(f"wrote {args.out}, {args.out.with_suffix('.png')} and {args.out.with_suffix('.json')} ({minutes:.1f} min)")
    return 0 if inconsistent == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
