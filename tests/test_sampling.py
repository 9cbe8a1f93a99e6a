"""The two-stage categorical sampler and the fused, blocked scaled log-sum-exp.

False-alarm budget: the two chi-square tests run at ALPHA = 1e-7 each.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as sps

from tevjax.sampling import categorical, scaled_logsumexp, vocab_block
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


def test_vocab_blocks():
    assert vocab_block(151_936) == 1187 and vocab_block(49_152) == 2048 and vocab_block(128_256) == 2004
    assert vocab_block(6144) == 2048
    assert vocab_block(3000) is None  # small: one stage
    assert vocab_block(8191) is None  # prime: one stage


@pytest.mark.parametrize("scale", [1.0, 1 / 0.7])
def test_two_stage_sampler_matches_softmax(scale):
    rng = np.random.default_rng(0)
    vocab = 6144  # three blocks of 2048
    logits = rng.normal(size=vocab).astype(np.float32) * 3.0
    logits[rng.random(vocab) < 0.2] = -np.inf
    logits[2048:4096] = -np.inf  # a whole block of zero mass
    logits[5000] += 8.0  # a heavy token
    probs = softmax(np.where(np.isinf(logits), -1e30, logits) * scale)
    probs[np.isinf(logits)] = 0.0
    keys = jax.random.split(jax.random.key(1), 50_000)
    draws = np.asarray(jax.jit(jax.vmap(lambda k: categorical(k, jnp.asarray(logits), scale)))(keys))
    assert draws.min() >= 0 and draws.max() < vocab
    assert _chi2(draws, probs) > ALPHA


def test_batched_rows_are_independent_point_masses():
    for vocab in (6144, 8191):  # two-stage and one-stage paths
        hot = np.array([3, 2100, 4097, vocab - 1])
        logits = np.full((4, vocab), -np.inf, np.float32)
        logits[np.arange(4), hot] = 0.0
        out = categorical(jax.random.key(0), jnp.asarray(logits))
        np.testing.assert_array_equal(np.asarray(out), hot)


@pytest.mark.parametrize("vocab", [1000, 6144, 8191])
def test_scaled_logsumexp_matches_reference(vocab):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(5, vocab)).astype(np.float32) * 4
    x[1, ::3] = -np.inf
    x[2, :] = 60.0
    x[3, : vocab // 2] = -np.inf  # whole blocks of -inf
    for scale in (1.0, 2.5, 0.3):
        got = np.asarray(scaled_logsumexp(jnp.asarray(x), scale))
        ref = np.asarray(jax.nn.logsumexp(jnp.asarray(x) * scale, axis=-1))
        np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-5)
    x[4, 7] = np.nan  # a garbage (padding) row poisons only itself
    got = np.asarray(scaled_logsumexp(jnp.asarray(x), 1.0))
    assert np.isnan(got[4]) and np.isfinite(got[:4]).all()
