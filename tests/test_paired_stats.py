"""The tau error bars of `tevjax eval` and the experiments (`tevjax.stats`), checked against values worked by hand."""

import math

import pytest

from tevjax.stats import Z95, detectable_gain, influence, paired_gain, tau_se


def test_tau_and_se_by_hand():
    # tokens (2, 4), rounds (2, 2): tau 1.5; d = (-1/6, 1/6); Var(log tau) = 2 * 2/36 = 1/9; SE = 1.5 / 3.
    assert influence([2, 4], [2, 2]).tolist() == pytest.approx([-1 / 6, 1 / 6])
    tau, se = tau_se([2, 4], [2, 2])
    assert tau == 1.5 and se == pytest.approx(0.5)
    # Equal per-prompt tau: no spread, SE 0 whatever the lengths.
    assert tau_se([3, 6, 30], [2, 4, 20]) == (1.5, pytest.approx(0.0, abs=1e-15))
    assert math.isnan(tau_se([3], [2])[1])


def test_paired_gain_by_hand():
    # a: tokens (2, 4) rounds (2, 2), tau 1.5; b: tokens (3, 5) rounds (2, 2), tau 2.
    # d_a = (-1/6, 1/6); d_b = (3/8 - 1/2, 5/8 - 1/2) = (-1/8, 1/8); d_b - d_a = (1/24, -1/24);
    # Var = 2 * 2 / 576 = 1/144, SE = 1/12; gain = 2 / 1.5 - 1 = 1/3.
    g = paired_gain([2, 4], [2, 2], [3, 5], [2, 2])
    assert g["gain"] == pytest.approx(1 / 3)
    assert g["se_log"] == pytest.approx(1 / 12)
    assert g["lo"] == pytest.approx(4 / 3 * math.exp(-Z95 / 12) - 1)
    assert g["hi"] == pytest.approx(4 / 3 * math.exp(Z95 / 12) - 1)
    # An arm against itself: gain 0, SE 0.
    same = paired_gain([2, 4], [2, 2], [2, 4], [2, 2])
    assert same["gain"] == 0 and same["se_log"] == 0 and same["lo"] == same["hi"] == 0


def test_pairing_cancels_what_prompts_share():
    # b is a uniformly 10% better on every prompt: the paired SE is 0, while each arm alone varies.
    ta, ra = [10, 40, 12], [8, 10, 9]
    tb = [1.1 * x for x in ta]
    g = paired_gain(ta, ra, tb, ra)
    assert g["gain"] == pytest.approx(0.1) and g["se_log"] == pytest.approx(0.0, abs=1e-12)
    assert tau_se(ta, ra)[1] > 0.1


def test_detectable_gain_and_errors():
    assert detectable_gain(0.0) == 0.0
    assert detectable_gain(math.log(1.05) / Z95) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="same nonzero length"):
        influence([1, 2], [1])
    with pytest.raises(ValueError, match="same prompts"):
        paired_gain([1, 2], [1, 1], [1, 2, 3], [1, 1, 1])
