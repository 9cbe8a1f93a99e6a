"""What stop strings cost, and where they stop rows (`DecodeConfig.stop`, `tevjax generate --stop`).

The embedded SmolLM2 with the shipped drafter on the default path (TEV at budget 8 with both lookup
chains, greedy, batch 1) answers `--prompts` held-out ShareGPT prompts in three arms:
- "none": no stop strings;
- "never": a stop string no answer holds, so every round runs the automaton and nothing stops:
  its tokens must equal "none"'s, and its time over "none"'s is the automaton's cost;
- "stop": `--stop` (default "\\n\\n", the end of a paragraph): its tokens must be "none"'s cut
  after the first token whose text holds the string (a brute-force search of the bytes).

Every prompt runs the arms back to back in an order that rotates by prompt, `--repeats` times;
the first repeat also compiles and is not timed. Reported: the time ratio never / none per prompt
(median and range over prompts), how many rows the stop string ended and how many tokens that
saved, and whether every output was as it must be.

    nice -n 19 python experiments/stop_strings.py     # experiments/results/stop_strings.md (+ .json)
    python experiments/stop_strings.py --prompts 4 --max-new-tokens 32 --out /tmp/stop_strings.md
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

NEVER = "\u2603\u2603\u2603"  # three snowmen: in no answer (checked: "never" must equal "none")


def first_stop(spellings: list[bytes], tokens: list[int], stop: bytes) -> int | None:
    """The first index whose text (the bytes of tokens[: i + 1]) holds `stop`."""
    text = b""
    for i, t in enumerate(tokens):
        text += spellings[t]
        if stop in text:
            return i
    return None


def run(args) -> list[dict]:
    from tevjax.convert.tokenizer import chat_prompt_ids, token_bytes
    from tevjax.decode.engine import DecodeConfig, Decoder
    from tevjax.evaluate import load_eval_prompts
    from tevjax.loading import load_models

    models = load_models("smollm2")
    spellings = token_bytes(models.tokenizer)
    base = dict(verifier="tev", budget=args.budget, lookup=args.budget, corpus=args.budget,
                max_new_tokens=args.max_new_tokens, eos_ids=models.eos_ids)
    arms = {"none": (), "never": (NEVER,), "stop": (args.stop,)}
    decoders = {arm: Decoder(models.target, models.drafter, DecodeConfig(stop=stops, **base), ngrams=models.ngrams,
                             spellings=spellings if stops else None) for arm, stops in arms.items()}
    prompts = [chat_prompt_ids(models.tokenizer, t) for t in load_eval_prompts("heldout", args.prompts)]
    rows = []
    for i, ids in enumerate(prompts):
        order = list(arms)[i % 3:] + list(arms)[: i % 3]
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        out = {}
        for r in range(args.repeats + 1):
            for arm in order:
                t0 = time.perf_counter()
                gen = decoders[arm].generate([ids])[0]
                if r > 0:  # the first repeat compiles
                    times[arm].append(time.perf_counter() - t0)
                out[arm] = gen
        none = out["none"].tokens
        cut = first_stop(spellings, none, args.stop.encode())
        rows.append({"prompt": i, "tokens": len(none), "stop_tokens": len(out["stop"].tokens),
                     "stopped": out["stop"].stop == "stop", "stop_at": cut,
                     "never_equal": out["never"].tokens == none and out["never"].stop == out["none"].stop,
                     "stop_exact": out["stop"].tokens == (none if cut is None else none[: cut + 1])
                     and out["stop"].stop == ("stop" if cut is not None else out["none"].stop),
                     **{f"{arm}_s": float(np.median(times[arm])) for arm in arms}})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def report(rows: list[dict], args, seconds: float) -> list[str]:
    ratio = np.array([r["never_s"] / r["none_s"] for r in rows])
    stopped = [r for r in rows if r["stopped"]]
    saved = sum(r["tokens"] - r["stop_tokens"] for r in rows)
    return [
        "# Stop strings: their cost and where they stop rows", "",
        f"Command: `python experiments/stop_strings.py --prompts {args.prompts} --max-new-tokens "
        f"{args.max_new_tokens} --repeats {args.repeats} --stop {json.dumps(args.stop)}` ({time.strftime('%Y-%m-%d')}, "
        f"{seconds / 60:.1f} min in all). Machine: {platform.processor() or platform.machine()}, "
        f"{platform.platform()}.",
        f"SmolLM2-135M-Instruct (fp32), the shipped drafter, TEV at budget {args.budget} with both lookup chains, "
        f"greedy, batch 1, held-out prompts 0-{args.prompts - 1} in the chat template. Arms per prompt, back to back "
        "in an order rotating by prompt; times are the median of the repeats after a first, compiling one.", "",
        "| measure | value |",
        "|---|---|",
        f"| time with a stop string that never matches / without (the automaton's cost), median [min-max] over "
        f"prompts | {np.median(ratio):.3f} [{ratio.min():.3f}-{ratio.max():.3f}] |",
        f"| pooled time, never / none | {sum(r['never_s'] for r in rows) / sum(r['none_s'] for r in rows):.3f} |",
        f"| outputs of 'never' equal to 'none' | {sum(r['never_equal'] for r in rows)} of {len(rows)} |",
        f"| rows {json.dumps(args.stop)} ended | {len(stopped)} of {len(rows)} |",
        f"| tokens without / with the stop string | {sum(r['tokens'] for r in rows)} / "
        f"{sum(r['stop_tokens'] for r in rows)} ({saved} not generated) |",
        f"| time without / with the stop string (pooled) | {sum(r['none_s'] for r in rows):.1f} s / "
        f"{sum(r['stop_s'] for r in rows):.1f} s |",
        f"| outputs cut exactly after the first token whose text holds it | {sum(r['stop_exact'] for r in rows)} "
        f"of {len(rows)} |",
    ]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--budget", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2, help="timed repeats after the compiling one")
    parser.add_argument("--stop", default="\n\n", help="the stop string of the 'stop' arm (default: a blank line)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "stop_strings.md"))
    args = parser.parse_args(argv)
    require_positive(parser, args, "prompts", "max_new_tokens", "budget", "repeats")
    if not args.stop:
        parser.error("--stop is empty")
    return args


def main() -> None:
    args = parse_args()
    t0 = time.perf_counter()
    rows = run(args)
    save(report(rows, args, time.perf_counter() - t0), args.out, {"args": vars(args), "prompts": rows})


if __name__ == "__main__":
    main()
