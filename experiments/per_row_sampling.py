"""What `DecodeConfig(sampling_per_row=True)` costs: rows with their own sampling settings.

With per-row settings every row runs both the greedy and the sampling verifier (a select per row,
`tevjax.verify` under a traced temperature), truncation cuts each row by its own top-k / top-p /
min-p (when any row truncates), and the fallback reads the row's temperature. This measures the
price on the embedded SmolLM2 with the shipped drafter on the default path (TEV at budget 8 with
both lookup chains), a batch of held-out prompts, seed 0:

- "fixed S": a Decoder whose rows all decode with settings S (static, as without the flag):
  temperature 0, temperature 1, and temperature 1 with top-k 20;
- "per-row S": `sampling_per_row=True` with every row given S; its tokens are checked equal to
  the fixed arm's (the same key streams), so both arms run the same rounds and their times
  compare directly;
- "per-row mixed": the rows cycle through greedy, temperature 1, and temperature 1 with top-k 20
  (no fixed arm can run that batch).

Arms at one temperature alternate within each repeat. The fallback is off in every arm, so rounds
depend on the tokens alone. Reported: seconds per generate (median and range over repeats) and
the per-row arm's time over the fixed arm's, per repeat.

    nice -n 19 python experiments/per_row_sampling.py   # experiments/results/per_row_sampling.md (+ .json)
    python experiments/per_row_sampling.py --repeats 1 --max-new-tokens 16 --out /tmp/prs.md
"""

from __future__ import annotations

import argparse
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
    prompts = [chat_prompt_ids(models.tokenizer, p) for p in load_eval_prompts("heldout", args.batch)]

    def decoder(**kw) -> Decoder:
        cfg = DecodeConfig(verifier="tev", budget=8, lookup=8, corpus=8, max_new_tokens=args.max_new_tokens,
                           eos_ids=models.eos_ids, **kw)
        dec = Decoder(models.target, models.drafter, cfg, ngrams=models.ngrams)
        dec.compile(prompts)
        return dec

    per_row = decoder(sampling_per_row=True)
    cycle = [dict(temperature=0.0, top_k=0), dict(temperature=1.0, top_k=0), dict(temperature=1.0, top_k=20)]
    mixed = [cycle[i % 3] for i in range(args.batch)]
    arms = {"fixed T0": (decoder(temperature=0.0), {}), "per-row T0": (per_row, dict(temperature=0.0)),
            "fixed T1": (decoder(temperature=1.0), {}), "per-row T1": (per_row, dict(temperature=1.0)),
            "fixed T1k20": (decoder(temperature=1.0, top_k=20), {}),
            "per-row T1k20": (per_row, dict(temperature=1.0, top_k=20)),
            "per-row mixed": (per_row, {key: [m[key] for m in mixed] for key in ("temperature", "top_k")})}
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    tokens: dict[str, list[list[int]]] = {}
    rounds: dict[str, int] = {}
    order = list(arms)
    for rep in range(args.repeats):
        for name in order if rep % 2 == 0 else order[::-1]:
            dec, settings = arms[name]
            t0 = time.perf_counter()
            gens = dec.generate(prompts, seed=0, **settings)
            seconds[name].append(time.perf_counter() - t0)
            tokens.setdefault(name, [g.tokens for g in gens])
            assert tokens[name] == [g.tokens for g in gens], f"{name}: the output changed between repeats"
            rounds[name] = max(g.rounds for g in gens)
            print(f"repeat {rep} {name}: {seconds[name][-1]:.2f} s, {rounds[name]} rounds", flush=True)
    for s in ("T0", "T1", "T1k20"):
        assert tokens[f"per-row {s}"] == tokens[f"fixed {s}"], f"per-row {s} decoded other tokens than fixed {s}"
    got = tokens["per-row mixed"]
    for i in range(args.batch):
        want = tokens[("fixed T0", "fixed T1", "fixed T1k20")[i % 3]][i]
        assert got[i] == want, f"row {i} of the mix decoded other tokens than its fixed arm"
    return {"seconds": seconds, "rounds": rounds}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=6, help="held-out prompts decoded together")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "per_row_sampling.md"))
    args = parser.parse_args(argv)
    require_positive(parser, args, "batch", "repeats", "max_new_tokens")
    out = run(args)
    sec = {k: np.asarray(v) for k, v in out["seconds"].items()}

    def spread(x: np.ndarray, digits: int = 2) -> str:
        return f"{np.median(x):.{digits}f} [{x.min():.{digits}f}-{x.max():.{digits}f}]"

    lines = ["# Rows with their own sampling settings: the cost of `sampling_per_row`", "",
             f"`python experiments/per_row_sampling.py` ({args.repeats} repeats, batch {args.batch}, "
             f"{args.max_new_tokens} new tokens, held-out prompts 0-{args.batch - 1}, seed 0; SmolLM2 + the shipped "
             f"drafter, TEV at budget 8 with both lookup chains, no fallback; {platform.machine()}, "
             f"{platform.processor() or 'cpu'}).", "",
             "Seconds per `generate` of the batch, median [range over repeats]; the ratio is per repeat (the arms "
             "of one temperature ran back to back, in alternating order).", "",
             "| arm | rounds (slowest row) | seconds | per-row / fixed |", "|---|---:|---|---|"]
    for name in out["seconds"]:
        s = name.split()[-1]
        ratio = spread(sec[name] / sec[f"fixed {s}"]) if name.startswith("per-row") and s != "mixed" else "-"
        lines.append(f"| {name} | {out['rounds'][name]} | {spread(sec[name])} | {ratio} |")
    lines += ["", "T0: greedy; T1: temperature 1; T1k20: temperature 1 with top-k 20. Every per-row arm decoded "
              "exactly its fixed arm's tokens, and each row of the mixed batch its setting's fixed arm's (checked)."]
    save(lines, args.out, {"args": vars(args), **out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
