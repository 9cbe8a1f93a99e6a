"""The drafter shipped in `tevjax/assets/smollm2-dflash`: it loads against SmolLM2-135M's shapes,
is small bf16 safetensors with a valid reduced draft vocabulary that holds the end-of-turn
token, and its model card names the command that measured it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tevjax.convert.dflash_ckpt import load_dflash
from tevjax.loading import SMOLLM2_MASK_TOKEN, TRAINED_DRAFTERS
from tevjax.models.config import PRESETS

SHIPPED = TRAINED_DRAFTERS["smollm2"]
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
        tokens, offsets, starts = z["tokens"], z["offsets"], z["starts"]
    assert offsets[0] == 0 and offsets[-1] == len(tokens) and np.all(np.diff(offsets) > starts)
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
