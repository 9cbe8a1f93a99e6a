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
