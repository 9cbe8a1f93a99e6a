"""`tevjax data --responses sharegpt`: training records carry ShareGPT's original first reply
(rendered by the chat template, cut at end-of-turn or max_new_tokens) with the features of one
causal forward, while the held-out prompts and records stay the target's own. A tiny random
target with SmolLM2's vocabulary and tokenizer keeps it fast."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tevjax.convert.embedded import prepare_smollm2
from tevjax.convert.tokenizer import chat_prompt_ids, load_tokenizer
from tevjax.loading import LoadedTarget
from tevjax.prompts import sharegpt_replies
from tevjax.testing import random_model, tiny_config
from tevjax.train.dataset import TrainData
from tevjax.train.rollout import RolloutConfig, _read_jsonl, generate_data, sequence_hidden

TAPS = (1, 2)
# Two data directories from the real ShareGPT file and SmolLM2 tokenizer: about a minute alone.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def loaded():
    tokenizer = load_tokenizer(prepare_smollm2())
    target = random_model(tiny_config(num_layers=3, vocab_size=49152), seed=0)
    eos = (int(tokenizer.convert_tokens_to_ids("<|im_end|>")),)
    return LoadedTarget(name="tiny-smollm2-vocab", hf_dir=prepare_smollm2(), target_cfg=target.cfg, target=target,
                        tokenizer=tokenizer, eos_ids=eos, notes=[])


def _cfg(responses):
    return RolloutConfig(num_prompts=4, heldout_prompts=3, heldout_records=2, max_new_tokens=24,
                         max_prompt_tokens=96, batch_size=2, taps=TAPS, responses=responses)


def test_sharegpt_replies_are_training_records_and_heldout_stays_the_targets(tmp_path, loaded):
    generate_data(loaded, _cfg("sharegpt"), tmp_path / "s", progress=False, log=lambda _: None)
    generate_data(loaded, _cfg("target"), tmp_path / "t", progress=False, log=lambda _: None, stop_after_shards=1)
    # The same held-out prompts and the same (regenerated) held-out records either way.
    assert _read_jsonl(tmp_path / "s" / "heldout.jsonl") == _read_jsonl(tmp_path / "t" / "heldout.jsonl")
    hs, ht = TrainData(tmp_path / "s", "heldout"), TrainData(tmp_path / "t", "heldout")
    for i in range(len(hs)):
        for a, b in zip(hs.record(i, [0, 1]), ht.record(i, [0, 1])):
            np.testing.assert_array_equal(a, b)

    replies = sharegpt_replies()
    rows = _read_jsonl(tmp_path / "s" / "prompts.jsonl")
    data = TrainData(tmp_path / "s", "train")
    assert len(data) == 4
    eos = loaded.eos_ids[0]
    for i, row in enumerate(rows):
        tokens, mask, feats = data.record(i, [0, 1])
        prompt = row["prompt_ids"]
        assert tokens[: len(prompt)].tolist() == prompt and not mask[: len(prompt)].any() and mask[len(prompt):].all()
        response = tokens[len(prompt):].tolist()
        text = loaded.tokenizer.decode(response, skip_special_tokens=True)
        reply = replies[row["id"]]
        if response[-1] == eos:  # the whole reply, closed by end-of-turn
            assert len(response) <= 24 and text.strip() == reply.strip()
        else:  # cut at max_new_tokens: a prefix of the reply
            assert len(response) == 24 and reply.strip().startswith(text.strip()[:20])
        # Features: one causal forward over the record (no zeroed last token, unlike decoding).
        want = sequence_hidden(loaded.target, [tokens.tolist()], TAPS)[0]
        got = feats.reshape(len(tokens), len(TAPS), -1)
        np.testing.assert_array_equal(got, np.asarray(want, np.float32))


def test_sharegpt_responses_need_sharegpt_prompts(tmp_path, loaded):
    with pytest.raises(ValueError, match="responses='target'"):
        generate_data(loaded, _cfg("sharegpt"), tmp_path / "g", prompts=([[5, 6]] * 3, [[7, 8]] * 4),
                      progress=False, log=lambda _: None)
    with pytest.raises(ValueError, match="responses must be one of"):
        _cfg("human")


def test_a_directory_resumes_with_the_exclusion_it_was_planned_with(tmp_path, loaded):
    """Directories planned before the exclusion field existed (their manifests lack it) left out only
    the held-out records; resumed by today's default ("source") they keep their own prompts, and a
    new directory's manifest says how it was planned."""
    import json

    old = tmp_path / "old"
    cfg = RolloutConfig(num_prompts=4, heldout_prompts=3, heldout_records=2, max_new_tokens=8,
                        max_prompt_tokens=96, batch_size=2, taps=TAPS, exclusion="conversation")
    generate_data(loaded, cfg, old, progress=False, log=lambda _: None, stop_after_shards=2)
    assert "exclusion" not in json.loads((old / "manifest.json").read_text())["rollout"]
    prompts = (old / "prompts.jsonl").read_text()
    today = dataclasses.replace(cfg, exclusion="source")
    manifest = generate_data(loaded, today, old, resume=True, progress=False, log=lambda _: None)
    assert manifest["complete"] and (old / "prompts.jsonl").read_text() == prompts
    assert len(TrainData(old, "train")) == 4
    new = tmp_path / "new"
    generate_data(loaded, today, new, progress=False, log=lambda _: None, stop_after_shards=1)
    assert json.loads((new / "manifest.json").read_text())["rollout"]["exclusion"] == "source"
    with pytest.raises(ValueError, match="other settings: rollout.max_new_tokens"):
        generate_data(loaded, dataclasses.replace(today, max_new_tokens=9), new, resume=True, progress=False,
                      log=lambda _: None)
