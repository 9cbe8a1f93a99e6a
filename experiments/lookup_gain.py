"""What the lookup chains (`DecodeConfig.lookup`, `DecodeConfig.corpus`) add to the shipped drafter: tau,
paired by prompt.

Each arm decodes the same held-out prompts with TEV at one budget, in batches through the engine's
`Decoder.generate`, with lookup chains of the given lengths (0: the drafter's tree alone). Greedy
outputs must not depend on the tree, so every arm's tokens are checked against the first arm's;
the result is each arm's tau (output-block length, bonus included, pooled over rounds) and its
paired gain over the first arm with a 95% interval (prompts as units: `tevjax.stats`). Wall times
are reported as a reading aid only; speed is `tevjax eval`'s job.

`--exponents` calibrates the chain against the drafter: each lookup arm runs once per exponent k,
with the survival table raised to the power k (`DecodeConfig.lookup_survival`), so the chain's log
reach is scaled by k: below 1 the chain wins more tree slots, above 1 fewer. `--survival FILE` adds
an arm per lookup with a table from a JSON file (`lookup_survival.py --json`). With `--temperature`
above 0 the arms sample (the same seed), so their outputs are not compared; prompts still pair them.
`--corpus` crosses every arm with corpus-chain lengths (the drafter directory's `corpus.npz`),
and `--corpus-exponents` scales the corpus chain's log reach as `--exponents` does the context's;
`--corpus-file` adds corpus arms with other corpora.

    python experiments/lookup_gain.py --lookups 0 8 --first-prompt 64 --num-prompts 192
    python experiments/lookup_gain.py --lookups 8 --exponents 1 0.5 0.75 1.5 2 --first-prompt 16 --num-prompts 48
    python experiments/lookup_gain.py --lookups 8 --survival T1.json --temperature 1
    python experiments/lookup_gain.py --lookups 8 --corpus 0 8 --corpus-exponents 1 0.75 1.5 --first-prompt 16 \
        --num-prompts 48
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from pathlib import Path

from tevjax.stats import paired_gain

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_trees import load_prompt_ids, machine_facts  # noqa: E402
from report import emit, require_positive  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "lookup_gain.md"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lookups", type=int, nargs="+", default=[0, 8],
                   help="chain lengths, one arm each; the first is the base")
    p.add_argument("--exponents", type=float, nargs="+", default=[1.0],
                   help="powers of the survival table, one arm per lookup > 0 each (1: the builder's table)")
    p.add_argument("--survival", type=Path, action="append", default=[],
                   help="a JSON survival table (5 rows of depths), one more arm per lookup > 0 (repeatable)")
    p.add_argument("--corpus", type=int, nargs="+", default=[0],
                   help="corpus-lookup chain lengths (DecodeConfig.corpus), one arm per lookup arm each")
    p.add_argument("--corpus-exponents", type=float, nargs="+", default=[1.0],
                   help="powers of the corpus chain's reach estimates, one arm per corpus > 0 each (1: the table's)")
    p.add_argument("--corpus-file", type=Path, action="append", default=[],
                   help="a corpus .npz (tevjax.loading.load_ngrams) in place of the drafter directory's: one more "
                        "set of corpus arms per file (repeatable; the drafter's own comes first)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="sampling seed (every arm the same)")
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
    bad = [n for n in args.lookups + args.corpus if not 0 <= n <= args.budget]
    if bad:
        p.error(f"--lookups and --corpus must lie in [0, --budget {args.budget}], got {bad}")
    for flag, ks in (("--exponents", args.exponents), ("--corpus-exponents", args.corpus_exponents)):
        if not all(0 < k < float("inf") for k in ks):
            p.error(f"{flag} must be finite and > 0, got {ks}")
    if not 0 <= args.temperature < float("inf"):
        p.error(f"--temperature must be finite and >= 0, got {args.temperature}")
    from tevjax.builder import LOOKUP_SURVIVAL, check_survival

    args.tables = {f"builder^{k:g}": tuple(tuple(x ** k for x in row) for row in LOOKUP_SURVIVAL)
                   for k in args.exponents}
    for path in args.corpus_file:
        if not path.is_file():
            p.error(f"--corpus-file {str(path)!r}: no such file")
    for path in args.survival:
        try:
            args.tables[path.stem] = check_survival(json.loads(path.read_text()))
        except (OSError, ValueError) as e:
            p.error(f"--survival {str(path)!r}: {e}")
    return args


def main(argv=None) -> int:
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from tevjax.decode.engine import DecodeConfig, Decoder
    from tevjax.law import is_greedy
    from tevjax.loading import load_models, load_ngrams

    models = load_models("smollm2", args.drafter, dtype="float32")
    if not models.drafter_trained:
        raise SystemExit("the drafter is untrained: give a trained --drafter")
    _, prompts = load_prompt_ids(models.tokenizer, args.prompts, args.first_prompt + args.num_prompts)
    prompts = prompts[args.first_prompt:]
    greedy = is_greedy(args.temperature)
    arms, first = {}, None
    corpora = {"drafter's": models.ngrams} if models.ngrams is not None else {}
    for path in args.corpus_file:
        try:
            corpora[str(path)] = load_ngrams(path)
        except ValueError as e:
            raise SystemExit(f"--corpus-file: {e}")
    if any(c > 0 for c in args.corpus) and not corpora:
        raise SystemExit("--corpus needs a drafter directory with a corpus.npz, or --corpus-file")
    runs = [(n, name, c, k, f) for n in args.lookups for name in (args.tables if n > 0 else ["-"]) for c in args.corpus
            for k in (args.corpus_exponents if c > 0 else [1.0]) for f in (corpora if c > 0 else ["-"])]
    for lookup, name, corpus, k, cfile in runs:
        table = corpora.get(cfile, models.ngrams)
        ngrams = dataclasses.replace(table, log_reach=table.log_reach * k) if table is not None else None
        cfg = DecodeConfig(verifier="tev", budget=args.budget, lookup=lookup, max_new_tokens=args.max_new_tokens,
                           eos_ids=models.eos_ids, prompt_bucket=128, temperature=args.temperature,
                           lookup_survival=args.tables.get(name), corpus=corpus)
        capacity = Decoder(models.target, models.drafter, cfg, ngrams=ngrams).shapes([len(p) for p in prompts])[1]
        decoder = Decoder(models.target, models.drafter, dataclasses.replace(cfg, capacity=capacity), ngrams=ngrams)
        t0, gens = time.perf_counter(), []
        for i in range(0, len(prompts), args.batch):
            gens += decoder.generate(prompts[i:i + args.batch], seed=args.seed + i)
        tokens = [g.tokens for g in gens]
        if first is None:
            first = tokens
        elif greedy and tokens != first:
            bad = [i for i, (a, b) in enumerate(zip(tokens, first)) if a != b]
            raise SystemExit(f"lookup {lookup}, table {name}, corpus {corpus}^{k:g} ({cfile}): greedy outputs differ "
                             f"from the first arm's on prompts {bad}")
        arm = arms[lookup, name, corpus, k, cfile] = {"blocks": [round(g.tau * g.rounds) for g in gens],
                                    "rounds": [g.rounds for g in gens], "minutes": (time.perf_counter() - t0) / 60}
        tau = sum(arm["blocks"]) / sum(arm["rounds"])
        print(f"lookup {lookup}, table {name}, corpus {corpus}^{k:g} ({cfile}): tau {tau:.3f}, "
              f"{arm['minutes']:.1f} min", flush=True)

    base = arms[runs[0]]
    mode = ("Greedy TEV" if greedy else f"TEV sampling at T = {args.temperature:g} (seed {args.seed} + batch start; "
            "arms decode different text, paired by prompt)")
    same = " Every arm's outputs equal the first arm's." if greedy else ""
    lines = [
        "# The lookup chains' gain in tau",
        "",
        f"{date}; `python experiments/lookup_gain.py {' '.join(sys.argv[1:] if argv is None else argv)}`.",
        f"{mode}, budget {args.budget}, {args.max_new_tokens} new tokens, {args.prompts} prompts "
        f"{args.first_prompt}-{args.first_prompt + args.num_prompts - 1}, batches of {args.batch}; drafter "
        f"{args.drafter or 'shipped'}.{same} {machine_facts()}",
        "",
        "| lookup | survival table | corpus | corpus reach^k | corpus file | tau | gain over the first arm [95% CI] "
        "| rounds | minutes |",
        "|---:|---|---:|---:|---|---:|---|---:|---:|",
    ]
    for (lookup, name, corpus, k, cfile), a in arms.items():
        tau = sum(a["blocks"]) / sum(a["rounds"])
        g = paired_gain(base["blocks"], base["rounds"], a["blocks"], a["rounds"])
        gain = "-" if a is base else f"{100 * g['gain']:+.2f}% [{100 * g['lo']:+.2f}, {100 * g['hi']:+.2f}]"
        lines.append(f"| {lookup} | {name} | {corpus} | {k:g} | {cfile} | {tau:.3f} | {gain} | {sum(a['rounds'])} "
                     f"| {a['minutes']:.1f} |")
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
