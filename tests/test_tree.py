"""DraftTree construction and validation of untrusted trees."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tevjax.tree import DraftTree, TreeValidationError, check_tree_logits, validate_tree
from treegen import assign_tokens, random_parents


def test_docstring_example():
    tree = DraftTree.from_parents([7, 11, 12, 99, 13], [-1, 0, 0, -1, 1])
    np.testing.assert_array_equal(tree.depth, [0, 1, 1, 0, 2])
    np.testing.assert_array_equal(tree.valid, [True, True, True, False, True])
    np.testing.assert_array_equal(tree.tokens, [7, 11, 12, 0, 13])  # padding token canonicalised
    np.testing.assert_array_equal(
        tree.ancestors.astype(int),
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [0, 0, 0, 1, 0], [1, 1, 0, 0, 1]],
    )
    assert int(tree.size) == 4 and tree.num_nodes == 5 and tree.max_depth == 4


def _reference_ancestors(parents):
    n = len(parents)
    anc = np.zeros((n, n), bool)
    for i in range(n):
        j = i
        path = []
        while j >= 0:
            path.append(j)
            if j == 0:
                break
            j = int(parents[j])
        if path[-1] == 0:  # reaches the root: a real node
            anc[i, path] = True
        else:
            anc[i, i] = True
    return anc


_from_parents = jax.jit(DraftTree.from_parents)


@settings(max_examples=50, deadline=None, derandomize=True)
@given(n=st.integers(1, 40), seed=st.integers(0, 2**31 - 1), pad_frac=st.sampled_from([0.0, 0.2, 0.5]))
def test_structure_matches_reference(n, seed, pad_frac):
    rng = np.random.default_rng(seed)
    parents = random_parents(n, rng, max_children=3, bias=rng.uniform(-2, 8))
    # Turn some nodes into padding: they and their whole subtrees must come out as padding.
    parents[1:][rng.random(n - 1) < pad_frac] = -1
    tokens = assign_tokens(np.where(parents >= 0, parents, 0), 50, rng)
    tree = _from_parents(jnp.asarray(np.pad(tokens, (0, 40 - n))), jnp.asarray(np.pad(parents, (0, 40 - n), constant_values=-1)))
    ref = _reference_ancestors(np.pad(parents, (0, 40 - n), constant_values=-1))
    np.testing.assert_array_equal(np.asarray(tree.ancestors), ref)
    valid = ref[:, 0]
    np.testing.assert_array_equal(np.asarray(tree.valid), valid)
    np.testing.assert_array_equal(np.asarray(tree.depth), np.where(valid, ref.sum(1) - 1, 0))
    padded_parents = np.pad(parents, (0, 40 - n), constant_values=-1)
    expected_children = (padded_parents[None, :] == np.arange(40)[:, None]) & valid[None, :]
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda t: t.children)(tree)), expected_children)


def test_vmap_matches_single_and_chain_depth():
    for n in (65, 6, 40):  # n - 1 a power of two or not: the pointer doubling rounds suffice either way
        chain = DraftTree.from_parents(np.arange(n), np.arange(n) - 1)
        np.testing.assert_array_equal(chain.depth, np.arange(n))
        assert bool(jnp.all(chain.ancestors == jnp.tril(jnp.ones((n, n), bool))))
    # A parent that is not strictly earlier makes its node padding, even if it would reach the root.
    later = DraftTree.from_parents([5, 1, 2], [-1, 2, 0])
    assert np.asarray(later.valid).tolist() == [True, False, True]
    assert np.asarray(later.depth).tolist() == [0, 0, 1] and np.asarray(later.parents).tolist() == [-1, -1, 0]
    rng = np.random.default_rng(0)
    par = np.stack([random_parents(12, rng, 3) for _ in range(4)])
    tok = np.stack([assign_tokens(p, 20, rng) for p in par])
    batched = jax.vmap(DraftTree.from_parents)(tok, par)
    for i in range(4):
        one = DraftTree.from_parents(tok[i], par[i])
        for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(batched)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b)[i])


def test_wrong_rank_is_rejected():
    with pytest.raises(ValueError, match="1-D tokens and parents"):
        DraftTree.from_parents(np.zeros((2, 3), np.int32), np.zeros((2, 3), np.int32))


def test_float_and_bool_ids_are_refused_not_truncated():
    """jnp.asarray(x, int32) would build the tree of token 5 from 5.7 and of token 1 from True."""
    for tokens, parents, name in (([5.7, 1.2], [-1, 0], "tokens"), ([True, False], [-1, 0], "tokens"),
                                  ([5, 1], [-1.0, 0.0], "parents"), (np.array([5, 1]), np.array([-1, 0.5]), "parents")):
        with pytest.raises(TypeError, match=f"from_parents: {name} must be integers"):
            DraftTree.from_parents(tokens, parents)


def test_empty_tree_is_rejected_clearly():
    with pytest.raises(ValueError, match="needs at least the root node; got 0 nodes"):
        DraftTree.from_parents(np.zeros(0, np.int32), np.zeros(0, np.int32))
    with pytest.raises(ValueError, match="needs at least the root node"):
        jax.jit(DraftTree.from_parents)(jnp.zeros(0, jnp.int32), jnp.zeros(0, jnp.int32))


@pytest.mark.parametrize("shape, dtype, message", [
    ((4, 8), jnp.float32, r"verify: logits must have shape \[N, V\] = \[5, V\] for a tree of 5 nodes; got \(4, 8\)"),
    ((6, 8), jnp.float32, r"got \(6, 8\)"),
    ((8,), jnp.float32, r"got \(8,\)"),
    ((2, 5, 8), jnp.float32, r"got \(2, 5, 8\)"),
    ((5, 0), jnp.float32, "empty vocabulary axis"),
    ((5, 8), jnp.int32, "logits must be floating point, got dtype int32"),
])
def test_check_tree_logits_names_the_problem(shape, dtype, message):
    tree = DraftTree.from_parents([7, 11, 12, 0, 13], [-1, 0, 0, -1, 1])
    with pytest.raises(TreeValidationError, match=message):
        check_tree_logits(tree, jnp.zeros(shape, dtype), "verify")
    check_tree_logits(tree, jnp.zeros((5, 16), jnp.bfloat16), "verify")  # the right layout passes


def test_eager_calls_get_the_data_checks():
    """On concrete arrays, `verify` and `exit_law` check the data too: a token outside the
    vocabulary (the gathers would clamp it to another token's probability) and NaN / +inf logits
    are errors naming the node. Under jit the same calls trust their inputs (validate_tree is the
    check for untrusted ones). Repeated sibling tokens never reach them: from_parents makes the
    later sibling padding (`test_a_repeated_sibling_token_is_padding_with_its_subtree`), and
    validate_tree names them in the raw input."""
    from tevjax import exit_law, verify

    key = jax.random.key(0)
    ok = DraftTree.from_parents([7, 11, 12], [-1, 0, 0])
    for tree, logits, message in [
        (DraftTree.from_parents([7, 40], [-1, 0]), jnp.zeros((2, 32)), r"node 1: token 40 is outside the vocabulary"),
        (ok, jnp.zeros((3, 16)).at[0, 11].set(jnp.inf), "logits row of node 0 contains \\+inf"),
        (ok, jnp.zeros((3, 16)).at[1, 2].set(jnp.nan), "logits row of node 1 contains NaN"),
    ]:
        for name, call in (("verify", lambda: verify(key, tree, logits, 1.0)),
                           ("exit_law", lambda: exit_law(tree, logits, 1.0))):
            with pytest.raises(TreeValidationError, match=f"{name}: {message}"):
                call()
    with pytest.raises(TreeValidationError, match="nodes 1 and 2 are siblings"):
        validate_tree(np.array([0, 5, 5]), np.array([-1, 0, 0]), vocab_size=8)
    # Traced trees are not read (no host sync inside jit or vmap): the contract is the caller's.
    trees = jax.tree.map(lambda a, b: jnp.stack([a, b]), ok, DraftTree.from_parents([7, 40, 12], [-1, 0, 0]))
    jax.vmap(lambda t, lg: exit_law(t, lg, 1.0))(trees, jnp.zeros((2, 3, 16)))


def test_check_tree_logits_under_jit_and_vmap():
    trees = jax.vmap(DraftTree.from_parents)(jnp.zeros((3, 5), jnp.int32),
                                             jnp.tile(jnp.array([-1, 0, 0, -1, 1]), (3, 1)))

    def checked(tree, logits):
        check_tree_logits(tree, logits, "exit_law")
        return logits.sum()

    jax.jit(jax.vmap(checked))(trees, jnp.zeros((3, 5, 8)))
    with pytest.raises(TreeValidationError, match=r"exit_law: .*= \[5, V\].*got \(4, 8\)"):
        jax.jit(jax.vmap(checked))(trees, jnp.zeros((3, 4, 8)))


GOOD_TOKENS = np.array([5, 1, 2, 3], np.int32)
GOOD_PARENTS = np.array([-1, 0, 0, 1], np.int32)


def test_valid_tree_passes():
    validate_tree(GOOD_TOKENS, GOOD_PARENTS, logits=np.zeros((4, 8)), temperature=0.7)
    # a padding slot may hold any token (from_parents canonicalises it to 0)
    validate_tree(np.array([5, 1, -7, 3]), np.array([-1, 0, -1, 1]))


@pytest.mark.parametrize(
    "tokens, parents, kwargs, message",
    [
        ([5, 1, 2], [0, 0, 0], {}, "node 0 is the root and must have parent -1"),
        ([5, 1, 2], [-1, 0, 7], {}, r"node 2: parent index 7 is out of range \[0, 3\)"),
        ([5, 1, 2], [-1, 0, -3], {}, r"node 2: parent index -3 is out of range"),
        ([5, 1, 2], [-1, 2, 0], {}, "node 1: parent 2 is not earlier than the node"),
        ([5, 1, 2], [-1, 1, 0], {}, "node 1: parent 1 is not earlier than the node"),
        ([5, 1, 2, 4], [-1, -1, 0, 1], {}, "node 3 has padding node 1 as its parent"),
        ([5, 1, 1], [-1, 0, 0], {}, "nodes 1 and 2 are siblings \\(parent 0\\) with the same token 1"),
        ([5, 1, 9], [-1, 0, 0], {"vocab_size": 8}, r"node 2: token 9 is outside the vocabulary \[0, 8\)"),
        ([5, -1, 2], [-1, 0, 0], {"vocab_size": 8}, r"node 1: token -1 is negative"),
        ([5, -1, 2], [-1, 0, 0], {}, r"node 1: token -1 is negative \(token ids are >= 0\)"),
        ([-3, 1, 2], [-1, 0, 0], {"temperature": 1.0}, r"node 0: token -3 is negative"),
        ([5, 1, 2], [-1, 0, 0], {"logits": np.zeros((4, 8))}, r"logits must have shape \[N, V\] = \[3, V\]"),
        ([5, 1, 2], [-1, 0, 0], {"logits": np.zeros(8)}, r"logits must have shape"),
        ([5, 1, 2], [-1, 0, 0], {"logits": np.zeros((3, 8), np.int64)}, r"logits must be floating point"),
        ([5, 1, 2], [-1, 0, 0], {"temperature": -0.5}, "temperature must be a finite float32 number >= 0"),
        ([5, 1, 2], [-1, 0, 0], {"temperature": float("nan")}, "temperature must be a finite float32 number >= 0"),
        ([5, 1, 2], [-1, 0, 0], {"temperature": 1e39}, "temperature must be a finite float32 number >= 0"),
        ([5, 1, 2], [-1, 0, 0], {"temperature": True}, r"temperature must be a number \(a scalar\), got True"),
        ([5, 1, 2], [-1, 0, 0], {"temperature": "x"}, r"temperature must be a number \(a scalar\), got 'x'"),
        ([5, 1, 2], [-1, 0], {}, "equal length"),
        ([], [], {}, "at least the root"),
        ([5.0, 1.0], [-1, 0], {}, "tokens must be integers"),
        ([5, 1, 8], [-1, 0, 0], {"vocab_size": 8}, r"node 2: token 8 is outside the vocabulary \[0, 8\)"),
        ([5, 1, 2], [-1, 0, 0], {"logits": np.zeros((3, 8)), "vocab_size": 9},
         "logits have vocabulary 8 but vocab_size=9"),
        ([5, 1], [-1.0, 0.0], {}, "parents must be integers"),
    ],
)
def test_validation_errors_name_the_culprit(tokens, parents, kwargs, message):
    with pytest.raises(TreeValidationError, match=message):
        validate_tree(np.asarray(tokens), np.asarray(parents), **kwargs)


def test_logits_rows_are_checked_only_for_real_nodes():
    logits = np.zeros((4, 8), np.float32)
    logits[2] = np.nan
    with pytest.raises(TreeValidationError, match="logits row of node 2 contains NaN"):
        validate_tree(GOOD_TOKENS, GOOD_PARENTS, logits=logits)
    logits[2] = -np.inf
    with pytest.raises(TreeValidationError, match="logits row of node 2 is entirely -inf"):
        validate_tree(GOOD_TOKENS, GOOD_PARENTS, logits=logits)
    # the same garbage in a padding row is fine
    logits[2] = np.nan
    validate_tree(np.array([5, 1, 0, 3]), np.array([-1, 0, -1, 1]), logits=logits)
    # The message names the node, not the row's position among the real rows (here 2).
    logits[3] = np.nan
    with pytest.raises(TreeValidationError, match="logits row of node 3 contains NaN"):
        validate_tree(np.array([5, 1, 0, 3]), np.array([-1, 0, -1, 1]), logits=logits)
    logits[3] = -np.inf
    with pytest.raises(TreeValidationError, match="logits row of node 3 is entirely -inf"):
        validate_tree(np.array([5, 1, 0, 3]), np.array([-1, 0, -1, 1]), logits=logits)


def test_root_parent_is_canonicalised():
    # The root is node 0 whatever parent it is given: from_parents (jittable, no checks) must still
    # report -1, or the root would count as an edge (its own child) in the laws.
    for root_parent in (0, 1, 5):
        tree = _from_parents(jnp.array([3, 4, 5]), jnp.array([root_parent, 0, 1]))
        assert np.asarray(tree.parents).tolist() == [-1, 0, 1]
        assert np.asarray(tree.depth).tolist() == [0, 1, 2] and bool(tree.valid.all())
        assert not bool(tree.children[:, 0].any())


def test_concrete_tree_with_traced_logits_gets_the_tree_checks():
    """Under jit over the logits alone the tree is still concrete: its checks run (the vocabulary
    comes from the logits' static shape) while the traced logits are not read."""
    from tevjax import exit_law

    ok = DraftTree.from_parents([99, 1, 2], [-1, 0, 0])  # the root's token is never scored: any id
    law = jax.jit(lambda lg: exit_law(ok, lg, 1.0))(jnp.zeros((3, 4)))
    np.testing.assert_allclose(np.asarray(law.exit_prob), [0.5, 0.25, 0.25], atol=1e-6)
    np.testing.assert_allclose(np.asarray(exit_law(ok, jnp.zeros((3, 4)), 1.0).exit_prob), [0.5, 0.25, 0.25])
    bad = DraftTree.from_parents([0, 1, 4], [-1, 0, 0])
    with pytest.raises(TreeValidationError, match=r"exit_law: node 2: token 4 is outside the vocabulary \[0, 4\)"):
        jax.jit(lambda lg: exit_law(bad, lg, 1.0))(jnp.zeros((3, 4)))


def test_ids_beyond_int32_are_refused_not_wrapped():
    """jnp.asarray(x, int32) wrapped 2**32 + 1 to token 1, a valid id no later check could question."""
    for tokens, parents, name in ((np.array([0, 2**32 + 1], np.int64), np.array([-1, 0]), "tokens"),
                                  (np.array([0, 2**32 - 1], np.uint32), np.array([-1, 0]), "tokens"),
                                  (np.array([0, 1]), np.array([-1, 2**32], np.int64), "parents")):
        with pytest.raises(ValueError, match=f"from_parents: {name} must fit in int32"):
            DraftTree.from_parents(tokens, parents)
    np.testing.assert_array_equal(DraftTree.from_parents(np.array([0, 5], np.int64), np.array([-1, 0])).tokens, [0, 5])


def test_a_repeated_sibling_token_is_padding_with_its_subtree():
    """Under jit nothing checks that siblings are distinct, and two root children of token 1 gave
    TEV and the sequential verifier P(first token = 1) = 1 against the target's 0.5 (token 1's
    acceptance counted twice). from_parents now makes the later one padding, with its child, so
    the exit law is that of the tree without them."""
    from tevjax.law import exit_law

    logits = jnp.log(jnp.array([[0.5, 0.3, 0.2, 1e-30]] * 5))
    dup = jax.jit(DraftTree.from_parents)(jnp.array([0, 1, 2, 1, 0]), jnp.array([-1, 0, 0, 0, 3]))
    np.testing.assert_array_equal(dup.valid, [True, True, True, False, False])
    np.testing.assert_array_equal(dup.parents, [-1, 0, 0, -1, -1])
    plain = DraftTree.from_parents(jnp.array([0, 1, 2]), jnp.array([-1, 0, 0]))
    got, want = jax.jit(exit_law)(dup, logits, 1.0), exit_law(plain, logits[:3], 1.0)
    np.testing.assert_allclose(got.exit_prob[:3], want.exit_prob, rtol=1e-6)
    np.testing.assert_allclose(got.exit_prob[3:], 0.0)
    assert float(got.coverage) == pytest.approx(float(want.coverage)) == pytest.approx(0.5)
    # Repeats under different parents are not siblings: both stay.
    cousins = DraftTree.from_parents(jnp.array([0, 1, 2, 1, 1]), jnp.array([-1, 0, 0, 1, 2]))
    assert bool(cousins.valid.all())
