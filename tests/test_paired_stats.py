"""The tau error bars of `tevjax eval` and the experiments (`tevjax.stats`), checked against values worked by hand."""

import json
import math
import sys
from pathlib import Path
from statistics import NormalDist

import numpy as np
import pytest

from tevjax.stats import Z95, detectable_gain, influence, paired_gain, q95, tau_se

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))


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
    # Var = 2 * 2 / 576 = 1/144, SE = 1/12; gain = 2 / 1.5 - 1 = 1/3. Two prompts: t with 1 df, 12.706.
    g = paired_gain([2, 4], [2, 2], [3, 5], [2, 2])
    assert g["gain"] == pytest.approx(1 / 3)
    assert g["se_log"] == pytest.approx(1 / 12)
    assert g["lo"] == pytest.approx(4 / 3 * math.exp(-12.706204736 / 12) - 1)
    assert g["hi"] == pytest.approx(4 / 3 * math.exp(12.706204736 / 12) - 1)
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


def test_q95_is_students_t_with_n_minus_1_df():
    # Two-sided 95% t quantiles (any t table) for n prompts; the normal one when n is unknown or huge.
    for n, t in ((2, 12.7062047), (3, 4.3026527), (8, 2.3646243), (16, 2.1314495), (33, 2.0369333),
                 (256, 1.9693106)):
        assert q95(n) == pytest.approx(t, abs=1e-6)
    assert q95(None) == Z95 and q95(10**6) == pytest.approx(Z95, abs=1e-5) and math.isnan(q95(1))


def test_small_sample_intervals_cover_about_95_percent():
    """Prompts drawn from a skewed population of known pooled tau: with the normal quantile a "95%"
    interval from 6 prompts covered ~87% (tau) and ~88% (paired gain); t with 5 df covers ~93-94%."""
    rng = np.random.default_rng(0)
    rounds = rng.integers(20, 61, 5000).astype(float)
    tokens = (1 + rng.gamma(4, 0.25, 5000)) * rounds
    better = tokens * (1.1 + 0.1 * rng.standard_normal(5000))
    truth, log_gain = tokens.sum() / rounds.sum(), math.log(better.sum() / tokens.sum())
    covered = paired = 0
    for _ in range(2000):
        i = rng.integers(5000, size=6)
        tau, se = tau_se(tokens[i], rounds[i])
        covered += abs(tau - truth) <= q95(6) * se
        g = paired_gain(tokens[i], rounds[i], better[i], rounds[i])
        paired += math.log1p(g["lo"]) <= log_gain <= math.log1p(g["hi"])
    assert covered / 2000 > 0.92 and paired / 2000 > 0.92


def test_detectable_gain_and_errors():
    assert detectable_gain(0.0) == 0.0
    assert detectable_gain(math.log(1.05) / Z95) == pytest.approx(0.05)
    # Over n prompts, as paired_gain's t interval: a gain of exactly that size has its interval start at 0.
    ta, ra, tb = [20.0, 30, 44, 50], [10.0, 12, 20, 21], [22.0, 31, 50, 52]
    se = paired_gain(ta, ra, tb, ra)["se_log"]
    scaled = [x * (1 + detectable_gain(se, 4)) / (1 + paired_gain(ta, ra, tb, ra)["gain"]) for x in tb]
    assert paired_gain(ta, ra, scaled, ra)["lo"] == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="same nonzero length"):
        influence([1, 2], [1])
    with pytest.raises(ValueError, match="same prompts"):
        paired_gain([1, 2], [1, 1], [1, 2, 3], [1, 1, 1])


def test_z95_and_degenerate_inputs():
    # Z95 is the exact two-sided 95% normal quantile (1.96 would shift every interval slightly).
    assert Z95 == pytest.approx(NormalDist().inv_cdf(0.975), abs=1e-12)
    with pytest.raises(ValueError, match="same nonzero length"):
        influence([], [])
    with pytest.raises(ValueError, match="same nonzero length"):
        influence([[1, 2]], [[1, 1]])
    # No tokens or no rounds at all: tau is undefined, not nan silently.
    for tokens, rounds in (([0, 0], [1, 1]), ([1, 2], [0, 0])):
        with pytest.raises(ValueError, match="at least one token and one round"):
            influence(tokens, rounds)


def _eval_json(path, rows, **settings):
    """A file as `tevjax eval --json` writes it, with only the fields `compare_evals` reads."""
    run = {"prompts": "heldout", "num_prompts": 3, "max_new_tokens": 16, "temperature": 0.0, "seed": 0}
    run.update(settings)
    run["budgets"] = [{"budget": b, "prompt_emitted": e, "prompt_rounds": r} for b, e, r in rows]
    path.write_text(json.dumps(run))
    return str(path)


def test_compare_evals_pairs_the_budgets_both_arms_hold(tmp_path, capsys):
    import compare_evals

    a = _eval_json(tmp_path / "a.json", [(8, [10, 12, 16], [6, 8, 8]), (16, [10, 12, 16], [5, 8, 7])])
    b8 = _eval_json(tmp_path / "b8.json", [(8, [10, 12, 16], [4, 6, 4])])
    b32 = _eval_json(tmp_path / "b32.json", [(32, [10, 12, 16], [3, 3, 3])])
    out = tmp_path / "report.md"
    results = compare_evals.main(["--a", a, "--b", b8, b32, "--label-b", "chains", "--out", str(out)])
    assert [r["budget"] for r in results] == [8]  # 16 is only in A, 32 only in B
    expected = paired_gain([10, 12, 16], [6, 8, 8], [10, 12, 16], [4, 6, 4])
    assert results[0]["gain"] == pytest.approx(expected)
    assert results[0]["a"][0] == pytest.approx(38 / 22) and results[0]["b"][0] == pytest.approx(38 / 14)
    assert "| 8 | 1.727 [" in out.read_text() and f"{100 * expected['gain']:+.1f}%" in out.read_text()


@pytest.mark.parametrize("b_rows, b_settings, message", [
    ([(8, [1, 2, 3], [1, 1, 1])], {"num_prompts": 4}, "other prompts or settings (num_prompts 3 vs 4)"),
    ([(8, [1, 2, 3], [1, 1, 1])], {"temperature": 1.0}, "temperature 0.0 vs 1.0"),
    ([(16, [1, 2, 3], [1, 1, 1])], {}, "no budget in both arms (A: [8], B: [16])"),
])
def test_compare_evals_refuses_runs_that_do_not_pair(tmp_path, capsys, b_rows, b_settings, message):
    import compare_evals

    a = _eval_json(tmp_path / "a.json", [(8, [1, 2, 3], [1, 1, 1])])
    b = _eval_json(tmp_path / "b.json", b_rows, **b_settings)
    with pytest.raises(SystemExit) as e:
        compare_evals.main(["--a", a, "--b", b])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_compare_evals_refuses_other_prompt_texts_under_the_same_spec(tmp_path, capsys):
    """Counts pair by position: two runs of `--prompts p.txt` on files of other texts (or the same texts
    in another order) must not pair, while files made before the digest was kept still do."""
    import compare_evals

    rows = [(8, [10, 12, 16], [6, 8, 8])]
    a = _eval_json(tmp_path / "a.json", rows, prompts="p.txt", prompts_sha256="0" * 64)
    b = _eval_json(tmp_path / "b.json", rows, prompts="p.txt", prompts_sha256="1" * 64)
    with pytest.raises(SystemExit) as e:
        compare_evals.main(["--a", a, "--b", b])
    assert e.value.code == 2 and "b.json: other prompt texts than" in capsys.readouterr().err
    b16 = _eval_json(tmp_path / "b16.json", [(16, [10, 12, 16], [6, 8, 8])], prompts="p.txt", prompts_sha256="1" * 64)
    with pytest.raises(SystemExit):  # within one arm too
        compare_evals.main(["--a", a, "--b", a, b16])
    assert "b16.json: other prompt texts than" in capsys.readouterr().err
    old = _eval_json(tmp_path / "old.json", [(16, [10, 12, 16], [6, 8, 8])], prompts="p.txt")
    assert [r["budget"] for r in compare_evals.main(["--a", a, old, "--b", a])] == [8]


def test_compare_evals_refuses_an_arm_of_mixed_configurations_and_other_sampling_laws(tmp_path, capsys):
    """One arm's files must be one decoding configuration (a budget-16 file without the chains joined a
    budget-8 file with them, and was reported under the arm's label), and sampled arms must share the
    truncation (min-p 0.1 against no cut paired two target laws); greedy arms need not, and files that
    lack a field (made before it existed) are not refused for it."""
    import compare_evals

    rows8, rows16 = [(8, [10, 12, 16], [6, 8, 8])], [(16, [10, 12, 16], [5, 8, 7])]
    chains = dict(lookup=None, corpus=None, verifier="tev")
    a = _eval_json(tmp_path / "a.json", rows8 + rows16, **chains)
    b8 = _eval_json(tmp_path / "b8.json", rows8, **chains)
    alone16 = _eval_json(tmp_path / "alone16.json", rows16, lookup=0, corpus=0, verifier="tev")
    with pytest.raises(SystemExit) as e:
        compare_evals.main(["--a", a, "--b", b8, alone16])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "alone16.json: lookup 0, corpus 0" in err and "lookup None, corpus None" in err
    old16 = _eval_json(tmp_path / "old16.json", rows16)  # no lookup field: not refused for it
    assert [r["budget"] for r in compare_evals.main(["--a", a, "--b", b8, old16])] == [8, 16]
    cut = dict(temperature=1.0, top_k=0, top_p=1.0)
    a1 = _eval_json(tmp_path / "a1.json", rows8, min_p=0.0, **cut)
    b1 = _eval_json(tmp_path / "b1.json", rows8, min_p=0.1, **cut)
    with pytest.raises(SystemExit) as e:
        compare_evals.main(["--a", a1, "--b", b1])
    assert e.value.code == 2 and "b1.json: min_p 0.1, " in capsys.readouterr().err
    a0 = _eval_json(tmp_path / "a0.json", rows8, min_p=0.0, top_k=0)
    b0 = _eval_json(tmp_path / "b0.json", rows8, min_p=0.1, top_k=0)  # greedy: the cut changes nothing
    assert [r["budget"] for r in compare_evals.main(["--a", a0, "--b", b0])] == [8]


def test_compare_evals_names_the_bad_file(tmp_path, capsys):
    import compare_evals

    good = _eval_json(tmp_path / "good.json", [(8, [1, 2, 3], [1, 1, 1])])
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"prompts": "heldout", "num_prompts": 3, "max_new_tokens": 16, "temperature": 0.0,
                               "seed": 0, "budgets": [{"budget": 8, "tau": 2.0}]}))
    (tmp_path / "bad.json").write_text("{not json")
    cases = [(str(old), f"{old}: budget 8 has no per-prompt counts"),
             (str(tmp_path / "bad.json"), "bad.json: not JSON"),
             (str(tmp_path / "none.json"), "none.json: no such file"),
             (good + " " + good, "budget 8 is in two files of the same arm")]
    for b, message in cases:
        with pytest.raises(SystemExit):
            compare_evals.main(["--a", good, "--b", *b.split()])
        assert message in capsys.readouterr().err


def test_output_tau_counts_each_prompts_output_against_its_rounds(tmp_path, monkeypatch):
    """`experiments/output_tau.py` on old greedy files: output tokens per round from the per-prompt
    output lengths (a stand-in for its AR pass) and each row's rounds, beside tau from the whole
    verified blocks, and the paired gain on each; it refuses sampled runs, runs whose outputs differ
    from AR's, and an AR pass whose total is not the runs' (other prompts)."""
    import output_tau

    lengths = [9, 12, 15]  # each prompt's last block was cut: 1, 0 and 1 tokens fewer than verified
    rows_a, rows_b = [(8, [10, 12, 16], [6, 8, 8])], [(8, [10, 12, 16], [4, 6, 4])]
    a = _eval_json(tmp_path / "a.json", [(b, e, r) for b, e, r in rows_a])
    b = _eval_json(tmp_path / "b.json", [(b, e, r) for b, e, r in rows_b])
    for path in (a, b):  # the fields output_tau reads beyond compare_evals'
        run = json.loads(Path(path).read_text())
        run["budgets"][0] |= {"tokens": 36, "mismatches": 0}
        Path(path).write_text(json.dumps(run))
    monkeypatch.setattr(output_tau, "output_lengths", lambda settings, batch, digest: lengths)
    lines = output_tau.main(["--a", a, "--b", b, "--out", str(tmp_path / "o.md")])
    out = json.loads((tmp_path / "o.json").read_text())
    arm_a = out["arms"]["A"]["8"]
    assert arm_a["tau"] == pytest.approx(38 / 22) and arm_a["tau_out"] == pytest.approx(36 / 22)
    assert out["arms"]["B"]["8"]["tau_out"] == pytest.approx(36 / 14)
    assert out["arms"]["B"]["8"]["tau_out_se"] == pytest.approx(tau_se(lengths, [4, 6, 4])[1])
    gain = paired_gain(lengths, [6, 8, 8], lengths, [4, 6, 4])["gain"]
    assert out["gains"]["8"]["tau_out"]["gain"] == pytest.approx(gain) and f"{gain:+.1%}" in "\n".join(lines)
    monkeypatch.setattr(output_tau, "output_lengths", lambda settings, batch, digest: [9, 12, 14])
    with pytest.raises(SystemExit, match="the AR pass output 35 tokens, the run 36"):
        output_tau.main(["--a", a])
    for batch in ("0", "-3"):  # refused before any model loads (0 raised in range(), -3 decoded nothing)
        with pytest.raises(SystemExit) as e:
            output_tau.main(["--a", a, "--batch", batch])
        assert e.value.code == 2
    for change, message in (({"temperature": 1.0}, "temperature 1.0: only greedy outputs equal AR's"),
                            ({"mismatches": 2}, "budget 8 has 2 outputs unlike AR's")):
        run = json.loads(Path(a).read_text())
        run.update({k: v for k, v in change.items() if k == "temperature"})
        run["budgets"][0].update({k: v for k, v in change.items() if k == "mismatches"})
        Path(tmp_path / "bad.json").write_text(json.dumps(run))
        with pytest.raises(SystemExit, match=message):
            output_tau.main(["--a", str(tmp_path / "bad.json")])
