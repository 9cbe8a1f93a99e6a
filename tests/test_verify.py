"""Statistical conformance of the three exact verifiers to the canonical (exit node, bonus) law.

False-alarm budget: every statistical assertion in this file uses a per-test significance level
ALPHA = 1e-6 / NUM_STAT_TESTS (Bonferroni), so a correct implementation fails the whole file with
probability below 1e-6. Seeds are fixed (`_seed`, stable across processes), so a given build
passes or fails deterministically.
"""

import functools
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from scipy import stats as sps

from tevjax import verifiers as verify_mod
from tevjax.law import exit_law
from tevjax.tree import DraftTree
from tevjax.verifiers import verify
from treegen import assign_tokens, chain, chi2_pvalue, exact_joint, insert_padding, random_parents, star

N_SLOTS, VOCAB, SAMPLES = 16, 6, 40_000
METHODS = ("tev", "predraw", "sequential")
TEMPS = (1.0, 0.6)


def _case(name: str):
    """A named tree (padded to N_SLOTS) with logits; deterministic per name."""
    rng = np.random.default_rng(sum(map(ord, name)))
    logits = None
    if name == "chain":
        parents = chain(7)
    elif name == "star":
        parents = star(6)
    elif name == "deep":
        parents = random_parents(12, rng, max_children=2, bias=6.0)
    elif name == "wide":
        parents = random_parents(14, rng, max_children=VOCAB, bias=-3.0)
    elif name == "single_root":
        parents = np.array([-1], np.int32)
    elif name == "random":
        parents = random_parents(16, rng, max_children=4)
    elif name == "padded":
        parents = random_parents(10, rng, max_children=3)
    elif name == "minus_inf":
        parents = random_parents(12, rng, max_children=3)
    elif name == "argmax_chain":  # drafter == target: the chain follows each row's argmax
        parents = chain(8)
    elif name == "full_cover":  # root's children hold every token: rho(root) = 0
        parents = star(VOCAB + 1)
    else:
        raise KeyError(name)
    tokens = assign_tokens(parents, VOCAB, rng, root_token=3)
    n = len(parents)
    logits = (rng.normal(size=(n, VOCAB)) * 1.5).astype(np.float32)
    if name == "minus_inf":
        logits[rng.random(size=logits.shape) < 0.3] = -np.inf
        logits[np.arange(n), rng.integers(VOCAB, size=n)] = 0.0  # keep every row proper
    if name == "argmax_chain":
        for i in range(1, n):
            logits[i - 1, tokens[i]] = logits[i - 1].max() + 1.0
    if name == "full_cover":
        tokens[1:] = np.arange(VOCAB)
    if name == "padded":
        parents, tokens, idx = insert_padding(parents, tokens, [2, 5, 5, 9])
        full = np.full((len(parents), VOCAB), np.nan, np.float32)
        full[idx] = logits
        logits = full
        n = len(parents)
    pad = N_SLOTS - n
    tokens = np.pad(tokens, (0, pad))
    parents = np.pad(parents, (0, pad), constant_values=-1)
    logits = np.pad(logits, ((0, pad), (0, 0)), constant_values=7.0)
    return tokens.astype(np.int32), parents.astype(np.int32), logits


CASES = ("chain", "star", "deep", "wide", "single_root", "random", "padded", "minus_inf", "argmax_chain", "full_cover")
NUM_STAT_TESTS = 2 * len(CASES) * len(METHODS) * len(TEMPS) + 3  # joint + mean tests, + power checks
ALPHA = 1e-6 / NUM_STAT_TESTS


@functools.partial(jax.jit, static_argnames=("method", "temperature"))
def _sample(keys, tokens, parents, logits, method, temperature):
    tree = DraftTree.from_parents(tokens, parents)
    return jax.vmap(lambda k: verify(k, tree, logits, temperature, method))(keys)


# Outcomes of exact probability 0 that float32 makes possible: at a node whose children hold every
# token (full_cover's root, some of wide's nodes), rho = 1 - sum of the children's p is a few ulps of
# 1 (e.g. 1.8e-7), not 0, so every verifier exits there at about that rate (the residual is then
# empty and the bonus falls back to p_v, `verifiers._residual_draw`). Over SAMPLES = 40,000 draws
# such events average at most ~0.03 per test (TEV's float32 w there: 1.8e-7 x 40,000 = 0.007;
# sequential: 2 events in 160 runs of its four affected cells); more than ROUNDING_EVENTS of them
# has probability ~2e-10 per test, while the broken verifiers below put thousands of draws there.
ROUNDING_EVENTS = 4


def _seed(*parts) -> int:
    """A key seed from the test's parameters that is the same in every process (Python's hash() of
    a string is salted per process, which made the draws, and a rare rounding event, vary by run)."""
    return zlib.crc32(repr(parts).encode())


def _chi2_pvalue(exit_nodes, bonus, joint):
    """Pearson chi-square of observed (exit, bonus) pairs against `joint` (`treegen.chi2_pvalue`);
    more than ROUNDING_EVENTS draws on outcomes of exact probability 0 are a hard failure (p = 0)."""
    counts = np.zeros(joint.shape)
    np.add.at(counts, (exit_nodes, bonus), 1)
    return chi2_pvalue(counts, joint, zero_draws=ROUNDING_EVENTS)


@pytest.mark.parametrize("temperature", TEMPS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("case", CASES)
def test_joint_law_and_mean_block_length(case, method, temperature):
    tokens, parents, logits = _case(case)
    keys = jax.random.split(jax.random.key(_seed(case, method, temperature)), SAMPLES)
    out = _sample(keys, tokens, parents, logits, method, temperature)
    exit_nodes = np.asarray(out.exit_node)
    bonus = np.asarray(out.bonus_token)
    clean = np.where(np.isnan(logits), 0.0, logits)
    joint = exact_joint(tokens, parents, clean, temperature)
    p = _chi2_pvalue(exit_nodes, bonus, joint)
    assert p > ALPHA, f"{case}/{method}/T={temperature}: joint law rejected, p={p:.3g}"

    law = exit_law(DraftTree.from_parents(tokens, parents), jnp.asarray(logits), temperature)
    depth = np.asarray(DraftTree.from_parents(tokens, parents).depth)
    w = np.asarray(law.exit_prob, np.float64)
    mean_d, var_d = (w * depth).sum(), (w * depth**2).sum() - (w * depth).sum() ** 2
    lengths = np.asarray(out.num_tokens)
    np.testing.assert_allclose(mean_d, float(law.coverage), atol=1e-5)
    if var_d > 1e-9:
        z = (lengths.mean() - (1.0 + mean_d)) / np.sqrt(var_d / SAMPLES)
        assert abs(z) < sps.norm.isf(ALPHA / 2), f"mean block length {lengths.mean():.4f} vs 1 + C_p = {1 + mean_d:.4f}"
    else:  # a deterministic block length (e.g. a single-root tree)
        assert np.all(lengths == round(1 + mean_d))


# --- power: deliberately broken verifiers must be rejected by the same test --------------------


def _broken_bonus_not_residual(key, tree, logits, temperature):
    """TEV whose bonus is drawn from p_v itself instead of the residual (a classic bug)."""
    stats = verify_mod._sample_stats(tree, logits, temperature)
    law = verify_mod.law_from_edges(tree, stats.edge_prob)
    k1, k2 = jax.random.split(key)
    exit_node = jax.random.categorical(k1, jnp.log(law.exit_prob)).astype(jnp.int32)
    return verify_mod._assemble(tree, exit_node, jax.random.categorical(k2, stats.scaled_row(exit_node)))


def _broken_sequential_no_renormalisation(key, tree, logits, temperature):
    """Sequential verification that accepts child j with p(x_j) instead of
    p(x_j) / (1 - rejected mass)."""
    stats = verify_mod._sample_stats(tree, logits, temperature)
    is_edge = tree.valid & (tree.parents >= 0)
    idx = jnp.arange(tree.num_nodes)
    k1, k2 = jax.random.split(key)
    u = jax.random.uniform(k1, (tree.num_nodes,))
    earlier = (tree.parents[:, None] == tree.parents[None, :]) & is_edge[None, :] & (idx[None, :] < idx[:, None])
    passes = is_edge & (u < stats.edge_prob)
    chosen = passes & ~jnp.any(earlier & passes[None, :], axis=-1)
    exit_node = verify_mod._deepest(tree, verify_mod._reached(tree, chosen))
    return verify_mod._assemble(tree, exit_node, verify_mod._residual_draw(k2, tree, stats, exit_node))


def _broken_predraw_fresh_bonus(key, tree, logits, temperature):
    """Predraw whose bonus is a fresh draw instead of the node's own pre-drawn token."""
    k1, k2 = jax.random.split(key)
    out = verify_mod._predraw(k1, tree, logits, temperature)
    z = logits[out.exit_node] / temperature
    return verify_mod._assemble(tree, out.exit_node, jax.random.categorical(k2, z))


@pytest.mark.parametrize(
    "broken", [_broken_bonus_not_residual, _broken_sequential_no_renormalisation, _broken_predraw_fresh_bonus]
)
def test_broken_verifiers_are_rejected(broken):
    tokens, parents, logits = _case("star")
    tree = DraftTree.from_parents(tokens, parents)
    keys = jax.random.split(jax.random.key(5), SAMPLES)
    out = jax.jit(jax.vmap(lambda k: broken(k, tree, jnp.asarray(logits), jnp.float32(1.0))))(keys)
    joint = exact_joint(tokens, parents, logits, 1.0)
    p = _chi2_pvalue(np.asarray(out.exit_node), np.asarray(out.bonus_token), joint)
    assert p < 1e-12, f"the conformance test failed to reject {broken.__name__} (p={p:.3g})"


def test_residual_draw_falls_back_to_p_when_children_cover_every_token():
    """rho(v) can round to ~1e-7 instead of 0 when v's children hold every token; a draw that lands
    there must still return a token of positive probability: p_v itself, not an empty residual."""
    tree = DraftTree.from_parents([0, 0, 1, 2, 3], [-1, 0, 0, 0, 0])  # root's children: all of V = 4
    logits = jnp.zeros((5, 4)).at[0, 3].set(6.0)  # p_root(3) ~ 0.99
    stats = verify_mod._sample_stats(tree, logits, jnp.float32(1.0))
    keys = jax.random.split(jax.random.key(2), 200)
    draw = jax.jit(jax.vmap(verify_mod._residual_draw, in_axes=(0, None, None, None)))
    bonus = np.asarray(draw(keys, tree, stats, jnp.int32(0)))
    assert np.sum(bonus == 3) > 180, np.bincount(bonus, minlength=4)
    # At a node with an undrafted token left, the drafted children are removed as usual.
    one_child = DraftTree.from_parents([0, 3, 0, 0, 0], [-1, 0, -1, -1, -1])  # same shape: no new compile
    stats = verify_mod._sample_stats(one_child, logits, jnp.float32(1.0))
    bonus = np.asarray(draw(keys, one_child, stats, jnp.int32(0)))
    assert not np.any(bonus == 3) and set(bonus.tolist()) == {0, 1, 2}


def test_verify_defaults_and_unknown_method():
    tokens, parents, logits = _case("random")
    tree, logits = DraftTree.from_parents(tokens, parents), jnp.asarray(logits)
    key = jax.random.key(3)
    # The documented defaults: temperature 1.0 and method "tev" (same key, same draws). With this key
    # the other methods give another block, so the comparison can tell them apart.
    default = verify(key, tree, logits)
    chex_equal(default, verify(key, tree, logits, 1.0, "tev"))
    for method in ("predraw", "sequential"):
        other = verify(key, tree, logits, 1.0, method)
        assert (int(other.exit_node), int(other.bonus_token)) != (int(default.exit_node), int(default.bonus_token))
    message = r"unknown verifier method 'nope'; choose one of \['predraw', 'sequential', 'tev'\]"
    with pytest.raises(ValueError, match=message):
        verify(key, tree, logits, 1.0, "nope")


# --- greedy, structure, batching, compilation --------------------------------------------------


def _greedy_reference(tokens, parents, logits):
    v, path = 0, []
    while True:
        top = int(np.argmax(logits[v]))
        nxt = [u for u in range(1, len(parents)) if parents[u] == v and tokens[u] == top]
        if not nxt:
            return path, top
        v = nxt[0]
        path.append(v)


@pytest.mark.parametrize("case", ["chain", "argmax_chain", "random", "padded", "minus_inf"])
def test_greedy_follows_argmax_path_for_every_method(case):
    tokens, parents, logits = _case(case)
    tree = DraftTree.from_parents(tokens, parents)
    real = np.asarray(tree.valid)
    path, bonus = _greedy_reference(tokens, np.where(real, parents, -1), np.where(np.isnan(logits), 0, logits))
    for method in METHODS:
        out = verify(jax.random.key(0), tree, jnp.asarray(logits), 0.0, method)
        assert int(out.num_accepted) == len(path)
        assert list(np.asarray(out.path)[: len(path)]) == path
        assert int(out.bonus_token) == bonus
        expected = [int(tokens[v]) for v in path] + [bonus]
        assert list(np.asarray(out.tokens)[: len(expected)]) == expected
    if case == "argmax_chain":
        assert len(path) == 7  # drafter == target accepts the whole greedy chain


def test_traced_temperature_matches_static():
    tokens, parents, logits = _case("random")
    tree = DraftTree.from_parents(tokens, parents)
    key = jax.random.key(3)
    for method in METHODS:
        traced_fn = jax.jit(lambda temp, m=method: verify(key, tree, jnp.asarray(logits), temp, m))
        static_fn = jax.jit(lambda m=method, t=0.0: verify(key, tree, jnp.asarray(logits), t, m), static_argnums=(0, 1))
        for t in (0.0, 0.6):
            chex_equal(static_fn(method, t), traced_fn(jnp.float32(t)))


def chex_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_vmap_over_trees_equals_one_by_one_and_jit_equals_eager():
    names = ["chain", "deep", "random", "padded", "minus_inf", "single_root"]
    cases = [_case(n) for n in names]
    tok = jnp.asarray(np.stack([c[0] for c in cases]))
    par = jnp.asarray(np.stack([c[1] for c in cases]))
    lg = jnp.asarray(np.stack([c[2] for c in cases]))
    keys = jax.random.split(jax.random.key(9), len(cases))
    for method in METHODS:
        for t in (0.0, 0.8):
            batched = jax.jit(
                jax.vmap(lambda k, a, b, c: verify(k, DraftTree.from_parents(a, b), c, t, method))
            )(keys, tok, par, lg)
            for i in (1, 3):  # eager dispatch is slow on CPU: spot-check two rows, incl. the padded one
                eager = verify(keys[i], DraftTree.from_parents(tok[i], par[i]), lg[i], t, method)
                chex_equal(jax.tree.map(lambda x: x[i], batched), eager)


N_PROP, V_PROP = 20, 8


@functools.partial(jax.jit, static_argnames=("method",))
def _verify_one(key, tokens, parents, logits, temperature, method):
    tree = DraftTree.from_parents(tokens, parents)
    return verify(key, tree, logits, temperature, method), exit_law(tree, logits, temperature)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    n=st.integers(1, N_PROP),
    seed=st.integers(0, 2**31 - 1),
    method=st.sampled_from(METHODS),
    temperature=st.sampled_from([0.0, 0.3, 1.0, 2.0]),
    neg_inf_frac=st.sampled_from([0.0, 0.5]),
)
def test_output_structure_properties(n, seed, method, temperature, neg_inf_frac):
    rng = np.random.default_rng(seed)
    parents = random_parents(n, rng, max_children=V_PROP, bias=rng.uniform(-3, 6))
    tokens = assign_tokens(parents, V_PROP, rng, root_token=int(rng.integers(V_PROP)))
    logits = rng.normal(size=(n, V_PROP)).astype(np.float32) * 3
    logits[rng.random(size=logits.shape) < neg_inf_frac] = -np.inf
    logits[np.arange(n), rng.integers(V_PROP, size=n)] = 1.0
    pad = N_PROP - n
    tokens = np.pad(tokens, (0, pad))
    parents = np.pad(parents, (0, pad), constant_values=-1)
    logits = np.pad(logits, ((0, pad), (0, 0)), constant_values=np.nan)  # garbage padding rows
    out, law = _verify_one(jax.random.key(seed), tokens, parents, logits, jnp.float32(temperature), method)
    out, law = jax.tree.map(np.asarray, (out, law))
    d, v, y = int(out.num_accepted), int(out.exit_node), int(out.bonus_token)
    assert out.num_tokens == d + 1
    path = list(out.path[:d])
    assert all(p >= 0 for p in path) and all(p == -1 for p in out.path[d:])
    chain_ = [0] + path
    assert all(parents[chain_[i + 1]] == chain_[i] for i in range(d))  # a root path
    assert (path[-1] if path else 0) == v
    assert list(out.tokens[:d]) == [tokens[p] for p in path] and out.tokens[d] == y
    assert all(t == -1 for t in out.tokens[d + 1 :])
    assert law.exit_prob[v] > 0, "exited at a node of zero exit probability"
    assert np.isfinite(logits[v, y]), "bonus token has zero target probability"
    children_tokens = {int(tokens[u]) for u in range(1, N_PROP) if parents[u] == v}
    assert y not in children_tokens, "bonus token repeats a drafted child of the exit node"


def test_bfloat16_logits_match_their_float32_upcast():
    """GPU targets emit bf16 logits: every statistic is computed in float32 from them."""
    tokens, parents, logits = _case("random")
    tree = DraftTree.from_parents(tokens, parents)
    bf16 = jnp.asarray(logits, jnp.bfloat16)
    up = bf16.astype(jnp.float32)
    law_b, law_f = exit_law(tree, bf16, 0.7), exit_law(tree, up, 0.7)
    np.testing.assert_allclose(np.asarray(law_b.exit_prob), np.asarray(law_f.exit_prob), atol=1e-6)
    assert law_b.exit_prob.dtype == jnp.float32
    key = jax.random.key(4)
    for method in METHODS:
        for t in (0.0, 0.7):
            chex_equal(verify(key, tree, bf16, t, method), verify(key, tree, up, t, method))


def test_one_temperature_rule_for_tiny_and_invalid_values():
    """Below GREEDY_BELOW (1e-5) every entry point is greedy, concrete or traced: 1 / temperature would
    overflow float32 at 1e-39 and below (once it made 1e-46 sample like 1.0 and 1e-39 emit token 0).
    Concrete negative, NaN and infinite temperatures raise; traced ones follow `law.samples`."""
    from tevjax.law import GREEDY_BELOW, is_greedy, samples

    tree = DraftTree.from_parents(jnp.array([5, 1, 2, 3]), jnp.array([-1, 0, 0, 1]))
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((4, 6)) * 3, jnp.float32)
    greedy = verify(jax.random.key(0), tree, logits, 0.0)
    traced = jax.jit(lambda t, k: verify(k, tree, logits, t))
    for t in (1e-46, 1e-39, 1e-8, GREEDY_BELOW / 2):
        assert is_greedy(t) is True
        for key in range(5):
            for out in (verify(jax.random.key(key), tree, logits, t), traced(jnp.float32(t), jax.random.key(key))):
                assert int(out.bonus_token) == int(greedy.bonus_token) and int(out.exit_node) == int(greedy.exit_node)
        np.testing.assert_array_equal(exit_law(tree, logits, t).exit_prob, exit_law(tree, logits, 0.0).exit_prob)
    assert is_greedy(GREEDY_BELOW) is False and bool(samples(jnp.float32(GREEDY_BELOW)))
    # At 1e-5 itself it samples, and stays finite (a proper, very peaked law).
    law = exit_law(tree, logits, GREEDY_BELOW)
    assert np.all(np.isfinite(np.asarray(law.exit_prob))) and abs(float(law.exit_prob.sum()) - 1) < 1e-5
    # 1e39 is a finite float64 but inf in float32, where logits are divided by it.
    assert is_greedy(3.4e38) is False
    for bad in (-1.0, float("nan"), float("inf"), 1e39):
        with pytest.raises(ValueError, match="temperature must be a finite float32 number >= 0"):
            verify(jax.random.key(0), tree, logits, bad)
        with pytest.raises(ValueError, match="temperature must be a finite float32 number >= 0"):
            exit_law(tree, logits, bad)
    # Not numbers: float() read True as 1.0 and "0.5" as 0.5; a [2] array failed in lax.cond.
    for bad in (True, "0.5", None, jnp.ones(2)):
        with pytest.raises(TypeError, match=r"temperature must be a number \(a scalar\)"):
            verify(jax.random.key(0), tree, logits, bad)
        with pytest.raises(TypeError, match=r"temperature must be a number \(a scalar\)"):
            exit_law(tree, logits, bad)
    # Traced invalid values cannot raise: NaN and negative decode greedily, +inf samples uniformly.
    assert not bool(samples(jnp.float32(float("nan")))) and not bool(samples(jnp.float32(-1.0)))
    assert bool(samples(jnp.float32(float("inf"))))


@pytest.mark.parametrize("method", METHODS)
def test_huge_temperatures_with_masked_logits_never_emit_a_masked_token(method):
    """Above ~8.5e37 (valid temperatures up to float32's max) 1 / temperature is subnormal and XLA
    flushes it to 0; 0 * -inf = NaN then made the law NaN and every verifier emit the masked token
    (token 3 here, in 2000 of 2000 draws). The law must be uniform over the unmasked tokens, as at 1e30."""
    tree = DraftTree.from_parents(jnp.array([7, 1, 2, 0, 3]), jnp.array([-1, 0, 0, -1, 1]))
    logits = jnp.asarray(np.array([[1., 2., 3., -np.inf, 0., 0.5]] * 5, np.float32))
    ref = exit_law(tree, logits, 1e30)
    keys = jax.random.split(jax.random.key(0), 2000)
    traced = jax.jit(jax.vmap(lambda k, t: verify(k, tree, logits, t, method), in_axes=(0, None)))
    for t in (1e38, 3.4e38, float("inf")):  # +inf: a traced invalid value, which samples uniformly
        if np.isfinite(t):
            np.testing.assert_allclose(np.asarray(exit_law(tree, logits, t).exit_prob), np.asarray(ref.exit_prob),
                                       atol=1e-6)
            assert int(verify(jax.random.key(1), tree, logits, t, method).bonus_token) != 3
        out = traced(keys, jnp.float32(t))
        assert not np.any(np.asarray(out.tokens) == 3)
        # Exit at the root with probability 0.6 (binomial sd 0.011 over 2000 draws).
        assert abs(float(np.mean(np.asarray(out.exit_node) == 0)) - 0.6) < 0.07


@pytest.mark.parametrize("vocab", [6, 4096])
def test_exit_law_and_verifiers_are_shift_invariant_at_small_temperatures_and_huge_logits(vocab):
    """The law of softmax(x / t) ignores a constant added to x. Scaling before shifting did not: at
    t = 1e-4 and logits near 30 the exit law was off by several percent, and logits of 1e34 at
    t = 0.5 made it NaN (or put probability 1 on two siblings at once)."""
    tree = DraftTree.from_parents(jnp.array([7, 1, 2, 0, 3]), jnp.array([-1, 0, 0, -1, 1]))
    gaps = np.full((5, vocab), -np.inf, np.float32)
    gaps[:, :6] = np.array([1., 2., 3., -np.inf, 0., 0.5], np.float32) * np.float32(1e-4)
    near_30 = gaps + np.float32(30.0)  # rounds the gaps; near_30 - 30 is then exact (Sterbenz)
    ref = np.asarray(exit_law(tree, jnp.asarray((near_30 - np.float32(30.0)) * np.float32(1e4)), 1.0).exit_prob)
    np.testing.assert_allclose(ref.sum(), 1.0, atol=1e-6)
    got = exit_law(tree, jnp.asarray(near_30), 1e-4).exit_prob
    np.testing.assert_allclose(np.asarray(got), ref, atol=2e-6)
    # All finite logits equal 1e34 (or 3e38) in float32: uniform over the 5 finite tokens.
    for big in (1e34, 3e38, -3e38):
        flat = np.where(np.isfinite(gaps), np.float32(big), gaps)
        np.testing.assert_allclose(np.asarray(exit_law(tree, jnp.asarray(flat), 0.5).exit_prob),
                                   [0.6, 0.2, 0.2, 0.0, 0.0], atol=1e-6)
        for method in METHODS:
            out = verify(jax.random.key(1), tree, jnp.asarray(flat), 0.5, method)
            assert int(out.bonus_token) in (0, 1, 2, 4, 5), method


def test_out_of_vocabulary_tokens_under_jit_have_probability_zero():
    """Under jit no check reads the ids: the gathers clamped token V to V - 1 and wrapped -1 to V - 1,
    so TEV and sequential accepted such a node at token V - 1's probability (0.4 here) and emitted the
    id V, while predraw and greedy never accept it; and a child token -1 removed token V - 1 from the
    residual at its parent."""
    logits = jnp.asarray(np.log(np.array([[0.1, 0.2, 0.3, 0.4]] * 3, np.float32)))
    keys = jax.random.split(jax.random.key(0), 4000)
    for bad in (4, -1):
        tree = jax.jit(DraftTree.from_parents)(jnp.array([0, bad, 1]), jnp.array([-1, 0, 0]))
        law = jax.jit(lambda t: exit_law(t, logits, 1.0))(tree)
        np.testing.assert_allclose(np.asarray(law.exit_prob), [0.8, 0.0, 0.2], atol=1e-6)
        for method in METHODS:
            out = jax.jit(jax.vmap(lambda k, t: verify(k, t, logits, 1.0, method), in_axes=(0, None)))(keys, tree)
            assert not np.any(np.asarray(out.exit_node) == 1)
            bonus_at_root = np.asarray(out.bonus_token)[np.asarray(out.exit_node) == 0]
            # Residual at the root: p without token 1 (0.1, 0, 0.3, 0.4) / 0.8; token 3 has 0.5 (sd 0.009).
            assert abs(float(np.mean(bonus_at_root == 3)) - 0.5) < 0.05
