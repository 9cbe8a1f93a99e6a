"""The training objectives against brute force: token loss, exit weights, exit loss and gradients,
anchor sampling, and full-prefix tree scoring against the decoder's own per-anchor tree pass."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tevjax.decode.engine import draft_trees, tree_pass
from tevjax.law import exit_law
from tevjax.models import KVCache, causal_mask
from tevjax.testing import random_model, tiny_config
from tevjax.train.objectives import (EXIT_WEIGHTS, P_FLOOR, batch_anchors, distill_loss_terms, exit_loss_terms,
                                     exit_weights, ratio, sample_anchors, token_loss_terms)
from tevjax.train.step import score_trees
from tevjax.tree import DraftTree
from tevjax.law import edge_stats, law_from_edges

V = 7
G = 4
# A 7-node tree: root 0; depth 1: nodes 1 (tok 3), 2 (tok 5); depth 2: 3 (tok 1, under 1), 4 (tok 2,
# under 1), 5 (tok 3, under 2); depth 3: 6 (tok 4, under 3); one padding slot.
TOKENS = [6, 3, 5, 1, 2, 3, 4, 0]
PARENTS = [-1, 0, 0, 1, 1, 2, 3, -1]


def _tree():
    return DraftTree.from_parents(jnp.asarray(TOKENS, jnp.int32), jnp.asarray(PARENTS, jnp.int32))


def _brute_weights(target_logits, kind, temperature=1.0):
    """omega per node by direct recursion over the tree (python floats)."""
    p = jax.nn.softmax(np.asarray(target_logits, np.float64) / temperature, axis=-1)
    p = np.asarray(p, np.float64)
    n = len(TOKENS)
    real = [i for i in range(n) if i == 0 or PARENTS[i] >= 0]
    children = {i: [c for c in real if PARENTS[c] == i and c != 0] for i in real}
    depth = {0: 0}
    P, Pf = {0: 1.0}, {0: 1.0}
    for i in sorted(real)[1:]:
        par = PARENTS[i]
        depth[i] = depth[par] + 1
        P[i] = P[par] * p[par, TOKENS[i]]
        Pf[i] = Pf[par] * max(p[par, TOKENS[i]], P_FLOOR)
    rho = {i: max(0.0, 1.0 - sum(p[i, TOKENS[c]] for c in children[i])) for i in real}
    w = {i: P[i] * rho[i] for i in real}
    non_root = [i for i in real if i != 0]
    if kind == "w":
        om = {i: w[i] for i in non_root}
    elif kind == "w_depth":
        om = {i: w[i] * depth[i] for i in non_root}
    elif kind == "P_floored":
        om = {i: Pf[i] for i in non_root}
    else:
        scale = sum(w[i] for i in non_root) / sum(P[i] for i in non_root)
        om = {i: P[i] * scale for i in non_root}
    return om, depth, non_root


@pytest.mark.parametrize("kind", EXIT_WEIGHTS)
def test_exit_loss_and_gradient_match_brute_force(kind):
    rng = np.random.default_rng(3)
    target_logits = jnp.asarray(rng.standard_normal((len(TOKENS), V)) * 2, jnp.float32)
    z = jnp.asarray(rng.standard_normal((G, V)), jnp.float32)
    tree = _tree()
    edge = edge_stats(tree, target_logits, 1.0).edge_prob
    omega = exit_weights(law_from_edges(tree, edge), tree, edge, kind)
    om, depth, non_root = _brute_weights(target_logits, kind)
    np.testing.assert_allclose(np.asarray(omega)[non_root], [om[i] for i in non_root], rtol=1e-5, atol=1e-7)
    assert float(omega[0]) == 0.0 and float(omega[-1]) == 0.0  # root and padding carry no weight

    def fast(z):
        return ratio(exit_loss_terms(jax.nn.logsumexp(z, -1), z, tree, omega, jnp.asarray(True)))

    def brute(z):
        logq = jax.nn.log_softmax(z, -1)
        return sum(om[i] * -logq[depth[i] - 1, TOKENS[i]] for i in non_root) / len(non_root)

    np.testing.assert_allclose(float(fast(z)), float(brute(z)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.grad(fast)(z)), np.asarray(jax.grad(brute)(z)), rtol=1e-5, atol=1e-7)
    # The weights are detached: no gradient flows into the target logits through omega.
    g_target = jax.grad(lambda t: jnp.sum(exit_weights(law_from_edges(tree, edge_stats(tree, t, 1.0).edge_prob),
                                                       tree, edge_stats(tree, t, 1.0).edge_prob, kind)))(target_logits)
    assert not np.any(np.asarray(g_target))


def test_w_weights_sum_to_one_minus_root_exit():
    rng = np.random.default_rng(4)
    logits = jnp.asarray(rng.standard_normal((len(TOKENS), V)), jnp.float32)
    tree = _tree()
    edge = edge_stats(tree, logits, 1.0).edge_prob
    law = law_from_edges(tree, edge)
    total = float(jnp.sum(exit_weights(law, tree, edge, "w")))
    np.testing.assert_allclose(total, 1.0 - float(law.exit_prob[0]), rtol=1e-6)
    rescaled = float(jnp.sum(exit_weights(law, tree, edge, "P_rescaled")))
    np.testing.assert_allclose(rescaled, total, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(law.exit_prob), np.asarray(exit_law(tree, logits, 1.0).exit_prob))


def test_invalid_anchor_trees_do_not_count():
    rng = np.random.default_rng(5)
    z = jnp.asarray(rng.standard_normal((2, G, V)), jnp.float32)
    trees = jax.tree.map(lambda x: jnp.stack([x, x]), _tree())
    omega = jnp.ones((2, len(TOKENS)))
    num, den = exit_loss_terms(jax.nn.logsumexp(z, -1), z, trees, omega, jnp.asarray([True, False]))
    num1, den1 = exit_loss_terms(jax.nn.logsumexp(z[:1], -1), z[:1], jax.tree.map(lambda x: x[:1], trees),
                                 omega[:1], jnp.asarray([True]))
    assert float(den) == float(den1) == 6.0  # six real non-root nodes
    np.testing.assert_allclose(float(num), float(num1), rtol=1e-6)


def _loss_case(seed):
    """Two sequences of 12 tokens, 3 anchors each (one invalid, one near the end), draft logits and
    teacher logits."""
    rng = np.random.default_rng(seed)
    b, q, m = 2, 12, 3
    tokens = rng.integers(0, V, (b, q)).astype(np.int32)
    mask = np.zeros((b, q), bool)
    mask[0, 4:] = True
    mask[1, 2:9] = True
    anchors = np.array([[4, 9, 11], [2, 7, 0]], np.int32)
    valid = np.array([[True, True, True], [True, True, False]])
    z = rng.standard_normal((b, m, G, V)).astype(np.float32)
    teacher = 2.0 * rng.standard_normal((b, m, G, V)).astype(np.float32)
    return tokens, mask, anchors, valid, z, teacher


@pytest.mark.parametrize("gamma", [7.0, None])
def test_token_loss_matches_brute_force(gamma):
    tokens, mask, anchors, valid, z, _ = _loss_case(6)
    b, m = anchors.shape
    q = tokens.shape[1]
    num, den = token_loss_terms(jax.nn.logsumexp(jnp.asarray(z), -1), jnp.asarray(z), jnp.asarray(tokens),
                                jnp.asarray(mask), jnp.asarray(anchors), jnp.asarray(valid), gamma)
    bn = bd = 0.0
    for i, j, k in itertools.product(range(b), range(m), range(1, G + 1)):
        a = anchors[i, j]
        if not valid[i, j] or a + k >= q or not mask[i, a + k]:
            continue
        wgt = 1.0 if gamma is None else np.exp(-(k - 1) / gamma)
        logq = z[i, j, k - 1] - np.log(np.sum(np.exp(z[i, j, k - 1].astype(np.float64))))
        bn += wgt * -logq[tokens[i, a + k]]
        bd += wgt
    np.testing.assert_allclose(float(num), bn, rtol=1e-5)
    np.testing.assert_allclose(float(den), bd, rtol=1e-6)


def test_distill_loss_and_gradient_match_brute_force():
    tokens, mask, anchors, valid, z, teacher = _loss_case(7)
    b, m = anchors.shape
    q = tokens.shape[1]
    args = tuple(map(jnp.asarray, (teacher, mask, anchors, valid)))

    def loss(zz):
        return ratio(distill_loss_terms(jax.nn.logsumexp(zz, -1), zz, *args, 7.0))

    num, den = distill_loss_terms(jax.nn.logsumexp(jnp.asarray(z), -1), jnp.asarray(z), *args, 7.0)
    bn = bd = 0.0
    grad = np.zeros_like(z, np.float64)
    for i, j, k in itertools.product(range(b), range(m), range(1, G + 1)):
        a = anchors[i, j]
        if not valid[i, j] or a + k >= q or not mask[i, a + k]:
            continue
        wgt = np.exp(-(k - 1) / 7.0)
        row = z[i, j, k - 1].astype(np.float64)
        logq = row - np.log(np.sum(np.exp(row)))
        t = teacher[i, j, k - 1].astype(np.float64)
        p = np.exp(t - t.max()) / np.sum(np.exp(t - t.max()))
        bn += wgt * -np.sum(p * logq)
        bd += wgt
        grad[i, j, k - 1] = wgt * (np.exp(logq) - p)  # d/dz of soft cross entropy: q - p
    np.testing.assert_allclose(float(num), bn, rtol=1e-5)
    np.testing.assert_allclose(float(den), bd, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.grad(loss)(jnp.asarray(z))), grad / bd, rtol=1e-4, atol=1e-7)


def test_distill_loss_of_a_one_hot_teacher_is_the_token_loss():
    """A teacher that puts all its mass on the data token (the T = 0 limit) gives the token loss."""
    tokens, mask, anchors, valid, z, _ = _loss_case(8)
    b, m = anchors.shape
    q = tokens.shape[1]
    pos = np.minimum(anchors[..., None] + np.arange(1, G + 1), q - 1)
    labels = tokens[np.arange(b)[:, None, None], pos]
    teacher = np.where(np.arange(V) == labels[..., None], 0.0, -1e4).astype(np.float32)
    lse = jax.nn.logsumexp(jnp.asarray(z), -1)
    common = tuple(map(jnp.asarray, (mask, anchors, valid)))
    soft = distill_loss_terms(lse, jnp.asarray(z), jnp.asarray(teacher), *common, 7.0)
    hard = token_loss_terms(lse, jnp.asarray(z), jnp.asarray(tokens), *common, 7.0)
    np.testing.assert_allclose(np.asarray(soft), np.asarray(hard), rtol=1e-6)


def test_sample_anchors_are_distinct_eligible_and_cover():
    mask = np.zeros(40, bool)
    mask[10:30] = True  # eligible anchors: 9..28 (the next token supervised; 9 is the last prompt token): 20 positions
    for seed in range(5):
        anchors, valid = sample_anchors(jax.random.key(seed), jnp.asarray(mask), 8)
        a = np.asarray(anchors)[np.asarray(valid)]
        assert len(a) == 8 and len(set(a.tolist())) == 8 and np.all((a >= 9) & (a <= 28))
        assert np.all(np.diff(a) > 0)  # sorted
    anchors, valid = sample_anchors(jax.random.key(0), jnp.asarray(mask), 25)
    assert int(valid.sum()) == 20 and sorted(np.asarray(anchors)[np.asarray(valid)].tolist()) == list(range(9, 29))
    anchors, valid = sample_anchors(jax.random.key(0), jnp.zeros(40, bool), 4)
    assert not np.any(np.asarray(valid))
    # More anchors than positions (a short record in a wide batch): the padding is invalid.
    anchors, valid = sample_anchors(jax.random.key(0), jnp.asarray(mask), 50)
    assert anchors.shape == (50,) and int(valid.sum()) == 20
    assert sorted(np.asarray(anchors)[np.asarray(valid)].tolist()) == list(range(9, 29))
    # Every eligible position is drawn about equally often (a uniform sample without replacement).
    counts = np.zeros(40)
    for seed in range(400):
        anchors, valid = sample_anchors(jax.random.key(seed), jnp.asarray(mask), 4)
        counts[np.asarray(anchors)[np.asarray(valid)]] += 1
    expected = 400 * 4 / 20
    # Binomial(400, 4/20) per position: sd 8.0, so +-40 is ~5 sd (false-alarm rate < 1e-5 overall).
    assert np.all(np.abs(counts[9:29] - expected) < 40) and counts[:9].sum() == counts[29:].sum() == 0


def test_full_prefix_scoring_equals_per_anchor_tree_passes():
    tcfg = tiny_config(num_layers=2)
    target = random_model(tcfg, seed=1)
    rng = np.random.default_rng(7)
    b, q, e, budget = 2, 20, 3, 5
    tokens = jnp.asarray(rng.integers(0, tcfg.vocab_size, (b, q)), jnp.int32)
    anchors = jnp.asarray([[3, 9, 15], [5, 6, 18]], jnp.int32)
    log_q = jnp.asarray(rng.standard_normal((b * e, G, tcfg.vocab_size)), jnp.float32)
    roots = jnp.take_along_axis(tokens, anchors, axis=1).reshape(-1)
    flat = draft_trees(log_q, roots, budget)
    trees = jax.tree.map(lambda x: x.reshape((b, e) + x.shape[1:]), flat)
    fast = np.asarray(score_trees(target, tokens, anchors, trees))
    # The decoder's way, one anchor at a time: the cache holds the prefix before the anchor and the
    # tree pass writes the tree at slot `anchor` (it sees slots < anchor: later slots of this full
    # prefill are masked out and overwritten), at positions anchor + depth.
    cap = q + budget + 1
    pre = target(tokens, jnp.broadcast_to(jnp.arange(q), (b, q)), KVCache.init(tcfg, b, cap),
                 jnp.zeros((b,), jnp.int32), jnp.broadcast_to(causal_mask(q), (b, q, q)))
    one = jax.jit(lambda cache, tree, a: tree_pass(target, tree, a, cache).logits)
    for i in range(b):
        cache_i = jax.tree.map(lambda x: x[:, i:i + 1], pre.cache)
        for j in range(e):
            tree = jax.tree.map(lambda x: x[i:i + 1, j], trees)
            ref = one(cache_i, tree, anchors[i, j:j + 1])[0]
            valid = np.asarray(tree.valid[0])
            np.testing.assert_allclose(fast[i, j][valid], np.asarray(ref)[valid], atol=2e-5, rtol=1e-5)


def test_ratio_of_an_empty_batch_is_zero():
    """An all-padding batch counts nothing: its loss is 0, not the 0/0 of a mean."""
    assert float(ratio((jnp.float32(0.0), jnp.float32(0.0)))) == 0.0
    assert float(ratio((jnp.float32(3.0), jnp.float32(2.0)))) == 1.5


def test_invalid_anchors_come_last_at_index_zero_and_rows_use_split_keys():
    """Fewer eligible positions than M: the valid anchors fill the front, sorted, and the invalid
    rest read index 0 (in the sequence, so any gather at them stays in bounds). `batch_anchors`
    row b is `sample_anchors` with the b-th of split(key, B): equal masks, different draws.
    (Shapes [40] and M = 4 as in the test above: eager ops already compiled.)"""
    mask = np.zeros(40, bool)
    mask[[3, 7, 30]] = True  # eligible anchors: 2, 6, 29
    anchors, valid = sample_anchors(jax.random.key(1), jnp.asarray(mask), 4)
    assert np.asarray(valid).tolist() == [True] * 3 + [False]
    assert np.asarray(anchors).tolist() == [2, 6, 29, 0]
    key, masks = jax.random.key(2), jnp.ones((2, 40), bool)
    rows, rows_valid = batch_anchors(key, masks, 4)
    for b, k in enumerate(jax.random.split(key, 2)):
        want, want_valid = sample_anchors(k, masks[b], 4)
        np.testing.assert_array_equal(np.asarray(rows[b]), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(rows_valid[b]), np.asarray(want_valid))
    assert np.asarray(rows[0]).tolist() != np.asarray(rows[1]).tolist()  # rows draw apart


def test_p_floored_floors_each_factor_and_unknown_weights_are_refused():
    """Edges far below P_FLOOR (which random logits never reach) weigh P_FLOOR each: node 1 hangs
    on one such edge, node 3 on two and node 6 on those two and one more ordinary edge."""
    rng = np.random.default_rng(9)
    logits = rng.standard_normal((len(TOKENS), V)) * 2
    logits[0, 3] = logits[1, 1] = -30.0  # edges 0 -> 1 (token 3) and 1 -> 3 (token 1): ~1e-14
    tree = _tree()
    edge = edge_stats(tree, jnp.asarray(logits, jnp.float32), 1.0).edge_prob
    assert float(edge[1]) < 1e-10 and float(edge[3]) < 1e-10
    law = law_from_edges(tree, edge)
    omega = np.asarray(exit_weights(law, tree, edge, "P_floored"))
    om, _, non_root = _brute_weights(logits, "P_floored")
    np.testing.assert_allclose(omega[non_root], [om[i] for i in non_root], rtol=1e-5)
    np.testing.assert_allclose(omega[[1, 3]], [P_FLOOR, P_FLOOR ** 2], rtol=1e-5)
    with pytest.raises(ValueError, match="unknown exit weight 'P'"):
        exit_weights(law, tree, edge, "P")
