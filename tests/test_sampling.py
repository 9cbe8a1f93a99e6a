"""The two-stage categorical sampler, the fused, blocked scaled log-sum-exp and truncation.

False-alarm budget: the three chi-square tests run at ALPHA = 1e-7 each; the truncation tests are
deterministic.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tevjax.sampling import (categorical, check_truncation, scaled_logsumexp, scaled_lse_parts, truncate_logits,
                             truncates, vocab_block)
from treegen import chi2_pvalue, softmax

ALPHA = 1e-7
# The 50,000-draw test spends its time running, not compiling: XLA's full optimisation (the test
# session compiles at level 0, see conftest.py) takes it from ~12 s to ~4 s on 2 cores.
RUN_FAST = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}


def _chi2(samples, probs):
    counts = np.bincount(samples, minlength=len(probs)).astype(float)
    assert counts[probs == 0].sum() == 0, "sampled a token of probability 0"
    return chi2_pvalue(counts, probs)


def test_vocab_blocks():
    assert vocab_block(151_936) == 1187 and vocab_block(49_152) == 2048 and vocab_block(128_256) == 2004
    assert vocab_block(6144) == 2048
    assert vocab_block(3000) is None  # small: one stage
    assert vocab_block(8191) is None  # prime: one stage


# The scaled case (temperature 0.7) runs with the slow tests: 50,000 draws cost ~15 s of 2 cores,
# and the scale enters the same two stages that the unscaled case checks.
@pytest.mark.parametrize("scale", [1.0, pytest.param(1 / 0.7, marks=pytest.mark.slow)])
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
    sample = jax.jit(jax.vmap(lambda k: categorical(k, jnp.asarray(logits), scale)), compiler_options=RUN_FAST)
    draws = np.asarray(sample(keys))
    assert draws.min() >= 0 and draws.max() < vocab
    assert _chi2(draws, probs) > ALPHA


def test_two_stage_sampler_applies_the_temperature_within_and_across_blocks():
    """The default suite's scaled case: a few tokens in three blocks of the two-stage path, where a
    scale left out of either stage moves the law far (the pair in block 0 alone goes from odds
    e^2.14 to e^1.5). 4,000 draws: a chi-square test at ALPHA, like the slow case's."""
    vocab, scale = 6144, 1 / 0.7
    logits = np.full(vocab, -np.inf, np.float32)
    logits[[0, 1, 2048, 4096]] = [0.0, 1.5, 1.0, -0.5]
    probs = softmax(np.where(np.isinf(logits), -1e30, logits) * scale)
    probs[np.isinf(logits)] = 0.0
    keys = jax.random.split(jax.random.key(2), 4_000)
    draws = np.asarray(jax.jit(jax.vmap(lambda k: categorical(k, jnp.asarray(logits), scale)))(keys))
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


@pytest.mark.parametrize("vocab", [1000, 6144])
def test_laws_are_shift_invariant_at_small_temperatures_and_huge_logits(vocab):
    """softmax(s * x) = softmax(s * (x - c)). Scaling before shifting broke it: at logits near 30
    and s = 1e4, s * x is 3e5, whose float32 spacing (0.03) rounded the law by several percent and
    changed the draws, and logits beyond ~3.4e38 / s overflowed the normaliser to +inf."""
    rng = np.random.default_rng(4)
    shifted = (30 + rng.normal(size=(3, vocab)) * 2e-4).astype(np.float32)  # gaps that matter at s = 1e4
    shifted[1, ::5] = -np.inf
    small = shifted - np.float32(30.0)  # exact in float32 (Sterbenz): the same law, shifted by 30
    m_ref = np.max(np.where(np.isfinite(small), small, -np.inf), axis=-1).astype(np.float64)
    s_ref = np.log(np.sum(np.exp(1e4 * (small.astype(np.float64) - m_ref[:, None])), axis=-1))
    for x in (small, shifted):
        m, s = scaled_lse_parts(jnp.asarray(x), 1e4)
        np.testing.assert_allclose(np.asarray(s), s_ref, rtol=1e-5)
        np.testing.assert_array_equal(np.asarray(m), np.max(x, axis=-1))
    keys = jax.random.split(jax.random.key(5), 64)
    draw = jax.jit(jax.vmap(lambda k, x: categorical(k, x, 1e4), in_axes=(0, None)))
    np.testing.assert_array_equal(np.asarray(draw(keys, jnp.asarray(small))),
                                  np.asarray(draw(keys, jnp.asarray(shifted))))
    huge = np.where(np.isfinite(small), np.float32(3e38), small)  # finite, and s * x overflows
    huge[:, 0] = np.float32(3.2e38)
    m, s = scaled_lse_parts(jnp.asarray(huge), 1e4)
    assert np.isfinite(np.asarray(s)).all() and np.isfinite(np.asarray(m)).all()
    np.testing.assert_array_equal(np.asarray(draw(keys, jnp.asarray(huge))), 0)  # the one largest logit


# --- truncation (top-k, top-p, min-p) ------------------------------------------------------------


# Jitted with the settings static (the path `DecodeConfig`'s settings take): one compiled program
# per case is ~2x faster here than dispatching its operations one at a time.
_truncate = jax.jit(truncate_logits, static_argnames=("top_k", "top_p", "min_p"))


def _kept(logits, temperature, **cut):
    return np.isfinite(np.asarray(_truncate(jnp.asarray(logits), temperature, **cut)))


def _hf_kept(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """The tokens transformers' warpers keep, applied in `generate`'s order."""
    import torch
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    ids = torch.zeros((logits.shape[0], 1), dtype=torch.long)
    scores = TemperatureLogitsWarper(temperature)(ids, torch.tensor(logits))
    for on, warper in ((top_k > 0, lambda: TopKLogitsWarper(top_k)), (top_p < 1, lambda: TopPLogitsWarper(top_p)),
                       (min_p > 0, lambda: MinPLogitsWarper(min_p))):
        if on:
            scores = warper()(ids, scores)
    return np.isfinite(scores.numpy())


def test_truncation_keeps_what_transformers_keeps():
    """Random logits (no ties) over vocabularies with and without two-stage blocks, at settings
    from 'keep one token' to 'keep nearly all', alone and combined."""
    rng = np.random.default_rng(0)
    cases = 0
    for vocab in (7, 100, 6144):
        for temperature in (0.3, 1.0, 1.7):
            for top_k, top_p, min_p in ((1, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.1, 0.0), (0, 0.9, 0.0), (0, 0.999, 0.0),
                                        (0, 1.0, 0.05), (0, 1.0, 0.5), (40, 0.9, 0.0), (40, 0.95, 0.02),
                                        (0, 0.8, 0.1)):
                x = (rng.normal(size=(4, vocab)) * rng.uniform(0.5, 6)).astype(np.float32)
                ours = _kept(x, temperature, top_k=top_k, top_p=top_p, min_p=min_p)
                hf = _hf_kept(x, temperature, top_k, top_p, min_p)
                np.testing.assert_array_equal(ours, hf, err_msg=f"{vocab=} {temperature=} {top_k=} {top_p=} {min_p=}")
                cases += 1
    assert cases == 90


def test_truncation_laws_on_a_hand_made_row():
    x = np.log(np.array([[0.4, 0.25, 0.2, 0.1, 0.05]], np.float32))
    assert _kept(x, 1.0, top_k=2).tolist() == [[True, True, False, False, False]]
    # top-p: 0.4 + 0.25 = 0.65 < 0.7, so the third token is needed; 0.65 >= 0.6 is not.
    assert _kept(x, 1.0, top_p=0.7).tolist() == [[True, True, True, False, False]]
    assert _kept(x, 1.0, top_p=0.6).tolist() == [[True, True, False, False, False]]
    assert _kept(x, 1.0, min_p=0.3).tolist() == [[True, True, True, False, False]]  # 0.1 < 0.3 * 0.4
    # Temperature 2 flattens the row to p ~ sqrt(p): min-p compares sqrt(0.1 / 0.4) = 0.5 >= 0.3.
    assert _kept(x, 2.0, min_p=0.3).tolist() == [[True, True, True, True, True]]
    # top-p is taken over what top-k kept, renormalised: 0.4 / 0.65 = 0.615 >= 0.6.
    assert _kept(x, 1.0, top_k=2, top_p=0.6).tolist() == [[True, False, False, False, False]]
    row = jnp.asarray(x)
    assert truncate_logits(row, 1.0, top_k=0, top_p=1.0, min_p=0.0) is row  # all off: the logits themselves
    assert not truncates() and truncates(top_k=1) and truncates(top_p=0.99) and truncates(min_p=0.01)
    kept = np.asarray(truncate_logits(jnp.asarray(x), 1.0, top_k=3))
    np.testing.assert_array_equal(kept[0, :3], x[0, :3])  # kept logits are untouched, the rest -inf
    assert np.all(kept[0, 3:] == -np.inf)


def test_ties_at_a_cut_are_kept_or_cut_together():
    x = np.array([[3.0, 1.0, 1.0, 1.0, 0.0, -2.0]], np.float32)
    assert _kept(x, 1.0, top_k=2).tolist() == [[True, True, True, True, False, False]]  # the 2nd value is tied
    p = softmax(x[0])
    # The three tied tokens hold p[1:4]; a cut inside them keeps all three, in any order of the row.
    cut = p[0] + p[1] / 2
    assert _kept(x, 1.0, top_p=float(cut)).tolist() == [[True, True, True, True, False, False]]
    assert _kept(x[:, ::-1], 1.0, top_p=float(cut)).tolist() == [[False, False, True, True, True, True]]
    # All-equal rows keep everything; the most probable token survives any setting.
    assert _kept(np.zeros((1, 9), np.float32), 1.0, top_k=1, top_p=0.01).all()
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 300)).astype(np.float32) * 5
    kept = _kept(x, 0.5, top_k=1, top_p=0.01, min_p=0.99)
    assert kept.sum() == 64 and kept[np.arange(64), x.argmax(-1)].all()


def test_truncation_composes_with_jit_vmap_traced_temperature_and_bf16():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(6, 3, 6144)).astype(np.float32) * 3)
    x = x.at[1, 2, :100].set(-jnp.inf)
    temps = jnp.asarray([0.5, 1.0, 1.5, 0.7, 2.0, 1.0])
    eager = jnp.stack([truncate_logits(x[i], float(temps[i]), top_k=50, top_p=0.9, min_p=0.01) for i in range(6)])
    fn = jax.jit(jax.vmap(lambda l, t: truncate_logits(l, t, top_k=50, top_p=0.9, min_p=0.01)))
    np.testing.assert_array_equal(np.asarray(fn(x, temps)), np.asarray(eager))
    counts = np.isfinite(np.asarray(eager)).sum(-1)
    assert counts.min() >= 1 and counts.max() <= 50
    xb = x.astype(jnp.bfloat16)
    out = truncate_logits(xb, 1.0, top_k=50)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.isfinite(np.asarray(out, np.float32)),
                                  _kept(np.asarray(xb, np.float32), 1.0, top_k=50))
    # A padding row (no finite entry) stays all -inf rather than turning NaN.
    pad = truncate_logits(jnp.full((1, 6144), -jnp.inf), 1.0, top_k=5, top_p=0.5, min_p=0.1)
    assert np.all(np.asarray(pad) == -np.inf)


def test_per_row_truncation_equals_each_rows_static_settings():
    """Settings given as arrays, one per row (traced under jit), keep exactly what the same static
    settings keep for that row; 0 / 1 / 0 leave a row uncut, as the static "off" values do."""
    rng = np.random.default_rng(3)
    settings = [(0, 1.0, 0.0), (1, 1.0, 0.0), (5, 1.0, 0.0), (0, 0.5, 0.0), (0, 1.0, 0.2), (40, 0.9, 0.02),
                (6144, 0.999, 0.0), (0, 0.1, 0.5)]
    x = jnp.asarray(rng.normal(size=(len(settings), 3, 6144)).astype(np.float32) * 3)
    temps = jnp.asarray(rng.uniform(0.4, 1.6, len(settings)), jnp.float32)
    k, p, m = (jnp.asarray(v)[:, None] for v in zip(*settings))
    fn = jax.jit(lambda x, t, k, p, m: truncate_logits(x, t[:, None, None], top_k=k, top_p=p, min_p=m))
    got = np.asarray(fn(x, temps, k.astype(jnp.int32), p.astype(jnp.float32), m.astype(jnp.float32)))
    for i, (top_k, top_p, min_p) in enumerate(settings):
        want = np.asarray(truncate_logits(x[i], float(temps[i]), top_k=top_k, top_p=top_p, min_p=min_p))
        np.testing.assert_array_equal(got[i], want, err_msg=str(settings[i]))
    np.testing.assert_array_equal(got[0], np.asarray(x[0]))  # all off: uncut
    assert (np.isfinite(got[1]).sum(-1) == 1).all()  # top-k 1: the most probable token alone
    # NumPy arrays are per-row settings too (not static numbers for `check_truncation`).
    np_got = truncate_logits(x, temps[:, None, None], top_k=np.asarray(k, np.int32), top_p=np.asarray(p, np.float32),
                             min_p=np.asarray(m, np.float32))
    np.testing.assert_array_equal(np.asarray(np_got), got)


def test_the_cut_is_exact_to_the_last_bit_over_the_whole_int32_key_range():
    """Logits one float32 ulp apart are told apart even when the row also holds -inf (a masked token)
    or a huge negative logit: the bisection's key span is then over 2^31, so it needs all 32 halvings
    to land on the k-th value itself rather than on the float one ulp below it."""
    for top in (1.0, 5.0, 30.0, -2.0):
        for low in (-np.inf, -1e4, -3e38):
            vals = [np.float32(top)]
            for _ in range(3):
                vals.append(np.nextafter(vals[-1], np.float32(-np.inf)))
            x = np.array([[low, top / 2 - 7.0, *vals]], np.float32)
            for k in (1, 2, 3):
                want = [False, False] + [True] * k + [False] * (4 - k)
                assert _kept(x, 1.0, top_k=k)[0].tolist() == want, (top, low, k)


def test_temperature_zero_keeps_the_greedy_token():
    """Temperature 0 (greedy) must not divide by zero: whatever the settings, static or per row, the
    most probable token survives and no NaN appears (a greedy row may share a batch with cut rows)."""
    x = np.log(np.array([[0.4, 0.25, 0.2, 0.1, 0.05]], np.float32))
    for cut in (dict(min_p=0.3), dict(top_p=0.5), dict(top_k=2, top_p=0.9, min_p=0.1)):
        out = np.asarray(truncate_logits(jnp.asarray(x), 0.0, **cut))
        assert not np.isnan(out).any() and np.isfinite(out[0, 0]), cut
    k, p, m = jnp.asarray([2], jnp.int32), jnp.asarray([0.5], jnp.float32), jnp.asarray([0.3], jnp.float32)
    out = np.asarray(jax.jit(lambda t: truncate_logits(jnp.asarray(x), t, top_k=k, top_p=p, min_p=m))(
        jnp.zeros((1, 1), jnp.float32)))
    assert not np.isnan(out).any() and np.isfinite(out[0, 0])


@pytest.mark.parametrize("cut, error, message", [
    ({"top_k": -1}, ValueError, r"top_k must be >= 0 \(0: off\), got -1"),
    ({"top_k": 2.5}, TypeError, "top_k must be an int"),
    ({"top_k": True}, TypeError, "top_k must be an int"),
    ({"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\] \(1: off\), got 0.0"),
    ({"top_p": 1.5}, ValueError, "top_p must be in"),
    ({"top_p": float("nan")}, ValueError, "top_p must be in"),
    ({"min_p": 1.0}, ValueError, r"min_p must be in \[0, 1\) \(0: off\), got 1.0"),
    ({"min_p": -0.1}, ValueError, "min_p must be in"),
    ({"min_p": "0.1"}, TypeError, "min_p must be a number, got '0.1'"),
])
def test_bad_truncation_settings_are_named(cut, error, message):
    settings = {"top_k": 0, "top_p": 1.0, "min_p": 0.0} | cut
    with pytest.raises(error, match=message):
        check_truncation(**settings)
    with pytest.raises(error, match=message):
        truncate_logits(jnp.zeros((2, 8)), 1.0, **cut)


def test_logits_and_temperatures_of_the_wrong_kind_are_named():
    """Integer logits failed with "cannot convert float infinity to integer", a scalar with an
    IndexError, None as a temperature with "None is not a valid value for jnp.array"."""
    for logits in (jnp.arange(8), jnp.float32(1.0)):
        with pytest.raises(TypeError, match=r"truncate_logits: logits must be a floating \[\.\.\., V\] array"):
            truncate_logits(logits, 1.0, top_k=2)
    for bad in (None, "0.5", True):
        with pytest.raises(TypeError, match=r"temperature must be a number \(a scalar\)"):
            truncate_logits(jnp.zeros((2, 8)), bad, top_k=2)


@pytest.mark.parametrize("temperature", [float("nan"), -1.0, 1e39])
def test_a_concrete_bad_temperature_is_refused_by_truncation(temperature):
    """The one temperature rule (a traced value cannot be checked, and is not)."""
    with pytest.raises(ValueError, match="temperature must be a finite float32 number >= 0"):
        truncate_logits(jnp.zeros((2, 8)), temperature, top_k=2)
    jax.jit(lambda t: truncate_logits(jnp.zeros((2, 8)), t, top_k=2))(temperature)
