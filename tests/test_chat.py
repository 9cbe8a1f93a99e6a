"""`tevjax chat`: each reply is the target's greedy continuation of the conversation so far (as
independent autoregressive decoding of the rendered conversation gives it), the conversation is
trimmed from its oldest exchange to fit the target, and a failed or interrupted turn leaves no
trace. The target is the tiny random Llama with a byte-level tokenizer (`text_target_dir`)."""

from __future__ import annotations

import io
import sys

import pytest

from tevjax.chat import Conversation
from tevjax.cli import main
from tevjax.convert.tokenizer import chat_prompt_ids, load_tokenizer


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text):
    return {"role": "assistant", "content": text}


def _chat(monkeypatch, capsys, target, lines, *flags):
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(f"{line}\n" for line in lines)))
    code = main(["chat", "--target", str(target), *flags])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out, err


@pytest.fixture(scope="module")
def replies(text_target_dir):
    """The greedy reply to a conversation, by autoregressive decoding of its rendering."""
    from tevjax.decode import DecodeConfig, Decoder
    from tevjax.loading import load_models

    models = load_models(str(text_target_dir), None, with_drafter=False)
    decoder = Decoder(models.target, None, DecodeConfig(max_new_tokens=10, eos_ids=models.eos_ids))

    def reply(messages):
        gen = decoder.generate([chat_prompt_ids(models.tokenizer, messages)])[0]
        return models.tokenizer.decode(gen.tokens, skip_special_tokens=True)

    return reply


@pytest.mark.parametrize("verifier", ["tev", "ar"])
def test_each_reply_continues_the_whole_conversation(text_target_dir, replies, monkeypatch, capsys, verifier):
    """Three turns with a /reset between the second and third: the second reply is the continuation
    of turn 1, its reply and turn 2 (not of turn 2 alone); after /reset the conversation starts
    over; commands, blank lines and unknown commands add nothing to it."""
    from tevjax.decode import engine

    kept, reused_prefix = [], engine.Decoder._reused_prefix

    def spy(self, prompts, reuse):
        kept.append(reused_prefix(self, prompts, reuse))
        return kept[-1]

    monkeypatch.setattr(engine.Decoder, "_reused_prefix", spy)
    lines = ["hello world", "", "/help", "12 hello", "/nonsense", "/reset", "12 hello", "/exit", "never read"]
    tree = ["--budget", "4"] if verifier != "ar" else []  # refused without a drafter
    out, err = _chat(monkeypatch, capsys, text_target_dir, lines, "--max-new-tokens", "10", *tree,
                     "--verifier", verifier)
    first = replies([_user("hello world")])
    second = replies([_user("hello world"), _assistant(first), _user("12 hello")])
    alone = replies([_user("12 hello")])
    assert second != alone  # the test can tell a conversation from its last message
    assert out == f"{first}\n{second}\n{alone}\n"
    # Turns 2 and 3 start from the last turn's caches: turn 2 keeps at least all of turn 1's prompt
    # (`Decoder.prefill(reuse=...)`), turn 3, after /reset, only what its rendering shares.
    tok = load_tokenizer(text_target_dir)
    opening = len(chat_prompt_ids(tok, [_user("hello world")]))
    assert len(kept) == 2 and kept[0] >= opening - 1 and 0 <= kept[1] < opening, (kept, opening)
    assert err.count("[tevjax] ") == 3 and "tevjax: conversation reset" in err
    assert "unknown command '/nonsense'" in err and "/reset   forget the conversation" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("limit", [60, 100])
def test_each_turn_keeps_the_longest_run_of_whole_exchanges_that_fits(text_target_dir, limit):
    """The reference: a turn keeps the latest exchanges before the new message, as many whole ones
    as fit, and reports how many it dropped. At 100 positions some turns drop one exchange and keep
    others; at 60 a turn keeps its message alone."""
    tok = load_tokenizer(text_target_dir)
    conv = Conversation(tok, limit=limit, reserve=20, system="hello")
    fits = lambda ms: len(chat_prompt_ids(tok, [{"role": "system", "content": "hello"}, *ms])) + 20 <= limit  # noqa: E731
    partial = 0
    for k, text in enumerate(["hello world 12", "world hello", "12 12 12 hello", "hello hello world", "12 world"]):
        before = list(conv.messages)
        drop = next(d for d in range(len(before) // 2 + 1) if fits(before[2 * d:] + [_user(text)]))
        _, dropped = conv.ask(text)
        assert (dropped, conv.messages) == (drop, before[2 * drop:] + [_user(text)]), k
        partial += 0 < drop < len(before) // 2
        conv.answer(f"reply {k}")
    assert partial > 0 if limit == 100 else partial == 0


def test_a_conversation_too_long_for_the_target_drops_its_oldest_exchanges(text_target_dir):
    tok = load_tokenizer(text_target_dir)
    system = "hello"
    conv = Conversation(tok, limit=60, reserve=20, system=system)
    texts = ["hello world 12", "world hello", "12 12 12 hello", "hello hello world"]
    dropped_total = 0
    for k, text in enumerate(texts):
        ids, dropped = conv.ask(text)
        dropped_total += dropped
        assert len(ids) + 20 <= 60
        assert ids == chat_prompt_ids(tok, [{"role": "system", "content": system}, *conv.messages])
        assert conv.messages[-1] == _user(text) and conv.messages[0]["role"] == "user"
        conv.answer(f"reply {k}")
    assert dropped_total > 0  # the limit was reached, and the conversation goes on
    # The kept messages are the latest ones, in order, as exchanges.
    everything = [m for k, t in enumerate(texts) for m in (_user(t), _assistant(f"reply {k}"))]
    assert conv.messages == everything[-len(conv.messages):] and len(conv.messages) % 2 == 0

    before = list(conv.messages)
    with pytest.raises(ValueError, match=r"this message makes a \d+-token prompt: .* exceeds the target's 60"):
        conv.ask("hello world " * 30)
    assert conv.messages == before  # a refused message changes nothing
    conv.ask("world")
    conv.retract()
    assert conv.messages == before


def test_a_message_too_long_is_refused_and_the_chat_goes_on(text_target_dir, replies, monkeypatch, capsys):
    out, err = _chat(monkeypatch, capsys, text_target_dir, ["hello world " * 80, "hello world"],
                     "--max-new-tokens", "10", "--budget", "4")
    assert "tevjax: error: this message makes a" in err and "exceeds the target's 128 positions" in err
    assert out == replies([_user("hello world")]) + "\n"


def test_an_interrupted_reply_is_forgotten(text_target_dir, replies, monkeypatch, capsys):
    """Ctrl-C while the first reply streams: that turn is dropped (no partial reply enters the
    conversation), and the next reply continues the conversation without it."""
    from tevjax.decode import engine

    stream, calls = engine.Decoder.stream, []

    def interrupted_once(self, prompts, seed=0, reuse=None):
        calls.append((seed, reuse))
        if len(calls) == 1:
            raise KeyboardInterrupt
        yield from stream(self, prompts, seed, reuse=reuse)

    monkeypatch.setattr(engine.Decoder, "stream", interrupted_once)
    out, err = _chat(monkeypatch, capsys, text_target_dir, ["hello world", "12 hello"],
                     "--max-new-tokens", "10", "--budget", "4")
    assert "reply interrupted; the turn is forgotten" in err
    assert out == "\n" + replies([_user("12 hello")]) + "\n"
    assert calls == [(0, None), (0, None)]  # the k-th given reply samples with seed + k, from a fresh prefill


@pytest.mark.parametrize("argv, message", [
    (["chat", "--system", "  "], "--system is empty"),
    (["chat", "--budget", "2", "--lookup", "3"], "--lookup 3 exceeds --budget 2"),
    (["chat", "--verifier", "eagle"], "--verifier 'eagle' is not one of"),
])
def test_bad_chat_flags_are_one_line(capsys, argv, message):
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_target_without_a_chat_template_is_refused(tiny_llama_dir, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    code = main(["chat", "--target", str(tiny_llama_dir), "--max-new-tokens", "4", "--budget", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "has no tokenizer with a chat template, which a chat needs" in err, err


def test_a_system_message_the_template_refuses_is_one_error_before_any_turn(text_target_dir, tmp_path,
                                                                            monkeypatch, capsys):
    import json
    import shutil

    target = tmp_path / "target"
    shutil.copytree(text_target_dir, target)
    config = json.loads((target / "tokenizer_config.json").read_text())
    config["chat_template"] = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                               "{{ raise_exception('System role not supported') }}{% endif %}"
                               "{{ m['content'] }}{% endfor %}")
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    code = main(["chat", "--target", str(target), "--system", "be brief", "--max-new-tokens", "4", "--budget", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "chat_template fails" in err and "System role not supported" in err, err
    assert "[tevjax]" not in err


def test_sampled_replies_replay_and_the_last_seed_wraps(text_target_dir, monkeypatch, capsys):
    """At temperature 1 the same conversation and seed give the same replies; from the largest
    seed the second reply's seed wraps to 0 instead of failing mid-chat."""
    lines = ["hello world", "12 hello"]
    flags = ("--max-new-tokens", "10", "--budget", "4", "--temperature", "1", "--seed", str(2**64 - 1))
    first, err = _chat(monkeypatch, capsys, text_target_dir, lines, *flags)
    again, _ = _chat(monkeypatch, capsys, text_target_dir, lines, *flags)
    assert first == again and err.count("[tevjax] ") == 2, err


def test_a_line_that_is_not_utf8_costs_that_line_only(text_target_dir, monkeypatch, capsys):
    """Python reads a byte that is not UTF-8 from stdin as a lone surrogate, which no tokenizer
    encodes: that line is refused by name and the chat goes on as if it had not been typed."""
    flags = ("--max-new-tokens", "6", "--verifier", "ar")
    want, _ = _chat(monkeypatch, capsys, text_target_dir, ["hello world", "12 hello"], *flags)
    got, err = _chat(monkeypatch, capsys, text_target_dir, ["hello world", "\udcff\udcfe bad", "12 hello"], *flags)
    assert got == want
    assert "tevjax: error: this message is not UTF-8 text (byte 0xff at character 0); it was not sent" in err, err


def test_a_line_that_is_not_utf8_costs_that_line_only_in_a_strict_locale(text_target_dir, monkeypatch, capsys):
    """Outside the C / C.UTF-8 locales (en_US.UTF-8, say) Python's stdin decodes strictly: a byte that
    is not UTF-8 raised from the read and ended the chat, and the lines before it in the same buffered
    chunk went unanswered. It costs that line only, as with surrogate escapes."""
    flags = ("--max-new-tokens", "6", "--verifier", "ar")
    want, _ = _chat(monkeypatch, capsys, text_target_dir, ["hello world", "12 hello"], *flags)
    raw = b"hello world\n\xff\xfe bad\n12 hello\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8", errors="strict"))
    code = main(["chat", "--target", str(text_target_dir), *flags])
    out, err = capsys.readouterr()
    assert code == 0 and out == want, err
    assert "tevjax: error: this message is not UTF-8 text (byte 0xff at character 0); it was not sent" in err, err


def test_a_closed_stdin_is_one_error_before_loading(monkeypatch, capsys):
    """`tevjax chat <&-`: Python's sys.stdin is None (it was an internal error, after the model loaded)."""
    monkeypatch.setattr(sys, "stdin", None)
    assert main(["chat", "--target", "/nonexistent"]) == 2
    assert capsys.readouterr().err == ("tevjax: error: stdin is closed: a chat reads its messages from stdin (a "
                                       "terminal, or one message per line of piped input)\n")


def test_a_system_message_that_leaves_no_room_is_refused_before_any_turn(text_target_dir, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\n"))
    code = main(["chat", "--target", str(text_target_dir), "--system", "x" * 3000, "--max-new-tokens", "8",
                 "--verifier", "ar"])
    err = capsys.readouterr().err
    assert code == 2 and "--system: the system message makes a" in err and "before any message" in err, err
    assert "this message makes" not in err


def test_reply_seeds_the_reserve_and_quit(text_target_dir, monkeypatch, capsys):
    """Reply k samples with --seed + k (past 2**64 - 1 it wraps to 0); the conversation keeps room for
    --max-new-tokens and a round's tree slots (the budget and the root; one slot without a drafter);
    /quit, in any case, ends the chat."""
    from tevjax import chat
    from tevjax.decode import engine

    stream, seeds, reserves = engine.Decoder.stream, [], []

    def spy(self, prompts, seed=0, reuse=None):
        seeds.append(seed)
        yield from stream(self, prompts, seed, reuse=reuse)

    class Spied(chat.Conversation):
        def __post_init__(self):
            reserves.append(self.reserve)
            super().__post_init__()

    monkeypatch.setattr(engine.Decoder, "stream", spy)
    monkeypatch.setattr(chat, "Conversation", Spied)
    _, err = _chat(monkeypatch, capsys, text_target_dir, ["hello world", "12 hello", "/Quit", "never read"],
                   "--max-new-tokens", "6", "--budget", "4", "--seed", str(2**64 - 1))
    assert (seeds, reserves) == ([2**64 - 1, 0], [6 + 5]) and err.count("[tevjax] ") == 2, err
    assert "unknown command" not in err
    _chat(monkeypatch, capsys, text_target_dir, ["hello"], "--max-new-tokens", "6", "--verifier", "ar", "--seed", "3")
    assert (seeds[2:], reserves[1:]) == ([3], [6 + 1])
