"""One-pass tree verification equals plain causal forwards over each root path.

Setup per case: two rows with different committed prefix lengths are prefilled into one cache
(the shorter row's prefill is right-padded, so stale K/V sits above its prefix and must stay
invisible); then one tree pass with `block_mask = tree.ancestors`, `positions = prefix + depth`
and `write_pos = prefix`. The logits at every real node must equal those of an ordinary causal
forward over prefix + that node's root path (root included), all such paths batched into one
reference call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tevjax.models import KVCache, causal_mask, forward
from tevjax.testing import random_model, tiny_config
from tevjax.tree import DraftTree

FWD = jax.jit(forward, static_argnames=("graphdef", "hidden_layers", "compute_logits"))


def random_tree(n: int, vocab: int, rng: np.random.Generator, pad_prob: float = 0.25, pad_at: int = 3):
    """Random parents (earlier real node or padding) and random tokens; node `pad_at` is always
    padding so every case exercises padded slots."""
    parents = np.full(n, -1, np.int32)
    real = [0]
    for i in range(1, n):
        if i != pad_at and rng.random() >= pad_prob:
            parents[i] = rng.choice(real)
            real.append(i)
    tokens = rng.integers(0, vocab, n).astype(np.int32)
    return tokens, parents


def root_path(parents: np.ndarray, i: int) -> list[int]:
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(int(parents[path[-1]]))
    return path[::-1]


def causal_last_logits(graphdef, state, cfg, seqs: list[list[int]]) -> np.ndarray:
    """Logits after the last token of each sequence, from one right-padded causal forward."""
    m, t = len(seqs), max(len(s) for s in seqs)
    toks = np.zeros((m, t), np.int32)
    for r, s in enumerate(seqs):
        toks[r, : len(s)] = s
    out = FWD(graphdef, state, jnp.asarray(toks), jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (m, t)),
              KVCache.init(cfg, m, t), jnp.zeros((m,), jnp.int32),
              jnp.broadcast_to(causal_mask(t), (m, t, t)))
    logits = np.asarray(out.logits)
    return np.stack([logits[r, len(s) - 1] for r, s in enumerate(seqs)])


@pytest.mark.parametrize("arch,seed", [("qwen3", 1), ("llama", 2)])
def test_tree_pass_equals_path_forwards(arch, seed):
    rng = np.random.default_rng(seed)
    overrides = {}
    if seed == 2:  # Llama-3 scaled RoPE exercises positions through the scaled frequencies
        from tevjax.models import RopeScaling

        overrides = dict(rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                  original_max_position_embeddings=16))
    cfg = tiny_config(arch, **overrides)
    graphdef, state = nnx.split(random_model(cfg, seed=seed))
    b, n = 2, 10
    prefix_len = np.array([3, 16])  # row 0 keeps stale prefill K/V in slots 13..15
    pmax = int(prefix_len.max())
    capacity = pmax + n + 3
    prefixes = [rng.integers(0, cfg.vocab_size, p).tolist() for p in prefix_len]

    # Prefill both rows in one call; row 0's tail is garbage that the tree pass must not see.
    pre = rng.integers(0, cfg.vocab_size, (b, pmax)).astype(np.int32)
    for r in range(b):
        pre[r, : prefix_len[r]] = prefixes[r]
    cache = KVCache.init(cfg, b, capacity)
    cache = FWD(graphdef, state, jnp.asarray(pre), jnp.broadcast_to(jnp.arange(pmax, dtype=jnp.int32), (b, pmax)),
                cache, jnp.zeros((b,), jnp.int32), jnp.broadcast_to(causal_mask(pmax), (b, pmax, pmax)),
                compute_logits=False).cache

    trees = [DraftTree.from_parents(*random_tree(n, cfg.vocab_size, rng)) for _ in range(b)]
    tree = jax.tree.map(lambda *x: jnp.stack(x), *trees)
    out = FWD(graphdef, state, tree.tokens, jnp.asarray(prefix_len, jnp.int32)[:, None] + tree.depth, cache,
              jnp.asarray(prefix_len, jnp.int32), tree.ancestors, hidden_layers=(0, cfg.num_layers - 1))
    logits = np.asarray(out.logits)
    assert np.isfinite(logits).all(), "padding rows must not produce NaN/inf"
    assert np.isfinite(np.asarray(out.hidden)).all()

    seqs, where = [], []
    for r in range(b):
        toks, par, valid = (np.asarray(x) for x in (trees[r].tokens, trees[r].parents, trees[r].valid))
        for i in np.flatnonzero(valid):
            seqs.append(prefixes[r] + [int(toks[j]) for j in root_path(par, i)])
            where.append((r, i))
    ref = causal_last_logits(graphdef, state, cfg, seqs)
    got = np.stack([logits[r, i] for r, i in where])
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)
    # The comparison is not vacuous: distinct paths give visibly different logits.
    assert np.abs(ref[0] - ref[-1]).max() > 1e-2


def test_tree_pass_writes_only_its_own_slots():
    """The tree pass leaves the committed prefix untouched and writes K/V at prefix + node."""
    cfg = tiny_config("llama")
    graphdef, state = nnx.split(random_model(cfg, seed=3))
    rng = np.random.default_rng(3)
    cache = KVCache.init(cfg, 1, 12)
    cache = KVCache(k=jnp.asarray(rng.normal(size=cache.k.shape), jnp.float32),
                    v=jnp.asarray(rng.normal(size=cache.v.shape), jnp.float32))
    tree = DraftTree.from_parents([5, 6, 7, 8], [-1, 0, 0, 1])
    out = FWD(graphdef, state, tree.tokens[None], 3 + tree.depth[None], cache, jnp.asarray([3], jnp.int32),
              tree.ancestors[None])
    new_k, old_k = np.asarray(out.cache.k), np.asarray(cache.k)
    np.testing.assert_array_equal(new_k[:, :, :, :3], old_k[:, :, :, :3])
    np.testing.assert_array_equal(new_k[:, :, :, 7:], old_k[:, :, :, 7:])
    assert np.abs(new_k[:, :, :, 3:7] - old_k[:, :, :, 3:7]).min() > 0


def test_full_mask_worked_example():
    """The example in the transformer module docstring, plus a second row at write_pos 0."""
    from tevjax.models import full_mask

    block = jnp.asarray([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)
    got = np.asarray(full_mask(jnp.stack([block, block]), jnp.asarray([2, 0], jnp.int32), 6)).astype(int)
    np.testing.assert_array_equal(got[0], [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 1, 0]])
    np.testing.assert_array_equal(got[1], [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0]])
    # Two trees in one block (as a pass over several exits' trees): the second's nodes do not see
    # node 0 at slot write_pos, only the prefix below it.
    forest = jnp.asarray([[1, 0, 0], [0, 1, 0], [0, 1, 1]], bool)
    got = np.asarray(full_mask(forest[None], jnp.asarray([2], jnp.int32), 6)).astype(int)
    np.testing.assert_array_equal(got[0], [[1, 1, 1, 0, 0, 0], [1, 1, 0, 1, 0, 0], [1, 1, 0, 1, 1, 0]])
