"""Crossed drafter x verifier (paper Table 4): {token-only, ExitTrain} x {predraw, TEV}: tau, SR, verifier stage.

The paper's reading: better trees (ExitTrain) carry the end-to-end gain, and TEV adds its
verifier-stage saving on top; on a fixed tree both verifiers have the same tau (claim 1).

Drafters: the token-only and ExitTrain (omega = w) arms of `exittrain_ablation.py` (same run
folders and training options; an arm not trained yet is trained first), or any two DFlash
checkpoints via `--token-drafter DIR --exittrain-drafter DIR`.

Per temperature, the same prompts are decoded autoregressively and by the four combinations at
one budget (batch 1, seed + prompt index, compilation excluded), interleaved prompt by prompt in
a rotated order so that machine noise hits them alike (as `tevjax eval` does).

* tau = tokens / rounds pooled over prompts +- delta-method SE, and the paired gain against
  (token-only, predraw) on the same prompts (`tevjax.stats`);
* SR = AR seconds per token / method seconds per token over all prompts, with the 10-90% range of
  per-prompt SRs (what a shared machine adds);
* verifier stage = decision + the engine's cache commit (as the paper times it), timed with
  `verifier_latency.time_stage` on REAL trees: the drafter's own DDTree trees and the target's
  logits captured from its decoding rounds (`real_trees.capture_rounds`), cycled call by call,
  round-robin across verifiers.

    python experiments/crossed.py                                  # ~20-30 min on 2 cores (drafters trained)
    python experiments/crossed.py --token-drafter A --exittrain-drafter B
    python experiments/crossed.py --quick                          # tiny random target, /tmp
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import types
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exittrain_ablation import (add_eval_args, add_training_args, check_common, ensure_arm, fmt_gain,  # noqa: E402
                                load_drafter, machine_and_versions, make_decoder, make_setup, summarise)
from real_trees import capture_rounds  # noqa: E402
from report import require_positive  # noqa: E402
from verifier_latency import time_stage  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "crossed.md"
QUICK_RESULTS = Path("/tmp/crossed_quick.md")
VERIFIERS = ("predraw", "tev")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--token-drafter", default=None, help="token-only DFlash checkpoint (default: the ablation's arm)")
    p.add_argument("--exittrain-drafter", default=None, help="ExitTrain DFlash checkpoint (default: the ablation's arm)")
    p.add_argument("--budget", type=int, default=32, help="decoding tree budget")
    p.add_argument("--exit-budget", type=int, default=32, help="exit-loss budget of the ablation's ExitTrain arm")
    p.add_argument("--stage-trees", type=int, default=8, help="real trees per drafter for the verifier-stage timing")
    p.add_argument("--stage-calls", type=int, default=60, help="timed stage calls per verifier and drafter")
    p.add_argument("--capacity", type=int, default=1024, help="KV-cache slots the stage commits into")
    add_training_args(p, steps=1000)
    add_eval_args(p, budgets=None, temperatures=(1.0,), sets=("heldout",), num_prompts=16, cache=False)
    p.add_argument("--quick", action="store_true", help=f"tiny random target; writes {QUICK_RESULTS} unless --out")
    p.add_argument("--out", type=Path, default=None, help=f"results markdown (default {RESULTS})")
    args = p.parse_args(argv)
    if (args.token_drafter is None) != (args.exittrain_drafter is None):
        p.error("give both --token-drafter and --exittrain-drafter, or neither (the ablation's arms)")
    for d in (args.token_drafter, args.exittrain_drafter):
        if d is not None and not (Path(d) / "config.json").is_file():
            p.error(f"{d!r}: no DFlash checkpoint there (config.json)")
    require_positive(p, args, "budget", "exit_budget", "stage_trees", "stage_calls")
    if args.quick:
        args.budget, args.exit_budget, args.stage_trees, args.stage_calls = 5, 5, 2, 8
        args.temperatures, args.prompt_sets = [1.0], ["heldout"]
    if args.stage_calls < 2 * args.stage_trees:
        p.error("--stage-calls must be at least twice --stage-trees (every tree is timed by both drafters' calls)")
    if args.capacity < 2 * (args.budget + 1):
        p.error(f"--capacity must hold twice the tree ({2 * (args.budget + 1)} slots)")
    args.budgets = [args.budget]
    check_common(p, args, QUICK_RESULTS, RESULTS, "/tmp/tevjax-ablation-quick")
    return args


def real_trees(setup, drafter, prompts, args, temperature: float) -> tuple[list, list]:
    """Up to --stage-trees (tree, logits) pairs from the drafter's own decoding rounds, spread over prompts."""
    models = types.SimpleNamespace(target=setup.target, drafter=drafter, eos_ids=setup.eos_ids)
    per_prompt = max(1, -(-args.stage_trees // len(prompts)))
    trees, logits = [], []
    for rnd in capture_rounds(models, prompts, decode_budget=args.budget, budgets=[args.budget],
                              temperature=temperature, max_new_tokens=args.max_new_tokens, seed=args.seed,
                              max_rounds=per_prompt):
        if len(trees) < args.stage_trees:
            trees.append(rnd.trees[args.budget])
            logits.append(rnd.logits[args.budget])
    return trees, logits


def main(argv=None) -> int:
    from tevjax.models.cache import KVCache

    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    started, cpu_started = time.perf_counter(), time.process_time()
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    setup = make_setup(args)
    if args.token_drafter is None:
        dirs = {"token-only": ensure_arm(setup, args, "token", args.exit_budget)["dir"],
                "ExitTrain": ensure_arm(setup, args, "w", args.exit_budget)["dir"]}
    else:
        dirs = {"token-only": args.token_drafter, "ExitTrain": args.exittrain_drafter}
    drafters = {k: load_drafter(setup, d) for k, d in dirs.items()}
    combos = [(d, v) for d in drafters for v in VERIFIERS]
    prompts = [p for s in args.prompt_sets for p in setup.prompts[s]]

    results, stage = {}, {}
    for t in args.temperatures:
        decoders = {"ar": make_decoder(setup, None, prompts, budget=1, temperature=t,
                                       max_new_tokens=args.max_new_tokens)}
        for d, v in combos:
            decoders[(d, v)] = make_decoder(setup, drafters[d], prompts, budget=args.budget, temperature=t,
                                            max_new_tokens=args.max_new_tokens, verifier=v)
        names = list(decoders)
        rec = {n: {"tokens": [], "rounds": [], "emitted": [], "seconds": []} for n in names}
        bar = None
        if not args.no_progress:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), unit="prompt", desc=f"crossed T={t:g}", dynamic_ncols=True)
        for i, p in enumerate(prompts):
            for n in names[i % len(names):] + names[:i % len(names)]:  # rotated order
                decoders[n].compile([p])
                t0 = time.perf_counter()
                g = decoders[n].generate([p], seed=args.seed + i)[0]
                rec[n]["seconds"].append(time.perf_counter() - t0)
                rec[n]["tokens"].append(g.tau * g.rounds)
                rec[n]["rounds"].append(g.rounds)
                rec[n]["emitted"].append(len(g.tokens))
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        ar = rec["ar"]
        ar_rate = np.array(ar["seconds"]) / np.maximum(ar["emitted"], 1)
        base = rec[combos[0]]
        results[str(t)] = {}
        for d, v in combos:
            r = rec[(d, v)]
            cell = summarise(r, None if (d, v) == combos[0] else base)
            rate = np.array(r["seconds"]) / np.maximum(r["emitted"], 1)
            cell["sr"] = float((sum(ar["seconds"]) / max(sum(ar["emitted"]), 1)) / (sum(r["seconds"]) / max(sum(r["emitted"]), 1)))
            per = ar_rate / rate
            cell["sr_range"] = [float(np.percentile(per, 10)), float(np.percentile(per, 90))]
            cell["tokens_per_s"] = sum(r["emitted"]) / sum(r["seconds"])
            results[str(t)][f"{d} + {v}"] = cell
        results[str(t)]["ar"] = {"tokens_per_s": sum(ar["emitted"]) / sum(ar["seconds"])}
        results[str(t)]["per_prompt"] = {("ar" if n == "ar" else f"{n[0]} + {n[1]}"): rec[n] for n in names}
        del decoders
        # Verifier stage on each drafter's own real trees: all trees in one round-robin (call i uses
        # tree i mod n), so machine noise hits both drafters and both verifiers alike.
        pool, owner = ([], []), []
        for d, drafter in drafters.items():
            trees, logits = real_trees(setup, drafter, prompts, args, t)
            pool[0].extend(trees)
            pool[1].extend(logits)
            owner += [d] * len(trees)
        box = {"cache": KVCache.init(setup.target.cfg, 1, args.capacity)}
        _, ms = time_stage(pool[0], pool[1], t, setup.target.cfg, args.capacity, box, args.stage_calls, VERIFIERS,
                           seed=args.seed)
        del box
        used = np.array(owner)[np.arange(args.stage_calls) % len(owner)]
        stage[str(t)] = {d: {"trees": owner.count(d), **{
            v: {"median": float(np.median(x[used == d])), "p10": float(np.percentile(x[used == d], 10)),
                "p90": float(np.percentile(x[used == d], 90))} for v, x in ms.items()}} for d in drafters}
    minutes = (time.perf_counter() - started) / 60
    cpu_minutes = (time.process_time() - cpu_started) / 60
    machine, vers = machine_and_versions()

    command = "python experiments/crossed.py" + (" " + " ".join(argv) if argv else "")
    lines = [
        "# Crossed drafter x verifier: tau, speedup and verifier-stage time",
        "",
        f"- Date: {date}; wall time {minutes:.1f} min (training of arms trained in this run included), process "
        f"CPU time {cpu_minutes:.1f} min.",
        f"- Command: `{command}`",
        f"- Machine: {machine}.",
        f"- Target: {setup.describe}. Drafters: " + "; ".join(f"{k} = `{v}`" for k, v in dirs.items()) + ".",
        f"- Decoding: budget {args.budget}, batch 1, {len(prompts)} prompts ({', '.join(args.prompt_sets)}), at most "
        f"{args.max_new_tokens} new tokens, seed {args.seed} + prompt index; AR and the four combinations "
        "interleaved prompt by prompt, compilation excluded.",
        f"- Verifier stage: decision + cache commit (`verifier_latency.time_stage`) on {args.stage_trees} real trees "
        f"per drafter (its own decoding rounds at budget {args.budget}), {args.stage_calls} timed calls per verifier "
        f"cycling through both drafters' trees, round-robin across verifiers, commit into a {args.capacity}-slot "
        "cache of the target's shape.",
        "",
    ]
    for t in args.temperatures:
        res, st = results[str(t)], stage[str(t)]
        lines += [f"## T = {t:g} (AR {res['ar']['tokens_per_s']:.2f} tok/s)", "",
                  "| drafter | verifier | tau +- SE | gain vs token-only + predraw [95%] (can it tell 5%?) | tok/s | "
                  "SR vs AR [10-90% over prompts] | verifier stage ms, median (10-90%) |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for d, v in combos:
            c, s = res[f"{d} + {v}"], st[d][v]
            lines.append(f"| {d} | {v} | {c['tau']:.3f} +- {c['se']:.3f} | {fmt_gain(c)} | {c['tokens_per_s']:.2f} | "
                         f"{c['sr']:.3f} [{c['sr_range'][0]:.2f}-{c['sr_range'][1]:.2f}] | {s['median']:.3f} "
                         f"({s['p10']:.3f}-{s['p90']:.3f}) |")
        lines.append("")
        for d in drafters:
            s = st[d]
            lines.append(f"- {d}: TEV stage vs predraw stage {100 * (s['tev']['median'] - s['predraw']['median']) / s['predraw']['median']:+.1f}% "
                         f"(medians, same real trees).")
        lines.append("")
    lines += ["Reading: at T = 0 both verifiers follow the greedy path, so their tau must be equal (exactness). At "
              "T > 0 they differ only by sampling noise on the same trees (claim 1); the drafter changes the trees. "
              "SR includes the whole round (drafting, tree pass, verification), so a verifier-stage saving shows in "
              "SR only in proportion to the stage's share of a round.", "",
              f"![tau, SR and verifier stage]({args.out.with_suffix('.png').name})", ""]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    plot(results, stage, combos, args.temperatures, args.out.with_suffix(".png"), len(prompts))
    raw = {"date": date, "command": command, "machine": machine, "versions": vers, "wall_minutes": minutes,
           "cpu_minutes": cpu_minutes, "drafters": dirs,
           "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "seeds": {"decode": f"{args.seed} + prompt index", "stage": args.seed}, "results": results, "stage": stage,
           "prompts": {s: setup.texts[s] for s in args.prompt_sets}}
    args.out.with_suffix(".json").write_text(json.dumps(raw, indent=1) + "\n")
    print("\n".join(lines))
    print(f"wrote {args.out}, .json and .png ({minutes:.1f} min)")
    return 0


def plot(results, stage, combos, temperatures, path: Path, n: int) -> None:
    """tau (95% intervals over the `n` prompts), speedup and verifier stage per drafter + verifier."""
    import matplotlib

    from tevjax.stats import q95

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(temperatures), 3, figsize=(12, 3.4 * len(temperatures) + 0.5), squeeze=False,
                             layout="constrained")
    names = [f"{d}\n+ {v}" for d, v in combos]
    for i, t in enumerate(temperatures):
        res, st = results[str(t)], stage[str(t)]
        cells = [res[f"{d} + {v}"] for d, v in combos]
        ax = axes[i, 0]
        ax.bar(names, [c["tau"] for c in cells], yerr=[q95(n) * np.nan_to_num(c["se"]) for c in cells],
               capsize=4)  # t with n - 1 df, as the tables' intervals
        ax.set_ylabel("tau (95% interval)", fontsize=8)
        ax.set_title(f"tau, T={t:g}", fontsize=9)
        ax = axes[i, 1]
        sr = np.array([c["sr"] for c in cells])
        rng = np.array([c["sr_range"] for c in cells]).T
        ax.bar(names, sr, yerr=np.abs(rng - sr), capsize=4)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_ylabel("SR vs AR (10-90% over prompts)", fontsize=8)
        ax.set_title(f"speedup, T={t:g}", fontsize=9)
        ax = axes[i, 2]
        med = np.array([st[d][v]["median"] for d, v in combos])
        err = np.array([[st[d][v]["median"] - st[d][v]["p10"], st[d][v]["p90"] - st[d][v]["median"]]
                        for d, v in combos]).T
        ax.bar(names, med, yerr=err, capsize=4)
        ax.set_ylabel("verify + commit, ms (10-90%)", fontsize=8)
        ax.set_title(f"verifier stage on real trees, T={t:g}", fontsize=9)
        for ax in axes[i]:
            ax.tick_params(axis="x", labelsize=7)
            ax.grid(alpha=0.3, axis="y")
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
