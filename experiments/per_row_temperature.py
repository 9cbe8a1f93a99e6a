"""What `DecodeConfig(temperature_per_row=True)` costs: rows at their own temperatures.

With per-row temperatures every row runs both the greedy and the sampling verifier (a select per
row, `tevjax.verify` under a traced temperature), and truncation and the fallback read the row's
value. This measures the price on the embedded SmolLM2 with the shipped drafter on the default
path (TEV at budget 8 with both lookup chains), a batch of held-out prompts, seed 0:

- "fixed T": a Decoder whose rows all decode at T (a static temperature, as before);
- "per-row T": `temperature_per_row=True` with every row given T; its tokens are checked equal to
  the fixed arm's (the same key streams), so both arms run the same rounds and their times
  compare directly;
- "per-row mixed": the rows alternate 0 and 1 (no fixed arm can run that batch).

Arms at one temperature alternate within each repeat. The fallback is off in every arm, so rounds
depend on the tokens alone. Reported: seconds per generate (median and range over repeats) and
the per-row arm's time over the fixed arm's, per repeat.

    nice -n 19 python experiments/per_row_temperature.py   # experiments/results/per_row_temperature.md (+ .json)
    python experiments/per_row_temperature.py --repeats 1 --max-new-tokens 16 --out /tmp/prt.md
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

    per_row = decoder(temperature_per_row=True)
    arms = {"fixed 0": (decoder(temperature=0.0), None), "per-row 0": (per_row, 0.0),
            "fixed 1": (decoder(temperature=1.0), None), "per-row 1": (per_row, 1.0),
            "per-row mixed": (per_row, [0.0, 1.0] * (args.batch // 2) + [0.0] * (args.batch % 2))}
    seconds: dict[str, list[float]] = {name: [] for name in arms}
    tokens: dict[str, list[list[int]]] = {}
    rounds: dict[str, int] = {}
    order = list(arms)
    for rep in range(args.repeats):
        for name in order if rep % 2 == 0 else order[::-1]:
            dec, temperature = arms[name]
            t0 = time.perf_counter()
            gens = dec.generate(prompts, seed=0, temperature=temperature)
            seconds[name].append(time.perf_counter() - t0)
            tokens.setdefault(name, [g.tokens for g in gens])
            assert tokens[name] == [g.tokens for g in gens], f"{name}: the output changed between repeats"
            rounds[name] = max(g.rounds for g in gens)
            print(f"repeat {rep} {name}: {seconds[name][-1]:.2f} s, {rounds[name]} rounds", flush=True)
    for t in ("0", "1"):
        assert tokens[f"per-row {t}"] == tokens[f"fixed {t}"], f"per-row {t} decoded other tokens than fixed {t}"
    mixed = tokens["per-row mixed"]
    assert all(mixed[i] == tokens["fixed 0"][i] for i in range(0, args.batch, 2)), "a greedy row of the mix changed"
    return {"seconds": seconds, "rounds": rounds}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=4, help="held-out prompts decoded together")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "per_row_temperature.md"))
    args = parser.parse_args(argv)
    require_positive(parser, args, "batch", "repeats", "max_new_tokens")
    out = run(args)
    sec = {k: np.asarray(v) for k, v in out["seconds"].items()}

    def spread(x: np.ndarray, digits: int = 2) -> str:
        return f"{np.median(x):.{digits}f} [{x.min():.{digits}f}-{x.max():.{digits}f}]"

    lines = ["# Rows at their own temperatures: the cost of `temperature_per_row`", "",
             f"`python experiments/per_row_temperature.py` ({args.repeats} repeats, batch {args.batch}, "
             f"{args.max_new_tokens} new tokens, held-out prompts 0-{args.batch - 1}, seed 0; SmolLM2 + the shipped "
             f"drafter, TEV at budget 8 with both lookup chains, no fallback; {platform.machine()}, "
             f"{platform.processor() or 'cpu'}).", "",
             "Seconds per `generate` of the batch, median [range over repeats]; the ratio is per repeat (the arms "
             "of one temperature ran back to back, in alternating order).", "",
             "| arm | rounds (slowest row) | seconds | per-row / fixed |", "|---|---:|---|---|"]
    for name in out["seconds"]:
        t = name.split()[-1]
        ratio = spread(sec[name] / sec[f"fixed {t}"]) if name.startswith("per-row") and t != "mixed" else "-"
        lines.append(f"| {name} | {out['rounds'][name]} | {spread(sec[name])} | {ratio} |")
    lines += ["", "Per-row 0 and per-row 1 decoded exactly the fixed arms' tokens, and the mixed batch's greedy "
              "rows the greedy tokens (checked)."]
    save(lines, args.out, {"args": vars(args), **out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
