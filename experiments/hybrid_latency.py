"""What a tree pass costs a hybrid target (Gated DeltaNet linear layers, Qwen3.5's layout) against an
all-attention one of the same width and depth: the round's target half, tree pass plus commit, at
each tree size N, in units of the same model's one-token step.

Two random float32 models with SmolLM2-135M's width (D 576, 9 query and 3 key/value heads of 64, MLP
1536, vocabulary 49,152) and `--layers` layers: a `qwen3` target, and a `qwen3_5_text` target whose
layers are Gated DeltaNet in three of every four (3 key heads and 6 value heads of 64, conv 4), the
others gated attention. Each model gets the engine's own prefill of a `--prefix`-token prompt, then
per round-robin round, for every N in `--nodes`: `engine.tree_pass` over a DDTree of N slots (random
peaked marginals, as `model_latency.py`), and the commit of a 3-node accepted path
(`KVCache.move_slots`, and for the hybrid `KVCache.advance`, which runs the path into the linear
layers' state), jitted together with the cache donated. N = 1 is the autoregressive step. Also timed:
one prefill chunk of `--prefix` tokens (a causal run), which the hybrid runs through the chunked
recurrence (`linear_attention.gated_delta_chunked`).

The ratios are of medians over rounds; their spread is the 10-90% range of the per-round ratios.
Everything runs in one process, interleaved in a fresh random order each round, so noise on the
shared host (and the cold caches after a prefill) hit both models and every N alike.

    python experiments/hybrid_latency.py                      # defaults: 12 layers, prefix 256
    python experiments/hybrid_latency.py --nodes 1 9 17 --iters 30
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tevjax.decode import engine
from tevjax.models.dflash import DFlashConfig, DFlashDrafter
from tevjax.testing import random_model, tiny_config
from model_latency import _peaked_log_marginals  # experiments/model_latency.py
from report import save  # experiments/report.py (scripts run from this folder)

WIDTH = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3, head_dim=64,
             tie_word_embeddings=True, max_position_embeddings=4096)


def configs(layers: int):
    """The all-attention and the hybrid config, the same width and depth."""
    attention = tiny_config("qwen3", num_layers=layers, **WIDTH)
    hybrid = tiny_config("qwen3_5_text", num_layers=layers, **WIDTH,
                         linear_layers=tuple(i for i in range(layers) if (i + 1) % 4), linear_key_heads=3,
                         linear_value_heads=6, linear_key_dim=64, linear_value_dim=64, linear_conv=4, rotary_dim=16)
    return {"attention": attention, "hybrid": hybrid}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12, help="layers of each model (a multiple of 4)")
    ap.add_argument("--prefix", type=int, default=256, help="prompt tokens prefilled before the timed passes")
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 9, 17, 33, 65], help="tree sizes N = budget + 1")
    ap.add_argument("--iters", type=int, default=30, help="timed round-robin rounds (>= 10)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds after compiling")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "hybrid_latency.md"))
    args = ap.parse_args(argv)
    if args.layers <= 0 or args.layers % 4:
        ap.error(f"--layers must be a positive multiple of 4 (three linear layers, then attention), got {args.layers}")
    if args.iters < 10:
        ap.error(f"--iters must be >= 10, got {args.iters}")
    if args.prefix < 2 or any(n < 1 for n in args.nodes):
        ap.error("--prefix must be >= 2 and every --nodes entry >= 1")
    return args


def prepare(models: dict, prompt: list[int], nodes: list[int], seed: int) -> dict:
    """Per model (name -> `Transformer`): the engine's prefill of `prompt`, a tree of each size in
    `nodes`, and the jitted passes `call` times."""
    vocab = next(iter(models.values())).cfg.vocab_size
    lm = jnp.asarray(_peaked_log_marginals(np.random.default_rng(seed), 15, vocab))[None]  # [1, G, V]
    build = jax.jit(engine.draft_trees, static_argnums=2)
    runs = {}
    for name, target in models.items():
        cfg = target.cfg
        # A drafter only so that the engine's cache records the largest tree (N = budget + 1 nodes).
        drafter = DFlashDrafter(DFlashConfig.for_target(cfg, num_layers=1, block_size=16, mask_token_id=0),
                                rngs=nnx.Rngs(seed))
        dec = engine.Decoder(target, drafter, engine.DecodeConfig(budget=max(max(nodes) - 1, 1), max_new_tokens=64,
                                                                  prompt_bucket=64))
        state = jax.block_until_ready(dec.prefill([prompt]))
        tgd = dec.tgd

        @functools.partial(jax.jit, donate_argnums=(1,))
        def round_half(tstate, cache, cache_len, trees, tgd=tgd):
            out = engine.tree_pass(nnx.merge(tgd, tstate), trees, cache_len, cache)
            n = trees.tokens.shape[1]
            path = jnp.minimum(jnp.arange(3, dtype=jnp.int32), n - 1)[None]
            src = jnp.where(jnp.arange(2)[None] < n - 1, cache_len[:, None] + 1 + jnp.arange(2)[None], -1)
            committed = out.cache.move_slots(src, cache_len + 1).advance(path, jnp.minimum(3, n)[None])
            return out.logits, committed

        @jax.jit
        def chunk(tstate, cache, tokens, tgd=tgd):
            t = tokens.shape[1]
            return nnx.merge(tgd, tstate)(tokens, jnp.arange(t, dtype=jnp.int32)[None], cache,
                                          jnp.zeros((1,), jnp.int32), None, compute_logits=False).final_hidden

        trees = {n: (engine.root_trees(state.root) if n == 1 else build(lm, state.root, n - 1)) for n in nodes}
        runs[name] = dict(cfg=cfg, tstate=dec.tstate, cache=state.target_cache, cache_len=state.cache_len,
                          trees=trees, round_half=round_half, chunk=chunk, tokens=jnp.asarray([prompt], jnp.int32))
    return runs


def call(run: dict, what) -> jax.Array:
    """One timed pass: "prefill" (a causal run over the prompt), or the tree pass + commit at N = what."""
    if what == "prefill":
        return run["chunk"](run["tstate"], run["cache"], run["tokens"])
    logits, run["cache"] = run["round_half"](run["tstate"], run["cache"], run["cache_len"], run["trees"][what])
    return logits


def measure(runs: dict, stages: list, iters: int, warmup: int, seed: int) -> dict:
    """{(model, stage): [ms]}: every stage of every model once a round, in a fresh random order each
    round (so that noise, and the cold caches after a prefill, hit every cell alike), after compiling."""
    for run in runs.values():
        for what in stages:
            jax.block_until_ready(call(run, what))
    times = {(name, what): [] for name in runs for what in stages}
    pairs = [(what, name) for what in stages for name in runs]
    order = np.random.default_rng(seed + 1)
    for r in range(warmup + iters):
        for i in order.permutation(len(pairs)):
            what, name = pairs[i]
            t0 = time.perf_counter()
            jax.block_until_ready(call(runs[name], what))
            if r >= warmup:
                times[name, what].append((time.perf_counter() - t0) * 1e3)
    return {k: np.asarray(v) for k, v in times.items()}


def ratio(times: dict, a, b) -> tuple[float, float, float]:
    """The ratio of medians of two cells, and the 10-90% range of their per-round ratios."""
    per = times[a] / times[b]
    return float(np.median(times[a]) / np.median(times[b])), *np.percentile(per, [10, 90])


TABLE = ["| N | attention ms | hybrid ms | attention / its step | hybrid / its step | hybrid / attention |",
         "|---:|---:|---:|---|---|---|"]


def rows(times: dict, nodes: list[int]) -> list[str]:
    """The table's rows: each N's medians and its ratios to the step (N = 1) and between the models."""
    step = 1 if 1 in nodes else nodes[0]
    out = []
    for n in nodes:
        a, h = float(np.median(times["attention", n])), float(np.median(times["hybrid", n]))
        ra, rh = ratio(times, ("attention", n), ("attention", step)), ratio(times, ("hybrid", n), ("hybrid", step))
        rx = ratio(times, ("hybrid", n), ("attention", n))
        out.append(f"| {n} | {a:.2f} | {h:.2f} | {ra[0]:.2f} [{ra[1]:.2f}-{ra[2]:.2f}] | "
                   f"{rh[0]:.2f} [{rh[1]:.2f}-{rh[2]:.2f}] | {rx[0]:.2f} [{rx[1]:.2f}-{rx[2]:.2f}] |")
    return out


def main() -> None:
    args = parse_args()
    t_start = time.perf_counter()
    prompt = np.random.default_rng(args.seed).integers(3, WIDTH["vocab_size"], args.prefix).tolist()
    models = {name: random_model(cfg, seed=args.seed) for name, cfg in configs(args.layers).items()}
    runs = prepare(models, prompt, args.nodes, args.seed)
    times = measure(runs, [*args.nodes, "prefill"], args.iters, args.warmup, args.seed)

    dev = jax.devices()[0]
    hyb, att = runs["hybrid"]["cfg"], runs["attention"]["cfg"]
    cmd = "python " + " ".join([pathlib.Path(sys.argv[0]).as_posix()] + sys.argv[1:])
    lines = [
        "# Tree passes on a hybrid (Gated DeltaNet) target against an all-attention one",
        "",
        f"Command: `{cmd}` (total run {time.perf_counter() - t_start:.0f} s).",
        f"Device: {dev.platform} ({dev.device_kind}), {os.cpu_count()} host cores, "
        f"{platform.processor() or platform.machine()}; jax {jax.__version__}; float32. Two random models of "
        f"{args.layers} layers, D = {hyb.hidden_size}, V = {hyb.vocab_size}: `qwen3` (every layer attention) and "
        f"`qwen3_5_text` ({len(hyb.linear_layers)} Gated DeltaNet layers, {hyb.linear_key_heads} key and "
        f"{hyb.linear_value_heads} value heads of {hyb.linear_key_dim}; {hyb.num_attention_layers} gated attention "
        f"layers). Batch 1, a {args.prefix}-token prefix prefilled by the engine; {args.iters} round-robin rounds "
        f"after {args.warmup} warm-up rounds; host load average at the end: {os.getloadavg()[0]:.1f}.",
        "",
        "Tree pass + commit of a 3-node path (N = 1: the autoregressive step), median ms, and in units of the "
        "same model's step [10-90% of per-round ratios]:",
        "",
        *TABLE,
        *rows(times, args.nodes),
    ]
    payload = {"args": vars(args), "ms": {f"{k[0]}:{k[1]}": v.tolist() for k, v in times.items()}}
    pa, ph = float(np.median(times["attention", "prefill"])), float(np.median(times["hybrid", "prefill"]))
    rp = ratio(times, ("hybrid", "prefill"), ("attention", "prefill"))
    lines += ["", f"One prefill chunk of {args.prefix} tokens (a causal run): attention {pa:.1f} ms, hybrid "
              f"{ph:.1f} ms, hybrid / attention {rp[0]:.2f} [{rp[1]:.2f}-{rp[2]:.2f}].",
              "", f"Models: attention {att.num_params / 1e6:.1f}M parameters, hybrid {hyb.num_params / 1e6:.1f}M."]
    save(lines, args.out, payload)


if __name__ == "__main__":
    main()
