"""The GPU script's dry run: experiments/gpu/run.sh --tiny on CPU really runs every stage.

Each stage must leave its markdown file with a table holding measured numbers, and must exit
cleanly (a stage that crashed or ran out of time writes an 'incomplete' note instead). The time
limits are scaled up (TIME_SCALE) so that a busy shared machine does not turn slowness into a
failure here; `make gpu-dry-run` runs with the real limits.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("a_correctness", "b_verifier", "c_engine", "d_train", "e_moe", "f_hybrid")


def _numeric_table_rows(text: str) -> list[str]:
    """Markdown table rows (not header or rule lines) with at least one cell holding a number."""
    rows = [line for line in text.splitlines() if line.startswith("|") and not re.match(r"^\|[-:| ]+\|$", line)]
    body = rows[1:] if rows else []  # the first row of a table is its header
    return [r for r in body if any(re.fullmatch(r"[-+]?\d[\d,]*(\.\d+)?%?( \(.*\))?", c.strip())
                                   for c in r.strip("|").split("|"))]


@pytest.mark.slow
def test_gpu_script_dry_run_writes_every_stage(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHON=sys.executable, TIME_SCALE="1000")
    proc = subprocess.run(["bash", str(ROOT / "experiments/gpu/run.sh"), str(tmp_path), "--tiny"], env=env,
                          capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = (tmp_path / "summary.md").read_text()
    for stage in STAGES:
        md = tmp_path / f"{stage}.md"
        assert md.is_file(), f"{stage}: no results file\n{summary}"
        text = md.read_text()
        assert "Stage incomplete" not in text, f"{stage} did not finish:\n{text[-3000:]}"
        assert re.search(r"^- jax \d", text, re.M) and "Device: " in text, f"{stage}: results are not stamped"
        assert _numeric_table_rows(text), f"{stage}: no table with numbers:\n{text}"
        assert re.search(rf"^\| {stage} \| 0 \|", summary, re.M), summary
    # Stage a really ran tests, and they passed.
    total = next(line for line in (tmp_path / "a_correctness.md").read_text().splitlines() if "**total**" in line)
    passed, failed, errors = (int(c) for c in total.strip("|").split("|")[2:5])
    assert passed > 0 and failed == 0 and errors == 0, total


@pytest.mark.slow
def test_drafter_scale_tiny_generates_trains_and_exports(tmp_path):
    """experiments/gpu/drafter_scale.py --tiny on CPU with the embedded target: the records it keeps
    are the target's greedy answers to the given prompts, and the exported drafter has moved."""
    import numpy as np

    from tevjax.convert.dflash_ckpt import load_dflash
    from tevjax.loading import TRAINED_DRAFTERS, load_target

    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 20000, n).tolist() for n in (12, 30, 7, 19, 25, 9, 14, 40)]
    np.savez(tmp_path / "p.npz", ids=np.concatenate(prompts).astype(np.uint16),
             offsets=np.cumsum([0] + [len(p) for p in prompts]), index=np.arange(100, 108))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "experiments/gpu/drafter_scale.py"), "--tiny", "--prompts",
                           str(tmp_path / "p.npz"), "--init", str(TRAINED_DRAFTERS["smollm2"]), "--out", str(out),
                           "--compile-cache", ""], env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["records"] == 8 and summary["done"] == summary["steps"] > 0
    parts = [np.load(out / f"records-{k}.npz") for k in (0, 1)]
    assert np.concatenate([z["index"] for z in parts]).tolist() == list(range(100, 108))
    loaded = load_target("smollm2", dtype="float32")
    from tevjax.decode.engine import DecodeConfig, Decoder

    dec = Decoder(loaded.target, None, DecodeConfig(max_new_tokens=16, eos_ids=loaded.eos_ids))
    z = parts[0]
    for r, prompt in enumerate(prompts[: len(z["prompt_len"])]):
        seq = z["tokens"][z["offsets"][r]:z["offsets"][r + 1]].astype(int).tolist()
        assert seq == prompt + dec.generate([prompt])[0].tokens
    _, before = load_dflash(TRAINED_DRAFTERS["smollm2"], loaded.target_cfg)
    _, after = load_dflash(out / "drafter", loaded.target_cfg)
    w0, w1 = (np.asarray(d.fc.kernel.get_value(), np.float32) for d in (before, after))
    assert w0.shape == w1.shape and not np.array_equal(w0, w1)


def test_drafter_scale_records_round_trip(tmp_path):
    """What one GPU call saves (`save_records`), a later one trains on again (`load_records`)."""
    import numpy as np

    sys.path.insert(0, str(ROOT / "experiments/gpu"))
    try:
        import drafter_scale as ds
    finally:
        sys.path.pop(0)
    rng = np.random.default_rng(3)
    records = [(rng.integers(0, 49152, rng.integers(1, 40)).tolist(),
                rng.integers(0, 49152, rng.integers(0, 30)).tolist(), "eos" if k % 3 else "length") for k in range(7)]
    ds.save_records(tmp_path, records, np.arange(50, 57))
    back = ds.load_records(tmp_path / "records-0.npz") + ds.load_records(tmp_path / "records-1.npz")
    assert back == records
    assert np.load(tmp_path / "records-1.npz")["index"].tolist() == list(range(53, 57))
    z = dict(np.load(tmp_path / "records-0.npz"))
    z["offsets"] = z["offsets"][:-1]
    np.savez(tmp_path / "bad.npz", **z)
    with pytest.raises(ValueError, match="bad.npz: inconsistent records file"):
        ds.load_records(tmp_path / "bad.npz")


@pytest.mark.slow
def test_drafter_scale_next_session_recipe(tmp_path):
    """The flags the next GPU session's recipe uses (`gpu_drafter_scale.md`): a drafter grown to 2
    layers, sampled responses (`--temperature 1`) and records of an earlier call carried along
    (`--records`, less those `--drop-index` lists). On CPU with --tiny: the records are sampled, not
    greedy, answers to the given prompts; the carried ones are trained on; the export has 2 layers
    and its first one moved."""
    import numpy as np

    from tevjax.convert.dflash_ckpt import load_dflash
    from tevjax.decode.engine import DecodeConfig, Decoder
    from tevjax.loading import TRAINED_DRAFTERS, load_target

    sys.path.insert(0, str(ROOT / "experiments/gpu"))
    try:
        import drafter_scale as ds
    finally:
        sys.path.pop(0)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(100, 20000, n).tolist() for n in (12, 30, 7, 19, 25, 9, 14, 40)]
    np.savez(tmp_path / "p.npz", ids=np.concatenate(prompts).astype(np.uint16),
             offsets=np.cumsum([0] + [len(p) for p in prompts]), index=np.arange(200, 208))
    carried = [(rng.integers(100, 20000, 20).tolist(), rng.integers(100, 20000, 30).tolist(), "length")
               for _ in range(6)]
    (tmp_path / "old").mkdir()
    ds.save_records(tmp_path / "old", carried, np.arange(6))
    (tmp_path / "drop.json").write_text(json.dumps({"drop_index": [1, 4, 99]}))
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "experiments/gpu/drafter_scale.py"), "--tiny",
           "--prompts", str(tmp_path / "p.npz"), "--init", str(TRAINED_DRAFTERS["smollm2"]), "--out", str(out),
           "--compile-cache", "", "--layers", "2", "--temperature", "1",
           "--records", str(tmp_path / "old/records-0.npz"), str(tmp_path / "old/records-1.npz"),
           "--drop-index", str(tmp_path / "drop.json")]
    proc = subprocess.run(cmd, env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["records"] == 8 and summary["carried_records"] == 4 and summary["done"] == summary["steps"] > 0
    records = ds.load_records(out / "records-0.npz") + ds.load_records(out / "records-1.npz")
    assert [p for p, _, _ in records] == prompts
    assert all(r and all(0 <= t < 49152 for t in r) for _, r, _ in records)
    loaded = load_target("smollm2", dtype="float32")
    greedy = Decoder(loaded.target, None, DecodeConfig(max_new_tokens=16, eos_ids=loaded.eos_ids))
    # Sampling 16 tokens at T = 1 from this target reproduces the greedy answer to all 8 prompts with
    # negligible probability; the run is seeded, so this is deterministic.
    assert any(r != greedy.generate([p])[0].tokens for p, r, _ in records)
    cfg, before = load_dflash(TRAINED_DRAFTERS["smollm2"], loaded.target_cfg)
    cfg2, after = load_dflash(out / "drafter", loaded.target_cfg)
    assert cfg.num_layers == 1 and cfg2.num_layers == 2
    w0, w1 = (np.asarray(d.fc.kernel.get_value(), np.float32) for d in (before, after))
    assert w0.shape == w1.shape and not np.array_equal(w0, w1)


@pytest.mark.slow  # ~20 s: it splits the 94 MiB GGUF and rebuilds both prompt plans
def test_staging_splits_the_target_and_plans_prompts_without_heldout_conversations(tmp_path):
    """experiments/gpu/stage_drafter_scale.py: the two folders join into the GGUF again (its digest
    travels too), each call weighs the same and fits the cap, and the prompts are the plans'
    training prompts (first turns first), none from a held-out prompt's conversation."""
    import hashlib
    import json as _json

    import numpy as np

    from tevjax.convert.embedded import prepare_smollm2, smollm2_gguf_path
    from tevjax.convert.tokenizer import load_tokenizer
    from tevjax.prompts import source_conversation
    from tevjax.train.rollout import RolloutConfig, select_prompts

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in ("gguf-0.19.0-py3-none-any.whl", "optax-0.2.8-py3-none-any.whl"):
        (wheels / name).write_bytes(b"wheel")
    s1, s2 = tmp_path / "s1", tmp_path / "s2"
    proc = subprocess.run([sys.executable, str(ROOT / "experiments/gpu/stage_drafter_scale.py"), str(s1), str(s2),
                           "--wheels", str(wheels), "--max-prompts", "40", "--all-prompts"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = _json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    gguf = smollm2_gguf_path().read_bytes()
    joined = (s1 / "gguf.partA").read_bytes() + (s2 / "gguf.partB").read_bytes()
    assert joined == gguf and (s2 / "gguf.sha256").read_text().split()[0] == hashlib.sha256(joined).hexdigest()
    c1, c2 = report["call_bytes"]
    assert abs(c1 - c2) <= 1 and c1 < report["cap"]
    for d in (s1, s2):
        assert sorted(f.name for f in d.glob("*.whl")) == ["gguf-0.19.0-py3-none-any.whl",
                                                          "optax-0.2.8-py3-none-any.whl"]
    assert (s1 / "config.json").read_bytes() == (prepare_smollm2() / "config.json").read_bytes()
    assert {f.name for f in s2.glob("gpu_*")} == {"gpu_drafter_scale_records-0.npz", "gpu_drafter_scale_records-1.npz",
                                                  "gpu_records_heldout_sources.json"}
    with np.load(s1 / "prompts.npz") as z:
        ids, offsets, index = z["ids"], z["offsets"], z["index"]
    assert index.tolist() == [1_000_000 + i for i in range(40)] + list(range(40))
    prompts = [ids[offsets[i]:offsets[i + 1]].tolist() for i in range(80)]
    tokenizer = load_tokenizer(prepare_smollm2())
    heldout = [_json.loads(line)["id"].removeprefix("sharegpt/")
               for line in (ROOT / "tevjax/assets/heldout.jsonl").read_text().splitlines()]
    sources = {source_conversation(h) for h in heldout}
    for k, turns in enumerate(("first", "later")):  # the plans `tevjax data` makes today, in order
        _, rows = select_prompts(tokenizer, RolloutConfig(num_prompts=40, turns=turns, taps=(0,)))
        assert [r["prompt_ids"] for r in rows] == prompts[40 * k:40 * (k + 1)]
        assert not any(source_conversation(r["id"].removeprefix("sharegpt/").split("#")[0]) in sources for r in rows)
    # By default the prompts the GPU run's records answer stay home (their answers travel in STAGE2).
    sys.path.insert(0, str(ROOT / "experiments/gpu"))
    try:
        import stage_drafter_scale as st
    finally:
        sys.path.pop(0)
    answered = st.answered_prompts()
    assert len(answered) > 18_000 and tuple(prompts[0]) not in answered
    _, _, index = st.plan_prompts(["later"], 40, answered | {tuple(prompts[45])})
    assert 5 not in index.tolist() and set(index.tolist()) < set(range(40))  # prompts[45] is later-turn row 5
