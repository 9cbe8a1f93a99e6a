"""The drafter shipped in `tevjax/assets/smollm2-dflash`: it loads against SmolLM2-135M's shapes,
is small bf16 safetensors with a valid reduced draft vocabulary that holds the end-of-turn
token, and its model card names the command that measured it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tevjax.convert.dflash_ckpt import load_dflash
from tevjax.loading import SMOLLM2_MASK_TOKEN, TRAINED_DRAFTERS
from tevjax.models.config import PRESETS

SHIPPED = TRAINED_DRAFTERS["smollm2"]
ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not (SHIPPED / "config.json").exists(), reason="no drafter shipped")


def test_shipped_drafter_loads_and_is_compact():
    target_cfg = PRESETS["smollm2-135m"]
    cfg, drafter = load_dflash(SHIPPED, target_cfg, dtype="float32", param_dtype="float32")
    assert json.loads((SHIPPED / "config.json").read_text())["dtype"] == "bfloat16"
    assert (SHIPPED / "model.safetensors").stat().st_size < 25 * 2**20
    assert cfg.mask_token_id == SMOLLM2_MASK_TOKEN and cfg.num_target_layers == target_cfg.num_layers
    ids = np.asarray(drafter.vocab_ids())
    assert cfg.draft_vocab_size == len(ids) and np.all(np.diff(ids) > 0)
    assert set(target_cfg.eos_token_ids) <= set(ids.tolist())  # end-of-turn can be drafted
    assert cfg.mask_token_id not in ids  # the mask is never proposed as a token
    card = (SHIPPED / "README.md").read_text()
    assert "tevjax eval --prompts heldout" in card and "tevjax train" in card


def test_shipped_corpus_is_answers_to_training_prompts_and_its_table_is_cached(tmp_path, monkeypatch):
    """The corpus next to the drafter holds the GPU run's records (later-turn training prompts, no
    held-out or evaluation prompt among them); its n-gram table is built once, then read from the
    cache, identical; a damaged cache entry is built again, and a file that is not a corpus is a
    clear error."""
    from tevjax.loading import CORPUS_FILE, load_ngrams

    corpus = SHIPPED / CORPUS_FILE
    assert corpus.stat().st_size < 5 * 2**20
    with np.load(corpus) as z:
        tokens, offsets, starts, index = z["tokens"], z["offsets"], z["starts"], z["index"]
    assert offsets[0] == 0 and offsets[-1] == len(tokens) and np.all(np.diff(offsets) > starts)
    # No record answers a turn of a held-out prompt's conversation (experiments/heldout_sources.py).
    sources = json.loads((ROOT / "experiments/results/gpu_records_heldout_sources.json").read_text())
    assert len(index) == len(starts) == sources["num_records"] - len(sources["drop_index"]) == 18_496
    assert not set(index.tolist()) & set(sources["drop_index"]) and len(set(index.tolist())) == len(index)
    from tevjax.convert.embedded import prepare_smollm2
    from tevjax.convert.tokenizer import chat_prompt_ids, load_tokenizer

    tokenizer = load_tokenizer(prepare_smollm2())
    record_prompts = {tuple(tokens[o:o + s].tolist()) for o, s in zip(offsets[:-1], starts)}
    heldout = [json.loads(line)["text"] for line in (SHIPPED.parent / "heldout.jsonl").read_text().splitlines()]
    assert len(heldout) == 256 and len(record_prompts) > 18_000
    assert not any(tuple(chat_prompt_ids(tokenizer, text)) in record_prompts for text in heldout)
    monkeypatch.setenv("TEVJAX_CACHE", str(tmp_path))
    built = load_ngrams(corpus)
    entries = list((tmp_path / "ngrams").glob("*.npz"))
    assert len(entries) == 1 and built.num_entries > 1_000_000
    cached = load_ngrams(corpus)
    for a, b in ((built.keys, cached.keys), (built.tokens, cached.tokens), (built.log_reach, cached.log_reach)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    entries[0].write_bytes(b"not an npz")
    again = load_ngrams(corpus)
    np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(built.tokens))
    bad = tmp_path / "bad.npz"
    np.savez(bad, tokens=tokens[:10])
    with pytest.raises(ValueError, match="is not a corpus file"):
        load_ngrams(bad)
    with pytest.raises(ValueError, match="corpus file .*missing.npz"):
        load_ngrams(tmp_path / "missing.npz")
    # Another target's corpus, even with its table cached: refused, naming an id it holds.
    assert int(tokens.max()) < 49_152
    load_ngrams(corpus, vocab_size=49_152)
    with pytest.raises(ValueError, match=rf"holds token id {int(tokens.max())}, outside the target's vocabulary "
                                         rf"\[0, {int(tokens.max())}\)"):
        load_ngrams(corpus, vocab_size=int(tokens.max()))
    broken = tmp_path / "broken.npz"  # records that overrun the tokens: the error names the file
    np.savez(broken, tokens=tokens[:100], offsets=np.array([0, 50, 200]), starts=np.array([10, 10]))
    with pytest.raises(ValueError, match=r"corpus file .*broken\.npz.*: offsets must rise from 0 to len\(tokens\)"):
        load_ngrams(broken)


def test_a_truncated_corpus_or_cache_entry_is_no_internal_error(tmp_path, monkeypatch):
    """An npz cut short (its zip directory lost) is a corpus file error naming the file, and a cache
    entry cut short is built again, as any other damaged entry (both raised zipfile.BadZipFile)."""
    from tevjax.loading import load_ngrams

    monkeypatch.setenv("TEVJAX_CACHE", str(tmp_path))
    corpus = tmp_path / "corpus.npz"
    np.savez(corpus, tokens=np.arange(3, 19), offsets=np.array([0, 8, 16]), starts=np.array([2, 2]))
    cut = tmp_path / "cut.npz"
    cut.write_bytes(corpus.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"cut\.npz' is not a corpus file"):
        load_ngrams(cut)
    built = load_ngrams(corpus)
    (entry,) = (tmp_path / "ngrams").glob("*.npz")
    entry.write_bytes(entry.read_bytes()[:100])
    np.testing.assert_array_equal(np.asarray(load_ngrams(corpus).tokens), np.asarray(built.tokens))


# Slow (~20 s of a 2-core run): it re-derives committed files, which change only with the assets.
@pytest.mark.slow
def test_the_records_that_share_a_heldout_conversation_are_the_listed_ones(tmp_path):
    """experiments/heldout_sources.py, run again: it rebuilds the later-turn plan the GPU records
    were drawn from, checks that every record's prompt is its plan prompt, and lists the records
    whose ShareGPT conversation holds a held-out prompt; the committed list and the shipped corpus
    are what it makes."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(ROOT / "experiments/heldout_sources.py"), "--out",
                           str(tmp_path / "s.json"), "--corpus-out", str(tmp_path / "c.npz")],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    made = json.loads((tmp_path / "s.json").read_text())
    assert made == json.loads((ROOT / "experiments/results/gpu_records_heldout_sources.json").read_text())
    assert len(made["drop_index"]) == 448 and len(made["heldout_affected"]) == 70
    with np.load(tmp_path / "c.npz") as a, np.load(SHIPPED / "corpus.npz") as b:
        for k in ("tokens", "offsets", "starts", "index"):
            np.testing.assert_array_equal(a[k], b[k])
