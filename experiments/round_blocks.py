"""Output-block length by round index: is the first round (root = the prompt's last token) weaker?

A decoding round's tree hangs from the last committed token. In round 0 that is the last token of
the prompt (for chat prompts, the assistant header's newline), every later round's root is a
response token. A drafter whose training never anchored a block at that position drafts round 0
blind. This script decodes held-out prompts greedily with TEV, one jitted round at a time (the
engine's own `Decoder.step`), and reports the mean output-block length (accepted tokens + bonus)
of round 0, 1, ... against the later rounds, for one or more drafters on the same prompts. Greedy
outputs do not depend on the drafter, so every drafter's tokens are checked against the first's.
With `--temperature T > 0` the rounds sample (prompt i uses seed + i for every drafter) and the
paired comparison of tau is the result.

    python experiments/round_blocks.py                                   # the shipped drafter
    python experiments/round_blocks.py --drafter A --label a --drafter B --label b
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np

from tevjax.stats import paired_gain
from tevjax.tree import valid_temperature

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_trees import load_prompt_ids, machine_facts, versions  # noqa: E402
from report import QUANTILE, drafters_and_labels, emit, require_positive  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "round_blocks.md"
PAIRED = "Paired over prompts against {} (tau = block tokens / rounds, 95% interval):"  # where the paired lines start


def by_round(blocks: list[list[int]], shown: int) -> list[dict]:
    """Per round index 0..shown-1, then every later round pooled: rounds, mean block and its SE.

    `blocks[p]` is prompt p's output-block lengths in round order. The SE treats rounds as
    independent: a reading aid; the paired comparison of drafters uses prompts as units."""
    if shown < 1:
        raise ValueError(f"shown must be >= 1, got {shown}")
    groups = [[b[r] for b in blocks if len(b) > r] for r in range(shown)]
    groups.append([x for b in blocks for x in b[shown:]])
    out = []
    for r, g in enumerate(groups):
        a = np.asarray(g, np.float64)
        se = float(a.std(ddof=1) / np.sqrt(len(a))) if len(a) > 1 else float("nan")
        out.append({"round": str(r) if r < shown else f">={shown}", "rounds": len(a),
                    "mean": float(a.mean()) if len(a) else float("nan"), "se": se})
    return out


def decode_rounds(models, prompts: list[list[int]], budget: int, max_new_tokens: int, seed: int,
                  temperature: float = 0.0):
    """TEV decoding (greedy by default), one round at a time: (tokens, block lengths in round order)
    per prompt."""
    from tevjax.decode.engine import DecodeConfig, Decoder

    cfg = DecodeConfig(verifier="tev", budget=budget, temperature=temperature, max_new_tokens=max_new_tokens,
                       eos_ids=models.eos_ids, prompt_bucket=128)
    # One capacity for every prompt, so the round compiles once.
    capacity = Decoder(models.target, models.drafter, cfg).shapes([len(p) for p in prompts])[1]
    decoder = Decoder(models.target, models.drafter, dataclasses.replace(cfg, capacity=capacity))
    tokens, blocks = [], []
    for i, prompt in enumerate(prompts):
        state = decoder.prefill([list(prompt)], seed=seed + i)
        got, last = [], 0
        while not bool(np.asarray(state.done)[0]):
            state = decoder.step(state)
            total = int(np.asarray(state.block_total)[0])
            got.append(total - last)
            last = total
        tokens.append(decoder.results(state)[0].tokens)
        blocks.append(got)
    return tokens, blocks


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--drafter", action="append", default=None,
                   help="DFlash checkpoint directory (repeat to compare; default: the shipped drafter)")
    p.add_argument("--label", action="append", default=None, help="one per --drafter")
    p.add_argument("--prompts", default="heldout")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--first-prompt", type=int, default=0,
                   help="skip this many prompts of the set (a confirmation run on prompts an earlier run did not use)")
    p.add_argument("--budget", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--shown", type=int, default=6, help="round indices reported one by one (later ones pooled)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (outputs checked equal across drafters)")
    p.add_argument("--out", type=Path, default=RESULTS, help="results markdown; .json goes next to it")
    args = p.parse_args(argv)
    require_positive(p, args, "num_prompts", "budget", "max_new_tokens", "shown")
    if args.first_prompt < 0:
        p.error(f"--first-prompt must be >= 0, got {args.first_prompt}")
    if not valid_temperature(args.temperature):
        p.error(f"--temperature must be a finite float32 number >= 0, got {args.temperature}")
    drafters_and_labels(p, args, default_label="shipped")
    return args


def paired_lines(runs: dict) -> list[str]:
    """Each drafter's paired gain in tau over the first one's, and its round-0 block (none for one drafter)."""
    labels = list(runs)
    if len(labels) < 2:
        return []
    a = runs[labels[0]]
    lines = ["", PAIRED.format(labels[0]), ""]
    for label in labels[1:]:
        b = runs[label]
        g = paired_gain(a["tokens"], a["rounds"], b["tokens"], b["rounds"])
        r0a = np.mean([x[0] for x in a["blocks"]])
        r0b = np.mean([x[0] for x in b["blocks"]])
        lines.append(f"- {label}: tau {g['gain']:+.1%} [{g['lo']:+.1%}, {g['hi']:+.1%}]; round-0 block "
                     f"{r0a:.2f} -> {r0b:.2f}.")
    return lines


def main(argv=None) -> int:
    started, date = time.perf_counter(), datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from tevjax.loading import load_models  # after the arguments: a bad command line fails at once

    runs = {}
    texts = prompts = first_tokens = None
    for label, drafter in zip(args.label, args.drafters):
        models = load_models("smollm2", drafter, dtype="float32")
        if not models.drafter_trained and drafter is None:
            raise SystemExit("the shipped drafter is missing or untrained: give --drafter")
        if prompts is None:
            texts, prompts = load_prompt_ids(models.tokenizer, args.prompts, args.first_prompt + args.num_prompts)
            texts, prompts = texts[args.first_prompt:], prompts[args.first_prompt:]
        t0 = time.perf_counter()
        # Prompt j of the set is seeded seed + j, wherever the run starts.
        tokens, blocks = decode_rounds(models, prompts, args.budget, args.max_new_tokens, args.seed + args.first_prompt,
                                       args.temperature)
        if first_tokens is None:
            first_tokens = tokens
        elif args.temperature == 0 and tokens != first_tokens:  # greedy decoding is exact whatever the drafter
            bad = [i for i, (a, b) in enumerate(zip(tokens, first_tokens)) if a != b]
            raise SystemExit(f"{label}: greedy outputs differ from {args.label[0]}'s on prompts {bad}")
        runs[label] = {"drafter": drafter or "shipped", "blocks": blocks, "minutes": (time.perf_counter() - t0) / 60,
                       "rows": by_round(blocks, args.shown),
                       "tokens": [sum(b) for b in blocks], "rounds": [len(b) for b in blocks]}
        print(f"{label}: {runs[label]['minutes']:.1f} min", flush=True)

    shown = [r["round"] for r in next(iter(runs.values()))["rows"]]
    span = f" (from prompt {args.first_prompt})" if args.first_prompt else ""
    sampling = ("Greedy TEV" if args.temperature == 0
                else f"TEV at T = {args.temperature:g} (prompt i seeded seed + i for every drafter)")
    lines = [
        "# Output-block length by round index",
        "",
        f"- Date: {date}; wall time {(time.perf_counter() - started) / 60:.1f} min.",
        f"- Command: `python experiments/round_blocks.py {' '.join(argv)}`",
        f"- Machine: {machine_facts()}.",
        f"- {sampling}, budget {args.budget}, {len(prompts)} `{args.prompts}` prompts{span}, "
        f"at most {args.max_new_tokens} "
        "new tokens, batch 1. A block is the round's accepted tokens plus the bonus token (before any "
        "end-of-turn or length cut). Round 0's root is the prompt's last token. +- is one SE over rounds.",
    ]
    if len(runs) > 1 and args.temperature == 0:
        lines.append(f"- Every drafter's greedy tokens equal {args.label[0]}'s on every prompt (checked).")
    lines += [
        "",
        "| drafter | " + " | ".join(f"round {r}" for r in shown) + " | tau (all rounds) |",
        "|---|" + "---:|" * (len(shown) + 1),
    ]
    for label, run in runs.items():
        tau = sum(run["tokens"]) / sum(run["rounds"])
        lines.append(f"| {label} | " + " | ".join(f"{r['mean']:.2f} +- {r['se']:.2f}" for r in run["rows"])
                     + f" | {tau:.3f} |")
    lines += paired_lines(runs)
    emit(lines, args.out)
    payload = {"date": date, "command": "python experiments/round_blocks.py " + " ".join(argv),
               "machine": machine_facts(), "versions": versions(), "quantile": QUANTILE,
               "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
               "prompts": texts, "runs": runs}
    Path(args.out).with_suffix(".json").write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
