"""`make demo`: the fixed-tree theory on a synthetic tree, then real generation on SmolLM2.

Part 1 (seconds): a synthetic tree, its exit law, and the three verifiers' empirical laws.
Part 2 (a few minutes on 2 CPU cores): the embedded SmolLM2-135M-Instruct answers chat prompts
with DFlash + DDTree + TEV; the same prompts are decoded autoregressively in the same run, and the
two outputs are compared token for token (greedy decoding is lossless, so they must agree).
"""

from __future__ import annotations

import statistics
import time

from tevjax import demo_laws

PROMPTS = (
    "What is the capital of France? Answer in one sentence.",
    "Write a Python function that returns the square of a number.",
    "Give me three tips for staying focused while studying.",
)


def main(*, max_new_tokens: int = 64, budget: int = 8, samples: int = 50_000, repeats: int = 3,
         skip_models: bool = False) -> int:
    """Runs the demonstration; returns how many greedy outputs differ from AR's (0 unless broken)."""
    print("=" * 78)
    print("Part 1. The canonical exit law on a fixed tree (paper Sec. 3-4)")
    print("=" * 78)
    demo_laws.main(samples=samples, temperature=1.0)
    if skip_models:
        return 0

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

    # Timing on a shared 2-core machine swings by +-20% from one second to the next, so each prompt
    # is decoded `repeats` times by both methods, in an order that alternates, and the speedup is
    # the median over repeats of (AR time per token) / (speculative time per token), with its range.
    spec_s = [[0.0] * repeats for _ in ids]
    ar_s = [[0.0] * repeats for _ in ids]
    outputs = []
    for r in range(repeats):
        for i, p in enumerate(ids):
            order = ("spec", "ar") if (r + i) % 2 == 0 else ("ar", "spec")
            for method in order:
                t1 = time.perf_counter()
                out = (spec if method == "spec" else ar).generate([p])[0]
                (spec_s if method == "spec" else ar_s)[i][r] = time.perf_counter() - t1
                if r == 0:
                    outputs.append((i, method, out))
    spec_tokens, ar_tokens = [0] * len(ids), [0] * len(ids)
    mismatches = 0
    for i, method, out in outputs:
        (spec_tokens if method == "spec" else ar_tokens)[i] = len(out.tokens)
    for i, prompt in enumerate(PROMPTS):
        g = next(o for j, m, o in outputs if j == i and m == "spec")
        a = next(o for j, m, o in outputs if j == i and m == "ar")
        same = "identical to" if g.tokens == a.tokens else "DIFFERENT FROM"
        mismatches += g.tokens != a.tokens
        print(f"user> {prompt}")
        print(f"assistant> {models.tokenizer.decode(g.tokens, skip_special_tokens=True).strip()}")
        print(f"   DDTree+TEV: {len(g.tokens)} tokens, {g.rounds} rounds, tau {g.tau:.2f}, "
              f"{len(g.tokens) / statistics.median(spec_s[i]):.1f} tok/s | "
              f"AR: {len(a.tokens) / statistics.median(ar_s[i]):.1f} tok/s | output {same} autoregressive greedy\n")
    # per repeat: tokens/s of each method over all prompts (prompts are deterministic, so the
    # token counts are the same in every repeat)
    spec_rate = [sum(spec_tokens) / sum(s[r] for s in spec_s) for r in range(repeats)]
    ar_rate = [sum(ar_tokens) / sum(s[r] for s in ar_s) for r in range(repeats)]
    ratios = [sr / ar_r for sr, ar_r in zip(spec_rate, ar_rate)]
    print(f"overall: DDTree+TEV {statistics.median(spec_rate):.1f} tok/s vs AR {statistics.median(ar_rate):.1f} tok/s: "
          f"speedup {statistics.median(ratios):.2f}x (median of {repeats} interleaved repeats, range "
          f"{min(ratios):.2f}-{max(ratios):.2f}x; same run, same machine)")
    if not models.drafter_trained:
        print("The drafter is UNTRAINED (freshly initialised): almost every draft token is rejected, "
              "so tau is close to 1 and\nspeculation costs more than it saves. The output is still "
              "exactly the target's; a trained drafter is what raises tau.")
    if mismatches:
        print(f"ERROR: {mismatches} speculative outputs differ from autoregressive greedy decoding.")
    return mismatches
