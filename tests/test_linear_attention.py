"""The gated delta rule's block form against its token-by-token recurrence: on sequences, on every
root-to-node path of random trees, with padding, chunked, and the tree conv against the causal one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tevjax.models.linear_attention import (causal_conv, gated_delta, gated_delta_chunked, l2_normalize,
                                            tree_conv)
from tevjax.tree import DraftTree

jax.config.update("jax_enable_x64", False)


def recurrence(q, k, v, g, beta, state):
    """The delta rule one token at a time (float64 numpy): per batch row and value head."""
    q, k, v, g, beta, s = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, state))
    s = s.copy()
    out = np.zeros(v.shape)
    for t in range(q.shape[1]):
        s *= np.exp(g[:, t])[..., None, None]
        mem = np.einsum("bhkv,bhk->bhv", s, k[:, t])
        delta = (v[:, t] - mem) * beta[:, t][..., None]
        s += np.einsum("bhk,bhv->bhkv", k[:, t], delta)
        out[:, t] = np.einsum("bhkv,bhk->bhv", s, q[:, t])
    return out, s


def inputs(rng, b, t, h=3, dk=8, dv=5):
    q = l2_normalize(rng.normal(size=(b, t, h, dk))) * dk ** -0.5
    k = l2_normalize(rng.normal(size=(b, t, h, dk)))
    v = rng.normal(size=(b, t, h, dv))
    g = -np.exp(rng.normal(size=(b, t, h)))  # < 0, some near 0
    beta = 1 / (1 + np.exp(-rng.normal(size=(b, t, h))))
    state = rng.normal(size=(b, h, dk, dv))
    return [np.asarray(x, np.float32) for x in (q, k, v, g, beta, state)]


def test_l2_normalize_keeps_eps_under_the_root():
    """x / sqrt(sum(x^2) + 1e-6), the FLA kernels' form: a zero vector stays zero (not NaN) and a short
    one is shrunk by the eps, not stretched to unit length."""
    x = np.zeros((2, 8), np.float32)
    x[1] = 1e-4  # squares sum to 8e-8, well below the eps
    got = np.asarray(l2_normalize(jnp.asarray(x)))
    np.testing.assert_array_equal(got[0], 0.0)
    np.testing.assert_allclose(got[1], 1e-4 / np.sqrt(8e-8 + 1e-6), rtol=1e-5)


def test_sequence_matches_recurrence_with_final_state():
    rng = np.random.default_rng(0)
    q, k, v, g, beta, s = inputs(rng, 2, 11)
    tril = np.broadcast_to(np.tril(np.ones((11, 11), bool)), (2, 11, 11))
    out, final = gated_delta(q, k, v, g, beta, s, tril, final=True)
    ref_out, ref_s = recurrence(q, k, v, g, beta, s)
    np.testing.assert_allclose(out, ref_out, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(final, ref_s, rtol=2e-4, atol=2e-5)


def test_padding_with_zero_decay_and_beta_leaves_the_state():
    rng = np.random.default_rng(1)
    q, k, v, g, beta, s = inputs(rng, 1, 9)
    g[:, 6:], beta[:, 6:] = 0.0, 0.0
    tril = np.tril(np.ones((9, 9), bool))[None]
    _, final = gated_delta(q, k, v, g, beta, s, tril, final=True)
    _, ref_s = recurrence(q[:, :6], k[:, :6], v[:, :6], g[:, :6], beta[:, :6], s)
    np.testing.assert_allclose(final, ref_s, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("t,chunk", [(37, 8), (16, 16), (5, 64)])
def test_chunked_matches_recurrence(t, chunk):
    rng = np.random.default_rng(t)
    q, k, v, g, beta, s = inputs(rng, 2, t)
    out, final = gated_delta_chunked(q, k, v, g, beta, s, chunk=chunk)
    ref_out, ref_s = recurrence(q, k, v, g, beta, s)
    np.testing.assert_allclose(out, ref_out, rtol=3e-4, atol=3e-5)
    np.testing.assert_allclose(final, ref_s, rtol=3e-4, atol=3e-5)


def random_tree(rng, n):
    parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]  # parents before children
    return DraftTree.from_parents(np.zeros((n,), np.int32), np.asarray(parents, np.int32))


def path_of(tree, i):
    parents = np.asarray(tree.parents)
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(int(parents[path[-1]]))
    return path[::-1]


def test_tree_nodes_get_their_paths_outputs():
    """Each node's output equals the recurrence over its root-to-node path from the same state."""
    rng = np.random.default_rng(2)
    n = 13
    trees = [random_tree(rng, n) for _ in range(2)]
    q, k, v, g, beta, s = inputs(rng, 2, n)
    mask = np.stack([np.asarray(tr.ancestors) for tr in trees])
    out, _ = gated_delta(q, k, v, g, beta, s, mask)
    for b, tree in enumerate(trees):
        for i in range(n):
            p = path_of(tree, i)
            sl = [x[b:b + 1, p] for x in (q, k, v, g, beta)]
            ref, _ = recurrence(*sl, s[b:b + 1])
            np.testing.assert_allclose(out[b, i], ref[0, -1], rtol=2e-4, atol=2e-5)


def test_commit_path_runs_only_the_first_count_nodes_of_the_path():
    """`commit_path` leaves the state and conv state that the first `count` nodes of each row's path
    would, as a sequence, leave: nodes past the count (rejected or padding) change nothing."""
    from tevjax.models.linear_attention import commit_path

    rng = np.random.default_rng(8)
    b, n, hk, hv, dk, dv, c, w = 2, 5, 1, 2, 4, 3, 6, 4
    x = rng.normal(size=(b, n, c)).astype(np.float32)
    k = rng.normal(size=(b, n, hk, dk)).astype(np.float32)
    v = rng.normal(size=(b, n, hv, dv)).astype(np.float32)
    gb = np.stack([-np.exp(rng.normal(size=(b, n, hv))), 1 / (1 + np.exp(-rng.normal(size=(b, n, hv))))], axis=2)
    state, conv = rng.normal(size=(b, hv, dk, dv)).astype(np.float32), rng.normal(size=(b, w - 1, c)).astype(np.float32)
    nodes, count = np.asarray([[0, 2, 3, 4], [0, 1, 4, 2]], np.int32), np.asarray([3, 1], np.int32)
    got_state, got_conv = jax.jit(commit_path)(*(jnp.asarray(a) for a in (state, conv, x, k, v, gb.astype(np.float32),
                                                                  nodes, count)))
    for r in range(b):
        path = nodes[r, :count[r]]
        kn = np.repeat(np.asarray(l2_normalize(k[r, path])), hv // hk, axis=1)[None]
        _, want = recurrence(kn, kn, v[r, path][None], gb[r, path, 0][None], gb[r, path, 1][None], state[r:r + 1])
        np.testing.assert_allclose(np.asarray(got_state[r]), want[0], rtol=2e-4, atol=2e-5, err_msg=f"row {r}")
        np.testing.assert_array_equal(np.asarray(got_conv[r]), np.concatenate([conv[r], x[r, path]])[-(w - 1):])


def test_tree_conv_matches_the_paths_causal_conv():
    rng = np.random.default_rng(3)
    n, c, width = 12, 6, 4
    tree = random_tree(rng, n)
    x = rng.normal(size=(1, n, c)).astype(np.float32)
    st = rng.normal(size=(1, width - 1, c)).astype(np.float32)
    w = rng.normal(size=(c, width)).astype(np.float32)
    out = tree_conv(x, st, w, np.asarray(tree.ancestors)[None], np.asarray(tree.depth)[None])
    for i in range(n):
        p = path_of(tree, i)
        ref = causal_conv(x[:, p], st, w)
        np.testing.assert_allclose(out[0, i], ref[0, -1], rtol=1e-5, atol=1e-5)
    # and on a sequence, the two agree everywhere
    tril = np.tril(np.ones((n, n), bool))[None]
    np.testing.assert_allclose(tree_conv(x, st, w, tril, np.arange(n)[None]), causal_conv(x, st, w), rtol=1e-5,
                               atol=1e-6)


def test_causal_conv_is_a_depthwise_convolution():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(1, 7, 3)).astype(np.float32)
    st = rng.normal(size=(1, 3, 3)).astype(np.float32)
    w = rng.normal(size=(3, 4)).astype(np.float32)
    xx = np.concatenate([st, x], axis=1)
    ref = np.stack([sum(xx[0, t + j] * w[:, j] for j in range(4)) for t in range(7)])[None]
    np.testing.assert_allclose(causal_conv(x, st, w), ref, rtol=1e-5, atol=1e-6)
