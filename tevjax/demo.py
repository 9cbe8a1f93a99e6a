"""`make demo`: the fixed-tree theory on a synthetic tree, then real generation on SmolLM2.

Part 1 (seconds): a synthetic tree, its exit law, and the three verifiers' empirical laws.
Part 2 (a few minutes on 2 CPU cores): the embedded SmolLM2-135M-Instruct answers chat prompts
with DFlash + DDTree + TEV; the same prompts are decoded autoregressively in the same run, and the
two outputs are compared token for token (greedy decoding is lossless, so they must agree).
"""

from __future__ import annotations

import time

from tevjax import demo_laws

PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the square of a number.",
    "Give me three tips for staying focused while studying.",
)


def main(*, max_new_tokens: int = 64, budget: int = 8, samples: int = 50_000, skip_models: bool = False) -> None:
    print("=" * 78)
    print("Part 1. The canonical exit law on a fixed tree (paper Sec. 3-4)")
    print("=" * 78)
    demo_laws.main(samples=samples, temperature=1.0)
    if skip_models:
        return

    from tevjax.convert.tokenizer import chat_prompt_ids
    from tevjax.decode.engine import DecodeConfig, Decoder
    from tevjax.loading import load_models

    print()
    print("=" * 78)
    print("Part 2. Lossless speculative decoding on the embedded SmolLM2-135M-Instruct (CPU, fp32)")
    print("=" * 78)
    t0 = time.perf_counter()
    models = load_models("smollm2")
    print(f"loaded target + tokenizer + drafter in {time.perf_counter() - t0:.1f} s")
    for note in models.notes:
        print(f"note: {note}")
    ids = [chat_prompt_ids(models.tokenizer, p) for p in PROMPTS]
    common = dict(max_new_tokens=max_new_tokens, eos_ids=models.eos_ids, temperature=0.0)
    spec = Decoder(models.target, models.drafter, DecodeConfig(verifier="tev", budget=budget, **common))
    ar = Decoder(models.target, None, DecodeConfig(**common))  # no drafter: autoregressive
    t0 = time.perf_counter()
    for p in ids:
        spec.compile([p])
        ar.compile([p])
    print(f"compiled DDTree+TEV (budget {budget}) and the autoregressive baseline in {time.perf_counter() - t0:.1f} s\n")

    totals = {"spec_tokens": 0, "spec_s": 0.0, "ar_tokens": 0, "ar_s": 0.0}
    for prompt, p in zip(PROMPTS, ids):
        t1 = time.perf_counter()
        g = spec.generate([p])[0]
        spec_s = time.perf_counter() - t1
        t1 = time.perf_counter()
        a = ar.generate([p])[0]
        ar_s = time.perf_counter() - t1
        totals["spec_tokens"] += len(g.tokens)
        totals["spec_s"] += spec_s
        totals["ar_tokens"] += len(a.tokens)
        totals["ar_s"] += ar_s
        same = "identical to" if g.tokens == a.tokens else "DIFFERENT FROM"
        print(f"user> {prompt}")
        print(f"assistant> {models.tokenizer.decode(g.tokens, skip_special_tokens=True).strip()}")
        print(f"   DDTree+TEV: {len(g.tokens)} tokens, {g.rounds} rounds, tau {g.tau:.2f}, "
              f"{len(g.tokens) / spec_s:.1f} tok/s | AR: {len(a.tokens) / ar_s:.1f} tok/s | "
              f"output {same} autoregressive greedy\n")
    sr = (totals["ar_s"] / max(totals["ar_tokens"], 1)) / (totals["spec_s"] / max(totals["spec_tokens"], 1))
    print(f"overall: DDTree+TEV {totals['spec_tokens'] / totals['spec_s']:.1f} tok/s vs AR "
          f"{totals['ar_tokens'] / totals['ar_s']:.1f} tok/s (speedup {sr:.2f}x, same run, same machine)")
    if not models.drafter_trained:
        print("The drafter is UNTRAINED (freshly initialised): almost every draft token is rejected, "
              "so tau is close to 1 and\nspeculation costs more than it saves. The output is still "
              "exactly the target's; a trained drafter is what raises tau.")
