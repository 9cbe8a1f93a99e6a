"""Chunked prefill equals the one-pass prefill it replaced, on tiny random models.

The reference is the previous `Decoder.prefill`: one target pass over the whole padded prompt with
a [T, T] causal block mask, the drafter context and the kept hidden states written from that pass.
The chunked prefill must fill the same caches (allclose: the causal path sums its softmax block by
block) and lead to the same tokens, greedy and sampled, with and without a drafter.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tevjax.decode import DecodeConfig, Decoder
from tevjax.models import KVCache, attention, causal_mask, full_mask
from tevjax.decode import engine
from tevjax.models.dflash import DFlashConfig, DFlashDrafter, DrafterCache
from tevjax.models.layers import causal_attention
from tevjax.models.transformer import Transformer
from tevjax.testing import random_model, tiny_config

LAYERS = (0, 1)  # kept hidden states: every layer of the 2-layer tiny target (the last one final-normed)
# prompt[:-1] (what prefill writes) of 44 and 29 tokens spans several chunks, 16 is exactly one
# 16-token chunk (and three 5-token chunks and a part), 2 is part of one, 0 prefills nothing.
PROMPT_LENGTHS = (45, 3, 30, 1, 17)


@pytest.fixture(scope="module")
def models():
    tcfg = tiny_config("llama", vocab_size=24)
    target = random_model(tcfg, seed=0)
    dcfg = DFlashConfig.for_target(tcfg, num_layers=1, block_size=6, mask_token_id=23)
    return target, DFlashDrafter(dcfg, rngs=nnx.Rngs(1))


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 23, n).tolist() for n in PROMPT_LENGTHS]


def one_pass_state(dec: Decoder, prompts, seed: int):
    """The previous prefill: prompt[:-1] of every row, padded to the bucket Tp, in one target pass
    under a [Tp, Tp] causal mask; then the drafter context and kept states from that pass."""
    from tevjax.decode.engine import _split_hidden, _taps

    target = nnx.merge(dec.tgd, dec.tstate)
    drafter = nnx.merge(dec.dgd, dec.dstate) if dec.dgd is not None else None
    lengths = [len(p) for p in prompts]
    tp, capacity = dec.shapes(lengths)
    b = len(prompts)
    tokens = np.zeros((b, tp), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p) - 1] = p[:-1]
    positions = jnp.broadcast_to(jnp.arange(tp, dtype=jnp.int32), (b, tp))
    zeros = jnp.zeros((b,), jnp.int32)
    taps = _taps(drafter, dec.cfg)
    out = target(jnp.asarray(tokens), positions, KVCache.init(target.cfg, b, capacity), zeros,
                 jnp.broadcast_to(causal_mask(tp), (b, tp, tp)), hidden_layers=taps, compute_logits=False)
    feats, kept = _split_hidden(out, taps, drafter, dec.cfg, target.cfg)
    state = dec.prefill(prompts, seed)  # roots, keys, output buffers: everything but what prefill computes
    dcache = None
    if drafter is not None:
        dcache = drafter.append_context(DrafterCache.init(drafter.cfg, b, capacity), feats, positions, zeros)
    hidden = jnp.zeros_like(state.hidden).at[:, :tp].set(kept) if kept is not None else None
    return dataclasses.replace(state, target_cache=out.cache, drafter_cache=dcache, hidden=hidden)


@pytest.mark.parametrize("windowed", [False, True])
def test_causal_attention_equals_masked_attention(windowed):
    """The causal path sees what `attention` under `full_mask` of a lower-triangular block sees, for
    rows with different prefixes, key blocks that divide the cache or not (a clamped last block),
    query tiles of every size that divides T (and one that does not: a single tile), prefixes long
    enough that whole blocks skip the mask, and a run that reaches the last slot. With sliding
    windows (traced, as the layer scan passes them; 0 is none) the mask also hides the slots at or
    below query slot - window; a query past the cache that sees no slot at all is finite (it
    averages some values, as `attention` does, and no one reads it). The windowed sweep also
    scales and soft-caps the scores (Gemma 2's), as `attention` does."""
    rng = np.random.default_rng(0)
    b, t, h, kh, dh, s = 3, 8, 4, 2, 16, 30
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
               for shape in ((b, t, h, dh), (b, kh, s, dh), (b, kh, s, dh)))  # caches are heads-major
    # One compile per block shape, reused for every prefix (eager calls compiled each of them anew).
    causal = jax.jit(causal_attention, static_argnames=("key_block", "query_block", "scale", "softcap"))
    scores = dict(scale=0.3, softcap=1.5) if windowed else {}
    firsts = [jnp.asarray(f, jnp.int32) for f in ([0, 5, s - t], [9, 13, s - t], [s - 2, s - 3, s - 1], [3, 0, 20])]
    cases = []  # (first, window, attention's output, which queries see any slot [B, T])
    for first in firsts:  # the third: queries past the cache
        causal_seen = full_mask(jnp.broadcast_to(causal_mask(t), (b, t, t)), first, s)
        for window in (0, 1, 3, 9, 40) if windowed else (None,):
            near = jnp.arange(s)[None, None, :] > (first[:, None] + jnp.arange(t))[:, :, None] - (window or s + t)
            visible = causal_seen & near
            cases.append((first, window, np.asarray(attention(q, k, v, visible, **scores)),
                          np.asarray(visible.any(-1))))
    for key_block in (1, 4, 7, 16, s, 64):
        for query_block in (1, 2, 3, 4, t, 64):
            for first, window, want, seen in cases:
                got = np.asarray(causal(q, k, v, first, key_block=key_block, query_block=query_block,
                                        window=None if window is None else jnp.int32(window), **scores))
                assert np.isfinite(got).all()
                np.testing.assert_allclose(got[seen], want[seen], atol=1e-6, rtol=1e-5,
                                           err_msg=f"{first=}, {window=}, {key_block=}, {query_block=}")


def test_transformer_causal_run_equals_block_mask(models):
    """`block_mask=None` (a causal run) equals the explicit causal block mask after a cached prefix
    of different lengths per row: logits, hidden states and the written cache."""
    target, _ = models
    rng = np.random.default_rng(1)
    b, prefix, t, s = 2, 9, 6, 32
    cache = target(jnp.asarray(rng.integers(0, 24, (b, prefix)), jnp.int32), jnp.broadcast_to(jnp.arange(prefix), (b, prefix)),
                   KVCache.init(target.cfg, b, s), jnp.zeros((b,), jnp.int32),
                   jnp.broadcast_to(causal_mask(prefix), (b, prefix, prefix))).cache
    write_pos = jnp.asarray([prefix, 4], jnp.int32)
    tokens = jnp.asarray(rng.integers(0, 24, (b, t)), jnp.int32)
    positions = write_pos[:, None] + jnp.arange(t)
    ref = target(tokens, positions, cache, write_pos, jnp.broadcast_to(causal_mask(t), (b, t, t)), hidden_layers=(0,))
    got = target(tokens, positions, cache, write_pos, None, hidden_layers=(0,))
    for a, w in ((got.logits, ref.logits), (got.hidden, ref.hidden), (got.cache.k, ref.cache.k), (got.cache.v, ref.cache.v)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(w), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("chunk, with_drafter", [(16, False), (5, True)], ids=["16-ar", "5-drafter"])
def test_chunked_prefill_equals_one_pass(models, prompts, chunk, with_drafter):
    """Chunks of 16 tokens and of 5 (not a divisor of the 16-token bucket), batch 5 with lengths 1..45:
    the caches, the drafter context (the features it was given) and the kept hidden states of every
    committed slot equal the one-pass prefill's, and so do the tokens generated from either state,
    greedy and at temperature 1 with the same seed."""
    target, drafter = models
    lengths = [len(p) for p in prompts]
    for temperature in (0.0, 1.0):
        cfg = DecodeConfig(budget=6, max_new_tokens=16, prompt_bucket=16, prefill_chunk=chunk,
                           temperature=temperature, hidden_layers=LAYERS)
        dec = Decoder(target, drafter if with_drafter else None, cfg)
        assert dec.chunk_size(lengths) == chunk and -(-(max(lengths) - 1) // chunk) >= 3
        got, want = dec.prefill(prompts, seed=7), one_pass_state(dec, prompts, seed=7)
        pairs = [(got.target_cache.k, want.target_cache.k), (got.target_cache.v, want.target_cache.v),
                 (got.hidden, want.hidden)]
        if with_drafter:
            pairs += [(got.drafter_cache.k, want.drafter_cache.k), (got.drafter_cache.v, want.drafter_cache.v)]
        for i, n in enumerate(lengths):
            for a, w in pairs:  # slots [0, length - 1) hold the committed prompt; the rest is padding
                # hidden [B, S, R, D]; caches [L, B, K, S, Dh] (their slots are axis 2 once the row is taken)
                row, slot = (0, 0) if a.ndim == 4 else (1, 2)
                a_i = np.take(np.take(np.asarray(a), i, axis=row), np.arange(n - 1), axis=slot)
                w_i = np.take(np.take(np.asarray(w), i, axis=row), np.arange(n - 1), axis=slot)
                np.testing.assert_allclose(a_i, w_i, atol=2e-5, rtol=1e-5)
        np.testing.assert_array_equal(np.asarray(got.cache_len), np.asarray(lengths) - 1)
        np.testing.assert_array_equal(np.asarray(got.root), [p[-1] for p in prompts])
        chunked = dec.results(dec.run(got), lengths)
        reference = dec.results(dec.run(want), lengths)
        assert [g.tokens for g in chunked] == [g.tokens for g in reference]
        assert [g.rounds for g in chunked] == [g.rounds for g in reference]
        assert all(len(g.tokens) == 16 or g.stop == "eos" for g in chunked)
        for g, r in zip(chunked, reference):
            np.testing.assert_allclose(g.hidden, r.hidden, atol=3e-5, rtol=1e-5)


def test_one_chunk_program_serves_every_prompt_length(models):
    """Past the chunk size, prompt length changes only the number of chunk calls: one compiled
    chunk for every long prompt (short prompts get one chunk sized to them)."""
    target, _ = models
    dec = Decoder(target, None, DecodeConfig(max_new_tokens=4, prompt_bucket=16, prefill_chunk=16, capacity=128))
    chunks, loops = dec._prefill_chunk._cache_size(), dec._loop._cache_size()  # (shared with equal Decoders)
    for n in (20, 40, 57, 100):
        assert dec.chunk_size([n]) == 16
        dec.generate([[3] * n])
    assert dec._prefill_chunk._cache_size() - chunks <= 1 and dec._loop._cache_size() - loops <= 1
    assert dec.chunk_size([5]) == 16 and Decoder(target, None, DecodeConfig(prompt_bucket=8)).chunk_size([5]) == 8
    # A large bucket (a chat's) does not make a short prompt pay for a long chunk: the power of two
    # that holds the prompt, from 32; what `prefill(reuse=...)` keeps is not prefilled again.
    wide = Decoder(target, None, DecodeConfig(prompt_bucket=256, max_new_tokens=4))
    assert [wide.chunk_size([n]) for n in (2, 20, 34, 41, 65, 120)] == [32, 32, 64, 64, 64, 128]
    assert wide.chunk_size([41], prefilled=30) == 32 and wide.chunk_size([41], prefilled=40) == 32


def test_compile_needs_only_shapes(models, monkeypatch, caplog):
    """`compile` builds every program from shapes (no prefill runs), and the generation after it
    compiles none of the engine's programs again."""
    target, drafter = models
    dec = Decoder(target, drafter, DecodeConfig(budget=4, max_new_tokens=8, prompt_bucket=16, prefill_chunk=8))
    batch = [[1, 2, 3] * 7, [4, 5]]

    def no_prefill(*_a, **_k):
        raise AssertionError("compile ran a prefill")

    with monkeypatch.context() as m:
        m.setattr(Decoder, "prefill", no_prefill)
        with caplog.at_level("WARNING"), jax.log_compiles(True):
            dec.compile(batch)
    engine_programs = ("_empty_state", "_prefill_chunk", "_rounds")
    compiled = " ".join(r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling"))
    assert all(f"jit({name})" in compiled for name in engine_programs), compiled
    caplog.clear()
    with caplog.at_level("WARNING"), jax.log_compiles(True):
        gens = dec.generate(batch)
    again = _compiled(caplog)
    assert not [m for m in again if any(f"jit({name})" in m for name in engine_programs)], again
    assert len(gens) == 2 and all(len(g.tokens) == 8 or g.stop == "eos" for g in gens)


def _compiled(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling")]


def test_compile_with_reuse_covers_a_reusing_prefill(models, caplog):
    """`compile(..., reuse=True)` also builds the rebase and the smallest chunk, so the next turn's
    prefill from the last state (a few new tokens, the same capacity) compiles nothing."""
    target, drafter = models
    dec = Decoder(target, drafter, DecodeConfig(budget=4, max_new_tokens=8, prompt_bucket=16, capacity=64))
    batch = [[1, 2, 3] * 7, [4, 5]]
    state = dec.run(dec.prefill(batch))
    follow = [p + g.tokens + [6] for p, g in zip(batch, dec.results(state))]
    with caplog.at_level("WARNING"), jax.log_compiles(True):
        dec.compile(follow, reuse=True)
    caplog.clear()
    with caplog.at_level("WARNING"), jax.log_compiles(True):
        dec.prefill(follow, reuse=(state, batch))
    again = _compiled(caplog)
    assert not [m for m in again if "jit(_rebase)" in m or "jit(_prefill_chunk)" in m], again


def test_decoders_with_equal_statics_share_their_programs(models, caplog):
    """A second Decoder for models of the same structure (other weights) and an equal config
    compiles nothing, and decodes with its own weights: they are arguments, not constants. Another
    config compiles its own programs."""
    target, drafter = models
    cfg = DecodeConfig(budget=4, max_new_tokens=6, prompt_bucket=16, capacity=48)
    batch = [[1, 2, 3, 4, 5], [6, 7]]
    first = Decoder(target, drafter, cfg).generate(batch)
    other = random_model(target.cfg, seed=7)
    other_drafter = DFlashDrafter(drafter.cfg, rngs=nnx.Rngs(8))
    caplog.clear()
    with caplog.at_level("WARNING"), jax.log_compiles(True):
        second = Decoder(other, other_drafter, dataclasses.replace(cfg)).generate(batch)
    assert _compiled(caplog) == []
    want = Decoder(other, None, cfg).generate(batch)  # other's greedy output, autoregressively
    assert [g.tokens for g in second] == [g.tokens for g in want] != [g.tokens for g in first]
    caplog.clear()
    with caplog.at_level("WARNING"), jax.log_compiles(True):
        Decoder(other, other_drafter, dataclasses.replace(cfg, budget=5)).generate(batch)
    assert any("jit(_rounds)" in m for m in _compiled(caplog))


def all_eqns(jaxpr):
    """Every equation of a jaxpr, those of its sub-jaxprs (loop bodies, scans, pjit) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from all_eqns(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from all_eqns(sub)


def test_prefill_chunk_builds_no_chunk_by_cache_array():
    """The traced prefill chunk (abstract target and drafter, nothing runs) holds no value with
    both a chunk axis C and a cache axis S, nor a [C, C] block: no causal mask and no full score
    matrix, whatever its dtype. The one-pass prefill under a [C, C] causal block mask, traced the
    same way, holds both, so the check can see them."""
    cfg = tiny_config("llama", max_position_embeddings=2048)
    dcfg = DFlashConfig.for_target(cfg, num_layers=1, block_size=4, mask_token_id=cfg.vocab_size - 1)
    target = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    drafter = nnx.eval_shape(lambda: DFlashDrafter(dcfg, rngs=nnx.Rngs(0)))
    dec = Decoder(target, drafter, DecodeConfig(budget=4, max_new_tokens=8, prompt_bucket=8, prefill_chunk=40))
    lengths = [300, 120]
    c, (_, s) = dec.chunk_size(lengths), dec.shapes(lengths)
    assert (c, s) == (40, 384) and s > 256  # S spans two key blocks; C, S and 2C collide with no other axis
    state = dec._abstract_state(len(lengths), s)
    chunk = functools.partial(engine._prefill_chunk, tgd=dec.tgd, dgd=dec.dgd, cfg=dec.cfg)
    tokens = jax.ShapeDtypeStruct((len(lengths), c), jnp.int32)
    jaxpr = jax.make_jaxpr(chunk)(dec.tstate, dec.dstate, state, tokens, jnp.int32(0)).jaxpr

    def chunk_by_cache(jaxpr):
        shapes = {tuple(v.aval.shape) for e in all_eqns(jaxpr) for v in e.outvars if hasattr(v.aval, "shape")}
        return sorted(sh for sh in shapes if (c in sh and s in sh) or sh[-2:] == (c, c))

    assert chunk_by_cache(jaxpr) == []

    def one_pass(tstate, tokens):
        model = nnx.merge(dec.tgd, tstate)
        b = tokens.shape[0]
        return model(tokens, jnp.broadcast_to(jnp.arange(c), (b, c)), KVCache.init(cfg, b, s), jnp.zeros((b,), jnp.int32),
                     jnp.broadcast_to(causal_mask(c), (b, c, c)), compute_logits=False).cache

    found = chunk_by_cache(jax.make_jaxpr(one_pass)(dec.tstate, tokens).jaxpr)
    assert (2, c, s) in found and (2, c, c) in found, found


# ---------------------------------------------------------------------- prefill from an earlier state


def _spy_chunks(dec: Decoder) -> list[tuple[int, int]]:
    """Records (chunk length, start slot) of every prefill chunk `dec` runs from now on."""
    calls, run = [], dec._prefill_chunk

    def spy(tstate, dstate, state, chunk, start):
        calls.append((chunk.shape[1], int(start)))
        return run(tstate, dstate, state, chunk, start)

    dec._prefill_chunk = spy
    return calls


def _assert_same_committed_state(got, want, lengths):
    """The caches, the drafter context, the kept hidden states and the history of every row's
    committed slots [0, length - 1) agree, and so do cache_len and the root."""
    for i, n in enumerate(lengths):
        for a, w in ((got.target_cache.k, want.target_cache.k), (got.target_cache.v, want.target_cache.v),
                     (got.drafter_cache.k, want.drafter_cache.k), (got.drafter_cache.v, want.drafter_cache.v)):
            np.testing.assert_allclose(np.asarray(a)[:, i, :, : n - 1], np.asarray(w)[:, i, :, : n - 1],
                                       atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(got.hidden)[i, : n - 1], np.asarray(want.hidden)[i, : n - 1],
                                   atol=2e-5, rtol=1e-5)
        np.testing.assert_array_equal(np.asarray(got.history)[i, :n], np.asarray(want.history)[i, :n])
    for name in ("cache_len", "root", "num_out", "rounds", "block_total", "done", "skip", "wait",
                 "expected_block", "plain_rounds"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), err_msg=name)


@pytest.mark.parametrize("bucket", [16, 64], ids=["capacity-grows", "same-capacity"])
def test_reuse_prefills_only_past_each_rows_common_prefix(models, bucket):
    """A second batch that continues the first one's rows (prompt + output + more tokens), departs
    from it after 4 tokens, or shares nothing: the state prefilled with `reuse` has the committed
    slots, history and counters of a fresh prefill, its chunks start at the smallest kept prefix (the
    departing row's 4) and are sized to what is left, and decoding from it gives the fresh state's
    tokens. With a 16-token prompt bucket the longer second batch needs a larger cache, so the kept
    slots move to the new capacity; with 64 the capacity stays."""
    target, drafter = models
    cfg = DecodeConfig(budget=4, lookup=3, max_new_tokens=10, prompt_bucket=bucket, prefill_chunk=64,
                       capacity_bucket=16, hidden_layers=LAYERS, fallback_below=1.5)
    dec = Decoder(target, drafter, cfg)
    rng = np.random.default_rng(3)
    first = [rng.integers(0, 23, n).tolist() for n in (20, 9, 12)]
    state = dec.run(dec.prefill(first, seed=1))
    outs = [g.tokens for g in dec.results(state)]
    second = [first[0] + outs[0] + [5, 6, 7, 8, 9, 10], first[1][:4] + [22, 1, 2, 3, 4, 5, 6], [7] + first[2]]
    assert second[2][0] != first[2][0]
    lengths = [len(p) for p in second]
    assert (dec.shapes(lengths)[1] > state.target_cache.capacity) == (bucket == 16)
    calls = _spy_chunks(dec)
    got = dec.prefill(second, seed=2, reuse=(state, first))
    assert len(calls) == 1 and calls[0][1] == 0, calls  # the third row keeps nothing
    calls.clear()
    fresh = dec.prefill(second, seed=2)
    assert calls[0][1] == 0 and got.target_cache.capacity == fresh.target_cache.capacity
    _assert_same_committed_state(got, fresh, lengths)
    assert [g.tokens for g in dec.results(dec.run(got))] == [g.tokens for g in dec.results(dec.run(fresh))]

    # Without the row that shares nothing, the chunks start at the departing row's 4 shared tokens.
    state = dec.run(dec.prefill(first[:2], seed=1))
    calls.clear()
    got = dec.prefill(second[:2], seed=2, reuse=(state, first[:2]))
    assert calls == [(32, 4)], calls  # 31 tokens left: one chunk of 32, not of the prompt's bucket
    _assert_same_committed_state(got, dec.prefill(second[:2], seed=2), lengths[:2])


def test_reuse_keeps_nothing_it_cannot_vouch_for(models):
    """A row keeps at most the slots its caches hold (not the last token, a root never passed) and
    none after a non-finite round; a shorter second prompt keeps all but its own root; streaming
    with `reuse` equals streaming fresh."""
    target, drafter = models
    dec = Decoder(target, drafter, DecodeConfig(budget=4, max_new_tokens=6, prompt_bucket=16, hidden_layers=LAYERS,
                                                lookup=2, fallback_below=1.5))
    prompt = list(range(1, 19))
    calls = _spy_chunks(dec)
    state = dec.prefill([prompt])  # nothing decoded: slots [0, 17) hold prompt[:-1], the root is prompt[-1]
    calls.clear()
    dec.prefill([prompt + [3]], reuse=(state, [prompt]))
    assert calls == [(32, 17)]  # the old root's slot is prefilled (one token, in the smallest chunk)
    state = dec.prefill([prompt])
    calls.clear()
    dec.prefill([prompt[:10]], reuse=(state, [prompt]))
    assert calls == []  # prompt[:9] is cached: nothing to prefill, the root is prompt[9]
    state = dec.prefill([prompt])
    calls.clear()
    dec.prefill([prompt + [3]], reuse=(dataclasses.replace(state, nonfinite=jnp.ones((1,), bool)), [prompt]))
    assert calls[0][1] == 0
    *_, (_, last) = dec.stream([prompt], seed=5)
    follow = prompt + dec.results(last)[0].tokens + [9, 9]
    *_, (_, got) = dec.stream([follow], seed=6, reuse=(last, [prompt]))
    *_, (_, want) = dec.stream([follow], seed=6)
    assert dec.results(got)[0].tokens == dec.results(want)[0].tokens


def test_reuse_into_a_smaller_cache_keeps_the_bottom_slots(models):
    """A shorter next prompt needs fewer cache slots than the earlier state holds: the kept prefix
    (slots [0, 9) of a 40-token prompt, all a 10-token prompt needs) moves to the smaller cache,
    which then holds what a fresh prefill of the short prompt holds and decodes the same tokens."""
    target, drafter = models
    dec = Decoder(target, drafter, DecodeConfig(budget=4, max_new_tokens=6, prompt_bucket=16, capacity_bucket=16,
                                                hidden_layers=LAYERS, lookup=2, fallback_below=1.5))
    prompt = np.random.default_rng(5).integers(0, 23, 40).tolist()
    state = dec.prefill([prompt])
    calls = _spy_chunks(dec)
    got = dec.prefill([prompt[:10]], seed=2, reuse=(state, [prompt]))
    assert calls == []  # prompt[:9] was cached
    fresh = dec.prefill([prompt[:10]], seed=2)
    assert got.target_cache.capacity == fresh.target_cache.capacity == 32 < state.target_cache.capacity
    _assert_same_committed_state(got, fresh, [10])
    assert dec.results(dec.run(got))[0].tokens == dec.results(dec.run(fresh))[0].tokens


def test_reuse_of_a_foreign_state_is_a_clear_error(models):
    """Another decoder's state (another budget, so other tree slots and capacity rules do not matter:
    other fields), another row count, or a malformed `reuse` is refused before anything runs."""
    target, drafter = models
    dec = Decoder(target, drafter, DecodeConfig(budget=4, max_new_tokens=6, prompt_bucket=16))
    prompts = [[1, 2, 3], [4, 5]]
    state = dec.prefill(prompts)
    other = Decoder(target, None, DecodeConfig(max_new_tokens=6, prompt_bucket=16)).prefill(prompts)
    with pytest.raises(ValueError, match="not one of this decoder's"):
        dec.prefill(prompts, reuse=(other, prompts))
    with pytest.raises(ValueError, match="not one of this decoder's"):
        dec.prefill(prompts + [[6, 7]], reuse=(state, prompts + [[6]]))
    with pytest.raises(ValueError, match="2 earlier prompts for 3 prompts"):
        dec.prefill(prompts + [[6, 7]], reuse=(state, prompts))
    with pytest.raises(TypeError, match=r"\(state, earlier_prompts\) pair"):
        dec.prefill(prompts, reuse=state)
    with pytest.raises(TypeError, match="expected a DecodeState"):
        dec.prefill(prompts, reuse=({"cache": 1}, prompts))
    with pytest.raises(TypeError, match="token ids must be integers"):
        dec.prefill(prompts, reuse=(state, [[1.0, 2.0], [3]]))
    got = dec.prefill(prompts, reuse=(state, prompts))  # the state was not consumed by the refusals
    assert np.asarray(got.cache_len).tolist() == [2, 1]
    # Earlier prompts other than the ones the state was prefilled with would decode from the wrong
    # cache: each row's prompt fingerprint is kept and checked (nothing is consumed by a refusal).
    for wrong in ([[1, 2, 4], [4, 5]], [[9, 2, 3], [4, 5]]):  # the last token, or the first
        with pytest.raises(ValueError, match="earlier prompt 0 is not the prompt row 0"):
            dec.prefill(prompts, reuse=(got, wrong))
    with pytest.raises(ValueError, match="earlier prompt 0 is not the prompt row 0"):
        dec.prefill(prompts, reuse=(got, prompts[::-1]))  # another row order
    with pytest.raises(ValueError, match="earlier prompt 1 is not the prompt row 1"):
        dec.prefill(prompts, reuse=(got, [[1, 2, 3], [4, 5, 6]]))
    with pytest.raises(ValueError, match="earlier prompt 0 is not the prompt row 0"):  # no vocabulary's id
        dec.prefill(prompts, reuse=(got, [[1, 2, 2**70], [4, 5]]))
    # That reuse consumed `state` (its caches were donated): a second use is named, not XLA's
    # "Array has been deleted" from inside the call.
    for call in (lambda: dec.results(state), lambda: dec.run(state), lambda: dec.step(state),
                 lambda: dec.prefill(prompts, reuse=(state, prompts))):
        with pytest.raises(ValueError, match="was consumed by an earlier run, step or prefill"):
            call()
    with pytest.raises(TypeError, match=r"results: expected a DecodeState"):
        dec.results({"out": 1})
    assert len(dec.results(dec.run(got))) == 2  # the state it returned is the live one
