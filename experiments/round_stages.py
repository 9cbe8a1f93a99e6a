"""Where a speculative round's time goes, on the embedded SmolLM2 and a real (default: the shipped)
drafter, in AR-step units.

Every timed function is one of the engine's own stages (`tevjax.decode.engine`), jitted on its own,
on the state `Decoder.prefill` builds for a chat prefix; the whole round is the engine's `_round`
and the AR round the same function without a drafter. None of them donate their input, so every
call reads the same prefix (the copy each makes of its outputs is common to all of them). Timed
round-robin (every iteration calls each once, in the same order), so noise on the shared host
hits all alike; the ratio is the median of per-iteration ratios to the AR round, with its 10-90%
range.

Stages: draft (drafter block pass + draft-vocabulary logits) with the head rows gathered once at
prefill (`DecodeState.draft_head`, what the engine does) and gathered in the call (what it did
before); draft_trees (log-softmax + DDTree builder); the context chain with its merge and the
corpus chain (`tevjax.builder`), and the engine's round with both (the default path where the
drafter ships a corpus); the tree pass with and without the drafter's taps; the AR pass; verify
(TEV); commit.

    python experiments/round_stages.py                    # budget 8, 20 iterations
    python experiments/round_stages.py --budget 4 --iters 30
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import pathlib
import platform
import sys
import time

import jax
import numpy as np
from flax import nnx

from tevjax.builder import corpus_chain
from tevjax.decode import engine
from tevjax.loading import load_models
from tevjax.verifiers import verify
from report import emit  # experiments/report.py (scripts run from this folder)

FILLER = "Please summarise the following notes on speculative decoding for a short report. "


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; a bad value is a one-line error (exit 2) before any model loads."""
    default_out = pathlib.Path(__file__).parent / "results" / "round_stages.md"
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", default=None, help="DFlash drafter directory (default: the shipped one)")
    ap.add_argument("--budget", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=256, help="prompt tokens (the committed prefix)")
    ap.add_argument("--iters", type=int, default=20, help="timed round-robin iterations (>= 5)")
    ap.add_argument("--out", default=str(default_out))
    args = ap.parse_args(argv)
    for name, low in (("budget", 1), ("prefix", 2), ("iters", 5)):
        if getattr(args, name) < low:
            ap.error(f"--{name} must be >= {low}, got {getattr(args, name)}")
    if args.drafter is not None and not pathlib.Path(args.drafter).is_dir():
        ap.error(f"--drafter {args.drafter!r}: no such checkpoint directory")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    t_start = time.perf_counter()
    m = load_models("smollm2", args.drafter)
    target, drafter = m.target, m.drafter
    ids = (m.tokenizer.encode(FILLER * (1 + args.prefix // 8)))[: args.prefix]
    cfg = engine.DecodeConfig(budget=args.budget, max_new_tokens=128)
    spec, ar = engine.Decoder(target, drafter, cfg), engine.Decoder(target, None, cfg)
    # The default path adds both lookup chains (as long as the budget) where the drafter ships a corpus.
    chains = m.ngrams is not None
    chain_cfg = dataclasses.replace(cfg, lookup=args.budget, corpus=args.budget if chains else 0)
    sstate, astate = spec.prefill([ids]), ar.prefill([ids])
    cstate = engine.Decoder(target, drafter, chain_cfg, ngrams=m.ngrams).prefill([ids])  # keeps the history
    tgd, dgd = spec.tgd, spec.dgd
    ts, ds = spec.tstate, spec.dstate
    taps = engine._taps(drafter, cfg)

    round_spec = jax.jit(functools.partial(engine._round, tgd=tgd, dgd=dgd, cfg=cfg))
    round_ar = jax.jit(functools.partial(engine._round, tgd=ar.tgd, dgd=None, cfg=cfg))
    round_chains = jax.jit(functools.partial(engine._round, tgd=tgd, dgd=dgd, cfg=chain_cfg))

    @jax.jit
    def draft(ts, ds, st, head):
        return engine.draft(nnx.merge(dgd, ds), nnx.merge(tgd, ts), st.root, st.cache_len, st.drafter_cache, head)

    @functools.partial(jax.jit, static_argnums=2)
    def trees_of(ds, logits, budget, root):
        return engine.draft_trees(logits, root, budget, nnx.merge(dgd, ds).vocab_ids())

    @jax.jit
    def context(st, trees, scores):  # the engine's context-chain stage alone: chain, reach estimates, merge
        return engine.merge_lookups(trees, scores, st.history, st.cache_len, None,
                                    dataclasses.replace(chain_cfg, corpus=0))

    @jax.jit
    def corpus(st, ngrams):  # the corpus chain alone (its merge costs what the context merge does)
        return jax.vmap(corpus_chain, in_axes=(0, 0, None, None))(st.history, st.cache_len + 1, args.budget, ngrams)

    @functools.partial(jax.jit, static_argnums=3)
    def tree_pass(ts, trees, st, taps):
        return engine.tree_pass(nnx.merge(tgd, ts), trees, st.cache_len, st.target_cache, taps)

    @jax.jit
    def tev(key, trees, logits):
        return jax.vmap(lambda k, t, lg: verify(k, t, lg, 0.0, "tev"))(key, trees, logits)

    @jax.jit
    def commit(ts, ds, out, ver, st):
        return engine.commit(out, ver, st, nnx.merge(dgd, ds), cfg, target.cfg)

    logits = draft(ts, ds, sstate, sstate.draft_head)
    trees = trees_of(ds, logits, args.budget, sstate.root)
    scored = jax.jit(lambda lg, root: engine.draft_trees(lg, root, args.budget, nnx.merge(dgd, ds).vocab_ids(),
                                                         with_scores=True))(logits, sstate.root)
    out = tree_pass(ts, trees, sstate, taps)
    keys = jax.random.split(jax.random.key(0), 1)
    ver = tev(keys, trees, out.logits)
    ar_trees = engine.root_trees(astate.root)
    fns = {
        "AR round (engine, no drafter)": lambda: round_ar(ar.tstate, None, astate),
        f"speculative round (engine, budget {args.budget})": lambda: round_spec(ts, ds, sstate),
        f"speculative round with the lookup chains (engine default: lookup {chain_cfg.lookup}, corpus "
        f"{chain_cfg.corpus})": lambda: round_chains(ts, ds, cstate, m.ngrams),
        "draft, head gathered once (engine)": lambda: draft(ts, ds, sstate, sstate.draft_head),
        "draft, head gathered per call": lambda: draft(ts, ds, sstate, None),
        "draft_trees (log-softmax + builder)": lambda: trees_of(ds, logits, args.budget, sstate.root),
        "context chain + merge": lambda: context(cstate, *scored),
        **({f"corpus chain ({m.ngrams.num_entries:,} n-grams)": lambda: corpus(cstate, m.ngrams)}
           if chains else {}),
        f"tree pass, N = {args.budget + 1}, taps": lambda: tree_pass(ts, trees, sstate, taps),
        f"tree pass, N = {args.budget + 1}, no taps": lambda: tree_pass(ts, trees, sstate, ()),
        "AR pass (N = 1)": lambda: tree_pass(ts, ar_trees, astate, ()),
        "verify (TEV)": lambda: tev(keys, trees, out.logits),
        "commit": lambda: commit(ts, ds, out, ver, sstate),
    }
    for f in fns.values():  # compile
        jax.block_until_ready(f())
    times = {k: [] for k in fns}
    for _ in range(args.iters):
        for k, f in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f())
            times[k].append(time.perf_counter() - t0)
    ref = np.asarray(times["AR round (engine, no drafter)"])
    lines = [
        "# Where a speculative round's time goes (SmolLM2-135M, fp32, batch 1)", "",
        f"Command: `python experiments/round_stages.py {' '.join(argv if argv is not None else sys.argv[1:])}`"
        f" (total run {time.perf_counter() - t_start:.0f} s). Drafter: {args.drafter or 'shipped'}"
        f" (draft vocabulary {drafter.cfg.draft_vocab_dim}). Prefix {len(ids)} tokens.",
        f"Device: {jax.devices()[0].platform}, {os.cpu_count()} host cores, {platform.machine()}; jax {jax.__version__};"
        f" host load average at the end {os.getloadavg()[0]:.1f} (shared machine). {args.iters} round-robin iterations.",
        "", "| stage | median ms | min ms | ratio to the AR round [10-90%] |", "|---|---:|---:|---|",
    ]
    for k, v in times.items():
        v = np.asarray(v)
        r = v / ref
        lines.append(f"| {k} | {np.median(v) * 1e3:.1f} | {v.min() * 1e3:.1f} | "
                     f"{np.median(r):.2f} [{np.percentile(r, 10):.2f}-{np.percentile(r, 90):.2f}] |")
    lines += ["", "A speculative round must emit more tokens on average (tau) than its ratio to the AR round "
              "to beat autoregressive decoding."]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
