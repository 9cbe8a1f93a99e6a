"""Slow smoke runs of the experiments' --quick modes: the training experiments (a tiny random target, data
made on the fly), verifier_latency and truncation (the embedded SmolLM2).

exittrain_ablation, budget_transfer and crossed each fine-tune arms from one saved drafter, export
them and evaluate them end to end; verifier_latency times the verifier stage (decision + commit).
Each runs in its own process and writes md, json and png into a temporary folder; the test reads
the JSON back. The arms' run folders are shared between the three training scripts (as in a full
run), so the later scripts reuse the arms the first one trained.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


def run_quick(script: str, out: Path, *extra: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(REPO / "experiments" / script), "--quick", "--out", str(out), *extra],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for suffix in (".md", ".json", ".png"):
        assert out.with_suffix(suffix).stat().st_size > 0, suffix
    return json.loads(out.with_suffix(".json").read_text())


def check_tau_cells(raw: dict, baseline: str) -> None:
    for label, by_set in raw["results"].items():
        for s, by_t in by_set.items():
            for t, by_b in by_t.items():
                for b, cell in by_b.items():
                    counts = raw["per_prompt"][label][s][t][b]
                    assert len(counts["rounds"]) == raw["config"]["num_prompts"]
                    assert all(r >= 1 for r in counts["rounds"])
                    assert cell["tau"] == pytest.approx(sum(counts["tokens"]) / sum(counts["rounds"]))
                    assert 1.0 <= cell["tau"] and math.isfinite(cell["se"])
                    if label == baseline:
                        assert "gain" not in cell
                    else:
                        assert cell["gain_lo"] <= cell["gain"] <= cell["gain_hi"]


def test_exittrain_ablation_quick(tmp_path, runs):
    out = tmp_path / "exittrain_ablation.md"
    raw = run_quick("exittrain_ablation.py", out, "--runs", str(runs))
    assert raw["machine"] and raw["versions"]["jax"] and raw["wall_minutes"] > 0
    assert list(raw["arms"]) == ["token", "w", "P_rescaled"]
    for arm, rec in raw["arms"].items():
        assert rec["trained_now"] and (Path(rec["dir"]) / "config.json").exists()
        assert rec["summary"]["step"] == raw["config"]["steps"]
        assert ("loss_exit" in rec["summary"]) == (arm != "token")  # the control trains without the exit loss
    check_tau_cells(raw, "token")
    # Rerunning finds every exported drafter and trains nothing.
    again = run_quick("exittrain_ablation.py", tmp_path / "again.md", "--runs", str(runs))
    assert not any(r["trained_now"] for r in again["arms"].values())
    assert again["per_prompt"] == raw["per_prompt"]  # same drafters, same seeds: the same decoding
    assert "wall time" in out.read_text()


def test_budget_transfer_quick(tmp_path, runs):
    raw = run_quick("budget_transfer.py", tmp_path / "budget_transfer.md", "--runs", str(runs))
    assert list(raw["arms"]) == ["token", "w @ B_train=3", "w @ B_train=5"]
    check_tau_cells(raw, "token")


def test_crossed_quick(tmp_path, runs):
    raw = run_quick("crossed.py", tmp_path / "crossed.md", "--runs", str(runs))
    for t, res in raw["results"].items():
        for combo in ("token-only + predraw", "token-only + tev", "ExitTrain + predraw", "ExitTrain + tev"):
            assert res[combo]["tau"] >= 1.0 and res[combo]["sr"] > 0
        for d, st in raw["stage"][t].items():
            assert st["trees"] >= 1
            for v in ("tev", "predraw"):
                assert 0 < st[v]["p10"] <= st[v]["median"] <= st[v]["p90"]


def test_verifier_latency_quick(tmp_path):
    raw = run_quick("verifier_latency.py", tmp_path / "verifier_latency.md")
    assert [r["budget"] for r in raw["rows"]] == [8, 32]
    for r in raw["rows"]:
        for m in ("tev", "predraw", "sequential", "commit"):
            med, lo, hi = r["stage_" + m]
            assert 0 < lo <= med <= hi


def test_truncation_quick(tmp_path):
    """The cut's benchmark (each bisection checked against its reference inside the script) and one
    short decoding run per setting on the embedded SmolLM2 with the shipped drafter."""
    raw = run_quick("truncation.py", tmp_path / "truncation.md")
    assert {r["rows"] for r in raw["cuts"]} == {1, 9, 17}
    for r in raw["cuts"]:
        assert 0 < r["p10_ms"] <= r["median_ms"] <= r["p90_ms"]
        if "top-k 20" in r["method"]:
            assert r["kept_per_row"] == 20
    assert [run["setting"] for run in raw["runs"]] == ["none", "top-p 0.9", "top-k 20", "min-p 0.1"]
    for run in raw["runs"]:
        assert run["temperature"] == 1.0 and run["num_prompts"] == 2 and run["mismatches"] == 0
        for row in run["budgets"]:
            assert row["budget"] == 4 and 1.0 <= row["tau"] <= 5 and row["sr"] > 0
