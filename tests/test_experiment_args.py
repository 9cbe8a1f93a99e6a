"""The paper-claim experiments reject bad command lines with a one-line error, before loading any model."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import exit_mass  # noqa: E402
import fixed_tree_equivalence  # noqa: E402


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


def test_quick_modes_write_to_tmp():
    assert str(fixed_tree_equivalence.parse_args(["--quick"]).out).startswith("/tmp/")
    assert str(exit_mass.parse_args(["--quick"]).out).startswith("/tmp/")
    assert fixed_tree_equivalence.parse_args([]).out == fixed_tree_equivalence.RESULTS


def test_sampled_temperatures_only(capsys):
    assert "greedy is always checked separately" in error_of(
        fixed_tree_equivalence.parse_args, ["--temperatures", "0", "1"], capsys)
