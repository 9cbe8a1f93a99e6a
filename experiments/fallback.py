"""Fallback to plain target steps (`DecodeConfig.fallback_below`): speed against AR with it off and on.

For each case (the shipped drafter or a freshly initialised one, at temperature 0 or 1) one process
holds three decoders over the embedded SmolLM2 and the same held-out prompts: AR (no drafter),
speculation always (`fallback_below` 0) and speculation with the fallback (`--threshold`), all at
budget 8 with the context lookup (and the corpus lookup where the drafter has a table: the shipped
one). Prompt i runs every decoder back to back, in an order rotated by i, after compiling ahead;
seeds are the prompt index, so the three sample the same law and greedy outputs must all equal AR's.

Reported per case: each arm's speedup over AR (pooled tokens/s) with the 10-90% range of the
per-prompt ratios, tokens per round, the share of plain rounds, and the fallback's gain in speed
over speculation-always, paired over prompts (`tevjax.stats.paired_gain` on tokens and seconds:
a ratio of rates, its delta-method 95% interval).

    nice -n 19 python experiments/fallback.py                 # experiments/results/fallback.md (+ .json)
    python experiments/fallback.py --cases shipped:1 --num-prompts 8 --out /tmp/fallback.md
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
from report import emit  # noqa: E402  experiments/report.py

CASES = ("shipped:0", "shipped:1", "untrained:0", "untrained:1")


def run_case(drafter_kind: str, temperature: float, texts: list[str], *, threshold: float, rounds: int,
             budget: int, max_new_tokens: int) -> dict:
    from tevjax.convert.tokenizer import chat_prompt_ids
    from tevjax.decode.engine import DecodeConfig, Decoder
    from tevjax.loading import fresh_drafter, load_models, mask_token_for
    from tevjax.stats import paired_gain

    models = load_models("smollm2")
    drafter, ngrams = models.drafter, models.ngrams
    if drafter_kind == "untrained":
        drafter = fresh_drafter(models.target_cfg, seed=0, mask_token_id=mask_token_for(models.target_cfg,
                                                                                        models.tokenizer))
        ngrams = None
    prompts = [chat_prompt_ids(models.tokenizer, t) for t in texts]
    base = dict(temperature=temperature, max_new_tokens=max_new_tokens, eos_ids=models.eos_ids)
    spec = dict(verifier="tev", budget=budget, lookup=budget, corpus=budget if ngrams is not None else 0, **base)
    decoders = {"ar": Decoder(models.target, None, DecodeConfig(**base)),
                "always": Decoder(models.target, drafter, DecodeConfig(**spec), ngrams=ngrams),
                "fallback": Decoder(models.target, drafter, DecodeConfig(fallback_below=threshold,
                                                                         fallback_rounds=rounds, **spec),
                                    ngrams=ngrams)}
    names = list(decoders)
    arms = {m: {"tokens": [], "seconds": [], "rounds": [], "plain": [], "outputs": []} for m in names}
    for i, p in enumerate(prompts):
        for m in names[i % len(names):] + names[: i % len(names)]:
            decoders[m].compile([p])
            t0 = time.perf_counter()
            g = decoders[m].generate([p], seed=i)[0]
            arms[m]["seconds"].append(time.perf_counter() - t0)
            arms[m]["tokens"].append(len(g.tokens))
            arms[m]["rounds"].append(g.rounds)
            arms[m]["plain"].append(g.plain_rounds)
            arms[m]["outputs"].append(g.tokens)
    ar = arms["ar"]
    ar_rate = np.array(ar["tokens"]) / np.array(ar["seconds"])
    rows = {}
    for m in ("always", "fallback"):
        a = arms[m]
        rate = np.array(a["tokens"]) / np.array(a["seconds"])
        rows[m] = {"speedup": (sum(a["tokens"]) / sum(a["seconds"])) / (sum(ar["tokens"]) / sum(ar["seconds"])),
                   "speedup_p10_p90": [float(np.percentile(rate / ar_rate, q)) for q in (10, 90)],
                   "tokens_per_round": sum(a["tokens"]) / sum(a["rounds"]),
                   "plain_share": sum(a["plain"]) / sum(a["rounds"]),
                   "equal_to_ar": sum(x == y for x, y in zip(a["outputs"], ar["outputs"]))}
    gain = paired_gain(arms["always"]["tokens"], arms["always"]["seconds"], arms["fallback"]["tokens"],
                       arms["fallback"]["seconds"])
    return {"drafter": drafter_kind, "temperature": temperature,
            "ar_tokens_per_s": sum(ar["tokens"]) / sum(ar["seconds"]),
            "arms": rows, "fallback_gain": gain,
            "raw": {m: {k: v for k, v in arms[m].items() if k != "outputs"} for m in names}}


def report(results: list[dict], args, seconds: float) -> list[str]:
    lines = ["# Fallback to plain target steps: speed against AR, off and on", "",
             f"Command: `python experiments/fallback.py --num-prompts {args.num_prompts} --threshold {args.threshold} "
             f"--cases {','.join(args.cases)}` ({time.strftime('%Y-%m-%d')}, {seconds / 60:.1f} min in all). "
             f"Machine: {platform.processor() or platform.machine()}, {platform.platform()}.",
             f"SmolLM2-135M-Instruct (fp32), {args.num_prompts} held-out prompts, {args.max_new_tokens} new tokens, "
             f"batch 1, TEV at budget {args.budget} with the context lookup (and the corpus lookup for the shipped "
             f"drafter); fallback below {args.threshold} with waits of {args.rounds} rounds, doubling. "
             "AR and both arms ran back to back per prompt, in a rotated order. Speedup: pooled tokens/s over "
             "AR's, [10-90% over prompts]; gain: the fallback's tokens/s over speculation-always, paired over "
             "prompts, [95% interval].", "",
             "| drafter | temperature | AR tok/s | always: speedup | tok/round | fallback: speedup | tok/round "
             "| plain rounds | fallback gain | outputs == AR |",
             "|---|---:|---:|---|---:|---|---:|---:|---|---|"]
    for r in results:
        a, f, g = r["arms"]["always"], r["arms"]["fallback"], r["fallback_gain"]
        same = (f"{a['equal_to_ar']} / {f['equal_to_ar']} of {args.num_prompts}" if r["temperature"] == 0
                else "n/a (sampled)")
        lines.append(f"| {r['drafter']} | {r['temperature']:g} | {r['ar_tokens_per_s']:.1f} "
                     f"| {a['speedup']:.3f}x [{a['speedup_p10_p90'][0]:.2f}-{a['speedup_p10_p90'][1]:.2f}] "
                     f"| {a['tokens_per_round']:.2f} "
                     f"| {f['speedup']:.3f}x [{f['speedup_p10_p90'][0]:.2f}-{f['speedup_p10_p90'][1]:.2f}] "
                     f"| {f['tokens_per_round']:.2f} | {f['plain_share']:.0%} "
                     f"| {g['gain']:+.1%} [{g['lo']:+.1%}, {g['hi']:+.1%}] | {same} |")
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=lambda s: s.split(","), default=list(CASES),
                        help=f"drafter:temperature pairs, comma-separated (default {','.join(CASES)})")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--threshold", type=float, default=1.8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--budget", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "fallback.md"))
    args = parser.parse_args(argv)
    for case in args.cases:
        kind, _, temp = case.partition(":")
        if kind not in ("shipped", "untrained") or temp not in ("0", "1"):
            parser.error(f"--cases: {case!r} is not one of {', '.join(CASES)}")
    if args.num_prompts < 1 or args.rounds < 1 or args.budget < 1 or args.max_new_tokens < 1:
        parser.error("--num-prompts, --rounds, --budget and --max-new-tokens must be >= 1")
    if not 0 < args.threshold < float("inf"):
        parser.error(f"--threshold must be a finite number > 0 (0 is the always-speculate arm), "
                     f"got {args.threshold}")
    return args


def main() -> None:
    args = parse_args()
    from tevjax.evaluate import load_eval_prompts

    texts = load_eval_prompts("heldout", args.num_prompts)
    t0 = time.perf_counter()
    results = []
    json_path = Path(args.out).with_suffix(".json")
    for case in args.cases:
        kind, _, temp = case.partition(":")
        results.append(run_case(kind, float(temp), texts, threshold=args.threshold, rounds=args.rounds,
                                budget=args.budget, max_new_tokens=args.max_new_tokens))
        print(json.dumps({k: v for k, v in results[-1].items() if k != "raw"}), flush=True)
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps({"args": vars(args), "cases": results}, indent=1))
    emit(report(results, args, time.perf_counter() - t0), args.out)


if __name__ == "__main__":
    main()
