"""ShareGPT training prompts: first turns and later turns taken alone (`tevjax data --turns`).

The selection reads the packaged ShareGPT file (a few seconds per parse), so the pools are
built once per module."""

from __future__ import annotations

import dataclasses

import pytest

from tevjax.convert.embedded import prepare_smollm2
from tevjax.convert.tokenizer import load_tokenizer
from tevjax.prompts import (_normalise, _sharegpt_conversations, evaluation_texts, iter_sharegpt_prompts,
                            sharegpt_first_turns, sharegpt_prompts, sharegpt_replies, source_conversation)
from tevjax.train.rollout import RolloutConfig, _config_dict, select_prompts


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
    # An evaluation item equal to a prompt, or (40 characters or more) inside one, removes it; the
    # packaged evaluation sets happen to match no ShareGPT turn, so these stand in for them.
    inside = next(p for p in later[1:50] if len(p.text) >= 80)
    banned = [later[0].text.upper(), inside.text[10:60]]  # compared lower-cased, whitespace collapsed
    got = [p.id for p in sharegpt_prompts(50, turns="later", exclude=banned)]
    assert later[0].id not in got and inside.id not in got
    assert got[:10] == [p.id for p in later[:60] if p.id not in (later[0].id, inside.id)][:10]
    with pytest.raises(ValueError, match="turns must be one of first, later"):
        sharegpt_prompts(3, turns="middle")
    # The stream a data plan reads: the same order, one prompt at a time; a bad argument raises at
    # the call, not at the first next().
    stream = iter_sharegpt_prompts(turns="later")
    assert [next(stream).id for _ in range(50)] == [p.id for p in later[:50]]
    with pytest.raises(ValueError, match="turns must be one of first, later"):
        iter_sharegpt_prompts(turns="middle")
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match=r"n must be None \(all\) or an integer >= 0, got "):
            sharegpt_prompts(bad)


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
    held_first, train_first = select_prompts(tokenizer, RolloutConfig(**kw))
    held, train = select_prompts(tokenizer, RolloutConfig(**kw, turns="later"))
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


def test_source_conversation_is_the_share_id_of_a_split_record():
    assert source_conversation("QN3Tece_101") == "QN3Tece" == source_conversation("QN3Tece_0")
    assert source_conversation("abc") == "abc" and source_conversation("a_b") == "a_b"
    assert source_conversation("_7") == "_7" and source_conversation("x_y_12") == "x_y"


@pytest.mark.parametrize("turns", ["first", "later"])
def test_training_prompts_share_no_conversation_with_the_heldout_ones(turns):
    """The split file keeps one ShareGPT conversation in several records ("<share>_<k>"). Plans
    made before 2026-12-05 ("conversation") left out only the held-out records themselves, so
    turns from the rest of a held-out prompt's conversation became training prompts; the default
    ("source") leaves out every record of the held-out shares, and the held-out prompts stay the
    ones shipped in `tevjax/assets/heldout.jsonl`."""
    import json
    from pathlib import Path

    tokenizer = load_tokenizer(prepare_smollm2())
    n = 600 if turns == "later" else 2000  # the old first-turn plan first shares a source at row 1,382
    kw = dict(num_prompts=n, heldout_prompts=256, heldout_records=4, max_new_tokens=8, taps=(1,), turns=turns)
    held, train = select_prompts(tokenizer, RolloutConfig(**kw))
    shipped = Path(__file__).resolve().parents[1] / "tevjax/assets/heldout.jsonl"
    assert [r["id"] for r in held] == [json.loads(line)["id"] for line in shipped.read_text().splitlines()]

    def source(row):
        return source_conversation(row["id"].removeprefix("sharegpt/").split("#")[0])

    sources = {source(r) for r in held}
    assert not any(source(r) in sources for r in train) and len(train) == n
    old_held, old_train = select_prompts(tokenizer, RolloutConfig(**kw, exclusion="conversation"))
    assert old_held == held and sum(source(r) in sources for r in old_train) > 0  # what the old plans held
    with pytest.raises(ValueError, match="exclusion must be one of source, conversation"):
        RolloutConfig(**kw, exclusion="none")


def test_the_data_plan_on_a_stand_in_pool(monkeypatch):
    """`select_prompts` on a small stand-in for ShareGPT (no file read): held-out prompts are the first
    that fit max_prompt_tokens (chat template included, the bound itself fits); first-turn training
    prompts continue right after the last held-out one, without the held-out prompts' sources
    ("source") or with them ("conversation"); later-turn plans pass both exclusions on; with ShareGPT
    responses only turns with a reply count; too few prompts is an error unless exact=False."""
    from types import SimpleNamespace

    import tevjax.prompts
    from test_evaluate import _CharTokenizer  # one token per character; the chat template adds ">"

    first = [SimpleNamespace(id=f"sharegpt/{i}", text=t) for i, t in (
        ("a_0", "xyz"), ("b", "too long"), ("c", "ab"), ("d", "pqr"), ("a_1", "uv"), ("e", "w"), ("f", "qq"))]
    later = [SimpleNamespace(id="sharegpt/g#2", text="zz")]
    calls = []

    def iter_sharegpt_prompts(*, seed=0, turns="first", **kw):
        calls.append((turns, kw))
        return iter(first if turns == "first" else later)

    monkeypatch.setattr(tevjax.prompts, "iter_sharegpt_prompts", iter_sharegpt_prompts)
    replies = {"sharegpt/e": "R", "sharegpt/f": "S"}
    monkeypatch.setattr(tevjax.prompts, "sharegpt_replies", lambda turns="first": replies)
    tok = _CharTokenizer()
    cfg = RolloutConfig(num_prompts=2, heldout_prompts=2, heldout_records=1, max_prompt_tokens=4, taps=(1,))
    ids = lambda rows: [r["id"].removeprefix("sharegpt/") for r in rows]  # noqa: E731
    held, train = select_prompts(tok, cfg)
    assert ids(held) == ["a_0", "c"] and ids(train) == ["d", "e"]  # a_1 shares a_0's source
    assert [r["index"] for r in held] == [r["index"] for r in train] == [0, 1]
    assert held[0]["prompt_ids"] == tok.encode("xyz>")
    _, train = select_prompts(tok, dataclasses.replace(cfg, exclusion="conversation"))
    assert ids(train) == ["d", "a_1"]
    _, train = select_prompts(tok, dataclasses.replace(cfg, responses="sharegpt"))
    assert ids(train) == ["e", "f"] and [r["reply"] for r in train] == ["R", "S"]
    _, train = select_prompts(tok, dataclasses.replace(cfg, num_prompts=1, turns="later"))
    assert ids(train) == ["g#2"]
    assert calls[-1] == ("later", {"min_chars": 40, "exclude_conversations": {"a_0", "c"},
                                   "exclude_sources": {"a", "c"}})
    with pytest.raises(ValueError, match=r"only 2 \+ 3 ShareGPT prompts"):
        select_prompts(tok, dataclasses.replace(cfg, num_prompts=5))
    assert ids(select_prompts(tok, dataclasses.replace(cfg, num_prompts=5), exact=False)[1]) == ["d", "e", "f"]
