"""What the context lookup (`DecodeConfig.lookup`) adds to the shipped drafter: tau, paired by prompt.

Each arm decodes the same held-out prompts with TEV at one budget, in batches through the engine's
`Decoder.generate`, with lookup chains of the given lengths (0: the drafter's tree alone). Greedy
outputs must not depend on the tree, so every arm's tokens are checked against the first arm's;
the result is each arm's tau (output-block length, bonus included, pooled over rounds) and its
paired gain over the first arm with a 95% interval (prompts as units: `paired_stats`). Wall times
are reported as a reading aid only; speed is `tevjax eval`'s job.

    python experiments/lookup_gain.py --lookups 0 8 --first-prompt 64 --num-prompts 192
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paired_stats import paired_gain  # noqa: E402
from real_trees import load_prompt_ids, machine_facts  # noqa: E402
from report import emit, require_positive  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "lookup_gain.md"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lookups", type=int, nargs="+", default=[0, 8],
                   help="chain lengths, one arm each; the first is the base")
    p.add_argument("--drafter", default=None, help="drafter directory (default: the shipped one)")
    p.add_argument("--prompts", default="heldout")
    p.add_argument("--first-prompt", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=192)
    p.add_argument("--budget", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    require_positive(p, args, "num_prompts", "budget", "max_new_tokens", "batch")
    if args.first_prompt < 0:
        p.error(f"--first-prompt must be >= 0, got {args.first_prompt}")
    bad = [n for n in args.lookups if not 0 <= n <= args.budget]
    if bad:
        p.error(f"--lookups must lie in [0, --budget {args.budget}], got {bad}")
    return args


def main(argv=None) -> int:
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from tevjax.decode.engine import DecodeConfig, Decoder
    from tevjax.loading import load_models

    models = load_models("smollm2", args.drafter, dtype="float32")
    if not models.drafter_trained:
        raise SystemExit("the drafter is untrained: give a trained --drafter")
    _, prompts = load_prompt_ids(models.tokenizer, args.prompts, args.first_prompt + args.num_prompts)
    prompts = prompts[args.first_prompt:]
    arms, first = {}, None
    for lookup in args.lookups:
        cfg = DecodeConfig(verifier="tev", budget=args.budget, lookup=lookup, max_new_tokens=args.max_new_tokens,
                           eos_ids=models.eos_ids, prompt_bucket=128)
        capacity = Decoder(models.target, models.drafter, cfg).shapes([len(p) for p in prompts])[1]
        decoder = Decoder(models.target, models.drafter, dataclasses.replace(cfg, capacity=capacity))
        t0, gens = time.perf_counter(), []
        for i in range(0, len(prompts), args.batch):
            gens += decoder.generate(prompts[i:i + args.batch])
        tokens = [g.tokens for g in gens]
        if first is None:
            first = tokens
        elif tokens != first:
            bad = [i for i, (a, b) in enumerate(zip(tokens, first)) if a != b]
            raise SystemExit(f"lookup {lookup}: greedy outputs differ from lookup {args.lookups[0]}'s on prompts {bad}")
        arms[lookup] = {"blocks": [round(g.tau * g.rounds) for g in gens], "rounds": [g.rounds for g in gens],
                        "minutes": (time.perf_counter() - t0) / 60}
        tau = sum(arms[lookup]["blocks"]) / sum(arms[lookup]["rounds"])
        print(f"lookup {lookup}: tau {tau:.3f}, {arms[lookup]['minutes']:.1f} min", flush=True)

    base = arms[args.lookups[0]]
    lines = [
        "# The context lookup's gain in tau",
        "",
        f"{date}; `python experiments/lookup_gain.py {' '.join(sys.argv[1:] if argv is None else argv)}`.",
        f"Greedy TEV, budget {args.budget}, {args.max_new_tokens} new tokens, {args.prompts} prompts "
        f"{args.first_prompt}-{args.first_prompt + args.num_prompts - 1}, batches of {args.batch}; drafter "
        f"{args.drafter or 'shipped'}. Every arm's outputs equal the first arm's. {machine_facts()}",
        "",
        "| lookup | tau | gain over the first arm [95% CI] | rounds | minutes |",
        "|---:|---:|---|---:|---:|",
    ]
    for lookup, a in arms.items():
        tau = sum(a["blocks"]) / sum(a["rounds"])
        g = paired_gain(base["blocks"], base["rounds"], a["blocks"], a["rounds"])
        gain = "-" if a is base else f"{100 * g['gain']:+.1f}% [{100 * g['lo']:+.1f}, {100 * g['hi']:+.1f}]"
        lines.append(f"| {lookup} | {tau:.3f} | {gain} | {sum(a['rounds'])} | {a['minutes']:.1f} |")
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
