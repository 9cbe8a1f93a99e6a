"""The paper-claim experiments reject bad command lines with a one-line error, before loading any model."""

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tevjax.testing import forced_devices_env

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import adaptive_budget  # noqa: E402
import budget_transfer  # noqa: E402
import chat_reuse  # noqa: E402
import crossed  # noqa: E402
import data_curve  # noqa: E402
import exit_mass  # noqa: E402
import exittrain_ablation  # noqa: E402
import fallback  # noqa: E402
import fixed_tree_equivalence  # noqa: E402
import moe_dispatch  # noqa: E402
import heldout_screen  # noqa: E402
import hybrid_latency  # noqa: E402
import kill_resume  # noqa: E402
import rerender  # noqa: E402
import round_blocks  # noqa: E402
import round_stages  # noqa: E402
import truncation  # noqa: E402
import verifier_latency  # noqa: E402


def error_of(parse, argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


def test_missing_drafter_dir_is_named(tmp_path, capsys):
    missing = str(tmp_path / "no-such-drafter")
    assert f"--drafter {missing!r}: no such checkpoint directory" in error_of(
        fixed_tree_equivalence.parse_args, ["--drafter", missing], capsys)
    assert f"--drafter {missing!r}: no such checkpoint directory" in error_of(
        exit_mass.parse_args, ["--drafter", str(tmp_path), "--drafter", missing], capsys)


def test_exit_mass_labels_match_drafters(tmp_path, capsys):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    assert "one label per --drafter" in error_of(
        exit_mass.parse_args, ["--drafter", str(a), "--drafter", str(b), "--label", "x"], capsys)
    assert "labels must be distinct" in error_of(
        exit_mass.parse_args, ["--drafter", str(a), "--drafter", str(b), "--label", "x", "--label", "x"], capsys)
    args = exit_mass.parse_args(["--drafter", str(a), "--drafter", str(b)])
    assert args.label == ["a", "b"] and args.heat_budget == 64


def test_exit_mass_coverage_se_takes_prompts_as_units():
    """C_p's SE over rounds counts prompts, not rounds, as the independent units: two prompts whose
    four rounds each cover 1 and 0 leave the mean 0.5 resting on two draws (SE 0.5, the delta method
    over prompts), where std / sqrt(rounds) said 0.189; rounds that vary alike within each prompt
    leave no spread between prompts (SE 0)."""
    stats = [{"prompt": i // 4, "coverage": {8: 1.0 - i // 4}, "exit_mass": np.zeros((2, 2)),
              "nodes": np.zeros((2, 2)), "kinds": [1.0, 0.0, 0.0, 0.0]} for i in range(8)]
    agg = exit_mass.aggregate(stats, [8])
    assert agg["coverage"]["8"] == pytest.approx({"mean": 0.5, "se": 0.5})
    assert agg["prompts"] == 2 and agg["round_prompt"] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert exit_mass.coverage_se([1.0, 0.0, 1.0, 0.0], [0, 0, 1, 1]) == pytest.approx(0.0, abs=1e-12)
    assert math.isnan(exit_mass.coverage_se([1.0, 0.0], [3, 3])) and exit_mass.coverage_se([0, 0], [0, 1]) == 0.0


def test_quick_modes_write_to_tmp():
    assert str(fixed_tree_equivalence.parse_args(["--quick"]).out).startswith("/tmp/")
    assert str(exit_mass.parse_args(["--quick"]).out).startswith("/tmp/")
    assert fixed_tree_equivalence.parse_args([]).out == fixed_tree_equivalence.RESULTS


def test_sampled_temperatures_only(capsys):
    assert "greedy is always checked separately" in error_of(
        fixed_tree_equivalence.parse_args, ["--temperatures", "0", "1"], capsys)


def test_training_experiments_check_their_options(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "manifest.json").write_text("{}")
    base = ["--data", str(data)]
    abl = exittrain_ablation.parse_args
    assert "--arms 'x': choose from" in error_of(abl, [*base, "--arms", "x"], capsys)
    assert "--prompt-sets 'math500': choose from" in error_of(abl, [*base, "--prompt-sets", "math500"], capsys)
    assert "--exit-lambda must be > 0" in error_of(abl, [*base, "--exit-lambda", "0"], capsys)
    assert "--steps must be >= 1" in error_of(abl, [*base, "--steps", "0"], capsys)
    # Data are needed only to train an arm, so evaluating exported arms parses without them.
    assert abl(["--data", str(tmp_path / "none")]).data == str(tmp_path / "none")
    assert "no DFlash checkpoint there" in error_of(abl, [*base, "--init", str(tmp_path)], capsys)
    args = abl([*base, "--arms", "w", "w", "--budgets", "16", "4", "4", "--temperatures", "1", "0", "1"])
    assert args.arms == ["token", "w"] and args.budgets == [4, 16]  # the control always comes first
    assert args.temperatures == [1.0, 0.0]  # a repeat was decoded again and counted twice in the summary
    cell = {"gain": 0.05, "gain_lo": 0.04, "gain_hi": 0.06, "detectable": 0.02}
    table = {"w": {"heldout": {"1.0": {"8": cell}, "0.0": {"8": {**cell, "gain": -0.05, "gain_lo": -0.06,
                                                                   "gain_hi": -0.04}}}}}
    assert "mean paired gain +0.0% over 2 cells; interval above 0 in 1, below 0 in 1" in \
        exittrain_ablation.pooled_lines(table, args.arms, ["heldout"], args.temperatures, [8])[2]
    assert args.out == exittrain_ablation.RESULTS
    # Budget transfer: an exit-loss arm only; crossed: both drafters or neither.
    assert "choose an exit-loss arm" in error_of(budget_transfer.parse_args, [*base, "--arm", "token"], capsys)
    assert budget_transfer.parse_args([*base, "--train-budgets", "32", "8", "8"]).train_budgets == [8, 32]
    assert "give both --token-drafter and --exittrain-drafter" in error_of(
        crossed.parse_args, [*base, "--token-drafter", str(tmp_path)], capsys)
    assert "no DFlash checkpoint there" in error_of(
        crossed.parse_args, [*base, "--token-drafter", str(tmp_path), "--exittrain-drafter", str(tmp_path)], capsys)
    assert crossed.parse_args(base).budgets == [32]


def test_training_experiments_quick_runs_stay_out_of_the_repo():
    for mod in (exittrain_ablation, budget_transfer, crossed):
        args = mod.parse_args(["--quick"])
        assert str(args.out).startswith("/tmp/") and args.runs.startswith("/tmp/"), mod.__name__
    # Full runs keep their fine-tunes outside the repository, in one folder per training configuration.
    args = exittrain_ablation.parse_args(["--data", str(exittrain_ablation.DATA)]) \
        if (exittrain_ablation.DATA / "manifest.json").exists() else exittrain_ablation.parse_args(["--quick"])
    root = Path(__file__).resolve().parents[1]
    assert root not in exittrain_ablation.arm_dir(args, "w", 32).parents
    assert exittrain_ablation.arm_dir(args, "token", 8) == exittrain_ablation.arm_dir(args, "token", 32)
    assert exittrain_ablation.arm_dir(args, "w", 8) != exittrain_ablation.arm_dir(args, "w", 32)


def test_verifier_latency_options(capsys):
    assert "--temperatures must be finite and > 0" in error_of(verifier_latency.main, ["--temperatures", "0"], capsys)
    assert "--capacity 64 must hold twice the largest tree" in error_of(
        verifier_latency.main, ["--capacity", "64", "--budgets", "32"], capsys)
    assert verifier_latency.commit_target(49_152)[0] == "smollm2-135m"
    assert verifier_latency.commit_target(151_936)[0] == "qwen3-4b"


def test_round_stages_checks_its_arguments(tmp_path, capsys):
    assert "--budget must be >= 1, got 0" in error_of(round_stages.parse_args, ["--budget", "0"], capsys)
    assert "--iters must be >= 5, got 2" in error_of(round_stages.parse_args, ["--iters", "2"], capsys)
    missing = str(tmp_path / "none")
    assert f"--drafter {missing!r}: no such checkpoint directory" in error_of(
        round_stages.parse_args, ["--drafter", missing], capsys)
    args = round_stages.parse_args(["--budget", "4", "--iters", "5"])
    assert (args.budget, args.iters, args.prefix) == (4, 5, 256)


def test_training_an_arm_without_data_names_the_data(tmp_path):
    args = exittrain_ablation.parse_args(["--runs", str(tmp_path / "runs")])
    setup = exittrain_ablation.Setup("smollm2", None, (2,), tmp_path / "none", tmp_path / "init", {}, {}, "")
    with pytest.raises(SystemExit, match=r"arm w: no exported drafter at .*, and --data '.*none' is not a "
                                         r"`tevjax data` directory"):
        exittrain_ablation.ensure_arm(setup, args, "w", 32)
    # An arm exported there is used as it is: no data, no training.
    d = exittrain_ablation.arm_dir(args, "w", 32) / "drafter"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    rec = exittrain_ablation.ensure_arm(setup, args, "w", 32)
    assert rec["dir"] == str(d) and not rec["trained_now"]
    # Its report does not claim the run's --init and --data (unused) as the arms' origin.
    head = "\n".join(exittrain_ablation.header("t", [], args, setup, 1.0, 1.0, "d", "m", "s.py", trained=False))
    assert str(setup.data_dir) not in head and str(setup.init_dir) not in head and str(args.runs) in head
    head = "\n".join(exittrain_ablation.header("t", [], args, setup, 1.0, 1.0, "d", "m", "s.py"))
    assert str(setup.data_dir) in head and str(setup.init_dir) in head


def test_eval_cache_reuses_exactly_the_same_cells(tmp_path, monkeypatch):
    """A cell is decoded once and reused by a later run only when drafter bytes, prompts and settings match."""
    abl = exittrain_ablation
    drafters = {}
    for name, weights in (("a", b"1"), ("b", b"2")):
        d = drafters[name] = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text("{}")
        (d / "model.safetensors").write_bytes(weights)
    setup = abl.Setup("smollm2", None, (2,), tmp_path, tmp_path, {"heldout": [[5, 6], [7]]}, {}, "x")
    decoded = []

    def fake_counts(decoder, prompts, seed):
        decoded.append(decoder)
        return {"tokens": [3.0 * decoder[1], 2.0], "rounds": [2, 1]}

    monkeypatch.setattr(abl, "load_drafter", lambda setup, ddir: str(ddir))
    monkeypatch.setattr(abl, "make_decoder", lambda setup, drafter, every, budget, temperature, max_new_tokens:
                        (drafter, budget, temperature))
    monkeypatch.setattr(abl, "decode_counts", fake_counts)

    def run(cache, budgets=(4, 8), temperatures=(0.0,)):
        args = abl.parse_args(["--eval-cache", cache, "--prompt-sets", "heldout", "--temperatures",
                               *map(str, temperatures), "--budgets", *map(str, budgets)])
        return abl.evaluate_arms(setup, args, {k: str(v) for k, v in drafters.items()}, args.budgets, "a")

    first = run(str(tmp_path / "cache"))
    assert len(decoded) == 4 and first["reused_cells"] == 0
    again = run(str(tmp_path / "cache"), budgets=(4, 8, 16), temperatures=(0.0, 1.0))
    assert len(decoded) == 4 + 8 and again["reused_cells"] == 4  # only B = 16 and T = 1 are new
    assert again["counts"]["b"]["heldout"]["0.0"]["8"] == first["counts"]["b"]["heldout"]["0.0"]["8"]
    assert again["counts"]["b"]["heldout"]["0.0"]["8"]["tokens"] == [24.0, 2.0]
    # New drafter bytes, or no cache: decoded afresh.
    (drafters["b"] / "model.safetensors").write_bytes(b"3")
    assert run(str(tmp_path / "cache"))["reused_cells"] == 2 and len(decoded) == 12 + 2
    assert run("")["reused_cells"] == 0 and len(decoded) == 14 + 4
    assert not list((tmp_path / "cache").glob("*.tmp"))


def test_large_z_note_lists_only_passing_large_z_and_names_near_degenerate_trees():
    row = dict(tree=5, temperature=1.0, method="sequential", exact=1.0002, mean=1.0008, draws=65536,
               halfwidth=2e-3, pass_=True)
    rows = [
        {**row, "pass": True, "z": 5.8, "variance": 2.6e-4, "deviation": 6e-4},     # listed, ordinary tree
        {**row, "pass": True, "z": -12.0, "variance": 3e-7, "deviation": 1.5e-5},   # listed, Var L < 1e-5
        {**row, "pass": True, "z": 3.9, "variance": 1e-3, "deviation": 1e-4},       # |z| <= 4: not listed
        {**row, "pass": False, "z": 9.0, "variance": 1e-3, "deviation": 1e-2},      # failures are reported elsewhere
        {**row, "pass": True, "z": float("nan"), "variance": 0.0, "deviation": 0.0},
    ]
    lines = fixed_tree_equivalence.large_z_note(rows)
    table = [x for x in lines if x.startswith("| 5 |")]
    assert len(table) == 2
    assert "-12.0" in table[0] and "+5.8" in table[1]  # sorted by |z|, largest first
    assert "+39.3 of 65536" in table[1]  # draws beyond the law's mean = deviation x draws
    assert any(x.startswith("1 of them are trees whose block length is almost surely 1") for x in lines)
    assert fixed_tree_equivalence.large_z_note(rows[2:]) == []


def test_end_to_end_decodes_each_temperature_and_dataset_once():
    """A repeated temperature or dataset used to be decoded again into the same cells: the pooled row
    counted the dataset twice and the checks of the second pass read the first pass's runs."""
    import end_to_end

    args = end_to_end.parse_args(["--temperatures", "1", "0", "1", "--datasets", "gsm", "mtbench", "gsm",
                                  "--budgets", "16", "8", "16"])
    assert args.temperatures == [1.0, 0.0] and args.datasets == ["gsm", "mtbench"] and args.budgets == [8, 16]
    run = lambda n: end_to_end.Run(tokens=[1] * n, seconds=1.0, rounds=n, block_total=n, rss_mb=0.0)  # noqa: E731
    runs = {(0.0, "gsm", "ar", 0): [[run(4)]], (0.0, "mtbench", "ar", 0): [[run(6)]]}
    rows = end_to_end.summarize(runs, args.datasets, [("ar", 0)], [0.0], 1)
    assert [(r["dataset"], r["tokens"]) for r in rows] == [("gsm", 4), ("mtbench", 6), ("all", 10)]


def test_exittrain_and_crossed_plots_draw_t_intervals(tmp_path, monkeypatch):
    """The plots' "tau (95% interval)" bars are q95(n) SE, as the tables' intervals (`tevjax.stats`), not
    1.96 SE: at 16 prompts 2.131 SE."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.axes

    from tevjax.stats import q95

    drawn = []
    for name in ("errorbar", "bar"):
        real = getattr(matplotlib.axes.Axes, name)

        def spy(self, *a, _real=real, **kw):
            if kw.get("yerr") is not None:
                drawn.append(np.asarray(kw["yerr"], float))
            return _real(self, *a, **kw)

        monkeypatch.setattr(matplotlib.axes.Axes, name, spy)
    cell = {"tau": 2.0, "se": 0.1}
    table = {"token": {"heldout": {"0.0": {"8": cell, "16": cell}}}}
    exittrain_ablation.plot(table, ["token"], ["heldout"], [0.0], [8, 16], tmp_path / "a.png", "t", 16)
    assert drawn[0] == pytest.approx([0.1 * 2.1314495] * 2) and q95(16) == pytest.approx(2.1314495)
    drawn.clear()
    combos = [("token-only", "predraw")]
    results = {"1.0": {"token-only + predraw": {**cell, "sr": 0.5, "sr_range": [0.4, 0.6]}}}
    stage = {"1.0": {"token-only": {"predraw": {"median": 2.0, "p10": 1.9, "p90": 2.1}}}}
    crossed.plot(results, stage, combos, [1.0], tmp_path / "c.png", 48)
    assert drawn[0] == pytest.approx([0.1 * q95(48)])


def test_round_blocks_groups_by_round_index():
    rows = round_blocks.by_round([[1, 3, 2, 2], [2, 1], [4]], shown=2)
    assert [r["round"] for r in rows] == ["0", "1", ">=2"]
    assert [r["rounds"] for r in rows] == [3, 2, 2]
    assert [r["mean"] for r in rows] == [7 / 3, 2.0, 2.0]
    assert rows[2]["se"] == 0.0
    with pytest.raises(ValueError, match="shown"):
        round_blocks.by_round([[1]], shown=0)


def test_round_blocks_rejects_bad_drafters_and_labels(tmp_path, capsys):
    missing = str(tmp_path / "nope")
    assert f"--drafter {missing!r}: no such checkpoint directory" in error_of(
        round_blocks.parse_args, ["--drafter", missing], capsys)
    assert "one label per --drafter" in error_of(
        round_blocks.parse_args, ["--drafter", str(tmp_path), "--label", "a", "--label", "b"], capsys)
    assert "--budget must be >= 1" in error_of(round_blocks.parse_args, ["--budget", "0"], capsys)
    for bad in ("-1", "1e39"):
        assert "--temperature must be a finite float32 number >= 0" in error_of(
            round_blocks.parse_args, ["--temperature", bad], capsys)
    assert "--first-prompt must be >= 0" in error_of(round_blocks.parse_args, ["--first-prompt", "-1"], capsys)


def test_data_curve_fit_and_extrapolation(tmp_path):
    """Points on tau = 1 + 0.05 log2(records) give that line back, and the records at which it
    reaches a goal; eval files measured differently are refused rather than fitted together."""
    pts = [(f"v{i}", r, 1.0 + 0.05 * math.log2(r), 0.03) for i, r in enumerate((1000, 2000, 4000, 8000))]
    f = data_curve.fit(pts)
    assert abs(f["slope"] - 0.05) < 1e-12 and abs(f["intercept"] - 1.0) < 1e-12 and f["slope_se"] > 0
    mid, optimistic, pessimistic = data_curve.extrapolate(pts, f, 1.0 + 0.05 * 20)
    assert abs(math.log2(mid) - 20) < 1e-9 and optimistic < mid < pessimistic
    flat = data_curve.fit([(p[0], p[1], 1.5, 0.03) for p in pts])
    assert data_curve.extrapolate(pts, flat, 2.0)[0] == math.inf  # no trend: never
    for name, seed in (("a.json", 0), ("b.json", 1)):
        (tmp_path / name).write_text(json.dumps({
            "num_prompts": 16, "max_new_tokens": 128, "temperature": 0.0, "seed": seed, "verifier": "tev",
            "mismatches": 0, "budgets": [{"budget": 8, "tau": 1.8, "tau_prompt_sd": 0.1}]}))
    with pytest.raises(ValueError, match="not comparable"):
        data_curve.load_points(tmp_path, (("a", "a.json", 10), ("b", "b.json", 20)))


def test_data_curve_refuses_other_prompt_sets_budgets_and_chains(tmp_path):
    """Points must be the same prompts at the same budgets with the drafter alone: a 16-prompt MT-Bench file
    was fitted with held-out ones, and a file without budget 4 shifted the table's rows (row i of every
    budget is read as the same drafter)."""
    def write(name, prompts="heldout", budgets=((4, 1.6), (8, 1.7)), **row):
        (tmp_path / name).write_text(json.dumps({
            "prompts": prompts, "num_prompts": 16, "max_new_tokens": 128, "temperature": 0.0, "seed": 0,
            "verifier": "tev", "mismatches": 0,
            "budgets": [{"budget": b, "tau": t, "tau_prompt_sd": 0.1, **row} for b, t in budgets]}))

    write("a.json")
    write("b.json", budgets=((4, 1.7), (8, 1.9)))
    pts = data_curve.load_points(tmp_path, (("a", "a.json", 10), ("b", "b.json", 20)))
    assert pts[8] == [("a", 10, 1.7, 0.025), ("b", 20, 1.9, 0.025)]
    for name, kwargs in (("mt.json", {"prompts": "mtbench"}), ("b8.json", {"budgets": ((8, 1.8),)}),
                         ("chains.json", {"lookup": 8, "corpus": 8})):
        write(name, **kwargs)
        with pytest.raises(ValueError, match="not comparable|not the drafter alone"):
            data_curve.load_points(tmp_path, (("a", "a.json", 10), (name, name, 20)))


def test_draft_temperature_options_and_scorer(tmp_path, capsys):
    import draft_temperature as dt

    data = tmp_path / "data"
    data.mkdir()
    assert "not a `tevjax data` directory" in error_of(dt.parse_args, ["--data", str(data)], capsys)
    (data / "manifest.json").write_text("{}")
    assert "must include 1.0" in error_of(dt.parse_args, ["--data", str(data), "--temperatures", "0.5"], capsys)
    assert "must all be > 0" in error_of(dt.parse_args, ["--data", str(data), "--temperatures", "0", "1"], capsys)
    assert "include --tune-budget 8" in error_of(dt.parse_args, ["--data", str(data), "--budgets", "4"], capsys)
    assert dt.parse_args(["--data", str(data)]).budgets == [4, 8, 16, 32]

    # One anchor, two depths, a 32-token vocabulary. Depth 1: tokens 10 and 11 nearly tied; depth 2:
    # token 20 only mildly ahead of 31 others. At T = 1 a budget-2 tree holds 10 and 11 (the data
    # 10, 20 reaches depth 1: 2 tokens); sharpening depth 2 (T = 0.1) makes 10 -> 20 beat 11 (3 tokens).
    top = np.full((1, 2, 32), -20.0, np.float32)
    top[0, 0, :2] = [0.0, -0.1]
    top[0, 1, 0], top[0, 1, 1:] = 0.0, -1.0
    temps = (0.1, 1.0)
    lse = np.stack([np.log(np.exp(top / t).sum(-1)) for t in temps], -1)
    d = {"top": top, "ids": np.stack([np.arange(10, 42), np.arange(20, 52)])[None].astype(np.int32),
         "lse": lse.astype(np.float32), "truth": np.array([[10, 20]], np.int32), "ok": np.ones((1, 2), bool),
         "root": np.array([5], np.int32), "record": np.array([0])}
    score = dt.make_scorer(d, temps, (1, 2))
    assert score([1, 1])[2].tolist() == [2.0] and score([1, 0])[2].tolist() == [3.0]
    assert score([1, 1])[1].tolist() == [2.0]
    tokens, anchors = dt.per_record(np.array([2.0, 3.0, 1.0]), np.array([4, 9, 4]))
    assert tokens.tolist() == [3.0, 3.0] and anchors.tolist() == [2.0, 1.0]


def test_heldout_screen_rejects_bad_arguments(tmp_path, capsys):
    assert "not a `tevjax data` directory" in error_of(heldout_screen.parse_args, ["--data", str(tmp_path)], capsys)
    (tmp_path / "manifest.json").write_text("{}")
    ok = ["--data", str(tmp_path)]
    assert "--anchors must be >= 1" in error_of(heldout_screen.parse_args, ok + ["--anchors", "0"], capsys)
    assert "--budgets must all be >= 1" in error_of(heldout_screen.parse_args, ok + ["--budgets", "8", "0"], capsys)
    assert "give one label per --drafter" in error_of(
        heldout_screen.parse_args, ok + ["--drafter", str(tmp_path), "--label", "a", "--label", "b"], capsys)
    args = heldout_screen.parse_args(ok + ["--drafter", str(tmp_path), "--label", "a"])
    assert args.drafters == [str(tmp_path)] and args.budgets == [4, 8, 16] and args.anchors == 128


def test_lookup_experiments_check_their_arguments_and_measure_survival(capsys, tmp_path):
    import lookup_gain
    import lookup_survival

    argv = ["--budget", "4", "--lookups", "0", "5"]
    assert "--lookups and --corpus must lie in [0, --budget 4]" in error_of(lookup_gain.parse_args, argv, capsys)
    assert "--lookups and --corpus must lie in [0, --budget 4], got [8, -1]" in error_of(
        lookup_gain.parse_args, ["--budget", "4", "--corpus", "-1"], capsys)
    assert "--corpus-exponents must be finite and > 0" in error_of(
        lookup_gain.parse_args, ["--corpus-exponents", "inf"], capsys)
    assert "--exponents must be finite and > 0" in error_of(lookup_gain.parse_args, ["--exponents", "1", "0"], capsys)
    assert lookup_gain.parse_args(["--exponents", "0.5", "2"]).exponents == [0.5, 2.0]
    assert "--corpus-file " + repr(str(tmp_path / "none.npz")) + ": no such file" in error_of(
        lookup_gain.parse_args, ["--corpus-file", str(tmp_path / "none.npz")], capsys)
    (tmp_path / "flat.json").write_text("[[0.5, 0.6]]")
    assert "survival must be a 5 x D table" in error_of(
        lookup_gain.parse_args, ["--survival", str(tmp_path / "flat.json")], capsys)
    assert "--survival" in error_of(lookup_gain.parse_args, ["--survival", str(tmp_path / "none.json")], capsys)
    (tmp_path / "t1.json").write_text(json.dumps([[0.5, 0.25]] * 5))
    args = lookup_gain.parse_args(["--survival", str(tmp_path / "t1.json"), "--exponents", "1", "2"])
    from tevjax.builder import LOOKUP_SURVIVAL

    squared = tuple(tuple(x ** 2.0 for x in r) for r in LOOKUP_SURVIVAL)
    assert args.tables == {"builder^1": LOOKUP_SURVIVAL, "builder^2": squared, "t1": ((0.5, 0.25),) * 5}
    assert "no such file" in error_of(lookup_survival.main, [str(tmp_path / "none.npz")], capsys)
    assert "--temperature must be finite and > 0" in error_of(
        lookup_survival.main, [str(tmp_path / "none.npz"), "--temperature", "0"], capsys)
    # A record that repeats "1 2 3" after its prompt: every order-n chain holds to the end.
    tokens = np.array([9, 8, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2], np.uint16)
    table, counts = lookup_survival.survival(tokens, np.array([0, 16]), np.array([2]), 1, 128, 3)
    assert counts.sum() > 0 and np.all(table[counts > 0] == 1.0)


def test_corpus_calibration_checks_its_arguments_and_counts_held_tokens(capsys, tmp_path):
    import corpus_calibration

    assert "no such file" in error_of(corpus_calibration.main, [str(tmp_path / "a.npz"), str(tmp_path / "b.npz")],
                                      capsys)
    assert "--records must be" in error_of(corpus_calibration.main, ["a", "b", "--records", "0"], capsys)
    chains = np.array([[1, 2, 3], [1, 9, 3], [4, 4, 4]])
    future = np.array([[1, 2, 3], [1, 2, 3], [4, 4, 4]])
    assert corpus_calibration.held(chains, future, np.array([True, True, False])).tolist() == [3, 1, 0]


def test_truncation_experiment_arguments(capsys):
    assert str(truncation.parse_args(["--quick"]).out).startswith("/tmp/")
    assert "--temperature must be a finite number >= 1e-5 (truncation changes nothing when greedy), got 0.0" in \
        error_of(truncation.parse_args, ["--temperature", "0"], capsys)
    assert "invalid choice: 'top-p'" in error_of(truncation.parse_args, ["--settings", "top-p"], capsys)
    assert "--budgets must all be >= 1, got [8, 0]" in error_of(truncation.parse_args, ["--budgets", "8", "0"], capsys)


@pytest.mark.parametrize("argv, message", [
    (["--cases", "shipped:2"], "--cases: 'shipped:2' is not one of shipped:0, shipped:1, untrained:0, untrained:1"),
    (["--cases", "trained:0"], "--cases: 'trained:0' is not one of"),
    (["--rounds", "0"], "--num-prompts, --rounds, --budget and --max-new-tokens must be >= 1"),
    (["--threshold", "0"], "--threshold must be a finite number > 0"),
    (["--threshold", "nan"], "--threshold must be a finite number > 0"),
])
def test_fallback_bad_arguments(argv, message, capsys):
    assert message in error_of(fallback.parse_args, argv, capsys)
    assert fallback.parse_args(["--cases", "untrained:1"]).cases == ["untrained:1"]


@pytest.mark.parametrize("argv, message", [
    (["--turns", "0"], "--turns must be >= 1, got 0"),
    (["--max-chars", "-3"], "--max-chars must be >= 1, got -3"),
    (["--conversations", "x"], "invalid int value: 'x'"),
])
def test_chat_reuse_bad_arguments(argv, message, capsys):
    assert message in error_of(chat_reuse.parse_args, argv, capsys)
    assert chat_reuse.parse_args(["--turns", "2"]).turns == 2



@pytest.mark.parametrize("argv, message", [
    (["--budgets", "2", "4"], "--budgets must be >= 1 and include 8 (the reference), got [2, 4]"),
    (["--budgets", "0", "8"], "--budgets must be >= 1 and include 8"),
    (["--num-prompts", "0"], "--num-prompts and --max-new-tokens must be >= 1, --first >= 0"),
])
def test_adaptive_budget_bad_arguments(argv, message, capsys):
    assert message in error_of(adaptive_budget.parse_args, argv, capsys)
    assert adaptive_budget.parse_args(["--budgets", "16", "8", "8"]).budgets == [8, 16]


def test_adaptive_budget_simulates_greedy_rounds_exactly():
    """A hand-made tree at every position of a 5-token output: the accepted path within the first
    b nodes is the emitted block less its bonus token, rounds end at the output's end, and a policy
    that takes every node emits the blocks a decoder would."""
    output = np.array([7, 8, 9, 7, 8])
    # Root, then 7 (node 1), 8 under it (node 2), and a wrong first token 5 (node 3).
    tokens = np.array([0, 7, 8, 5])
    parents = np.array([-1, 0, 1, 0])
    assert adaptive_budget.accepted_depths(output, 0, tokens, parents).tolist() == [0, 1, 2, -1]
    assert adaptive_budget.accepted_depths(output, 3, tokens, parents).tolist() == [0, 1, 2, -1]
    assert adaptive_budget.accepted_depths(output, 1, tokens, parents).tolist() == [0, -1, -1, -1]
    scores = np.log(np.array([1.0, 0.5, 0.25, 0.1]))
    trees = [(output, np.stack([tokens] * 5), np.stack([parents] * 5), np.stack([scores] * 5))]
    # All 4 nodes: position 0 takes 7, 8 + bonus (3 tokens), position 3 takes 7, 8 (the output ends).
    assert adaptive_budget.simulate(trees, lambda reach: (4, 2.0)) == (5, 2, 4.0)
    # The root alone: one token per round.
    assert adaptive_budget.simulate(trees, lambda reach: (1, 1.0)) == (5, 5, 5.0)
    # The root and 7: 2 tokens at position 0, 1 at position 2 (7 is not the 9 there), 2 at position 3.
    assert adaptive_budget.simulate(trees, lambda reach: (2, 1.5)) == (5, 3, 4.5)


def test_moe_sharding_moves_one_partial_sum_per_layer_on_every_layout(tmp_path):
    """`moe_sharding.py` on 4 forced devices with a small layer: its arguments are checked, and
    every layout moves exactly one float32 [N, D] all-reduce per layer with either dispatch as
    tevjax traces it (the table's "x [N, D]" column is 1.0), the claim its results file rests on."""
    script = Path(moe_dispatch.__file__).with_name("moe_sharding.py")
    env = forced_devices_env(4)

    def run(*argv):
        return subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, env=env,
                              cwd=script.parent, timeout=600)

    for argv, message in [(["--per-token", "9", "--experts", "8"], "--per-token 9 is more than --experts 8"),
                          (["--experts", "6", "--per-token", "2"], "--experts 6 does not split over 4 devices"),
                          (["--tokens", "0"], "argument --tokens: must be positive, got 0")]:
        res = run(*argv)
        assert res.returncode == 2 and message in res.stderr, res.stderr[-500:]
    out = tmp_path / "moe_sharding.md"
    res = run("--experts", "8", "--per-token", "2", "--width", "16", "--expert-width", "8", "--tokens", "6",
              "--out", str(out))
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [line.split("|") for line in out.read_text().splitlines() if line.startswith("| width") or
            line.startswith("| experts") or line.startswith("| both")]
    assert len(rows) == 12, rows
    mesh_rows = [r for r in rows if "on the mesh" in r[2]]
    assert len(mesh_rows) == 6 and all(float(r[5]) == 1.0 for r in mesh_rows), mesh_rows
    assert all(r[7].strip() == "1/4" for r in rows), rows  # each device holds a quarter of the experts


def test_moe_dispatch_checks_its_arguments_and_compares_equal_outputs(tmp_path, monkeypatch, capsys):
    for argv, message in [(["--top-k", "9"], "--top-k 9 is more than --experts 8"),
                          (["--tokens", "0"], "argument --tokens: must be positive, got 0"),
                          (["--iters", "0"], "argument --iters: must be positive, got 0")]:
        monkeypatch.setattr(sys, "argv", ["moe_dispatch.py", *argv])
        with pytest.raises(SystemExit):
            moe_dispatch.main()
        assert message in capsys.readouterr().err
    out = tmp_path / "moe.md"
    monkeypatch.setattr(sys, "argv", ["moe_dispatch.py", "--tokens", "3", "5", "--hidden", "8", "--width", "4",
                                      "--iters", "1", "--repeats", "2", "--out", str(out)])
    moe_dispatch.main()
    rows = [line for line in out.read_text().splitlines() if line.startswith(("| 3 ", "| 5 "))]
    assert len(rows) == 2
    assert all(float(row.split("|")[5]) < 1e-5 for row in rows)  # both dispatches gave the same outputs
    assert json.loads(out.with_suffix(".json").read_text())["results"][1]["tokens"] == 5


def test_hybrid_latency_needs_whole_periods_of_layers(capsys):
    assert "--layers must be a positive multiple of 4" in error_of(hybrid_latency.parse_args, ["--layers", "6"], capsys)
    assert "--iters must be >= 10" in error_of(hybrid_latency.parse_args, ["--iters", "3"], capsys)
    assert "every --nodes entry >= 1" in error_of(hybrid_latency.parse_args, ["--nodes", "0", "9"], capsys)
    assert hybrid_latency.parse_args([]).nodes == [1, 9, 17, 33, 65]


def test_kill_resume_checks_its_arguments_before_any_run(tmp_path, capsys):
    """Trial counts and --work are refused before a target is built or a command starts."""
    for argv in (["--train-trials", "-1"], ["--train-trials", "0", "--data-trials", "0"]):
        assert "--train-trials and --data-trials must be >= 0, and one of them >= 1" in error_of(
            kill_resume.parse_args, argv, capsys)
    (tmp_path / "left").write_text("x")
    assert "must be a new or empty directory" in error_of(kill_resume.parse_args, ["--work", str(tmp_path)], capsys)
    assert "--draft-vocab must be >= 0" in error_of(kill_resume.parse_args, ["--draft-vocab", "-3"], capsys)
    args = kill_resume.parse_args(["--data-trials", "0", "--work", str(tmp_path / "new")])
    assert (args.train_trials, args.data_trials, args.seed) == (12, 0, 0) and not (tmp_path / "new").exists()
    assert args.draft_vocab == 0 and not args.init and args.hosts == 1
    assert "--init starts the training runs from a drafter" in error_of(
        kill_resume.parse_args, ["--init", "--train-trials", "0"], capsys)
    assert "invalid choice: 3" in error_of(kill_resume.parse_args, ["--hosts", "3"], capsys)


def _stale(lines: list[str]) -> list[str]:
    """`lines` with every interval written as a normal-quantile report had it: other endpoints."""
    return [line.replace(" [", " [~") for line in lines]


def test_rerender_rebuilds_the_statistics_from_the_counts_and_keeps_the_rest(tmp_path):
    """A report made before the switch to t intervals is rebuilt from its JSON's counts: the statistics
    equal a fresh run's, the header, the training table and the notes after the statistics stay, one
    line says so, the JSON records the new results, and a second pass changes nothing."""
    rng = np.random.default_rng(0)

    def counts(n):
        rounds = rng.integers(20, 40, n)
        return {"tokens": (rounds * rng.uniform(1.5, 2.5, n)).astype(int).tolist(), "rounds": rounds.tolist()}

    cfg = {"prompt_sets": ["heldout"], "temperatures": [0.0], "budgets": [4, 8], "quick": True, "steps": 3,
           "num_prompts": 6}
    per_prompt = {arm: {"heldout": {"0.0": {str(b): counts(6) for b in (4, 8)}}} for arm in ("token", "w")}
    table = exittrain_ablation.summarise_all(per_prompt, "token")
    stats = exittrain_ablation.tau_tables(table, ["token", "w"], ["heldout"], [0.0], [4, 8])
    stats += exittrain_ablation.pooled_lines(table, ["token", "w"], ["heldout"], [0.0], [4, 8])
    stats += ["", "![tau by budget per arm](abl.png)"]
    head = ["# ExitTrain ablation", "", "- Date: then.", "- Arms: token, w.", "", "## Training", "", "| arm |", ""]
    (tmp_path / "abl.md").write_text("\n".join(head + _stale(stats) + ["", "A note."]) + "\n")
    raw = {"command": "python experiments/exittrain_ablation.py --steps 3", "config": cfg,
           "arms": {"token": {}, "w": {}}, "per_prompt": per_prompt, "results": {}}
    (tmp_path / "abl.json").write_text(json.dumps(raw))
    assert rerender.rerender(tmp_path / "abl.json", "2026-12-07")
    got = (tmp_path / "abl.md").read_text().splitlines()
    note = got[4]
    assert note.startswith(rerender.NOTE) and "abl.json" in note and sum(x.startswith(rerender.NOTE) for x in got) == 1
    assert got[:4] + got[5:] == head + stats + ["", "A note."]
    assert json.loads((tmp_path / "abl.json").read_text())["results"] == json.loads(json.dumps(table))
    assert (tmp_path / "abl.png").stat().st_size > 0
    assert not rerender.rerender(tmp_path / "abl.json", "2026-12-08")  # nothing stale is left
    assert (tmp_path / "abl.md").read_text().splitlines() == got

    runs = {label: {"anchors": [10, 12, 9, 11], "tau_8": [21, 25, 17, 24 + k]} for k, label in enumerate(("v1", "v2"))}
    paired = heldout_screen.paired_lines(runs, ("sim",), [8])
    head = ["# Held-out screen", "", "- Date: then.", "- 4 records.", "", "| drafter |", "|---|"]
    (tmp_path / "scr.md").write_text("\n".join(head + _stale(paired) + ["", "Why it ran."]) + "\n")
    (tmp_path / "scr.json").write_text(json.dumps({"command": "python experiments/heldout_screen.py --x", "z95": 1.96,
                                                   "config": {"budgets": [8]}, "runs": runs}))
    assert rerender.rerender(tmp_path / "scr.json", "2026-12-07")
    got = (tmp_path / "scr.md").read_text().splitlines()
    assert got[4].startswith(rerender.NOTE) and got[:4] + got[5:] == head + paired + ["", "Why it ran."]
    saved = json.loads((tmp_path / "scr.json").read_text())
    assert "z95" not in saved and saved["quantile"].startswith("Student's t")
    with pytest.raises(SystemExit, match="made by end_to_end.py"):
        (tmp_path / "e2e.json").write_text(json.dumps({"command": "python experiments/end_to_end.py"}))
        rerender.rerender(tmp_path / "e2e.json", "2026-12-07")
