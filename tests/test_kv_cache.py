"""KV cache protocol: incremental decoding equals one full forward, per row, for rows of
different lengths; moving accepted slots (the tree commit) equals re-running the path;
writes past capacity are dropped; the forward is differentiable end to end."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tevjax.models import KVCache, causal_mask, forward
from tevjax.testing import random_model, tiny_config
from tevjax.tree import DraftTree

FWD = jax.jit(forward, static_argnames=("graphdef", "hidden_layers", "compute_logits"))
CFG = tiny_config("qwen3")
ATOL = 1e-4  # whole-model tolerance (float32), fixed


def _setup(seed=0):
    return nnx.split(random_model(CFG, seed=seed))


def _causal(graphdef, state, tokens, cache, write_pos, positions=None, **kw):
    b, t = tokens.shape
    if positions is None:
        positions = write_pos[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    return FWD(graphdef, state, tokens, positions, cache, write_pos,
               jnp.broadcast_to(causal_mask(t), (b, t, t)), **kw)


def test_prefill_then_steps_equals_full_forward():
    graphdef, state = _setup()
    rng = np.random.default_rng(0)
    b, total, cap = 2, 12, 16
    seq = jnp.asarray(rng.integers(0, CFG.vocab_size, (b, total)), jnp.int32)
    zero = jnp.zeros((b,), jnp.int32)
    full = _causal(graphdef, state, seq, KVCache.init(CFG, b, cap), zero, hidden_layers=(0,))
    full_logits, full_hidden = np.asarray(full.logits), np.asarray(full.hidden)

    # Rows prefill different lengths (3 and 6; row 0's prefill is right-padded with junk that
    # the next step overwrites), then decode one token per step at per-row write positions.
    lens = np.array([3, 6])
    pre = np.asarray(seq)[:, :6].copy()
    pre[0, 3:] = 7
    out = _causal(graphdef, state, jnp.asarray(pre), KVCache.init(CFG, b, cap), zero)
    cache = out.cache
    for r in range(b):
        np.testing.assert_allclose(np.asarray(out.logits)[r, : lens[r]], full_logits[r, : lens[r]], atol=ATOL, rtol=0)
    for _ in range(6):
        tok = jnp.asarray(np.asarray(seq)[np.arange(b), lens][:, None])
        step = _causal(graphdef, state, tok, cache, jnp.asarray(lens, jnp.int32), hidden_layers=(0,))
        cache = step.cache
        for r in range(b):
            np.testing.assert_allclose(np.asarray(step.logits)[r, 0], full_logits[r, lens[r]], atol=ATOL, rtol=0)
            np.testing.assert_allclose(np.asarray(step.hidden)[r, 0], full_hidden[r, lens[r]], atol=ATOL, rtol=0)
        lens = lens + 1
    # The cache now holds exactly the K/V the full forward wrote for the covered prefixes.
    for r in range(b):
        np.testing.assert_allclose(np.asarray(cache.k)[:, r, :, : lens[r]],  # [L, B, K, S, Dh]
                                   np.asarray(full.cache.k)[:, r, :, : lens[r]],
                                   atol=ATOL, rtol=0)


def test_chunked_prefill_equals_full_forward():
    graphdef, state = _setup(1)
    rng = np.random.default_rng(1)
    seq = jnp.asarray(rng.integers(0, CFG.vocab_size, (1, 12)), jnp.int32)
    full = np.asarray(_causal(graphdef, state, seq, KVCache.init(CFG, 1, 12), jnp.zeros((1,), jnp.int32)).logits)
    cache = KVCache.init(CFG, 1, 12)
    for start in range(0, 12, 4):
        out = _causal(graphdef, state, seq[:, start : start + 4], cache, jnp.asarray([start], jnp.int32))
        cache = out.cache
        np.testing.assert_allclose(np.asarray(out.logits)[0], full[0, start : start + 4], atol=ATOL, rtol=0)


def test_move_slots_commits_accepted_path():
    """Tree pass, then move the accepted path's K/V behind the prefix: continuing decoding from
    there equals a plain forward over prefix + path."""
    graphdef, state = _setup(2)
    rng = np.random.default_rng(2)
    p, cap = 5, 20
    prefix = jnp.asarray(rng.integers(0, CFG.vocab_size, (1, p)), jnp.int32)
    cache = _causal(graphdef, state, prefix, KVCache.init(CFG, 1, cap), jnp.zeros((1,), jnp.int32)).cache
    #        root   a    b   c(a)  d(c)   e(b)
    tokens = [11, 21, 22, 23, 24, 25]
    tree = DraftTree.from_parents(tokens, [-1, 0, 0, 1, 3, 2])
    out = FWD(graphdef, state, tree.tokens[None], p + tree.depth[None], cache, jnp.asarray([p], jnp.int32),
              tree.ancestors[None])
    accepted = [0, 1, 3, 4]  # root -> a -> c -> d; src slots p + node index
    src = jnp.asarray([[p + i for i in accepted] + [-1]], jnp.int32)  # trailing -1: unused entry
    cache = jax.jit(KVCache.move_slots)(out.cache, src, jnp.asarray([p], jnp.int32))
    committed = p + len(accepted)
    nxt = jnp.asarray([[77]], jnp.int32)
    step = _causal(graphdef, state, nxt, cache, jnp.asarray([committed], jnp.int32))

    path = jnp.concatenate([prefix, jnp.asarray([[tokens[i] for i in accepted]], jnp.int32), nxt], axis=1)
    ref = _causal(graphdef, state, path, KVCache.init(CFG, 1, cap), jnp.zeros((1,), jnp.int32))
    np.testing.assert_allclose(np.asarray(step.logits)[0, 0], np.asarray(ref.logits)[0, -1], atol=ATOL, rtol=0)
    # Without the move the result differs (slots p+2 holds node b, not c), so the test has teeth.
    wrong = _causal(graphdef, state, nxt, out.cache, jnp.asarray([committed], jnp.int32))
    assert np.abs(np.asarray(wrong.logits) - np.asarray(step.logits)).max() > 1e-3


def test_move_slots_and_scatter_rows_on_a_hand_filled_cache():
    """Slot values are their own slot index, so each copy is visible: a path from slot 0 (the
    decoder's sources start at 1, so only this test reaches it) is copied, -1 entries and
    destinations past the capacity are skipped, and nothing else changes."""
    from tevjax.models.cache import scatter_rows

    cache = KVCache.init(CFG, 1, 8)
    filled = jnp.broadcast_to(jnp.arange(8, dtype=cache.k.dtype)[:, None], cache.k.shape)  # [L, B, K, S, Dh]
    cache = dataclasses.replace(cache, k=filled, v=filled + 100)
    moved = KVCache.move_slots(cache, jnp.asarray([[0, 2, -1]], jnp.int32), jnp.asarray([3], jnp.int32))
    want = np.arange(8, dtype=np.float32)
    want[3], want[4] = 0, 2
    np.testing.assert_array_equal(np.asarray(moved.k)[0, 0, 0, :, 0], want)
    np.testing.assert_array_equal(np.asarray(moved.v)[0, 0, 0, :, 0], want + 100)
    tail = KVCache.move_slots(cache, jnp.asarray([[1, 5]], jnp.int32), jnp.asarray([7], jnp.int32))
    want = np.arange(8, dtype=np.float32)
    want[7] = 1  # slot 8 is past the capacity: dropped, not clipped onto slot 7
    np.testing.assert_array_equal(np.asarray(tail.k)[0, 0, 0, :, 0], want)
    buf = jnp.zeros((1, 4), jnp.int32)
    assert scatter_rows(buf, jnp.asarray([[4]]), jnp.asarray([[9]])).tolist() == [[0, 0, 0, 0]]  # past the end
    assert scatter_rows(buf, jnp.asarray([[1]]), jnp.asarray([[9]])).tolist() == [[0, 9, 0, 0]]


def test_writes_past_capacity_are_dropped():
    graphdef, state = _setup(3)
    cache = KVCache.init(CFG, 1, 6)
    toks = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
    out = _causal(graphdef, state, toks, cache, jnp.asarray([4], jnp.int32))
    k = np.asarray(out.cache.k)
    assert np.isfinite(np.asarray(out.logits)).all()
    np.testing.assert_array_equal(k[:, :, :, :4], 0)  # nothing wrapped around to the start
    assert np.abs(k[:, :, :, 4:6]).min() > 0


def test_forward_is_differentiable():
    """Gradients flow through embedding, scanned layers, cache writes and the head, and match
    a central finite difference along a random direction."""
    graphdef, state = _setup(4)
    rng = np.random.default_rng(4)
    toks = jnp.asarray(rng.integers(0, CFG.vocab_size, (1, 5)), jnp.int32)
    params = state.filter(nnx.Param)

    def loss(params):
        out = _causal(graphdef, params, toks, KVCache.init(CFG, 1, 8), jnp.zeros((1,), jnp.int32),
                      hidden_layers=(0,))
        return jnp.mean(jax.nn.log_softmax(out.logits)[..., 3]) + 0.1 * jnp.mean(out.hidden ** 2)

    loss = jax.jit(loss)
    grads = jax.jit(jax.grad(loss))(params)
    flat = jax.tree.leaves(grads)
    assert all(np.isfinite(np.asarray(g)).all() for g in flat)
    q_grad = np.asarray(grads["layers"]["self_attn"]["q_proj"]["kernel"])
    assert np.abs(q_grad[0]).max() > 0 and np.abs(q_grad[1]).max() > 0  # both scanned layers
    # Random direction of unit global norm (numpy: no eager XLA ops); the step eps keeps the
    # change in the linear regime.
    host = jax.tree.map(np.asarray, params)
    direction = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(np.float32), host)
    norm = np.sqrt(sum(float(np.sum(d * d)) for d in jax.tree.leaves(direction)))
    direction = jax.tree.map(lambda d: d / norm, direction)
    eps = 1e-2
    plus = loss(jax.tree.map(lambda p, d: p + eps * d, host, direction))
    minus = loss(jax.tree.map(lambda p, d: p - eps * d, host, direction))
    numeric = float(plus - minus) / (2 * eps)
    analytic = sum(float(np.vdot(np.asarray(g), d)) for g, d in zip(flat, jax.tree.leaves(direction)))
    assert abs(analytic) > 1e-3  # a direction the loss actually depends on
    np.testing.assert_allclose(analytic, numeric, rtol=1e-2, atol=1e-4)


def test_bad_call_inputs_name_the_tensor():
    model = nnx.merge(*_setup(5))
    b, t = 2, 3
    args = dict(tokens=jnp.zeros((b, t), jnp.int32), positions=jnp.zeros((b, t), jnp.int32),
                cache=KVCache.init(CFG, b, 8), write_pos=jnp.zeros((b,), jnp.int32),
                block_mask=jnp.ones((b, t, t), bool))
    for field, bad, match in [
        ("positions", jnp.zeros((b, t + 1), jnp.int32), r"positions has shape \(2, 4\), expected \(2, 3\)"),
        ("write_pos", jnp.zeros((b + 1,), jnp.int32), "write_pos has shape"),
        ("block_mask", jnp.ones((b, t, t + 1), bool), "block_mask has shape"),
        ("cache", KVCache.init(CFG, b + 1, 8), "cache.k has shape"),
        ("tokens", jnp.zeros((b, t), jnp.float32), "must be integer"),
    ]:
        with pytest.raises(ValueError, match=match):
            model(**{**args, field: bad})
    with pytest.raises(ValueError, match=r"hidden_layers entry 2 is outside \[0, 2\)"):
        model(**args, hidden_layers=(2,))


def test_a_run_longer_than_the_cache_and_misshapen_commits_are_refused_by_name():
    """A run of more new tokens than the cache has slots cannot write them all: its last tokens'
    queries attended without their own keys and gave wrong logits (the same call with room for
    them differs), without an error. It is refused, as are tokens that are not [B, T] and a
    commit whose src or dst_start does not fit the cache's rows (they failed with bare
    unpacking and broadcasting errors)."""
    model = nnx.merge(*_setup(6))
    toks = jnp.asarray(np.random.default_rng(6).integers(0, CFG.vocab_size, (1, 10)), jnp.int32)
    args = dict(tokens=toks, positions=jnp.arange(10, dtype=jnp.int32)[None], write_pos=jnp.zeros((1,), jnp.int32))
    for block_mask in (None, causal_mask(10)[None]):
        roomy = model(**args, cache=KVCache.init(CFG, 1, 16), block_mask=block_mask)
        assert np.isfinite(np.asarray(roomy.logits)).all()
        with pytest.raises(ValueError, match="10 new tokens do not fit a cache of 8 slots per row"):
            model(**args, cache=KVCache.init(CFG, 1, 8), block_mask=block_mask)
        with pytest.raises(ValueError, match="10 new tokens do not fit a cache of 8 slots"):
            nnx.jit(lambda m, c: m(**args, cache=c, block_mask=block_mask))(model, KVCache.init(CFG, 1, 8))
    model(**args, cache=KVCache.init(CFG, 1, 10), block_mask=None)  # exactly full is fine
    with pytest.raises(ValueError, match=r"tokens has shape \(10,\), expected \(B, T\)"):
        model(**{**args, "tokens": toks[0]}, cache=KVCache.init(CFG, 1, 16), block_mask=None)
    cache = KVCache.init(CFG, 2, 8)
    for src, dst in [(jnp.zeros((3,), jnp.int32), jnp.zeros((2,), jnp.int32)),
                     (jnp.zeros((2, 3), jnp.int32), jnp.zeros((3,), jnp.int32)),
                     (jnp.zeros((1, 3), jnp.int32), jnp.zeros((1,), jnp.int32))]:
        with pytest.raises(ValueError, match=r"KVCache.move_slots: src has shape .* expected \(2, M\) and \(2,\)"):
            cache.move_slots(src, dst)
