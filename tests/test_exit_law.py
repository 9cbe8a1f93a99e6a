"""The canonical exit law against brute-force enumeration and its structural identities."""

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np
import pytest
import zlib
from hypothesis import given, settings, strategies as st

from tevjax.law import exit_law, law_from_edges
from tevjax.tree import DraftTree
from treegen import (
    assign_tokens,
    brute_force_law,
    chain,
    exact_joint,
    insert_padding,
    random_parents,
    softmax,
    star,
)

TOL = 2e-6


@jax.jit(static_argnums=3)
def _law(tokens, parents, logits, temperature):
    return exit_law(DraftTree.from_parents(tokens, parents), logits, temperature)


def _law_np(tokens, parents, logits, temperature):
    return jax.tree.map(np.asarray, _law(tokens, parents, logits, float(temperature)))


@pytest.mark.parametrize("shape", ["chain", "star", "random", "deep"])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 0.0])
def test_matches_brute_force_enumeration(shape, temperature):
    rng = np.random.default_rng(zlib.crc32(repr((shape, temperature)).encode()))  # stable across processes
    vocab = 3
    n = {"chain": 4, "star": 4, "random": 6, "deep": 6}[shape]
    parents = {
        "chain": lambda: chain(n),
        "star": lambda: star(n),
        "random": lambda: random_parents(n, rng, max_children=vocab),
        "deep": lambda: random_parents(n, rng, max_children=2, bias=4.0),
    }[shape]()
    tokens = assign_tokens(parents, vocab, rng)
    logits = rng.normal(size=(n, vocab)).astype(np.float32) * 1.5
    joint, reach, rho = brute_force_law(tokens, parents, logits, temperature)
    law = _law_np(tokens, parents, logits, temperature)
    np.testing.assert_allclose(law.prefix_prob, reach, atol=TOL)
    np.testing.assert_allclose(law.exit_prob, joint.sum(axis=1), atol=TOL)
    mask = reach > 1e-9
    np.testing.assert_allclose(law.local_exit[mask], rho[mask], atol=1e-5)
    depth = np.asarray(DraftTree.from_parents(tokens, parents).depth)
    np.testing.assert_allclose(law.coverage, (joint.sum(axis=1) * depth).sum(), atol=TOL)


def _random_case(rng, n, vocab, pad=0):
    parents = random_parents(n, rng, max_children=min(vocab, 4), bias=rng.uniform(0, 4))
    tokens = assign_tokens(parents, vocab, rng, root_token=int(rng.integers(vocab)))
    logits = rng.normal(size=(n, vocab)).astype(np.float32) * 2.0
    return tokens, parents, logits


N_MAX, V_MAX = 24, 9


@settings(max_examples=60, deadline=None, derandomize=True)
@given(n=st.integers(1, N_MAX), vocab=st.integers(2, V_MAX), seed=st.integers(0, 2**31 - 1))
def test_identities_hold_on_random_trees(n, vocab, seed):
    rng = np.random.default_rng(seed)
    tokens, parents, logits = _random_case(rng, n, vocab)
    # One static shape for every example (one compile): trailing padding slots, and tokens beyond
    # the drawn vocabulary at -inf, which gives them probability 0 and so changes nothing.
    tokens = np.pad(tokens, (0, N_MAX - n))
    parents = np.pad(parents, (0, N_MAX - n), constant_values=-1)
    logits = np.pad(logits, ((0, N_MAX - n), (0, V_MAX - vocab)), constant_values=-np.inf)
    law = _law_np(tokens, parents, logits, 1.0)
    tree = DraftTree.from_parents(tokens, parents)
    depth = np.asarray(tree.depth)
    anc = np.asarray(tree.ancestors)
    assert np.all(law.exit_prob >= 0) and np.all(law.local_exit >= 0)
    np.testing.assert_allclose(law.exit_prob.sum(), 1.0, atol=1e-5)
    # C_p = sum_{v != r} P(v) = sum_v w(v) depth(v)   (paper Eq. 6)
    np.testing.assert_allclose(law.coverage, law.prefix_prob[1:].sum(), atol=1e-5)
    np.testing.assert_allclose(law.coverage, (law.exit_prob * depth).sum(), atol=1e-5)
    # P(u) = sum of w over the subtree of u (probability conservation, paper Eq. 26)
    np.testing.assert_allclose(law.prefix_prob, (anc * law.exit_prob[:, None]).sum(axis=0), atol=1e-5)
    # closed form of the joint law
    np.testing.assert_allclose(
        law.exit_prob, exact_joint(tokens, parents, np.nan_to_num(logits, neginf=-1e30), 1.0).sum(1), atol=1e-5
    )


def test_padding_is_invisible():
    rng = np.random.default_rng(7)
    tokens, parents, logits = _random_case(rng, 10, 6)
    law = _law_np(tokens, parents, logits, 0.8)
    p_par, p_tok, new_index = insert_padding(parents, tokens, [1, 4, 4, 9, 10, 10])
    p_logits = np.full((len(p_par), 6), np.nan, np.float32)  # padding rows may hold anything
    p_logits[new_index] = logits
    padded = _law_np(p_tok, p_par, p_logits, 0.8)
    for field in ("prefix_prob", "local_exit", "exit_prob"):
        got = getattr(padded, field)
        np.testing.assert_allclose(got[new_index], getattr(law, field), atol=1e-7)
        pad = np.setdiff1d(np.arange(len(p_par)), new_index)
        assert np.all(got[pad] == 0.0)
    np.testing.assert_allclose(padded.coverage, law.coverage, atol=1e-7)
    assert not np.isnan(padded.exit_prob).any()


def test_minus_inf_logits_give_zero_probability_and_no_nan():
    tokens = np.array([0, 1, 2, 3], np.int32)
    parents = np.array([-1, 0, 0, 1], np.int32)
    logits = np.array(
        [[0.0, -np.inf, 1.0, 0.5], [-np.inf, -np.inf, 2.0, -np.inf], [0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, 4.0]],
        np.float32,
    )
    law = _law_np(tokens, parents, logits, 1.0)
    assert not np.isnan(law.exit_prob).any()
    assert law.prefix_prob[1] == 0.0 and law.prefix_prob[3] == 0.0  # token 1 has -inf at the root
    p_root = softmax(logits[0])
    np.testing.assert_allclose(law.prefix_prob[2], p_root[2], rtol=1e-6)
    np.testing.assert_allclose(law.exit_prob.sum(), 1.0, atol=1e-6)


def test_children_covering_all_mass_clamp_to_zero_exit():
    vocab = 5
    parents = star(vocab + 1)
    tokens = np.arange(vocab + 1, dtype=np.int32) - 1
    tokens[0] = 0
    # Large logits make 1 - sum(child probs) round to a tiny negative or positive number.
    logits = np.tile(np.array([[30.0, 29.0, 28.0, 27.9, 27.7]], np.float32), (vocab + 1, 1))
    law = _law_np(tokens, parents, logits, 1.0)
    assert law.local_exit[0] == 0.0 or abs(law.local_exit[0]) < 1e-6
    assert law.local_exit[0] >= 0 and np.all(law.exit_prob >= 0)
    np.testing.assert_allclose(law.exit_prob.sum(), 1.0, atol=1e-5)


def test_temperature_scales_logits():
    rng = np.random.default_rng(3)
    tokens, parents, logits = _random_case(rng, 12, 7)
    hot = _law_np(tokens, parents, logits, 0.5)
    scaled = _law_np(tokens, parents, logits / 0.5, 1.0)
    np.testing.assert_allclose(hot.exit_prob, scaled.exit_prob, atol=1e-6)
    # Temperature -> 0 approaches the greedy law when every row's top-2 gap is >> the temperature
    # (here gap >= 0.3 = 300 x temperature).
    spaced = np.stack([rng.permutation(7) * 0.3 for _ in range(12)]).astype(np.float32)
    cold = _law_np(tokens, parents, spaced, 1e-3)
    greedy = _law_np(tokens, parents, spaced, 0.0)
    np.testing.assert_allclose(cold.exit_prob, greedy.exit_prob, atol=1e-6)


def test_greedy_law_is_point_mass_on_argmax_path():
    vocab = 4
    tokens = np.array([0, 2, 1, 3, 0], np.int32)
    parents = np.array([-1, 0, 0, 1, 1], np.int32)
    logits = np.zeros((5, vocab), np.float32)
    logits[0, 2] = 5  # root -> node 1 (token 2)
    logits[1, 3] = 5  # node 1 -> node 3 (token 3)
    logits[3, 1] = 5  # node 3 is a leaf
    law = _law_np(tokens, parents, logits, 0.0)
    np.testing.assert_array_equal(law.exit_prob, [0, 0, 0, 1, 0])
    np.testing.assert_array_equal(law.prefix_prob, [1, 1, 0, 1, 0])
    assert law.coverage == 2.0


def test_vmap_over_different_trees_equals_one_by_one_and_jit_equals_eager():
    rng = np.random.default_rng(11)
    cases = [_random_case(rng, 9, 6) for _ in range(5)]
    tok = np.stack([c[0] for c in cases])
    par = np.stack([c[1] for c in cases])
    lg = np.stack([c[2] for c in cases])
    temps = np.array([1.0, 0.7, 0.0, 1.3, 0.2], np.float32)

    @jax.jit
    @jax.vmap
    def batched(t, p, l, temp):
        return exit_law(DraftTree.from_parents(t, p), l, temp)

    out = batched(tok, par, lg, temps)
    for i, (t, p, l) in enumerate(cases):
        one = _law_np(t, p, l, float(temps[i]))
        eager = exit_law(DraftTree.from_parents(t, p), jnp.asarray(l), float(temps[i]))
        for ref in (one, eager):
            np.testing.assert_allclose(np.asarray(out.exit_prob[i]), np.asarray(ref.exit_prob), atol=1e-6)
            np.testing.assert_allclose(np.asarray(out.coverage[i]), np.asarray(ref.coverage), atol=1e-6)


def test_edge_stats_by_hand():
    """edge_prob[u] = p_pa(u)(x_u) at real non-root nodes and exactly 0 at the root and at padding
    (`EdgeStats`' contract, which the training objectives read directly)."""
    from tevjax.law import edge_stats

    tree = DraftTree.from_parents([2, 1, 2, 9, 0], [-1, 0, 0, -1, 1])  # node 3 is padding
    logits = np.array([[0.0, 1.0, 2.0], [3.0, 1.0, 0.0], [0.0, 0.0, 0.0], [np.nan] * 3, [1.0, 1.0, 5.0]], np.float32)
    lg = jnp.asarray(logits)
    for t in (1.0, 0.5):
        p0, p1 = softmax(logits[0] / t), softmax(logits[1] / t)
        want = [0.0, p0[1], p0[2], 0.0, p1[0]]
        for temp in (t, jnp.float32(t)):
            np.testing.assert_allclose(np.asarray(edge_stats(tree, lg, temp).edge_prob), want, rtol=1e-6)
    # Greedy: 1 exactly on the edges that take the parent's argmax.
    for temp in (0.0, jnp.float32(0.0)):
        np.testing.assert_array_equal(np.asarray(edge_stats(tree, lg, temp).edge_prob), [0, 0, 1, 0, 1])


def test_greedy_threshold_is_the_documented_1e_5():
    # The CLI help, the verify docstring and the paper's released code name 1e-5; a test that only uses
    # GREEDY_BELOW itself would follow a changed constant.
    from tevjax.law import GREEDY_BELOW, is_greedy, samples

    assert GREEDY_BELOW == 1e-5
    assert is_greedy(9.9e-6) is True and is_greedy(1e-5) is False
    assert not bool(samples(jnp.float32(9.9e-6))) and bool(samples(jnp.float32(1e-5)))


def test_is_greedy_refuses_what_is_not_a_number():
    """float() read True as 1.0 (sampling) and the string "0" as 0.0 (greedy)."""
    from tevjax.law import is_greedy

    for bad in (True, False, "0", None, 1 + 2j, np.zeros(2)):
        with pytest.raises(TypeError, match="temperature must be a"):
            is_greedy(bad)
    assert is_greedy(np.float64(0.0)) is True and is_greedy(jnp.float32(1.0)) is False
    assert jax.jit(lambda t: is_greedy(t) is None)(1.0)  # traced: decided at run time


def test_law_from_edges_reads_only_edge_entries_and_default_temperature():
    """Entries of edge_prob at the root and at padding are not edges: both propagations ignore
    them (the scan's scatter must not wrap the parent index -1 onto node N - 1, a real leaf here)."""
    tree = DraftTree.from_parents([0, 1, 2, 0, 1], [-1, 0, 0, -1, 1])  # node 3 padding, node 4 last
    edges = jnp.array([0.0, 0.5, 0.25, 0.0, 0.4])
    noisy = edges.at[0].set(0.5).at[3].set(0.3)
    for propagation in ("matrix", "scan"):
        want = law_from_edges(tree, edges, propagation)
        np.testing.assert_allclose(np.asarray(want.exit_prob), [0.25, 0.3, 0.25, 0.0, 0.2], atol=1e-7)
        got = law_from_edges(tree, noisy, propagation)
        for field in ("prefix_prob", "local_exit", "exit_prob", "coverage"):
            np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)))
    # exit_law's documented default temperature is 1.0 (sampling), not greedy.
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(5, 3)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(exit_law(tree, logits).exit_prob),
                                  np.asarray(exit_law(tree, logits, 1.0).exit_prob))
    assert float(exit_law(tree, logits).exit_prob.max()) < 1.0


# --- "scan" (level-by-level) and "matrix" (ancestor product) propagation give the same law ---

# Both multiply the same edge probabilities root-first, but XLA may associate the matrix's
# reductions differently. P and C_p: relative 1e-6 (a few float32 ulps; observed <= 2). rho = 1 - the
# children's mass cancels, so its error is absolute: 2.4e-7 = 2 ulps at 1 (observed 1), and w = P rho
# inherits it (P <= 1).
SCAN_TOL = {"prefix_prob": 0.0, "coverage": 0.0, "local_exit": 2.4e-7, "exit_prob": 2.4e-7}


@jax.jit(static_argnums=3)
def _laws_both(tokens, parents, logits, temperature):
    tree = DraftTree.from_parents(tokens, parents)
    return exit_law(tree, logits, temperature, "matrix"), exit_law(tree, logits, temperature, "scan")


def _assert_same_law(matrix, scan):
    for field, atol in SCAN_TOL.items():
        got, want = np.asarray(getattr(scan, field)), np.asarray(getattr(matrix, field))
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=atol, err_msg=field)


def _shaped_case(shape, rng, vocab=24):
    """A tree of the named shape with logits; padded rows hold NaN, neg_inf rows hold -inf entries."""
    n = {"chain": 40, "star": 20}.get(shape, 24)
    parents = {
        "chain": lambda: chain(n),
        "star": lambda: star(n),
        "deep": lambda: random_parents(n, rng, max_children=2, bias=8.0),
    }.get(shape, lambda: random_parents(n, rng, max_children=4, bias=rng.uniform(0, 4)))()
    tokens = assign_tokens(parents, vocab, rng, root_token=int(rng.integers(vocab)))
    # Boost drafted tokens so that P stays well above float32 underflow down a 40-node chain
    # and greedy paths go below the root.
    logits = rng.normal(size=(n, vocab)).astype(np.float32) * 2.0
    logits[np.maximum(parents, 0)[1:], tokens[1:]] += 8.0
    if shape == "neg_inf":
        # -inf on a third of the entries, drafted tokens included (zero-probability edges).
        logits[rng.random(logits.shape) < 0.33] = -np.inf
        logits[:, 0] = np.maximum(logits[:, 0], 0.0)  # every row keeps a finite entry
    logits[0, tokens[1]] = logits[0].max() + 1.0  # node 1 is the root's top token: C_p >= P(1) > 0
    if shape == "padded":
        parents, tokens, new_index = insert_padding(parents, tokens, [1, 5, 5, 12, n, n])
        padded = np.full((len(parents), vocab), np.nan, np.float32)
        padded[new_index] = logits
        logits = padded
    return tokens, parents, logits


SCAN_SHAPES = ("random", "padded", "chain", "star", "deep", "neg_inf")


@pytest.mark.parametrize("shape", SCAN_SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 0.6, 0.0])
def test_scan_propagation_equals_matrix(shape, temperature):
    # A seed from the parameters' positions: hash() of a str changes from one process to the next.
    rng = np.random.default_rng([SCAN_SHAPES.index(shape), int(temperature * 10)])
    tokens, parents, logits = _shaped_case(shape, rng)
    matrix, scan = _laws_both(tokens, parents, logits, temperature)
    _assert_same_law(matrix, scan)
    assert float(matrix.coverage) > 0.1  # a non-trivial law: mass reaches below the root
    assert not np.isnan(np.asarray(scan.exit_prob)).any()
    pad = ~np.asarray(DraftTree.from_parents(tokens, parents).valid)
    for field in ("prefix_prob", "local_exit", "exit_prob"):
        assert np.all(np.asarray(getattr(scan, field))[pad] == 0.0)


def test_scan_propagation_on_a_root_only_tree():
    # N = 1: the scan runs zero levels; w is the point mass on the root.
    root = (np.zeros(1, np.int32), np.full(1, -1, np.int32), np.zeros((1, 5), np.float32))
    matrix, scan = _laws_both(*root, 1.0)
    _assert_same_law(matrix, scan)
    np.testing.assert_array_equal(np.asarray(scan.exit_prob), [1.0])


def test_scan_propagation_equals_matrix_under_vmap_with_traced_temperatures():
    rng = np.random.default_rng(5)
    cases = [_shaped_case(shape, rng) for shape in ("random", "deep", "neg_inf", "random")]
    tok, par, lg = (np.stack([c[i] for c in cases]) for i in range(3))
    temps = np.array([1.0, 0.6, 0.0, 1.3], np.float32)

    @jax.jit
    @jax.vmap
    def batched(t, p, l, temp):
        tree = DraftTree.from_parents(t, p)
        return exit_law(tree, l, temp, "matrix"), exit_law(tree, l, temp, "scan")

    matrix, scan = batched(tok, par, lg, temps)
    _assert_same_law(matrix, scan)
    for i in range(len(cases)):
        one_matrix, one_scan = _laws_both(tok[i], par[i], lg[i], float(temps[i]))
        _assert_same_law(one_matrix, jax.tree.map(lambda x: x[i], scan))
        _assert_same_law(one_scan, jax.tree.map(lambda x: x[i], scan))


def test_verifier_entry_point_accepts_both_propagations():
    rng = np.random.default_rng(9)
    tokens, parents, logits = _shaped_case("padded", rng)
    tree = DraftTree.from_parents(tokens, parents)
    edge_prob = jnp.asarray(rng.uniform(0, 0.3, len(parents)), jnp.float32) * tree.valid * (tree.parents >= 0)
    laws = [jax.jit(law_from_edges, static_argnums=2)(tree, edge_prob, p) for p in ("matrix", "scan")]
    _assert_same_law(*laws)
    with pytest.raises(ValueError, match="propagation"):
        law_from_edges(tree, edge_prob, "ancestors")


def _square_values(jaxpr: jex.Jaxpr, n: int) -> list[tuple[str, tuple[int, ...]]]:
    """(primitive, shape) of every value computed in `jaxpr` or its sub-jaxprs with two axes of size n."""
    found = []
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            shape = tuple(getattr(var.aval, "shape", ()))
            if sum(d == n for d in shape) >= 2:
                found.append((eqn.primitive.name, shape))
        for sub in jex.jaxprs_in_params(eqn.params):
            found += _square_values(sub, n)
    return found


def test_scan_propagation_builds_no_n_by_n_intermediate():
    # N = 37 and V = 50 so that no other axis is of size N. The tree (with its [N, N] ancestor
    # mask) is an input here: only values the law computes are inspected.
    n, vocab, batch = 37, 50, 3
    rng = np.random.default_rng(2)
    parents = random_parents(n, rng, max_children=3)
    tree = DraftTree.from_parents(assign_tokens(parents, vocab, rng), parents)
    logits = jnp.asarray(rng.normal(size=(n, vocab)), jnp.float32)
    trees, lgs = jax.tree.map(lambda x: jnp.stack([x] * batch), (tree, logits))

    def squares(propagation):
        one = jax.make_jaxpr(lambda t, l, temp: exit_law(t, l, temp, propagation))(tree, logits, 0.7)
        many = jax.make_jaxpr(jax.vmap(lambda t, l, temp: exit_law(t, l, temp, propagation)))(
            trees, lgs, jnp.full(batch, 0.7)
        )
        return _square_values(one.jaxpr, n) + _square_values(many.jaxpr, n)

    assert squares("scan") == []
    assert squares("matrix")  # the check does see the ancestor product's [N, N] values
