"""Stop strings: the token automaton against a brute-force search of the text, the streamed text,
token spellings against the tokenizers' own decoding, and decoding that stops exactly where
autoregressive decoding's text first holds a stop string."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tevjax.convert.tokenizer import build_tokenizer, token_bytes
from tevjax.decode import DecodeConfig, Decoder
from tevjax.decode.stops import StopText, advance, cut_text, stop_table
from test_decode import models  # noqa: F401  the tiny target (vocabulary 24) and its fresh drafter

# ------------------------------------------------------------------------------------- automaton

ALPHABET = "ab\né"  # é is two bytes in UTF-8: tokens may split it
_byte_strings = st.lists(st.sampled_from(list("ab\né".encode())), max_size=3).map(bytes)


def first_stop(spellings, tokens, stops) -> int | None:
    """Brute force: the first index i whose text (tokens[: i + 1]'s bytes) holds a stop string."""
    text = b""
    for i, t in enumerate(tokens):
        text += spellings[t]
        if any(s.encode() in text for s in stops):
            return i
    return None


@settings(max_examples=300, deadline=None, derandomize=True)
@given(spellings=st.lists(_byte_strings, min_size=1, max_size=10),
       stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), min_size=1, max_size=3),
       picks=st.lists(st.integers(0, 10**6), max_size=24))
def test_the_automaton_stops_at_the_first_token_whose_text_holds_a_stop_string(spellings, stops, picks):
    vocab = len(spellings) + 1  # one spare id past the spellings: it spells nothing
    table = stop_table(stops, spellings, vocab)
    tokens = [p % vocab for p in picks]
    padded = spellings + [b""]
    # Every subset of the strings (a row's mask), the whole set among them, on the one table.
    for mask in range(1, 2 ** len(stops)):
        q, hit = 0, None
        for i, t in enumerate(tokens):
            if int(table.hits[q, t]) & mask:
                hit = i
                break
            q = int(table.next[q, t])
        watched = [s for k, s in enumerate(stops) if mask >> k & 1]
        assert hit == first_stop(padded, tokens, watched), mask
    assert (table.next[table.matched] == table.matched).all() and not table.hits[table.matched].any()  # absorbing


def test_advance_walks_the_table_and_skips_invalid_tokens():
    spellings = [b"xa", b"b", b"cab", b"a"]
    table = stop_table(["ab"], spellings, 5)
    # The module docstring's worked example.
    assert table.matched == 3
    assert (int(table.next[0, 0]), int(table.next[1, 1]), int(table.next[0, 2]), int(table.next[0, 1])) == (1, 2, 2, 0)
    assert (int(table.hits[0, 0]), int(table.hits[1, 1]), int(table.hits[0, 2]), int(table.hits[1, 2])) == (0, 1, 1, 1)
    tokens = jnp.asarray([0, 4, 3, 1, 0], jnp.int32)
    valid = jnp.asarray([True, True, True, False, True])
    got = jax.jit(advance)(jax.device_put(table), jnp.int32(0), tokens, valid)
    # "xa" -> 1; token 4 spells nothing; "a" -> 1; the invalid "b" is skipped; "xa" -> 1.
    assert got.tolist() == [1, 1, 1, 1, 1]
    assert jax.jit(advance)(table, jnp.int32(1), tokens[3:4], valid[:1]).tolist() == [3]
    # A row watching none of the strings reads on through "b" (to state 2, the text ending in "ab").
    assert jax.jit(advance)(table, jnp.int32(1), tokens[3:4], valid[:1], 0).tolist() == [2]
    # A stop string that ends inside another's prefix ("b" within "abc") is found there: the
    # automaton's failure links carry the shorter string's mark.
    nested = stop_table(["abc", "b"], [b"a", b"b", b"c"], 3)
    state_a = int(nested.next[0, 0])
    state_ab = int(nested.next[state_a, 1])
    assert int(nested.hits[state_a, 1]) == 2 and int(nested.hits[state_ab, 2]) == 1  # "b", then "abc"
    two = stop_table(["ab", "x"], spellings, 5)
    walk = jax.jit(advance)
    tokens = jnp.asarray([0, 1], jnp.int32)  # "xa", "b": "x" ends in the first token, "ab" in the second
    assert [walk(two, jnp.int32(0), tokens, jnp.ones(2, bool), m).tolist() for m in (-1, 1, 2, 0)] == [
        [4, 4], [1, 4], [4, 4], [1, 2]]


def test_stop_string_errors_name_the_problem():
    with pytest.raises(TypeError, match=r"the single string 'ab': write \('ab',\)"):
        DecodeConfig(stop="ab")
    with pytest.raises(ValueError, match="stop string 1 is empty"):
        DecodeConfig(stop=("a", ""))
    with pytest.raises(TypeError, match="stop string 0 must be a str"):
        DecodeConfig(stop=(b"a",))
    assert DecodeConfig(stop=["a", "b"]).stop == ("a", "b")  # any sequence becomes a hashable tuple
    with pytest.raises(ValueError, match="3 token spellings for a vocabulary of 2"):
        stop_table(["a"], [b"a", b"b", b"c"], 2)
    with pytest.raises(ValueError, match="no stop strings given"):
        stop_table([], [b"a"], 1)
    for spellings in (["a", "b"], b"ab"):  # failed in np.frombuffer / len() without naming the spellings
        with pytest.raises(TypeError, match="spellings must be a list of each token's bytes"):
            stop_table(["a"], spellings, 2)
    with pytest.raises(TypeError, match="the single string b'ab'"):  # not the "stop strings" 97 and 98
        cut_text("xab", b"ab")


def test_a_stop_string_that_is_not_valid_unicode_is_refused_by_name():
    """Half of a surrogate pair (a JSON "\\ud83d" cut from its partner) was accepted by DecodeConfig, then
    failed building the byte automaton with a bare UnicodeEncodeError."""
    for call in (lambda: DecodeConfig(stop=("ok", "a\ud83d")), lambda: stop_table(["ok", "a\ud83d"], [b"a"], 1),
                 lambda: cut_text("a", ["ok", "a\ud83d"])):
        with pytest.raises(ValueError, match=r"stop string 1 \('a\\ud83d'\) is not valid Unicode"):
            call()
    assert DecodeConfig(stop=("\U0001f600",)).stop == ("\U0001f600",)  # a whole pair is one character


def test_a_table_holds_thirty_two_stop_strings_and_no_more():
    """The 32nd string is bit 31 of a row's int32 mask, its sign bit: a row watching only it (mask
    -2**31) stops on it, and a 33rd string is refused."""
    stops = [chr(65 + i) for i in range(32)]  # "A" .. "`", one byte each
    spellings = [s.encode() for s in stops]
    table = stop_table(stops, spellings, 32)
    assert int(table.hits[0, 31]) == -2**31 and int(table.hits[0, 0]) == 1
    got = advance(table, jnp.int32(0), jnp.asarray([0, 31], jnp.int32), jnp.ones(2, bool), -2**31)
    assert got.tolist() == [int(table.next[0, 0]), table.matched]  # "A" is not watched, "`" is
    with pytest.raises(ValueError, match="33 stop strings: a table holds at most 32"):
        stop_table(stops + ["x"], spellings, 32)


# ------------------------------------------------------------------------------------------- text

@settings(max_examples=300, deadline=None, derandomize=True)
@given(text=st.text("ab\n", max_size=30), stops=st.lists(st.text("ab\n", min_size=1, max_size=4), min_size=1,
                                                          max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=8))
def test_streamed_text_joins_to_the_cut_text(text, stops, cuts):
    """However the text arrives, the pieces shown join to the text before the first stop string,
    and nothing of a stop string is ever shown."""
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    shown = StopText(stops)
    pieces = [shown.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])]
    want, hit = cut_text(text, stops)
    joined = "".join(pieces) + shown.flush()
    assert joined == want and shown.stopped == hit
    for k in range(1, len(pieces) + 1):
        assert not any(s in "".join(pieces[:k]) for s in stops)


def test_streamed_text_flushes_its_held_tail_once():
    """The tail held back (it could begin "ab") comes out once at the end of the stream, not again."""
    shown = StopText(("ab",))
    assert (shown.feed("xa"), shown.flush(), shown.flush(), shown.feed("b")) == ("x", "a", "", "b")


def test_cut_text_cuts_the_stop_string_that_ends_first():
    assert cut_text("one two three", ("three", "two")) == ("one ", True)
    assert cut_text("one", ("x",)) == ("one", False)
    assert cut_text("aa\na", ("\n", "a\na")) == ("aa", True)  # "a\na" starts first but ends later
    assert cut_text("xab", ("b", "ab")) == ("x", True)  # both end at once: the longer one goes
    with pytest.raises(TypeError, match="got the single string 'bc'"):  # not the stops "b" and "c"
        cut_text("xcb", "bc")
    with pytest.raises(ValueError):
        cut_text("abc", [""])


# --------------------------------------------------------------------------------------- spellings

def _joined(spellings, ids) -> str:
    return b"".join(spellings[i] for i in ids).decode("utf-8", "replace")


def test_byte_level_spellings_decode_as_the_tokenizer_does():
    from test_tokenizer import tiny_meta

    tok = build_tokenizer(tiny_meta())
    spellings = token_bytes(tok)
    assert len(spellings) == tok.get_vocab_size(with_added_tokens=True)
    assert spellings[1] == b"" and spellings[tok.token_to_id("Ġworld")] == b" world"
    rng = np.random.default_rng(0)
    for _ in range(200):
        ids = rng.integers(0, len(spellings), 12).tolist()
        assert _joined(spellings, ids) == tok.decode(ids, skip_special_tokens=True)
    text = "hello  world 12 é🙂\n"
    ids = tok.encode(text).ids
    assert b"".join(spellings[i] for i in ids) == text.encode()


def test_sentencepiece_spellings_and_unsupported_decoders():
    from tokenizers import Tokenizer, decoders, models

    # (7 and 8 only look like byte tokens: they spell their text, as ByteFallback decodes them)
    vocab = {"<unk>": 0, "<s>": 1, "\u2581a": 2, "b": 3, "<0x0A>": 4, "<0xC3>": 5, "<0xA9>": 6, "<0xZZ>": 7,
             "<0x0A>>": 8}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken("<s>", special=True)])
    spellings = token_bytes(tok)
    assert spellings == [b"<unk>", b"", b" a", b"b", b"\n", b"\xc3", b"\xa9", b"<0xZZ>", b"<0x0A>>"]
    ids = [3, 2, 4, 5, 6, 2, 7, 8]
    assert _joined(spellings, ids) == tok.decode(ids)  # no leading space here for the decoder to strip
    assert _joined(spellings, [2, 3]) == " " + tok.decode([2, 3])  # the one the decoder strips is kept
    tok.decoder = decoders.Metaspace()  # (without ByteFallback: "<0x0A>" is still read as its byte)
    assert token_bytes(tok) == spellings
    tok.decoder = decoders.WordPiece()
    with pytest.raises(ValueError, match=r"its decoder is \['WordPiece'\]"):
        token_bytes(tok)


def test_smollm2_spellings_decode_as_its_tokenizer():
    from tevjax.loading import load_target

    tok = load_target().tokenizer
    spellings = token_bytes(tok)
    rng = np.random.default_rng(1)
    for _ in range(100):  # random ids, special ones and partial characters included
        ids = rng.integers(0, len(spellings), 16).tolist()
        assert _joined(spellings, ids) == tok.decode(ids, skip_special_tokens=True)
    text = "Lists:\n\n1. Apples — 🍎 and `code()`\n\tend"
    assert b"".join(spellings[i] for i in tok.encode(text)) == text.encode()


# --------------------------------------------------------------------------------------- decoding

PROMPTS = [[1, 5, 7, 9, 11], [1, 3], [1, 4, 4, 4, 4, 4, 8, 9, 10, 12, 14], [6]]
# Tokens 0..21 spell one to three letters of a-f; 22 and 23 (the drafter's mask) spell nothing.
SPELLINGS = [bytes([97 + i % 6]) * (1 + i % 3) for i in range(22)] + [b"", b""]
KW = dict(max_new_tokens=24, budget=8, prompt_bucket=16, capacity=64)


@pytest.fixture(scope="module")
def reference(models):
    """Autoregressive greedy outputs without stop strings, and stop strings chosen from them: one
    row's text holds each early on, and one row's text holds none."""
    outs = [g.tokens for g in Decoder(models[0], None, DecodeConfig(**KW)).generate(PROMPTS)]
    texts = [b"".join(SPELLINGS[t] for t in out).decode() for out in outs]
    return outs, texts


STOPS = ("ca", "fe", "ddd")


def _expected(outs):
    cuts = [first_stop(SPELLINGS, out, STOPS) for out in outs]
    return [out if c is None else out[: c + 1] for out, c in zip(outs, cuts)], cuts


@pytest.mark.parametrize("verifier", [None, "tev"])  # (the cut is the engine's, after any verifier)
def test_decoding_stops_where_the_autoregressive_text_first_holds_a_stop_string(models, reference, verifier):
    outs, texts = reference
    want, cuts = _expected(outs)
    # The test can fail both ways: some rows stop early, and some run to their length.
    assert any(c is not None and c + 1 < len(o) for c, o in zip(cuts, outs)) and None in cuts, texts
    drafter = models[1] if verifier else None
    cfg = DecodeConfig(stop=STOPS, lookup=5 if verifier else 0, **({"verifier": verifier} if verifier else {}), **KW)
    dec = Decoder(models[0], drafter, cfg, spellings=SPELLINGS)
    gens = dec.generate(PROMPTS)
    assert [g.tokens for g in gens] == want
    assert [g.stop for g in gens] == ["length" if c is None else "stop" for c in cuts]
    # Rows alone, and one round per loop call: the automaton's state carries across calls.
    assert [g.tokens for g in dec.generate(PROMPTS, rounds_per_call=1)] == want
    streamed = [[] for _ in PROMPTS]
    for new, state in dec.stream(PROMPTS):
        for row, toks in zip(streamed, new):
            row.extend(toks)
    assert streamed == want and [g.tokens for g in dec.results(state)] == want
    if verifier:
        # Some stopped row's last round accepted tokens past its stop, which the cut dropped.
        assert any(round(g.tau * g.rounds) > len(g.tokens) for g in gens if g.stop == "stop")


@pytest.mark.parametrize("verifier", [None, "tev"])
def test_rows_watch_their_own_stop_strings(models, reference, verifier):
    """`stop=` gives each row its own subset of cfg.stop: each row stops where the autoregressive
    text first holds one of its strings (or runs to its length), in fixed and continuous batches,
    with the loop compiled once; a row watching none runs on, and strings outside cfg.stop are
    refused by name."""
    outs, texts = reference
    drafter = models[1] if verifier else None
    cfg = DecodeConfig(stop=STOPS, lookup=5 if verifier else 0, **({"verifier": verifier} if verifier else {}), **KW)
    dec = Decoder(models[0], drafter, cfg, spellings=SPELLINGS)
    dec.generate(PROMPTS)
    compiled = dec._loop._cache_size()
    subsets = [["ddd"], ["ca", "fe"], [], list(STOPS)]
    cuts = [first_stop(SPELLINGS, out, sub) for out, sub in zip(outs, subsets)]
    want = [out if c is None else out[: c + 1] for out, c in zip(outs, cuts)]
    assert want != _expected(outs)[0], "the subsets change no row: the test could not fail"
    gens = dec.generate(PROMPTS, stop=subsets)
    assert [g.tokens for g in gens] == want
    assert [g.stop for g in gens] == ["length" if c is None else "stop" for c in cuts]
    assert [g.tokens for g in dec.generate_continuous(PROMPTS, 2, stop=subsets)] == want
    assert dec._loop._cache_size() == compiled
    for bad, error, message in [([["ca"], ["zz"], [], []], ValueError, r"stop\[1\]: 'zz' is not one of DecodeConfig"),
                                ([["ca"]] * 2, ValueError, "2 values for 4 prompts"),
                                (["ca", "fe", "ddd", "ca"], TypeError, r"stop\[0\]: .*single string 'ca'"),
                                ("ca", TypeError, "stop must be one list of stop strings per prompt or None")]:
        with pytest.raises(error, match=message):
            dec.generate(PROMPTS, stop=bad)
    with pytest.raises(ValueError, match="DecodeConfig.stop, which is empty"):
        Decoder(models[0], None, DecodeConfig(**KW)).generate(PROMPTS, stop=[["ca"]] * 4)


def test_a_reused_state_matches_its_new_output_from_the_start(models, reference):
    """A second turn from a stopped state: the automaton starts over on the new output, so the
    turn decodes what a fresh prefill of the same prompts decodes."""
    dec = Decoder(models[0], models[1], DecodeConfig(stop=STOPS, lookup=5, **{**KW, "capacity": 128}),
                  spellings=SPELLINGS)
    state = dec.run(dec.prefill(PROMPTS))
    second = [p + g.tokens + [2, 3] for p, g in zip(PROMPTS, dec.results(state))]
    again = dec.run(dec.prefill(second, seed=1, reuse=(state, PROMPTS)))
    assert [g.tokens for g in dec.results(again)] == [g.tokens for g in dec.generate(second, seed=1)]


def test_a_decoder_with_stop_strings_needs_the_spellings(models):
    with pytest.raises(ValueError, match="needs the tokens' bytes"):
        Decoder(models[0], None, DecodeConfig(stop=("a",), **KW))


def test_emit_cuts_blocks_at_the_first_stop_eos_or_length():
    """Rows of one block "x c a" (stop "ca") with room for all, room for two (the length cut comes
    before the stop: not a stop), an EOS first, and a row already done, whose text ends in "c" and
    which is given "a c a": it emits nothing, so its state stays (not "ca", a stop it never wrote)."""
    from types import SimpleNamespace

    from tevjax.decode.engine import emit

    spellings = [b"c", b"a", b"x", b""]  # 3 is the EOS: it spells nothing
    table = stop_table(["ca"], spellings, 4)
    cfg = DecodeConfig(stop=("ca",), eos_ids=(3,), max_new_tokens=4)
    blocks = jnp.asarray([[2, 0, 1], [2, 0, 1], [3, 0, 1], [1, 0, 1]], jnp.int32)
    c_state = int(table.next[0, 0])  # the text ends in "c": a stop string's first byte
    ver = SimpleNamespace(tokens=blocks, num_tokens=jnp.asarray([3, 3, 3, 3], jnp.int32))
    state = SimpleNamespace(out=jnp.full((4, 4), -1, jnp.int32), num_out=jnp.asarray([0, 2, 0, 0], jnp.int32),
                            limit=jnp.full((4,), 4, jnp.int32),
                            done=jnp.asarray([False, False, False, True]),
                            stop_at=jnp.asarray([0, 0, 0, c_state], jnp.int32),
                            stop_mask=jnp.full(4, -1, jnp.int32))
    out, num_out, finished, stop_at = emit(ver, state, cfg, stops=table)
    assert num_out.tolist() == [3, 4, 1, 0] and finished.tolist() == [True, True, True, False]
    assert out[0].tolist() == [2, 0, 1, -1] and out[1].tolist()[2:] == [2, 0]
    assert stop_at.tolist() == [table.matched, c_state, 0, c_state]


def test_emit_reads_no_entry_past_a_block():
    """Past its num_tokens a block holds -1, which the automaton would read as token 0: a row
    given "x" (one token) watching "xc", with "c" token 0, keeps one token and is not stopped."""
    from types import SimpleNamespace

    from tevjax.decode.engine import emit

    table = stop_table(["xc"], [b"c", b"a", b"x", b""], 4)
    cfg = DecodeConfig(stop=("xc",), max_new_tokens=4)
    ver = SimpleNamespace(tokens=jnp.asarray([[2, -1, -1]], jnp.int32), num_tokens=jnp.asarray([1], jnp.int32))
    state = SimpleNamespace(out=jnp.full((1, 4), -1, jnp.int32), num_out=jnp.zeros(1, jnp.int32),
                            limit=jnp.full((1,), 4, jnp.int32), done=jnp.zeros(1, bool),
                            stop_at=jnp.zeros(1, jnp.int32), stop_mask=jnp.full(1, -1, jnp.int32))
    out, num_out, finished, stop_at = emit(ver, state, cfg, stops=table)
    assert num_out.tolist() == [1] and finished.tolist() == [False] and out[0].tolist() == [2, -1, -1, -1]
    assert stop_at.tolist() == [int(table.next[0, 2])] != [table.matched]
