"""ShareGPT training prompts: first turns and later turns taken alone (`tevjax data --turns`).

The selection reads the packaged ShareGPT file (a few seconds per parse), so the pools are
built once per module."""

from __future__ import annotations

import pytest

from tevjax.convert.embedded import prepare_smollm2
from tevjax.convert.tokenizer import load_tokenizer
from tevjax.prompts import (_normalise, _sharegpt_conversations, evaluation_texts, sharegpt_first_turns,
                            sharegpt_prompts, sharegpt_replies)
from tevjax.train.rollout import RolloutConfig, _config_dict, _select_prompts


@pytest.fixture(scope="module")
def conversations():
    return {str(r.get("id", "")): r.get("conversations") or [] for r in _sharegpt_conversations()}


@pytest.fixture(scope="module")
def later():
    return sharegpt_prompts(None, turns="later")


def test_later_turns_are_human_turns_after_the_first_and_never_a_first_turn(later, conversations):
    first = {_normalise(t.strip()) for _, t in sharegpt_first_turns()}
    assert len(later) > 30_000  # ~4x the first turns: the point of the source
    keys = [_normalise(p.text) for p in later]
    assert len(set(keys)) == len(keys)  # distinct
    assert not first & set(keys)  # never regenerates a first-turn prompt
    for p in later[:500]:
        cid, k = p.id.removeprefix("sharegpt/").rsplit("#", 1)
        turn = conversations[cid][int(k)]
        assert int(k) >= 1 and turn["from"] == "human" and turn["value"].strip() == p.text
    banned = [b for b in evaluation_texts() if len(b) >= 40]
    assert not any(b in key for key in keys[:2000] for b in banned)


def test_selection_is_a_function_of_the_seed_and_honours_exclusions(later):
    assert [p.id for p in sharegpt_prompts(50, turns="later")] == [p.id for p in later[:50]]
    other = sharegpt_prompts(50, turns="later", seed=1)
    assert [p.id for p in other] != [p.id for p in later[:50]]
    drop = {p.id.removeprefix("sharegpt/").split("#")[0] for p in later[:20]}
    kept = sharegpt_prompts(None, turns="later", exclude_conversations=drop)
    assert not any(p.id.removeprefix("sharegpt/").split("#")[0] in drop for p in kept)
    assert len(kept) < len(later)
    with pytest.raises(ValueError, match="turns must be one of first, later"):
        sharegpt_prompts(3, turns="middle")


def test_later_replies_are_the_assistant_turn_that_follows(later, conversations):
    replies = sharegpt_replies("later")
    assert len(replies) > 30_000
    for p in later[:300]:
        if p.id not in replies:
            continue
        cid, k = p.id.removeprefix("sharegpt/").rsplit("#", 1)
        nxt = conversations[cid][int(k) + 1]
        assert nxt["from"] == "gpt" and nxt["value"] == replies[p.id]
    assert all("#" not in pid for pid in list(sharegpt_replies("first"))[:1000])


def test_data_plan_with_later_turns_keeps_the_heldout_prompts():
    tokenizer = load_tokenizer(prepare_smollm2())
    kw = dict(num_prompts=40, heldout_prompts=24, heldout_records=4, max_new_tokens=8, taps=(1,))
    held_first, train_first = _select_prompts(tokenizer, RolloutConfig(**kw))
    held, train = _select_prompts(tokenizer, RolloutConfig(**kw, turns="later"))
    assert held == held_first  # training-time evaluations read the same prompts either way
    assert all("#" in r["id"] for r in train) and not any("#" in r["id"] for r in train_first)
    held_conversations = {r["id"].removeprefix("sharegpt/") for r in held}
    assert not any(r["id"].removeprefix("sharegpt/").split("#")[0] in held_conversations for r in train)
    assert all(len(r["text"]) >= 40 and len(r["prompt_ids"]) <= 256 for r in train)
    assert [r["index"] for r in train] == list(range(40))
    # Manifests written before the field existed describe first-turn plans: the default stays absent.
    assert "turns" not in _config_dict(RolloutConfig(**kw), "t", RolloutConfig(**kw))["rollout"]
    assert _config_dict(RolloutConfig(**kw, turns="later"), "t", RolloutConfig(**kw))["rollout"]["turns"] == "later"
    with pytest.raises(ValueError, match="turns must be one of"):
        RolloutConfig(**kw, turns="all")
