"""The two-stage categorical sampler and the fused scaled log-sum-exp.

False-alarm budget: the two chi-square tests run at ALPHA = 1e-7 each.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sps

from tevjax.sampling import categorical, scaled_logsumexp
from treegen import softmax

ALPHA = 1e-7


def _chi2(samples, probs):
    counts = np.bincount(samples, minlength=len(probs)).astype(float)
    assert counts[probs == 0].sum() == 0, "sampled a token of probability 0"
    expected = probs * len(samples)
    keep = expected >= 5
    o = np.append(counts[keep], counts[~keep].sum())
    e = np.append(expected[keep], expected[~keep].sum())
    return sps.chi2.sf(np.sum((o - e) ** 2 / e), len(e) - 1)


@pytest.mark.parametrize("scale", [1.0, 1 / 0.7])
def test_two_stage_sampler_matches_softmax(scale):
    rng = np.random.default_rng(0)
    vocab, block = 3000, 256  # 11 full blocks and a 184-token tail block
    logits = rng.normal(size=vocab).astype(np.float32) * 2.5
    logits[rng.random(vocab) < 0.2] = -np.inf
    logits[512:768] = -np.inf  # a whole block of zero mass
    logits[2900] += 6.0  # a heavy token in the tail block
    probs = softmax(np.where(np.isinf(logits), -1e30, logits) * scale)
    probs[np.isinf(logits)] = 0.0
    keys = jax.random.split(jax.random.key(1), 200_000)
    draws = np.asarray(jax.jit(jax.vmap(lambda k: categorical(k, jnp.asarray(logits), scale, block)))(keys))
    assert draws.min() >= 0 and draws.max() < vocab
    assert _chi2(draws, probs) > ALPHA


def test_batched_rows_are_independent_and_respect_shape():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(4, 1500)).astype(np.float32)
    logits[:, :] = -np.inf
    hot = np.array([3, 700, 1100, 1499])
    logits[np.arange(4), hot] = 0.0  # each row is a point mass
    out = categorical(jax.random.key(0), jnp.asarray(logits), 1.0, 256)
    np.testing.assert_array_equal(np.asarray(out), hot)


def test_scaled_logsumexp_matches_reference():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(5, 1000)).astype(np.float32) * 4
    x[1, ::3] = -np.inf
    x[2, :] = 60.0
    for scale in (1.0, 2.5, 0.3):
        got = np.asarray(scaled_logsumexp(jnp.asarray(x), scale))
        ref = np.asarray(jax.nn.logsumexp(jnp.asarray(x) * scale, axis=-1))
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-5)
    x[4, 7] = np.nan  # a garbage (padding) row poisons only itself
    got = np.asarray(scaled_logsumexp(jnp.asarray(x), 1.0))
    assert np.isnan(got[4]) and np.isfinite(got[:4]).all()
