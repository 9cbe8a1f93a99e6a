"""Continuous batching (`Decoder.generate_continuous`) against batches of fixed rows.

The embedded SmolLM2 with the shipped drafter on the default path (TEV at budget `--budget` with
both lookup chains, greedy, end-of-turn as EOS) answers `--prompts` held-out ShareGPT prompts in
the chat template, `--batch` rows at a time, two ways:
- "fixed": `generate` on consecutive groups of `--batch` prompts, as `tevjax generate
  --batch-file --batch-size` runs them: each group runs until its longest answer is done, with
  the rows that finished first idle;
- "continuous": `generate_continuous(prompts, batch)`: a finished row's result is read and the
  next prompt is prefilled into it while the other rows keep decoding.
Both must give every prompt the same tokens. Each pass runs both arms, in an order alternating by
pass; the first pass compiles and is not timed. Reported: each arm's wall time and tokens per
second (median over the timed passes, with their range), the ratio, and how the answers ended.

    nice -n 19 python experiments/continuous_batching.py   # experiments/results/continuous_batching.md (+ .json)
    python experiments/continuous_batching.py --prompts 8 --max-new-tokens 32 --out /tmp/cb.md
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import require_positive, save  # noqa: E402  experiments/report.py


def run(args) -> dict:
    from tevjax.convert.tokenizer import chat_prompt_ids
    from tevjax.decode.engine import DecodeConfig, Decoder
    from tevjax.evaluate import load_eval_prompts
    from tevjax.loading import load_models

    models = load_models("smollm2")
    cfg = DecodeConfig(verifier="tev", budget=args.budget, lookup=args.budget, corpus=args.budget,
                       max_new_tokens=args.max_new_tokens, eos_ids=models.eos_ids)
    decoder = Decoder(models.target, models.drafter, cfg, ngrams=models.ngrams)
    prompts = [chat_prompt_ids(models.tokenizer, t) for t in load_eval_prompts("heldout", args.prompts)]

    def fixed():
        return [g for i in range(0, len(prompts), args.batch)
                for g in decoder.generate(prompts[i: i + args.batch], first_row=i)]

    arms = {"fixed": fixed, "continuous": lambda: decoder.generate_continuous(prompts, args.batch)}
    seconds: dict[str, list[float]] = {arm: [] for arm in arms}
    outputs = {}
    for p in range(args.repeats + 1):
        for arm in (list(arms) if p % 2 == 0 else list(arms)[::-1]):
            t0 = time.perf_counter()
            outputs[arm] = arms[arm]()
            if p > 0:  # the first pass compiles
                seconds[arm].append(time.perf_counter() - t0)
            print(json.dumps({"pass": p, "arm": arm, "seconds": time.perf_counter() - t0}), flush=True)
    gens = outputs["fixed"]
    return {"seconds": seconds, "tokens": sum(len(g.tokens) for g in gens),
            "equal": sum(a.tokens == b.tokens for a, b in zip(outputs["fixed"], outputs["continuous"])),
            "eos": sum(g.stop == "eos" for g in gens), "lengths": [len(g.tokens) for g in gens],
            "rounds": [g.rounds for g in gens]}


def batch_rounds(rounds: list[int], batch: int) -> tuple[int, int]:
    """(rounds the batch runs with fixed groups, with continuous batching) for prompts taking
    `rounds` each: a fixed group runs as long as its slowest prompt; a continuous batch gives each
    free row the next prompt at once (its loop stops when a row finishes), so it runs for the
    makespan of that list schedule."""
    fixed = sum(max(rounds[i: i + batch]) for i in range(0, len(rounds), batch))
    free_at = [0] * batch
    for r in rounds:
        row = min(range(batch), key=free_at.__getitem__)
        free_at[row] += r
    return fixed, max(free_at)


def report(res: dict, args, seconds: float) -> list[str]:
    fixed, cont = (np.array(res["seconds"][a]) for a in ("fixed", "continuous"))
    ratio = fixed / cont  # passes pair up: each ran both arms back to back
    lengths, rounds = np.array(res["lengths"]), np.array(res["rounds"])
    groups = [rounds[i: i + args.batch] for i in range(0, len(rounds), args.batch)]
    row_rounds = sum(len(g) * g.max() for g in groups)  # a fixed group's rows wait for its slowest
    fixed_rounds, cont_rounds = batch_rounds(res["rounds"], args.batch)
    return [
        "# Continuous batching against batches of fixed rows", "",
        f"Command: `python experiments/continuous_batching.py --prompts {args.prompts} --batch {args.batch} "
        f"--max-new-tokens {args.max_new_tokens} --repeats {args.repeats}` ({time.strftime('%Y-%m-%d')}, "
        f"{seconds / 60:.1f} min in all). Machine: {platform.processor() or platform.machine()}, {platform.platform()}.",
        f"SmolLM2-135M-Instruct (fp32), the shipped drafter, TEV at budget {args.budget} with both lookup chains, "
        f"greedy, end-of-turn as EOS, held-out prompts 0-{args.prompts - 1} in the chat template, {args.batch} rows. "
        "Times are the median of the timed passes (after a compiling one), with their range; the speedup pairs the "
        "two arms of each pass.", "",
        "| arm | seconds | tokens/s |",
        "|---|---|---:|",
        f"| fixed batches (`generate` per group) | {np.median(fixed):.1f} [{fixed.min():.1f}-{fixed.max():.1f}] "
        f"| {res['tokens'] / np.median(fixed):.1f} |",
        f"| continuous (`generate_continuous`) | {np.median(cont):.1f} [{cont.min():.1f}-{cont.max():.1f}] "
        f"| {res['tokens'] / np.median(cont):.1f} |", "",
        f"- Speedup of continuous batching: {np.median(ratio):.2f}x [{ratio.min():.2f}-{ratio.max():.2f}] over "
        f"{len(ratio)} passes.",
        f"- Same tokens for {res['equal']} of {args.prompts} prompts.",
        f"- {res['eos']} of {args.prompts} answers ended at end-of-turn; the rest at {args.max_new_tokens} tokens "
        f"({lengths.mean():.0f} tokens on average). Rows finish at different rounds even at equal lengths, since "
        f"each has its own tau: answers took {rounds.min()}-{rounds.max()} rounds, and the rows of fixed groups "
        f"sat idle for {1 - rounds.sum() / row_rounds:.0%} of the rounds their groups ran.",
        f"- Rounds the batch ran: {fixed_rounds} with fixed groups, {cont_rounds} with continuous batching "
        f"({fixed_rounds / cont_rounds:.2f}x fewer; every round costs about the same whatever its rows do). The "
        "wall-time speedup is that, less the refills' prefills and the extra loop calls.",
    ]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--budget", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=4, help="timed passes after the compiling one")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "continuous_batching.md"))
    args = parser.parse_args(argv)
    require_positive(parser, args, "prompts", "batch", "max_new_tokens", "budget", "repeats")
    return args


def main() -> None:
    args = parse_args()
    t0 = time.perf_counter()
    res = run(args)
    save(report(res, args, time.perf_counter() - t0), args.out, {"args": vars(args), **res})


if __name__ == "__main__":
    main()
