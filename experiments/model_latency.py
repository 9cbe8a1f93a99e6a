"""Load time, one-token decode step and one-pass tree verification on the embedded SmolLM2.

Every timed pass is one of the engine's own round stages (`tevjax.decode.engine`), jitted on its
own; the KV caches are the engine's too (`Decoder.prefill` of a `--prefix`-token chat prefix: all
but the last token cached, the last one the root, the capacity the engine allocates). Measured in
one run (CPU or whatever `jax.devices()[0]` is; the target is float32):

* load: GGUF -> HF conversion into a fresh temporary cache directory, the cached
  `prepare_smollm2()` call that follows it, `load_hf_target` and the tokenizer;
* step: `tree_pass` over `root_trees`, one token and no taps (the autoregressive decode step of a
  `Decoder` without a drafter);
* tree pass: `tree_pass` over N = budget + 1 slots for each N in `--nodes`, on a real DDTree
  (`draft_trees` on random peaked marginals; positions prefix + depth, the drafter's tap layers
  requested), i.e. the target half of a speculative round;
* for context, the fresh (untrained) DFlash drafter's block pass (`draft`, block 16) and the DDTree
  builder stage (`draft_trees`: the log-softmax and the builder) at budget 16 on [G, V] random peaked
  marginals (G = block_size - 1 = 15).

All passes are timed round-robin: every round calls each of them once, in the same order, so
noise on the shared host hits all of them alike; the ratio to the one-token step is the ratio of
medians, and its spread is the 10-90% range of the per-round ratios. The ratio of the minima is
listed too: on a shared host the minimum is the figure least disturbed by other processes.
Every target pass donates the KV cache and threads the returned one into the next call, as the
engine's donated state does, so no call copies the cache. Writes land at slots >= cache_len (the
root's slot), so the cached prefix every call reads is never modified. Prints a markdown table and writes
experiments/results/model_latency.md.

    python experiments/model_latency.py                       # defaults: prefix 256, 40 rounds
    python experiments/model_latency.py --nodes 9 17 --iters 30
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import platform
import shutil
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tevjax.convert.embedded import prepare_smollm2
from tevjax.convert.hf import load_hf_target
from tevjax.convert.tokenizer import chat_prompt_ids, load_tokenizer
from tevjax.decode import engine
from tevjax.loading import SMOLLM2_MASK_TOKEN, fresh_drafter
from report import emit  # experiments/report.py (scripts run from this folder)

# Filler for a realistic chat prefix; the content does not change the cost, only the length does.
FILLER = ("Please summarise the following notes on speculative decoding for a short report. "
          "A small drafter proposes several tokens, the large target checks them in one pass, "
          "and every accepted token saves one sequential step of the target model. ")


def _prefix_ids(tok, length: int) -> list[int]:
    """A chat-formatted user request cut to exactly `length` tokens."""
    text = FILLER
    while True:
        ids = chat_prompt_ids(tok, text)
        if len(ids) >= length:
            return ids[:length]
        text += FILLER


def _peaked_log_marginals(rng: np.random.Generator, depth: int, vocab: int) -> np.ndarray:
    """[G, V] log-probabilities (G = depth): noisy logits with one boosted token per depth (top-1
    probability roughly 0.3-0.9), like a drafter that is fairly sure of its first choice."""
    logits = 2.0 * rng.standard_normal((depth, vocab))
    peak = rng.integers(0, vocab, depth)
    logits[np.arange(depth), peak] += rng.uniform(14.0, 18.0, depth)
    logits -= logits.max(axis=1, keepdims=True)
    return (logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))).astype(np.float32)


def _stats(x: np.ndarray) -> tuple[float, float, float, float]:
    p10, p50, p90 = np.percentile(x, [10, 50, 90])
    return float(p50), float(p10), float(p90), float(np.min(x))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix", type=int, default=256, help="committed tokens in the KV cache")
    ap.add_argument("--nodes", type=int, nargs="+", default=[9, 17, 33, 65], help="tree sizes N = budget + 1")
    ap.add_argument("--iters", type=int, default=40, help="timed round-robin rounds (>= 30)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed rounds after compiling")
    ap.add_argument("--max-new-tokens", type=int, default=128,
                    help="sizes the cache as the engine would: prefix + 1 + this + N, rounded up to 128")
    ap.add_argument("--seed", type=int, default=0)
    default_out = pathlib.Path(__file__).parent / "results" / "model_latency.md"
    ap.add_argument("--out", default=str(default_out))
    args = ap.parse_args()
    if args.iters < 30:
        raise SystemExit("--iters must be >= 30 (medians over fewer calls are too noisy)")
    if any(n < 2 for n in args.nodes):
        raise SystemExit("--nodes must all be >= 2 (a root and at least one drafted node)")
    t_start = time.perf_counter()

    # ------------------------------------------------------------------ (a) load times
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="tevjax_latency_"))
    try:
        t0 = time.perf_counter()
        hf_dir = prepare_smollm2(cache_dir=tmp)
        t_convert = time.perf_counter() - t0
        t0 = time.perf_counter()
        again = prepare_smollm2(cache_dir=tmp)
        t_cached = time.perf_counter() - t0
        assert again == hf_dir
        t0 = time.perf_counter()
        cfg, target = load_hf_target(hf_dir, dtype="float32")
        t_load = time.perf_counter() - t0
        t0 = time.perf_counter()
        tok = load_tokenizer(hf_dir)
        t_tok = time.perf_counter() - t0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # ~0.5 GB; the model is in memory now
    print(f"convert {t_convert:.2f} s, cached prepare {t_cached * 1e3:.2f} ms, "
          f"load_hf_target {t_load:.2f} s, tokenizer {t_tok:.2f} s", flush=True)

    drafter = fresh_drafter(cfg, seed=args.seed, block_size=16, mask_token_id=SMOLLM2_MASK_TOKEN)
    dcfg = drafter.cfg
    taps = dcfg.target_layer_ids
    p = args.prefix
    # The engine's prefill and cache sizing, for the largest tree (the capacity is what a Decoder
    # allocates for this prefix with --max-new-tokens and budget max(--nodes) - 1).
    decoder = engine.Decoder(target, drafter, engine.DecodeConfig(budget=max(args.nodes) - 1,
                                                                  max_new_tokens=args.max_new_tokens))
    try:
        capacity = decoder.shapes([p])[1]
    except ValueError as e:
        raise SystemExit(f"--prefix {p}: {e}") from None
    tgd, tstate, dgd, dstate = decoder.tgd, decoder.tstate, decoder.dgd, decoder.dstate

    # ------------------------------------------------------------------ prefix in both caches
    state = jax.block_until_ready(decoder.prefill([_prefix_ids(tok, p)]))
    cache, dcache = state.target_cache, state.drafter_cache
    cache_len, root = state.cache_len, state.root  # [1]: prefix - 1 cached tokens; the root is the last

    # ------------------------------------------------------------------ the timed functions
    # The engine's stages, each jitted on its own. Each target pass donates the cache (argument 1)
    # and returns the new one, as the engine's donated state does; its writes land at slots
    # >= cache_len, so the prefix every call reads is never modified.
    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(tstate, cache, cache_len, root):
        """Autoregressive step: the root alone, no hidden taps (a Decoder without a drafter)."""
        out = engine.tree_pass(nnx.merge(tgd, tstate), engine.root_trees(root), cache_len, cache)
        return out.logits, out.cache

    @functools.partial(jax.jit, donate_argnums=(1,))
    def tree_pass(tstate, cache, cache_len, trees):
        """Target half of a round: N tree slots at cache_len + depth under the ancestor mask, taps on."""
        out = engine.tree_pass(nnx.merge(tgd, tstate), trees, cache_len, cache, taps)
        return out.logits, out.hidden, out.cache

    @jax.jit
    def draft(tstate, dstate, dcache, cache_len, root, head):
        """Drafter block pass: draft logits [1, G, V] (`head`: the engine's pre-gathered draft head)."""
        return engine.draft(nnx.merge(dgd, dstate), nnx.merge(tgd, tstate), root, cache_len, dcache, head)

    build = jax.jit(engine.draft_trees, static_argnums=2)  # log-softmax + DDTree builder

    rng = np.random.default_rng(args.seed)
    lm = jnp.asarray(_peaked_log_marginals(rng, dcfg.block_size - 1, cfg.vocab_size))[None]  # [1, G, V]
    trees = {}
    for n in args.nodes:
        trees[n] = build(lm, root, n - 1)
        print(f"N={n}: tree of {int(trees[n].size[0])} nodes, max depth {int(trees[n].depth.max())}", flush=True)

    names = ["step"] + [f"tree{n}" for n in args.nodes] + ["draft", "build16"]
    times = {k: [] for k in names}
    box = {"cache": cache}

    def call(name):
        if name == "step":
            logits, box["cache"] = step(tstate, box["cache"], cache_len, root)
            return logits
        if name == "draft":
            return draft(tstate, dstate, dcache, cache_len, root, state.draft_head)
        if name == "build16":
            return build(lm, root, 16)
        logits, hidden, box["cache"] = tree_pass(tstate, box["cache"], cache_len, trees[int(name[4:])])
        return logits, hidden

    t0 = time.perf_counter()
    for name in names:  # compile
        jax.block_until_ready(call(name))
    t_compile = time.perf_counter() - t0
    print(f"compiled {len(names)} functions in {t_compile:.1f} s", flush=True)
    for r in range(args.warmup + args.iters):
        for name in names:
            t0 = time.perf_counter()
            jax.block_until_ready(call(name))
            if r >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    times = {k: np.asarray(v) * 1e3 for k, v in times.items()}  # ms
    load_end = os.getloadavg()[0]
    step_ms = times["step"]
    med_step = float(np.median(step_ms))

    # ------------------------------------------------------------------ report
    dev = jax.devices()[0]
    cmd = "python " + " ".join([pathlib.Path(sys.argv[0]).as_posix()] + sys.argv[1:])
    lines = [
        "# SmolLM2-135M-Instruct latency: load, decode step, tree pass",
        "",
        f"Command: `{cmd}` (total run {time.perf_counter() - t_start:.0f} s).",
        f"Device: {dev.platform} ({dev.device_kind}), {os.cpu_count()} host cores,"
        f" {platform.processor() or platform.machine()}; jax {jax.__version__}; **{dev.platform.upper()},"
        f" float32** weights and compute. Target: SmolLM2-135M-Instruct (embedded Q4_1 GGUF,"
        f" dequantised to float32), {cfg.num_layers} layers, D = {cfg.hidden_size}, V = {cfg.vocab_size}."
        f" KV cache: {p}-token chat prefix (engine prefill), capacity {capacity} slots (what the engine allocates for"
        f" this prefix with max_new_tokens = {args.max_new_tokens}). Batch 1.",
        f"Timing: {args.iters} round-robin rounds after {args.warmup} warm-up rounds; each round calls"
        f" every pass once; host load average at the end: {load_end:.1f} (shared, noisy machine).",
        "",
        "## Load",
        "",
        "| stage | time |",
        "|---|---:|",
        f"| GGUF -> HF conversion, fresh cache dir (`prepare_smollm2(cache_dir=tmp)`) | {t_convert:.2f} s |",
        f"| cached `prepare_smollm2` (marker check only) | {t_cached * 1e3:.2f} ms |",
        f"| `load_hf_target` (safetensors -> float32 params, warm page cache) | {t_load:.2f} s |",
        f"| tokenizer (`load_tokenizer`) | {t_tok:.2f} s |",
        "",
        f"Compiling the {len(names)} timed functions: {t_compile:.1f} s.",
        "",
        "## Passes",
        "",
        "| pass | tokens | median ms | p10-p90 ms | min ms | ms per token | ratio to 1-token step"
        " (p10-p90 of per-round ratio) | ratio of minima |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def row(label, key, ntok):
        med, p10, p90, mn = _stats(times[key])
        ratio = times[key] / step_ms
        r10, r90 = np.percentile(ratio, [10, 90])
        per_tok = f"{med / ntok:.2f}" if ntok else "-"
        lines.append(f"| {label} | {ntok or '-'} | {med:.2f} | {p10:.2f}-{p90:.2f} | {mn:.2f} | {per_tok} |"
                     f" {med / med_step:.2f} ({r10:.2f}-{r90:.2f}) | {mn / np.min(step_ms):.2f} |")

    row("target step (AR decode)", "step", 1)
    for n in args.nodes:
        row(f"target tree pass, B = {n - 1}", f"tree{n}", n)
    row(f"drafter block pass (fresh, {dcfg.num_layers} layers, block {dcfg.block_size})", "draft", dcfg.block_size)
    row(f"DDTree builder (log-softmax + build), B = 16, [{dcfg.block_size - 1}, {cfg.vocab_size}] marginals",
        "build16", 0)
    lines.append("")
    if 17 in args.nodes:
        round_ms = float(np.median(times["draft"]) + np.median(times["build16"]) + np.median(times["tree17"]))
        lines.append(
            f"A B = 16 round's drafter + builder + tree pass (medians summed, verify and commit not"
            f" included) is {round_ms:.1f} ms = {round_ms / med_step:.2f} one-token steps: on this"
            f" machine a round must commit more than that many tokens on average (tau) to beat"
            f" autoregressive decoding.")
        lines.append("")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
