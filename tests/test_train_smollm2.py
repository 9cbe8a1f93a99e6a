"""Slow end-to-end smoke test of the training system on the embedded SmolLM2 target, through the CLI:
data -> train (stopped by SIGTERM mid-run) -> resume -> export -> generate with the exported drafter."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tevjax.cli import main

pytestmark = pytest.mark.slow


def _cli(*argv):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "tevjax", *argv], capture_output=True, text=True, env=env,
                          timeout=1800)


def test_data_train_interrupt_resume_export_generate(tmp_path, capsys):
    data, run, drafter = tmp_path / "data", tmp_path / "run", tmp_path / "drafter"
    assert main(["data", "--num-prompts", "4", "--heldout", "2", "--heldout-records", "2", "--max-new-tokens", "24",
                 "--batch-size", "2", "--out", str(data), "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["complete"] and summary["records"] == 6 and summary["response_tokens"] > 0
    heldout = [json.loads(line) for line in (data / "heldout.jsonl").read_text().splitlines()]
    train_prompts = [json.loads(line)["text"] for line in (data / "prompts.jsonl").read_text().splitlines()]
    assert len(heldout) == 2 and not {h["text"] for h in heldout} & set(train_prompts)

    train = ["train", "--data", str(data), "--out", str(run), "--steps", "40", "--batch", "2", "--anchors", "4",
             "--seq-len", "384", "--exit-budget", "4", "--exit-anchors", "2", "--checkpoint-every", "1",
             "--eval-every", "1000", "--no-progress"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.Popen([sys.executable, "-m", "tevjax", *train], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 1200
    while time.time() < deadline and not any((run / "checkpoints").glob("[0-9]*")) and proc.poll() is None:
        time.sleep(1)
    proc.send_signal(signal.SIGTERM)  # stops after the current step, with a checkpoint
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 130, err[-2000:]  # stopped early: not a finished run
    stopped = json.loads(out.strip().splitlines()[-1])["step"]
    assert 1 <= stopped < 40 and "stopped by signal" in err

    res = _cli(*train, "--resume")
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout.strip().splitlines()[-1])["step"] == 40
    assert f'"step": {stopped}' in res.stderr  # resumed from where it stopped

    res = _cli("train", "export", str(run), str(drafter))
    assert res.returncode == 0, res.stderr[-2000:]
    assert (drafter / "config.json").is_file() and (drafter / "model.safetensors").is_file()

    outs = {}
    for verifier in ("tev", "ar"):
        given = ["--drafter", str(drafter)] if verifier != "ar" else []  # refused without a drafter
        res = _cli("generate", *given, "--prompt", "Name three colours.", "--max-new-tokens", "24",
                   "--verifier", verifier, "--json")
        assert res.returncode == 0, res.stderr[-2000:]
        outs[verifier] = json.loads(res.stdout.strip().splitlines()[-1])
    assert outs["tev"]["tokens"] == outs["ar"]["tokens"]  # exact with the trained drafter
