"""What ordering the layer scan's weight slices is worth on XLA:CPU (`Transformer.__call__`).

XLA:CPU copies every slice of the stacked weights that the layer scan takes, and takes a slice as
soon as its index is known. Left alone it took each layer's MLP weights before the layer's
attention had run, and all of a period's layers' weights at once where a scan step holds several
layers (a hybrid's three linear layers), so the copies had left the cache when they were used. On
one CPU device tevjax makes each index read the input its weights are applied to
(`tevjax.models.transformer.ORDER_WEIGHT_SLICES`). This script times the same passes with the
ordering on and off, in one process, on the engine's own round stages:

* the embedded SmolLM2-135M (float32): the one-token step (a root-only `tree_pass`), a tree pass
  over N = 9 nodes (a budget-8 DDTree on random peaked marginals) and a `--prefix`-token prefill
  chunk (a causal run);
* a random `qwen3_5_text` hybrid of the same width, 12 layers (`hybrid_latency.py`'s): the step.

Each pass is jitted twice (the flag is read when a forward is traced), and every round calls all
of them once in a fresh random order, so noise on the shared host hits both sides alike. Ratios
are of medians (on / off), with the 10-90% range of the per-round ratios.

    python experiments/weight_slices.py                 # 30 rounds, a 256-token prefix
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import tevjax.models.transformer as transformer
from tevjax.decode import engine
from tevjax.loading import load_models
from tevjax.testing import random_model
from hybrid_latency import configs as hybrid_configs  # experiments/hybrid_latency.py
from model_latency import _peaked_log_marginals  # experiments/model_latency.py
from report import save  # experiments/report.py


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix", type=int, default=256, help="prompt tokens prefilled before the timed passes")
    ap.add_argument("--iters", type=int, default=30, help="timed rounds (>= 10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "weight_slices.md"))
    args = ap.parse_args(argv)
    if args.iters < 10 or args.prefix < 2:
        ap.error(f"--iters must be >= 10 and --prefix >= 2, got {args.iters} and {args.prefix}")
    return args


def passes(name: str, target, drafter, prompt: list[int], seed: int, with_tree: bool) -> dict:
    """{(model, pass, ordered): zero-argument timed call} for one target."""
    dec = engine.Decoder(target, drafter, engine.DecodeConfig(budget=8, max_new_tokens=64, prompt_bucket=64))
    state = jax.block_until_ready(dec.prefill([prompt]))
    tgd, tstate = dec.tgd, dec.tstate
    vocab = target.cfg.vocab_size
    lm = jnp.asarray(_peaked_log_marginals(np.random.default_rng(seed), 15, vocab))[None]
    trees = {1: engine.root_trees(state.root)}
    if with_tree:
        trees[9] = jax.jit(engine.draft_trees, static_argnums=2)(lm, state.root, 8)
    tokens = jnp.asarray([prompt], jnp.int32)
    calls = {}
    for ordered in (True, False):
        transformer.ORDER_WEIGHT_SLICES = ordered
        tree_pass = jax.jit(lambda ts, cache, n, tr: engine.tree_pass(nnx.merge(tgd, ts), tr, n, cache).logits)

        @jax.jit
        def chunk(ts, cache, toks):
            t = toks.shape[1]
            return nnx.merge(tgd, ts)(toks, jnp.arange(t, dtype=jnp.int32)[None], cache, jnp.zeros((1,), jnp.int32),
                                      None, compute_logits=False).final_hidden

        for n, tr in trees.items():
            call = (lambda f=tree_pass, tr=tr: f(tstate, state.target_cache, state.cache_len, tr))
            jax.block_until_ready(call())  # compiled now, with the flag as it is
            calls[name, "step" if n == 1 else f"tree pass, N = {n}", ordered] = call
        if with_tree:
            call = (lambda f=chunk: f(tstate, state.target_cache, tokens))
            jax.block_until_ready(call())
            calls[name, f"prefill chunk, {len(prompt)} tokens", ordered] = call
    transformer.ORDER_WEIGHT_SLICES = True
    return calls


def main() -> None:
    args = parse_args()
    t_start = time.perf_counter()
    if jax.default_backend() != "cpu" or jax.device_count() != 1:
        sys.exit("weight_slices.py measures XLA:CPU on one device (JAX_PLATFORMS=cpu, no forced devices)")
    prompt = np.random.default_rng(args.seed).integers(3, 49152, args.prefix).tolist()
    models = load_models("smollm2")
    calls = passes("SmolLM2-135M", models.target, models.drafter, prompt, args.seed, with_tree=True)
    hybrid = random_model(hybrid_configs(12)["hybrid"], seed=args.seed)
    calls.update(passes("hybrid (random, 12 layers)", hybrid, None, prompt, args.seed, with_tree=False))
    keys = list(calls)
    times = {k: [] for k in keys}
    order = np.random.default_rng(args.seed + 1)
    for r in range(args.iters + 2):
        for i in order.permutation(len(keys)):
            t0 = time.perf_counter()
            jax.block_until_ready(calls[keys[i]]())
            if r >= 2:
                times[keys[i]].append((time.perf_counter() - t0) * 1e3)
    rows = []
    for model, what in dict.fromkeys((k[0], k[1]) for k in keys):
        on, off = np.asarray(times[model, what, True]), np.asarray(times[model, what, False])
        lo, hi = np.percentile(on / off, [10, 90])
        rows.append(f"| {model} | {what} | {np.median(off):.2f} | {np.median(on):.2f} | "
                    f"{np.median(on) / np.median(off):.3f} [{lo:.2f}-{hi:.2f}] |")
    dev = jax.devices()[0]
    cmd = "python " + " ".join([pathlib.Path(sys.argv[0]).as_posix()] + sys.argv[1:])
    lines = [
        "# Ordering the layer scan's weight slices on XLA:CPU",
        "",
        f"Command: `{cmd}` (total run {time.perf_counter() - t_start:.0f} s).",
        f"Device: {dev.platform}, {os.cpu_count()} host cores, {platform.processor() or platform.machine()}; "
        f"jax {jax.__version__}; float32; batch 1, a {args.prefix}-token prefix prefilled by the engine; "
        f"{args.iters} rounds, every pass once a round in a fresh random order; host load average at the end: "
        f"{os.getloadavg()[0]:.1f}. Passes are not donated (each returns a new cache).",
        "",
        "| model | pass | off: median ms | on: median ms | on / off [10-90% of per-round ratios] |",
        "|---|---|---:|---:|---|",
        *rows,
    ]
    save(lines, args.out, {"args": vars(args), "ms": {f"{k[0]}:{k[1]}:{'on' if k[2] else 'off'}": v
                                                       for k, v in times.items()}})


if __name__ == "__main__":
    main()
