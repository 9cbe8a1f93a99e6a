"""Tests for the on-device DDTree builder against a host best-first heap reference."""

from __future__ import annotations

import functools
import heapq
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tevjax.builder import (LOOKUP_SURVIVAL, NGRAM_CALIBRATION, build_ddtree, build_ddtree_from_top, chain_log_reach,
                            check_survival, context_chain, corpus_chain, merge_chain, ngram_table)
from tevjax.tree import validate_tree

# One compiled builder per (G, V, budget): budget is static.
_build_jit = jax.jit(build_ddtree, static_argnums=2)
_build_batch = jax.jit(jax.vmap(build_ddtree, in_axes=(0, 0, None)), static_argnums=2)

# float32 accumulation vs the float64 reference: scores agree to this, and two prefixes whose
# reference scores differ by less than this count as tied.
TOL = 1e-4


def heap_reference(log_marginals: np.ndarray, budget: int) -> list[tuple[tuple[int, ...], float]]:
    """Best-first DDTree construction on the host, in float64: [(token path, score)] in pop order.

    Like DDTree's `build_ddtree_tree`: keep the top k = min(budget, V) tokens of each depth; the heap
    starts with the best depth-1 token; popping a prefix pushes its next sibling (same parent, next
    rank) and its first child (best token of the next depth, if below the depth cap). Ties pop the
    smaller rank tuple first, i.e. a parent before its child. Unlike DDTree, it stops at the first
    -inf score, so only finite-score prefixes become nodes.
    """
    lm = np.asarray(log_marginals, np.float64)
    depth_cap, vocab = lm.shape
    k = min(budget, vocab)
    order = np.argsort(-lm, axis=1, kind="stable")[:, :k]
    vals = np.take_along_axis(lm, order, axis=1)
    out: list[tuple[tuple[int, ...], float]] = []
    if budget == 0 or depth_cap == 0:
        return out
    # entries: (-score, rank path, parent score, parent token path)
    heap = [(-vals[0, 0], (0,), 0.0, ())]
    while heap and len(out) < budget:
        neg, ranks, parent_score, parent_path = heapq.heappop(heap)
        if neg == math.inf:
            break
        depth, rank = len(ranks), ranks[-1]
        path = parent_path + (int(order[depth - 1, rank]),)
        out.append((path, -neg))
        if rank + 1 < k:
            sib = parent_score + vals[depth - 1, rank + 1]
            heapq.heappush(heap, (-sib, ranks[:-1] + (rank + 1,), parent_score, parent_path))
        if depth < depth_cap:
            heapq.heappush(heap, (-(-neg + vals[depth, 0]), ranks + (0,), -neg, path))
    return out


def tree_paths(tokens, parents, scores) -> list[tuple[tuple[int, ...], float]]:
    """Token paths and scores of the real non-root nodes of a built tree, in node order."""
    tokens, parents, scores = np.asarray(tokens), np.asarray(parents), np.asarray(scores)
    paths: dict[int, tuple[int, ...]] = {0: ()}
    out = []
    for i in range(1, len(tokens)):
        if parents[i] >= 0:
            paths[i] = paths[int(parents[i])] + (int(tokens[i]),)
            out.append((paths[i], float(scores[i])))
    return out


def random_log_marginals(rng, depth_cap, vocab, *, scale=2.0, p_inf=0.0, p_dead_row=0.0):
    """Continuous random log-probabilities (ties have probability zero), optionally with -inf."""
    logits = rng.normal(size=(depth_cap, vocab)) * scale
    lm = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    lm[rng.random(lm.shape) < p_inf] = -np.inf
    lm[rng.random(depth_cap) < p_dead_row] = -np.inf
    return lm.astype(np.float32)


def finite_prefix_count(lm: np.ndarray) -> int:
    counts = np.cumprod(np.isfinite(lm).sum(axis=1).astype(np.int64))
    return int(counts.sum())


def check_tree(tokens, parents, scores, depth, valid, lm, budget, root_token):
    """Structural properties every build must have, whatever the ties."""
    tokens, parents, scores = np.asarray(tokens), np.asarray(parents), np.asarray(scores)
    depth, valid = np.asarray(depth), np.asarray(valid)
    lm32 = np.asarray(lm, np.float32)
    depth_cap, vocab = lm32.shape
    n = budget + 1
    assert tokens.shape == parents.shape == scores.shape == (n,)
    assert scores.dtype == np.float32
    validate_tree(tokens, parents, vocab_size=vocab)  # parents precede children, siblings distinct
    assert tokens[0] == root_token and parents[0] == -1 and scores[0] == 0.0
    real = parents >= 0
    real[0] = True
    np.testing.assert_array_equal(valid, real)
    n_real = int(real.sum()) - 1
    assert n_real == min(budget, finite_prefix_count(lm32))
    # Real nodes first, then padding; padding is canonical (token 0, score -inf).
    assert real[: n_real + 1].all() and not real[n_real + 1 :].any()
    assert np.all(tokens[~real] == 0) and np.all(scores[~real] == -np.inf)
    # Depth cap and score bookkeeping: each score is the parent's score plus the edge log-prob,
    # so scores never increase along a root path.
    assert np.all(depth[real] <= depth_cap)
    for i in range(1, n_real + 1):
        p = parents[i]
        assert depth[i] == depth[p] + 1
        edge = lm32[depth[i] - 1, tokens[i]]
        assert np.isfinite(scores[i])
        np.testing.assert_allclose(scores[i], scores[p] + edge, rtol=0, atol=1e-5)
        assert scores[i] <= scores[p]
    # Node order is descending score; equal scores go to the shallower node.
    s = scores[1 : n_real + 1]
    d = depth[1 : n_real + 1]
    assert np.all(s[:-1] >= s[1:])
    assert np.all((s[:-1] > s[1:]) | (d[:-1] <= d[1:]))
    # Optimality certificate: the chosen set is prefix-closed (validate_tree) and no child of a
    # chosen node or of the root that was left out scores above the worst chosen node. Every
    # unchosen prefix has such a frontier ancestor with at least its score, so the chosen nodes
    # are `budget` best-scoring prefixes.
    if n_real < budget:
        return  # every finite prefix was taken (count checked above)
    worst = s[-1]
    chosen = {path for path, _ in tree_paths(tokens, parents, scores)}
    for path, score in [((), 0.0)] + tree_paths(tokens, parents, scores):
        if len(path) == depth_cap:
            continue
        for tok in range(vocab):
            if path + (tok,) not in chosen:
                assert score + lm32[len(path), tok] <= worst + 1e-5


def assert_same_as_reference(tokens, parents, scores, lm, budget):
    """Same node set (as token paths) and order as the heap, up to near-ties in float32."""
    ours = tree_paths(tokens, parents, scores)
    ref = heap_reference(lm, budget)
    assert len(ours) == len(ref)
    if not ref:
        return
    np.testing.assert_allclose([s for _, s in ours], [s for _, s in ref], rtol=0, atol=TOL)
    cutoff = ref[-1][1]
    ref_score = dict(ref)
    our_score = dict(ours)
    for path in set(ref_score) ^ set(our_score):
        # A differing prefix is only acceptable as a tie at the budget boundary.
        score = ref_score.get(path, our_score.get(path))
        assert abs(score - cutoff) < TOL, (path, score, cutoff)
    ref_scores = np.array([s for _, s in ref])
    if len(ref) < 2 or np.min(ref_scores[:-1] - ref_scores[1:]) > TOL:
        assert [p for p, _ in ours] == [p for p, _ in ref]  # pop order == node numbering


# (G, V, budget, batch): budgets below, at and above the number of prefixes; k < V, k = V, V = 1.
REFERENCE_CASES = [
    (1, 5, 3, 8),
    (3, 2, 20, 8),  # 14 prefixes exist: 6 padding slots
    (4, 3, 17, 8),
    (4, 6, 2, 8),  # k = budget < V
    (2, 40, 32, 6),
    (5, 1, 8, 4),  # a chain capped at depth 5
    (6, 8, 64, 4),
]


@pytest.mark.parametrize("depth_cap,vocab,budget,batch", REFERENCE_CASES)
def test_matches_heap_reference(depth_cap, vocab, budget, batch):
    rng = np.random.default_rng(1000 * depth_cap + 10 * vocab + budget)
    lm = np.stack([random_log_marginals(rng, depth_cap, vocab) for _ in range(batch)])
    roots = rng.integers(0, vocab, size=batch).astype(np.int32)
    tree, scores = jax.device_get(_build_batch(lm, roots, budget))
    for b in range(batch):
        check_tree(tree.tokens[b], tree.parents[b], scores[b], tree.depth[b], tree.valid[b],
                   lm[b], budget, roots[b])
        assert_same_as_reference(tree.tokens[b], tree.parents[b], scores[b], lm[b], budget)


@pytest.mark.parametrize("depth_cap,vocab,budget", [(3, 4, 10), (5, 6, 30)])
def test_neg_inf_entries_match_reference(depth_cap, vocab, budget):
    # Random -inf tokens and whole -inf rows (nothing can be drafted at or below such a depth);
    # budgets often exceed the number of finite prefixes, so the tail must be padding.
    rng = np.random.default_rng(7 + depth_cap * vocab + budget)
    batch = 12
    lm = np.stack([
        random_log_marginals(rng, depth_cap, vocab, p_inf=0.4, p_dead_row=0.15)
        for _ in range(batch)
    ])
    lm[0, 0] = -np.inf  # nothing at depth 1: root only
    roots = np.arange(batch, dtype=np.int32) % vocab
    tree, scores = jax.device_get(_build_batch(lm, roots, budget))
    saw_padding = False
    for b in range(batch):
        check_tree(tree.tokens[b], tree.parents[b], scores[b], tree.depth[b], tree.valid[b],
                   lm[b], budget, roots[b])
        assert_same_as_reference(tree.tokens[b], tree.parents[b], scores[b], lm[b], budget)
        saw_padding |= bool((~tree.valid[b]).any())
    assert int(tree.valid[0].sum()) == 1
    assert saw_padding


def test_vmap_equals_one_by_one_and_jit_equals_eager():
    rng = np.random.default_rng(3)
    depth_cap, vocab, budget, batch = 4, 6, 24, 5
    lm = np.stack([random_log_marginals(rng, depth_cap, vocab, p_inf=0.1) for _ in range(batch)])
    roots = rng.integers(0, vocab, size=batch).astype(np.int32)
    leaves_b = jax.tree_util.tree_leaves(_build_batch(lm, roots, budget))
    for b in range(batch):
        # Eager (op by op) is slow to dispatch; once is enough to compare it with jit.
        runs = [_build_jit(lm[b], roots[b], budget)]
        if b == 0:
            runs.append(build_ddtree(lm[b], roots[b], budget))
        for one in runs:
            for x, y in zip(jax.tree_util.tree_leaves(one), leaves_b):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y)[b])


def test_bf16_input_scores_in_float32():
    # bf16 -> f32 is exact, so a bf16 input must build exactly the tree of its f32 upcast, with
    # float32 scores (summing in bf16 would round the scores to ~3 significant digits).
    rng = np.random.default_rng(11)
    lm = random_log_marginals(rng, 4, 50, scale=3.0)
    lm_bf16 = jnp.asarray(lm, jnp.bfloat16)
    tree16, scores16 = _build_jit(lm_bf16, 3, 24)
    tree32, scores32 = _build_jit(lm_bf16.astype(jnp.float32), 3, 24)
    assert scores16.dtype == jnp.float32
    for x, y in zip(jax.tree_util.tree_leaves((tree16, scores16)),
                    jax.tree_util.tree_leaves((tree32, scores32))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    lm_up = np.asarray(lm_bf16.astype(jnp.float32))
    check_tree(tree16.tokens, tree16.parents, scores16, tree16.depth, tree16.valid, lm_up, 24, 3)
    assert_same_as_reference(tree16.tokens, tree16.parents, scores16, lm_up, 24)


def test_ties_prefer_shallower_and_stay_prefix_closed():
    # Uniform marginals: every prefix of depth d scores -d log V, so ties are everywhere. The set
    # must still be prefix-closed and breadth-first: all depth-1 nodes before any depth-2 node.
    vocab, depth_cap, budget = 3, 4, 20
    lm = np.full((depth_cap, vocab), -np.log(vocab), np.float32)
    tree, scores = _build_jit(lm, 0, budget)
    check_tree(tree.tokens, tree.parents, scores, tree.depth, tree.valid, lm, budget, 0)
    np.testing.assert_array_equal(np.asarray(tree.depth[1:]), [1] * 3 + [2] * 9 + [3] * 8)
    # Probability-one tokens (log q = 0) tie a child with its parent: the parent comes first and
    # the whole chain of zeros is taken before anything of lower score.
    lm = np.array([[0.0, -np.inf, -np.inf],
                   [-np.inf, 0.0, -np.inf],
                   [-0.5, -1.0, -np.inf]], np.float32)
    tree, scores = _build_jit(lm, 2, 4)
    check_tree(tree.tokens, tree.parents, scores, tree.depth, tree.valid, lm, 4, 2)
    np.testing.assert_array_equal(np.asarray(tree.tokens), [2, 0, 1, 0, 1])
    np.testing.assert_array_equal(np.asarray(tree.parents), [-1, 0, 1, 2, 2])
    np.testing.assert_array_equal(np.asarray(scores), np.array([0, 0, 0, -0.5, -1.0], np.float32))


def test_degenerate_inputs_give_root_only():
    for lm, budget in [(np.zeros((3, 4), np.float32), 0),
                       (np.zeros((0, 4), np.float32), 5),
                       (np.full((3, 4), -np.inf, np.float32), 5),
                       (np.zeros((3, 0), np.float32), 5)]:  # V = 0: no token to draft
        tree, scores = _build_jit(lm, 9, budget)
        assert tree.num_nodes == budget + 1
        np.testing.assert_array_equal(np.asarray(tree.valid), [True] + [False] * budget)
        np.testing.assert_array_equal(np.asarray(tree.tokens), [9] + [0] * budget)
        np.testing.assert_array_equal(np.asarray(scores), [0.0] + [-np.inf] * budget)
    with pytest.raises(ValueError, match="budget"):
        build_ddtree(np.zeros((2, 3), np.float32), 0, -1)
    with pytest.raises(ValueError, match="budget"):  # a bool is an int to Python, not a budget
        build_ddtree(np.zeros((2, 3), np.float32), 0, True)
    with pytest.raises(ValueError, match="root_token must be a scalar"):  # a batch of roots: vmap instead
        build_ddtree(np.zeros((2, 3), np.float32), np.array([0, 1]), 4)
    with pytest.raises(ValueError, match=r"\[G, V\]"):
        build_ddtree(np.zeros((2, 2, 3), np.float32), 0, 4)
    with pytest.raises(ValueError, match="floating"):
        build_ddtree(np.zeros((2, 3), np.int32), 0, 4)


def test_eager_build_refuses_what_is_not_a_log_probability():
    """Raw logits (> 0), NaN or +inf let a child outscore its parent: the build came out root-only
    (or lost its deeper nodes) with finite scores on padding slots, and no error. Eager calls on
    concrete arrays name the entry; under jit, padding still scores -inf."""
    lm = np.log(np.array([[0.5, 0.3, 0.2], [0.6, 0.3, 0.1]], np.float32))
    for (d, v), value in (((0, 1), np.nan), ((1, 0), np.inf), ((0, 2), 0.5)):
        bad = lm.copy()
        bad[d, v] = value
        with pytest.raises(ValueError, match=rf"log_marginals must be log-probabilities.*depth {d + 1}, token {v}"):
            build_ddtree(bad, 0, 5)
    raw = np.array([[1.0, 2.0, 0.5], [3.0, 0.1, 0.2]], np.float32)  # logits, not log_softmax
    with pytest.raises(ValueError, match="log_softmax"):
        build_ddtree(raw, 0, 5)
    tree, scores = _build_jit(raw, 0, 5)
    assert np.all(np.isneginf(np.asarray(scores)[~np.asarray(tree.valid)]))
    build_ddtree(np.full((2, 3), -np.inf, np.float32), 0, 5)  # every token ruled out is well formed


def test_build_from_top_gives_budget_plus_one_slots_whatever_the_shapes():
    """`build_ddtree_from_top` with no depth (G = 0) returned a 1-slot tree instead of budget + 1,
    and budget 0 failed inside NumPy; both are root-only trees of budget + 1 slots, like `build_ddtree`."""
    for depth_cap, k, budget in ((0, 3, 3), (2, 0, 3), (2, 2, 0)):
        tree, scores = build_ddtree_from_top(jnp.zeros((depth_cap, k)), jnp.zeros((depth_cap, k), jnp.int32), 4,
                                             budget)
        assert tree.num_nodes == budget + 1 and scores.shape == (budget + 1,)
        assert np.asarray(tree.valid).tolist() == [True] + [False] * budget
        assert np.asarray(scores).tolist() == [0.0] + [-np.inf] * budget
    with pytest.raises(ValueError, match="budget must be a static int >= 0"):
        build_ddtree_from_top(jnp.zeros((2, 2)), jnp.zeros((2, 2), jnp.int32), 0, -1)
    with pytest.raises(ValueError, match=r"\[G, k\]"):
        build_ddtree_from_top(jnp.zeros((2, 2)), jnp.zeros((2, 3), jnp.int32), 0, 4)


def test_full_size_shapes_trace():
    # The GPU configuration (B = 128 batch of V = 151,936, L = 15, budget 128) traces and keeps
    # static shapes, without allocating it on this machine.
    lm = jax.ShapeDtypeStruct((128, 15, 151_936), jnp.bfloat16)
    roots = jax.ShapeDtypeStruct((128,), jnp.int32)
    tree, scores = jax.eval_shape(jax.vmap(lambda x, r: build_ddtree(x, r, 128)), lm, roots)
    assert tree.tokens.shape == tree.parents.shape == scores.shape == (128, 129)
    assert tree.ancestors.shape == (128, 129, 129)
    assert scores.dtype == jnp.float32


# Hypothesis varies the effective depth and vocabulary inside one physical [4, 6] shape (-inf
# columns shrink the vocabulary, a -inf row caps the depth), so examples share a few compilations.
@settings(max_examples=30, deadline=None, derandomize=True)
@given(
    depth_eff=st.integers(1, 4),
    vocab_eff=st.integers(1, 6),
    budget=st.sampled_from([1, 5, 24]),
    p_inf=st.sampled_from([0.0, 0.3]),
    seed=st.integers(0, 2**31 - 1),
)
def test_tree_properties(depth_eff, vocab_eff, budget, p_inf, seed):
    rng = np.random.default_rng(seed)
    lm = random_log_marginals(rng, 4, 6, p_inf=p_inf)
    lm[:, vocab_eff:] = -np.inf
    lm[depth_eff:] = -np.inf
    root = int(rng.integers(0, vocab_eff))
    tree, scores = _build_jit(lm, root, budget)
    check_tree(tree.tokens, tree.parents, scores, tree.depth, tree.valid, lm, budget, root)
    assert_same_as_reference(tree.tokens, tree.parents, scores, lm, budget)
    assert int(np.max(np.asarray(tree.depth))) <= depth_eff


# --- context lookup: context_chain, chain_log_reach, merge_chain --------------------------------


def chain_reference(seq: list[int], length: int, size: int, orders=(5, 4, 3, 2, 1)) -> tuple[list[int], int]:
    """Host reference: the latest earlier occurrence of the longest matching suffix, continued
    periodically; ([0] * size, 0) when no suffix occurred before."""
    ctx = seq[:length]
    for n in orders:
        if length < n + 1:
            continue
        key = ctx[length - n:]
        for j in range(length - 2, n - 2, -1):
            if ctx[j - n + 1:j + 1] == key:
                period = length - 1 - j
                return [ctx[j + 1 + i % period] for i in range(size)], n
    return [0] * size, 0


_chain_jit = jax.jit(context_chain, static_argnums=2)


def test_context_chain_examples():
    seq = jnp.array([5, 1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 0, 0, 0])
    # "1 2" last ended at slot 6 (no earlier "7 1 2"): 3 7 1 2 followed it, a period of 4.
    chain, order = _chain_jit(seq, 11, 6)
    assert chain.tolist() == [3, 7, 1, 2, 3, 7] and int(order) == 2
    chain, order = _chain_jit(jnp.array([4, 4, 4, 4, 0]), 4, 3)  # a loop of period 1
    assert chain.tolist() == [4, 4, 4] and int(order) == 3
    chain, order = _chain_jit(jnp.array([1, 2, 3, 9]), 3, 3)  # nothing repeats; slot 3 is beyond the context
    assert chain.tolist() == [0, 0, 0] and int(order) == 0
    chain, order = _chain_jit(jnp.array([8, 0, 0]), 1, 2)  # the root alone
    assert int(order) == 0
    with pytest.raises(ValueError, match="size must be a static int >= 1"):
        context_chain(seq, 11, 0)
    with pytest.raises(ValueError, match="longest first"):
        context_chain(seq, 11, 2, (1, 2))


def test_context_chain_matches_reference_on_random_texts():
    rng = np.random.default_rng(0)
    batch = jax.jit(jax.vmap(context_chain, in_axes=(0, 0, None)), static_argnums=2)
    for vocab in (2, 3, 6, 40):
        seqs = rng.integers(0, vocab, size=(64, 24))
        lengths = rng.integers(1, 25, size=64)
        chains, orders = batch(jnp.asarray(seqs), jnp.asarray(lengths), 7)
        for s, n, c, o in zip(seqs.tolist(), lengths.tolist(), np.asarray(chains).tolist(), np.asarray(orders)):
            assert (c, int(o)) == chain_reference(s, n, 7), (s, n)


def test_chain_log_reach_follows_the_survival_table():
    got = np.exp(np.asarray(chain_log_reach(jnp.int32(3), 10)))
    table = LOOKUP_SURVIVAL[2]
    np.testing.assert_allclose(got[:8], table, rtol=1e-6)
    ratio = table[-1] / table[-2]
    np.testing.assert_allclose(got[8:], [table[-1] * ratio, table[-1] * ratio ** 2], rtol=1e-5)
    assert np.all(np.diff(got) <= 0)
    assert np.all(np.isneginf(np.asarray(chain_log_reach(jnp.int32(0), 4))))


def test_a_custom_survival_table_is_read_and_normalised():
    table = [[0.5, 0.25, 0.125]] + [[0.9, 0.8, 0.7]] * 4  # lists, as a user might write them
    assert check_survival(table) == tuple(tuple(r) for r in table)
    got = np.exp(np.asarray(chain_log_reach(jnp.int32(1), 4, table)))
    np.testing.assert_allclose(got, [0.5, 0.25, 0.125, 0.0625], rtol=1e-6)  # continued at ratio 1/2
    got5 = np.exp(np.asarray(chain_log_reach(jnp.int32(7), 2, table)))  # orders above 5 read row 5
    np.testing.assert_allclose(got5, [0.9, 0.8], rtol=1e-6)
    assert check_survival(LOOKUP_SURVIVAL) == LOOKUP_SURVIVAL
    # The last row is order 5's own, not order 4's; longer matches read it too.
    for order in (5, 9):
        np.testing.assert_allclose(np.exp(np.asarray(chain_log_reach(jnp.int32(order), 8))), LOOKUP_SURVIVAL[4],
                                   rtol=1e-6)


def test_check_survival_refuses_tables_that_break_the_reach_laws():
    good = [[0.5, 0.25]] * 5
    check_survival(good)
    for table, match in [([[0.5]] * 5, r"5 x D table"),  # one depth: no ratio to continue a chain with
                         ([[0.5, 0.25]] * 4, r"5 x D table"),  # a row per match order 1..5
                         (good[:4] + [[0.5, 0.0]], r"probabilities in \(0, 1\]"),  # log 0: a -inf inside a chain
                         (good[:4] + [[1.5, 0.5]], r"probabilities in \(0, 1\]"),
                         (good[:4] + [[0.5, 0.6]], "must not grow with depth")]:  # merge_chain needs non-increasing
        with pytest.raises(ValueError, match=match):
            check_survival(table)


def _paths(tokens, parents) -> dict[tuple[int, ...], int]:
    """{token path from the root: node} of a tree's real nodes (the root: the empty path)."""
    out, path = {(): 0}, {0: ()}
    for i in range(1, len(tokens)):
        if parents[i] >= 0:
            path[i] = path[parents[i]] + (tokens[i],)
            out[path[i]] = i
    return out


def merge_reference(tokens, parents, scores, chain, chain_scores) -> set[tuple[int, ...]]:
    """Host reference: the N - 1 best-scoring non-root paths of the union of the tree's paths and
    the chain's prefixes (a shared path scores the larger estimate; ties to the shorter path)."""
    cand = {}
    for p, i in _paths(tokens, parents).items():
        if p:
            cand[p] = scores[i]
    for d in range(1, len(chain) + 1):
        if np.isfinite(chain_scores[d - 1]):
            p = tuple(chain[:d])
            cand[p] = max(cand.get(p, -np.inf), chain_scores[d - 1])
    ranked = sorted((p for p in cand if np.isfinite(cand[p])), key=lambda p: (-cand[p], len(p)))
    return set(ranked[: len(tokens) - 1])


@pytest.mark.parametrize("budget,vocab,depth_cap,size", [(8, 6, 5, 8), (4, 3, 6, 6), (16, 20, 7, 5), (3, 5, 3, 9)])
def test_merge_chain_keeps_the_best_nodes_of_the_union(budget, vocab, depth_cap, size):
    rng = np.random.default_rng(budget * 100 + vocab)
    merge = jax.jit(merge_chain)
    for trial in range(12):
        lm = np.log(rng.dirichlet(np.full(vocab, 0.3), size=depth_cap)).astype(np.float32)
        tree, scores = _build_jit(jnp.asarray(lm), jnp.int32(0), budget)
        tokens, parents = np.asarray(tree.tokens).tolist(), np.asarray(tree.parents).tolist()
        # Chains that share a prefix with the tree half of the time.
        chain = list(rng.integers(0, vocab, size=size))
        if trial % 2 and budget >= 1:
            node = int(rng.integers(1, budget + 1))
            prefix = [p for p, i in _paths(tokens, parents).items() if i == node][0]
            chain = (list(prefix) + chain)[:size]
        order = int(rng.integers(0, 6))
        cs = np.asarray(chain_log_reach(jnp.int32(order), size))
        merged = merge(tree, scores, jnp.asarray(chain, jnp.int32), jnp.asarray(cs))
        mt, mp = np.asarray(merged.tokens), np.asarray(merged.parents)
        validate_tree(mt, mp)  # parents first, distinct siblings
        got = set(_paths(mt.tolist(), mp.tolist())) - {()}
        want = merge_reference(tokens, parents, np.asarray(scores).tolist(), chain, cs.tolist())
        if len(want) == budget:  # no ties at the cut decide membership (random float scores)
            assert got == want, (trial, order)
        if order == 0:  # nothing proposed: the tree itself
            assert mt.tolist() == tokens and mp.tolist() == parents


def test_merge_chain_with_a_confident_chain_holds_the_whole_chain():
    lm = np.log(np.full((4, 5), 0.2, np.float32))  # a flat drafter: every node scores below 0.2 ** d
    tree, scores = _build_jit(jnp.asarray(lm), jnp.int32(0), 6)
    chain = jnp.asarray([3, 3, 1, 4], jnp.int32)
    merged = merge_chain(tree, scores, chain, chain_log_reach(jnp.int32(5), 4))
    paths = _paths(np.asarray(merged.tokens).tolist(), np.asarray(merged.parents).tolist())
    assert all(tuple(chain[:d].tolist()) in paths for d in range(1, 5))
    assert int(merged.size) == 7  # the root and 6 nodes: the chain took 4 of them


def test_lookup_and_merge_inputs_are_named():
    """Inputs that would give a wrong tree or chain, not an error (the gathers clamp, and a chain
    score that grows with depth breaks the merge's prefix-closed selection), are refused by name on
    concrete arrays. Under jit only shapes and dtypes are read, as the decoder calls them."""
    seq = jnp.array([5, 1, 2, 3, 9, 1, 2])
    table = ngram_table(np.array([1, 2, 3, 1, 2, 3]), np.array([0, 6]), np.array([0]), orders=(2,), min_count=1)
    for call in (lambda s, n: context_chain(s, n, 3), lambda s, n: corpus_chain(s, n, 3, table)):
        with pytest.raises(ValueError, match=r"seq must be one row.*shape \(0,\)"):
            call(jnp.zeros((0,), jnp.int32), 1)
        with pytest.raises(ValueError, match=r"seq must be one row.*\(2, 7\)"):
            call(jnp.stack([seq, seq]), 7)  # a batch: vmap over rows instead
        with pytest.raises(TypeError, match="integer token ids"):
            call(seq.astype(jnp.float32), 7)
        for length in (0, 8, 2.5):
            with pytest.raises(ValueError, match=r"length must be an int in \[1, 7\]"):
                call(seq, length)
    with pytest.raises(ValueError, match="distinct"):
        context_chain(seq, 7, 3, (2, 2))
    with pytest.raises(ValueError, match=">= 1"):  # order 0 would match every slot
        context_chain(seq, 7, 3, (2, 0))
    for got, want in ((context_chain(seq.tolist(), 7, 3), context_chain(seq, 7, 3)),  # a list is one row too
                      (corpus_chain(seq.tolist(), 7, 3, table), corpus_chain(seq, 7, 3, table))):
        assert [np.asarray(g).tolist() for g in got] == [np.asarray(w).tolist() for w in want]
    with pytest.raises(TypeError, match="NgramTable"):
        corpus_chain(seq, 7, 3, {"orders": (2,)})
    lm = np.log(np.full((3, 5), 0.2, np.float32))
    tree, scores = _build_jit(jnp.asarray(lm), jnp.int32(0), 4)
    chain, reach = jnp.asarray([3, 1], jnp.int32), jnp.asarray([-0.5, -1.0])
    merge_chain(tree, scores, chain, reach)  # well formed
    cases = [((tree, scores, chain[:0], reach[:0]), ValueError, r"chain must be one row of token ids \[M\], M >= 1"),
             ((tree, scores, chain, reach[:1]), ValueError, "chain_scores must have the chain's shape"),
             ((tree, scores[:2], chain, reach), ValueError, r"scores must have shape \[N\] = \[5\]"),
             ((tree, scores, chain.astype(jnp.float32), reach), TypeError, "integer token ids"),
             ((tree, scores, chain, reach[::-1]), ValueError, "must not grow along the chain"),
             ((tree, scores, chain, reach.at[0].set(jnp.nan)), ValueError, "chain_scores must be log estimates"),
             ((tree, scores.at[1].set(jnp.inf), chain, reach), ValueError, "scores must be log estimates"),
             ((tree.tokens, scores, chain, reach), TypeError, "tree must be a DraftTree"),
             ((jax.tree.map(lambda x: x[None], tree), scores, chain, reach), ValueError, r"one tree of \[N\] slots")]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            merge_chain(*args)
    # A chain that stops (-inf from some depth on) is well formed.
    merge_chain(tree, scores, chain, jnp.asarray([-0.5, -jnp.inf]))
    # Under jit only shapes are read (no host sync): traced values pass unchecked, as documented.
    jax.jit(merge_chain)(tree, scores, chain, reach[::-1])
    jax.jit(context_chain, static_argnums=2)(seq, 99, 3)


def test_merge_chain_scores_let_a_second_chain_merge():
    """`with_scores` returns each kept node's merged estimate (0 at the root, -inf for padding), so
    merging a second chain into the result keeps the best nodes of the tree and both chains."""
    rng = np.random.default_rng(7)
    merge = jax.jit(lambda *a: merge_chain(*a, with_scores=True))
    budget, vocab, size = 8, 5, 6
    for trial in range(12):
        lm = np.log(rng.dirichlet(np.full(vocab, 0.3), size=5)).astype(np.float32)
        tree, scores = _build_jit(jnp.asarray(lm), jnp.int32(0), budget)
        tokens, parents = np.asarray(tree.tokens).tolist(), np.asarray(tree.parents).tolist()
        chains = [list(rng.integers(0, vocab, size=size)) for _ in range(2)]
        chains[1][:2] = chains[0][:2] if trial % 2 else chains[1][:2]  # half the time the chains share a prefix
        reach = [np.cumsum(np.log(rng.uniform(0.3, 1.0, size))).astype(np.float32) for _ in range(2)]
        once, once_scores = merge(tree, scores, jnp.asarray(chains[0], jnp.int32), jnp.asarray(reach[0]))
        twice, _ = merge(once, once_scores, jnp.asarray(chains[1], jnp.int32), jnp.asarray(reach[1]))
        mt, mp = np.asarray(twice.tokens), np.asarray(twice.parents)
        validate_tree(mt, mp)
        # The reference: every path of the tree and prefix of either chain, each at its best estimate.
        cand = {p: float(np.asarray(scores)[i]) for p, i in _paths(tokens, parents).items() if p}
        for chain, r in zip(chains, reach):
            for d in range(1, size + 1):
                cand[tuple(chain[:d])] = max(cand.get(tuple(chain[:d]), -np.inf), float(r[d - 1]))
        ranked = sorted(cand, key=lambda p: (-cand[p], len(p)))
        if abs(cand[ranked[budget - 1]] - cand[ranked[budget]]) > TOL:  # no near-tie at the cut
            assert set(_paths(mt.tolist(), mp.tolist())) - {()} == set(ranked[:budget]), trial
        got = np.asarray(once_scores)
        once_paths = _paths(np.asarray(once.tokens).tolist(), np.asarray(once.parents).tolist())
        assert got[0] == 0 and np.all(np.isneginf(got[~np.asarray(once.valid)]))
        for p, i in once_paths.items():  # each kept node carries its best estimate from tree and chain 0
            if p:
                want = max([float(np.asarray(scores)[j]) for q, j in _paths(tokens, parents).items() if q == p]
                           + [float(reach[0][len(p) - 1])] * (tuple(chains[0][:len(p)]) == p))
                assert abs(got[i] - want) < TOL, (trial, p)


def test_merge_chain_leaves_padding_alone_and_reads_the_chain_only_to_its_length():
    """A padded tree (few finite prefixes) merged with a chain that stops: exactly the finite candidates
    become nodes, whatever the padding slots' scores say (the tree's valid mask decides); a chain
    estimate above 0 still leaves the root at slot 0; a tree node deeper than the chain is not on it."""
    merge = functools.partial(merge_chain, with_scores=True)
    inf = np.inf
    # 4 finite prefixes (0, 1, 0 0, 1 0) for 6 slots: 2 padding.
    lm = np.array([[np.log(0.6), np.log(0.4), -inf], [np.log(0.9), -inf, -inf], [-inf] * 3], np.float32)
    tree, scores = _build_jit(jnp.asarray(lm), jnp.int32(1), 6)
    chain = jnp.asarray([2, 1], jnp.int32)
    for padding_score in (-np.inf, 0.0):
        s = jnp.where(tree.valid, scores, padding_score)
        mt, ms = merge(tree, s, chain, jnp.asarray([-0.1, -jnp.inf]))
        tokens, parents = np.asarray(mt.tokens).tolist(), np.asarray(mt.parents).tolist()
        validate_tree(tokens, parents)
        assert set(_paths(tokens, parents)) == {(), (0,), (1,), (0, 0), (1, 0), (2,)}, padding_score
        assert np.asarray(mt.valid).tolist() == [True] * 6 + [False]
        assert ms[0] == 0 and np.isneginf(ms[6]) and tokens[6] == 0 and parents[6] == -1
    mt, _ = merge(tree, scores, chain, jnp.asarray([0.5, 0.25]))  # log estimates above 0: still below the root
    tokens, parents = np.asarray(mt.tokens).tolist(), np.asarray(mt.parents).tolist()
    validate_tree(tokens, parents)
    assert tokens[0] == 1 and parents[0] == -1 and {(2,), (2, 1)} <= set(_paths(tokens, parents))
    # Token 1 everywhere: the tree holds 1, 1 1 and 1 1 1. The chain [1, 1] covers the first two; the
    # depth-3 node keeps its own score (a chain of 2 says nothing about depth 3).
    lm = np.log(np.full((3, 3), [0.1, 0.8, 0.1], np.float32))
    tree, scores = _build_jit(jnp.asarray(lm), jnp.int32(0), 6)
    mt, ms = merge(tree, scores, jnp.asarray([1, 1], jnp.int32), jnp.asarray([-0.01, -0.02]))
    before = {p: float(scores[i]) for p, i in _paths(np.asarray(tree.tokens).tolist(),
                                                      np.asarray(tree.parents).tolist()).items()}
    after = {p: float(ms[i]) for p, i in _paths(np.asarray(mt.tokens).tolist(),
                                                 np.asarray(mt.parents).tolist()).items()}
    np.testing.assert_allclose([after[(1,)], after[(1, 1)]], [-0.01, -0.02], rtol=1e-6)
    assert after[(1, 1, 1)] == before[(1, 1, 1)] < -0.5


def ngram_reference(texts, starts, orders, min_count):
    """{order: {n-gram: (most frequent next token, its count, total)}} by counting, ties to the
    smallest token."""
    out = {}
    for n in orders:
        counts = {}
        for text, start in zip(texts, starts):
            for i in range(max(start, 1, n), len(text)):
                gram = tuple(text[i - n:i])
                counts.setdefault(gram, {}).setdefault(text[i], 0)
                counts[gram][text[i]] += 1
        table = {}
        for gram, nxt in counts.items():
            total = sum(nxt.values())
            if total >= min_count:
                token = min(nxt, key=lambda t: (-nxt[t], t))
                table[gram] = (token, nxt[token], total)
        out[n] = table
    return out


def corpus_chain_reference(ref, ctx, size, calibration=NGRAM_CALIBRATION):
    alpha, beta = calibration
    ctx, chain, scores, score = list(ctx), [], [], 0.0
    for _ in range(size):
        hit = None
        for n in sorted(ref, reverse=True):
            if len(ctx) >= n and tuple(ctx[-n:]) in ref[n]:
                hit = ref[n][tuple(ctx[-n:])]
                break
        if hit is None:
            break
        token, count, total = hit
        score += math.log(alpha * (count / total) ** beta)
        chain.append(token)
        scores.append(score)
        ctx.append(token)
    return chain + [0] * (size - len(chain)), scores + [-math.inf] * (size - len(scores))


def test_ngram_table_and_corpus_chain_match_counting():
    rng = np.random.default_rng(3)
    # Texts with shared phrases, so that orders of every length match and counts exceed 1.
    phrases = [list(rng.integers(0, 9, size=int(rng.integers(2, 7)))) for _ in range(6)]
    texts = [sum((phrases[int(i)] for i in rng.integers(0, 6, size=8)), []) for _ in range(30)]
    starts = [int(rng.integers(0, 6)) for _ in texts]
    offsets = np.cumsum([0] + [len(t) for t in texts])
    orders = (4, 3, 2)
    table = ngram_table(np.concatenate(texts), offsets, np.asarray(starts), orders=orders, min_count=2)
    ref = ngram_reference(texts, starts, orders, 2)
    assert table.num_entries == sum(len(r) for r in ref.values())
    chains = jax.jit(jax.vmap(corpus_chain, in_axes=(None, 0, None, None)), static_argnums=2)
    for text in texts[:10] + [list(rng.integers(0, 9, size=20))]:
        lengths = np.arange(1, len(text) + 1)
        got_chain, got_scores = chains(jnp.asarray(text, jnp.int32), jnp.asarray(lengths, jnp.int32), 5, table)
        for n, c, sc in zip(lengths, np.asarray(got_chain), np.asarray(got_scores)):
            want_chain, want_scores = corpus_chain_reference(ref, text[:n], 5)
            assert c.tolist() == want_chain, (text[:n], c)
            np.testing.assert_allclose(sc, want_scores, rtol=1e-5)
            assert np.all(np.diff(sc[np.isfinite(sc)]) <= 0)


def test_ngram_table_rejects_bad_input():
    tokens, offsets, starts = np.arange(10), np.array([0, 4, 10]), np.array([1, 1])
    cases = [((tokens, offsets, np.array([1])), {}, "starts"),
             ((tokens, np.array([0, 4, 9]), starts), {}, "offsets must rise from 0 to len"),
             ((tokens, np.array([0, 6, 4, 10]), np.array([0, 0, 0])), {}, "offsets must rise"),
             ((tokens - 5, offsets, starts), {}, r"token ids must be in \[0"),
             ((tokens, offsets, starts), {"orders": (2, 3)}, "longest first"),
             ((tokens, offsets, starts), {"min_count": 0}, "min_count must be >= 1"),
             ((tokens, offsets, starts), {"calibration": (1.5, 1.0)}, "calibration"),
             ((tokens, offsets, starts), {"calibration": (0.5, 0.0)}, "calibration"),  # beta <= 0: p ** beta >= 1
             ((tokens, offsets, starts), {"orders": (2, 0)}, ">= 1"),
             ((tokens + 2 ** 31 - 9, offsets, starts), {}, r"token ids must be in \[0, 2\*\*31\)"),
             ((tokens + 0.5, offsets, starts), {}, "tokens must be integers, got dtype float64"),  # was truncated
             ((tokens, offsets.astype(float), starts), {}, "offsets must be integers")]
    for args, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            ngram_table(*args, **kw)
    with pytest.raises(ValueError, match="size must be a static int >= 1"):
        corpus_chain(jnp.arange(4), 3, 0, ngram_table(tokens, offsets, starts))


def test_corpus_chain_on_an_empty_table_and_at_hash_edges():
    """No n-gram kept: an empty chain. A window that reaches before the context (its missing tokens
    hash as 0) never matches, though its hash equals a real n-gram's; a context whose hash is the
    padding key falls through to a shorter order instead of stopping on the padding."""
    from tevjax.builder import _NGRAM_MUL as mul, _hash_np

    wrap = 2 ** 32  # the table's polynomial hash in uint32, tokens hashed as id + 1

    def hash_of(gram):
        return int(_hash_np(np.asarray(gram), len(gram))[0])

    empty = ngram_table(np.array([1, 2, 1, 3]), np.array([0, 4]), np.array([0]), orders=(2,), min_count=5)
    assert empty.num_entries == 0
    chain, scores = corpus_chain(jnp.array([1, 2]), 2, 3, empty)
    assert np.asarray(chain).tolist() == [0, 0, 0] and np.all(np.isneginf(np.asarray(scores)))
    # [0, 0, z] hashes like [5, 7], so the order-3 window [none, 5, 7] has the key of a real 3-gram.
    z = (hash_of([5, 7]) - hash_of([0, 0]) * mul - 1) % wrap
    assert z < 2 ** 31 and hash_of([0, 0, z]) == hash_of([5, 7])
    table = ngram_table(np.array([0, 0, z, 4]), np.array([0, 4]), np.array([0]), orders=(3, 2), min_count=1)
    chain, scores = corpus_chain(jnp.array([5, 7]), 2, 2, table)
    assert np.asarray(chain).tolist() == [0, 0] and np.all(np.isneginf(np.asarray(scores)))
    assert np.asarray(corpus_chain(jnp.array([0, 0, z]), 3, 1, table)[0]).tolist() == [4]
    # [2147, b] hashes to the padding key 0xFFFFFFFF; the order-2 row is padded (1 entry, order 1 has 2).
    b = (wrap - 1 - 2148 * mul) % wrap - 1
    assert b < 2 ** 31 and hash_of([2147, b]) == wrap - 1
    table = ngram_table(np.array([3, b, 9]), np.array([0, 3]), np.array([0]), orders=(2, 1), min_count=1)
    chain, scores = corpus_chain(jnp.array([2147, b]), 2, 1, table)
    assert np.asarray(chain).tolist() == [9] and np.isfinite(np.asarray(scores)).all()
