"""What a new Decoder costs once an equal one exists (`tevjax.decode.engine._program`).

Decoders whose models have the same structure and whose config and mesh are equal share their
jitted programs, so a second one (a new request handler, an evaluation's repeat, a chat turn's
fresh decoder) compiles nothing. This measures that on the embedded SmolLM2 with the shipped drafter
on the default path (TEV at budget 8 with both lookup chains, greedy), one held-out prompt:

- "shared": `--decoders` Decoders built one after another; for each, the seconds of construction +
  `compile([prompt])` and of its first `generate`;
- "unshared": the same with the program cache cleared before each Decoder, which is what every
  Decoder paid before programs were shared.

The arms alternate, `--repeats` times, in one process (the first Decoder of a "shared" repeat after
an "unshared" one compiles again, since the cache was cleared). Reported: medians and ranges.

    nice -n 19 python experiments/shared_programs.py   # experiments/results/shared_programs.md (+ .json)
    python experiments/shared_programs.py --repeats 1 --out /tmp/shared_programs.md
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


def run(args) -> dict[str, list[list[tuple[float, float]]]]:
    from tevjax.convert.tokenizer import chat_prompt_ids
    from tevjax.decode import engine
    from tevjax.decode.engine import DecodeConfig, Decoder
    from tevjax.evaluate import load_eval_prompts
    from tevjax.loading import load_models

    models = load_models("smollm2")
    prompt = chat_prompt_ids(models.tokenizer, load_eval_prompts("heldout", 1)[0])
    cfg = DecodeConfig(verifier="tev", budget=8, lookup=8, corpus=8, max_new_tokens=args.max_new_tokens,
                       eos_ids=models.eos_ids)
    out: dict[str, list[list[tuple[float, float]]]] = {"shared": [], "unshared": []}
    tokens = None
    for rep in range(args.repeats):
        for arm in ("unshared", "shared") if rep % 2 else ("shared", "unshared"):
            engine._program.cache_clear()  # each repeat's first Decoder compiles, in both arms
            times = []
            for _ in range(args.decoders):
                if arm == "unshared":
                    engine._program.cache_clear()
                t0 = time.perf_counter()
                dec = Decoder(models.target, models.drafter, cfg, ngrams=models.ngrams)
                dec.compile([prompt])
                t1 = time.perf_counter()
                got = dec.generate([prompt])[0].tokens
                times.append((t1 - t0, time.perf_counter() - t1))
                if tokens is None:
                    tokens = got
                assert got == tokens, "a Decoder's output changed"
            out[arm].append(times)
            print(f"repeat {rep} {arm}: " + ", ".join(f"{a:.2f}+{b:.2f} s" for a, b in times), flush=True)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decoders", type=int, default=3, help="Decoders built one after another per arm")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "shared_programs.md"))
    args = parser.parse_args(argv)
    require_positive(parser, args, "decoders", "repeats", "max_new_tokens")
    out = run(args)

    def cell(arm: str, k: int, part: int) -> str:
        x = np.asarray([times[k][part] for times in out[arm]])
        return f"{np.median(x):.2f} [{x.min():.2f}-{x.max():.2f}]"

    lines = ["# A new Decoder once an equal one exists", "",
             f"`python experiments/shared_programs.py` ({args.repeats} repeats, {args.decoders} Decoders per arm, "
             f"{args.max_new_tokens} new tokens, one held-out prompt; SmolLM2 + the shipped drafter, TEV at "
             f"budget 8 with both lookup chains; {platform.machine()}, {platform.processor() or 'cpu'}).", "",
             "Seconds, median [range over repeats]: construction + `compile([prompt])`, and the first `generate`.",
             "", "| Decoder | shared: build + compile | shared: first generate | unshared: build + compile "
             "| unshared: first generate |", "|---|---|---|---|---|"]
    for k in range(args.decoders):
        lines.append(f"| {k + 1} | {cell('shared', k, 0)} | {cell('shared', k, 1)} | {cell('unshared', k, 0)} "
                     f"| {cell('unshared', k, 1)} |")
    lines += ["", "Every Decoder's output was the same tokens (checked)."]
    save(lines, args.out, {"args": vars(args), "seconds": out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
