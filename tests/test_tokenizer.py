"""GGUF tokenizer metadata -> tokenizer.json, and ChatML prompt ids.

Tiny vocabularies pin the pre-tokenizer rules; the real SmolLM2 GGUF is checked against
transformers' own GGUF tokenizer conversion on varied strings, and against llama.cpp's "smollm"
split rule (digits isolated, then the GPT-2 split; regexes from llama.cpp's llama-vocab.cpp) on the
strings where transformers' conversion, which ignores `tokenizer.ggml.pre = smollm`, differs.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from test_gguf import CHAT_TEMPLATE, MERGES, SPECIALS, byte_alphabet, tiny_vocab
from tevjax.convert.tokenizer import (
    StreamDetokenizer,
    TokenizerConversionError,
    build_tokenizer,
    chat_prompt_ids,
    load_tokenizer,
    token_bytes,
    tokenizer_files_from_gguf,
)

ROOT = Path(__file__).resolve().parents[1]


def tiny_meta(pre: str = "smollm") -> dict:
    tokens = tiny_vocab()
    return {
        "general.architecture": "llama",
        "llama.context_length": 128,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in SPECIALS else 1 for t in tokens],
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.padding_token_id": 2,
        "tokenizer.chat_template": CHAT_TEMPLATE,
    }


def write_tok_dir(meta: dict, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, content in tokenizer_files_from_gguf(meta).items():
        (path / name).write_text(json.dumps(content), encoding="utf-8")
    return path


def pieces(tok, ids):
    vocab = {i: t for t, i in tok.get_vocab().items()}
    return [vocab[i] for i in ids]


# ------------------------------------------------------------------------------ tiny vocabulary


def test_tiny_tokenizer_merges_and_specials():
    tok = build_tokenizer(tiny_meta())
    assert tok.get_vocab_size() == len(tiny_vocab())
    enc = tok.encode("<|im_start|>hello world<|im_end|>")
    assert enc.tokens == ["<|im_start|>", "hello", "Ġworld", "<|im_end|>"]
    assert enc.ids[0] == 1 and enc.ids[-1] == 2
    assert tok.decode(enc.ids, skip_special_tokens=False) == "<|im_start|>hello world<|im_end|>"
    assert tok.decode(enc.ids, skip_special_tokens=True) == "hello world"
    # UTF-8 text falls back to byte symbols, and round-trips
    text = "héllo ✓"
    assert tok.decode(tok.encode(text).ids) == text


@pytest.mark.parametrize("pre, text, want", [
    # smollm isolates every digit, so the learned "12" / "Ġ1" merges can never apply ...
    ("smollm", "12", ["1", "2"]),
    ("smollm", "a 12", ["a", "Ġ", "1", "2"]),
    # ... and whitespace before a digit stays one piece ("ĠĠ" merge applies)
    ("smollm", "a  1", ["a", "ĠĠ", "1"]),
    ("smollm", "a   1", ["a", "ĠĠĠ", "1"]),
    # the plain GPT-2 split keeps digit runs and a leading space together
    ("gpt-2", "12", ["12"]),
    # (merge "1 2" ranks before "Ġ 1", so BPE of "Ġ12" ends as Ġ + 12)
    ("gpt-2", "a 12", ["a", "Ġ", "12"]),
    ("gpt-2", "a  1", ["a", "Ġ", "Ġ1"]),
])
def test_pre_tokenizer_rules(pre, text, want):
    tok = build_tokenizer(tiny_meta(pre))
    assert tok.encode(text).tokens == want


def test_a_file_without_token_types_or_pre_tokenizer_has_normal_tokens_and_the_gpt2_split():
    """The defaults: no `token_type` means every token is normal (none is skipped when
    decoding), no `tokenizer.ggml.pre` means GPT-2's split (whitespace before a digit joins it)."""
    meta = {k: v for k, v in tiny_meta().items() if k not in ("tokenizer.ggml.token_type", "tokenizer.ggml.pre")}
    tok = build_tokenizer(meta)
    assert tok.encode("a  1").tokens == ["a", "Ġ", "Ġ1"]
    ids = tok.encode("<|im_start|>hello").ids
    assert tok.decode(ids, skip_special_tokens=True) == "<|im_start|>hello"


def test_raw_utf8_user_defined_and_foreign_control_tokens_keep_their_ids():
    """A normal token written in raw UTF-8 ("ω", not its bytes' "Ïī") is respelled so BPE can produce it; a
    control token outside the byte alphabet keeps its spelling and id; a user-defined token is
    matched whole and, unlike a control token, kept by decode(skip_special_tokens=True) and spelled
    by `token_bytes` (in its own UTF-8 where it is not in the byte alphabet)."""
    meta = tiny_meta()
    n = len(meta["tokenizer.ggml.tokens"])
    extra = {"ω": 1, "<｜end▁of▁sentence｜>": 3, "<tool>": 4, "<ω>": 4}
    meta["tokenizer.ggml.tokens"] = meta["tokenizer.ggml.tokens"] + list(extra)
    meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"] + list(extra.values())
    meta["tokenizer.ggml.merges"] = MERGES + [" ".join(byte_alphabet()[b] for b in "ω".encode())]
    tok = build_tokenizer(meta)
    assert tok.get_vocab_size(with_added_tokens=True) == n + 4
    ids = tok.encode("ω<tool>ω<｜end▁of▁sentence｜>").ids
    assert ids == [n, n + 2, n, n + 1]
    assert tok.decode(ids, skip_special_tokens=True) == "ω<tool>ω"
    assert token_bytes(tok)[n:] == ["ω".encode(), b"", b"<tool>", "<ω>".encode()]  # the last as spelled, in UTF-8


def test_contradictory_vocabularies_are_refused_by_name():
    meta = tiny_meta()
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    n = len(tokens)
    for change, message in (
            ({"tokenizer.ggml.token_type": types + [1]}, f"token_type has {n + 1} entries for {n} tokens"),
            ({"tokenizer.ggml.tokens": tokens[:-1] + ["hello"]},
             f"token 'hello' appears twice \\(ids {tokens.index('hello')} and {n - 1}\\)"),
            ({"tokenizer.ggml.merges": MERGES + ["Ġ Ġ Ġ"]}, r"merges\[13\] = 'Ġ Ġ Ġ' is not 'left right'")):
        with pytest.raises(TokenizerConversionError, match="x.gguf: .*" + message):
            build_tokenizer(dict(meta, **change), source="x.gguf")
    with pytest.raises(TokenizerConversionError, match="bos_token_id=-1 is outside the vocabulary"):
        tokenizer_files_from_gguf(dict(meta, **{"tokenizer.ggml.bos_token_id": -1}))
    # An add_bos_token whose id is not a token adds nothing (rather than failing to build).
    for bad in (-1, n):
        tok = build_tokenizer(dict(meta, **{"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.bos_token_id": bad}))
        assert tok.encode("hello").ids == [tokens.index("hello")]


def test_tokenizer_config_fields(tmp_path):
    files = tokenizer_files_from_gguf(tiny_meta())
    cfg = files["tokenizer_config.json"]
    assert (cfg["bos_token"], cfg["eos_token"], cfg["unk_token"], cfg["pad_token"]) == (
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_end|>")
    assert cfg["chat_template"] == CHAT_TEMPLATE
    assert cfg["model_max_length"] == 128
    tok = load_tokenizer(write_tok_dir(tiny_meta(), tmp_path / "t"))
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    # No BOS is added to plain text (see the module docstring of tevjax.convert.tokenizer).
    assert tok.encode("hello") == [tiny_vocab().index("hello")]
    # Prompt lengths are checked against the target, not the file's context length.
    assert tok.model_max_length >= 10**30


def test_chat_prompt_ids_tiny(tmp_path):
    tok = load_tokenizer(write_tok_dir(tiny_meta(), tmp_path / "t"))
    ids = chat_prompt_ids(tok, "hello world")
    text = tok.decode(ids)
    assert text == "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    msgs = [{"role": "system", "content": "hello"}, {"role": "user", "content": "world"},
            {"role": "assistant", "content": "hello"}]
    ids2 = chat_prompt_ids(tok, msgs, add_generation_prompt=False)
    assert tok.decode(ids2) == ("<|im_start|>system\nhello<|im_end|>\n<|im_start|>user\nworld"
                                "<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n")
    assert ids2.count(1) == 3 and ids2.count(2) == 3  # specials are single ids, not pieces
    # A file that asks for BOS on plain text gets none in a chat prompt: the template writes its own.
    bos = load_tokenizer(write_tok_dir(dict(tiny_meta(), **{"tokenizer.ggml.add_bos_token": True}), tmp_path / "b"))
    assert bos.encode("hello")[0] == 1 and chat_prompt_ids(bos, msgs, add_generation_prompt=False) == ids2


def test_chat_prompt_ids_bad_messages(tmp_path):
    tok = load_tokenizer(write_tok_dir(tiny_meta(), tmp_path / "t"))
    with pytest.raises(ValueError, match=r"messages\[0\]\['role'\] = 'robot'"):
        chat_prompt_ids(tok, [{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match=r"messages\[1\]\['content'\] must be a string"):
        chat_prompt_ids(tok, [{"role": "user", "content": "x"}, {"role": "user", "content": 3}])
    with pytest.raises(ValueError, match="empty"):
        chat_prompt_ids(tok, [])
    for bad in ({"role": "user", "content": "x", "name": "y"}, {"content": "x"}, ["user", "x"]):
        with pytest.raises(ValueError, match=r"messages\[0\] must be a dict with 'role' and 'content'"):
            chat_prompt_ids(tok, [bad])
    meta = tiny_meta()
    del meta["tokenizer.chat_template"]
    bare = load_tokenizer(write_tok_dir(meta, tmp_path / "bare"))
    with pytest.raises(ValueError, match="no chat_template"):
        chat_prompt_ids(bare, "hi")


def test_unsupported_tokenizers():
    with pytest.raises(TokenizerConversionError, match="tokenizer.ggml.model='t5'"):
        build_tokenizer(dict(tiny_meta(), **{"tokenizer.ggml.model": "t5"}), source="x.gguf")
    with pytest.raises(TokenizerConversionError, match="x.gguf: tokenizer.ggml.pre='deepseek-llm' is not supported"):
        build_tokenizer(tiny_meta("deepseek-llm"), source="x.gguf")
    meta = tiny_meta()
    del meta["tokenizer.ggml.merges"]
    with pytest.raises(TokenizerConversionError, match="tokenizer.ggml.merges is missing"):
        build_tokenizer(meta)
    with pytest.raises(TokenizerConversionError, match="out of|outside"):
        tokenizer_files_from_gguf(dict(tiny_meta(), **{"tokenizer.ggml.eos_token_id": 999}))


def test_load_tokenizer_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json in"):
        load_tokenizer(tmp_path)


def _edit_json(name, **changes):
    def edit(d):
        obj = json.loads((d / name).read_text())
        obj.update(changes)
        (d / name).write_text(json.dumps({k: v for k, v in obj.items() if v is not ...}))
    return edit


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "tokenizer.json").write_bytes(b'{"version": "1.0", \xff\xfe'),
     r"tokenizer\.json is not UTF-8 text: byte 0xff at line 1, offset 19"),
    (lambda d: (d / "tokenizer.json").write_text((d / "tokenizer.json").read_text()[:300]),
     r"tokenizer\.json is not valid JSON: .*line 1 column"),
    (lambda d: (d / "tokenizer.json").write_text("[1, 2]"), r"tokenizer\.json must hold a JSON object, got list"),
    (_edit_json("tokenizer.json", added_tokens=...), r"tokenizer\.json: required field 'added_tokens' is missing"),
    (_edit_json("tokenizer.json", model=None), r"tokenizer\.json: field 'model' must be an object, got None"),
    (_edit_json("tokenizer.json", model={"type": "BPE", "vocab": 3}),
     r"tokenizer\.json: not a tokenizer the tokenizers library can read \(.*line 1 column"),
    (lambda d: (d / "tokenizer_config.json").write_bytes(b"\x00\x9c"),
     r"tokenizer_config\.json is not UTF-8 text: byte 0x9c at line 1, offset 1"),
    (lambda d: (d / "tokenizer_config.json").write_text('"x"'),
     r"tokenizer_config\.json must hold a JSON object, got str"),
    (_edit_json("tokenizer_config.json", chat_template=5),
     r"tokenizer_config\.json: field 'chat_template' must be a Jinja template string, got 5"),
])
def test_damaged_tokenizer_files_name_file_and_problem(tmp_path, damage, message):
    d = write_tok_dir(tiny_meta(), tmp_path / "t")
    damage(d)
    with pytest.raises(ValueError, match=message) as e:
        load_tokenizer(d)
    assert str(d) in str(e.value) and "\n" not in str(e.value)


def test_broken_chat_template_names_file_and_line(tmp_path):
    d = write_tok_dir(tiny_meta(), tmp_path / "t")
    _edit_json("tokenizer_config.json", chat_template="{{ messages }}\n{% for %}")(d)
    tok = load_tokenizer(d)  # transformers compiles templates only when rendering
    with pytest.raises(ValueError, match=r"t/tokenizer_config\.json: chat_template fails at template line 2 "
                                         r"\(TemplateSyntaxError: Expected an expression"):
        chat_prompt_ids(tok, "hi")


def test_load_tokenizer_is_torch_free(tmp_path):
    d = write_tok_dir(tiny_meta(), tmp_path / "t")
    code = (
        "import sys\n"
        "from tevjax.convert.tokenizer import load_tokenizer, chat_prompt_ids\n"
        f"ids = chat_prompt_ids(load_tokenizer({str(d)!r}), 'hello')\n"
        "assert ids[0] == 1, ids\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------------------ streaming

# Emoji (4-byte, ZWJ sequences, flags, a keycap), CJK, right-to-left scripts with marks, Latin.
EMOJI = list("🙂🚀🤖👩‍👩‍👧🇫🇷1️⃣❤️")
CJK = list("日本語のテキスト中文字符한국어")
RTL = list("עברית ועربي مرحبا بالعالم") + ["\u05b8", "\u064e", "\u200f"]
ALPHABET = EMOJI + CJK + RTL + list("hello world 12\n")


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
    return load_tokenizer(write_tok_dir(tiny_meta(), tmp_path_factory.mktemp("stream_tok")))


def _stream(tok, ids, sizes, skip_special_tokens=True):
    """Feeds `ids` in chunks of `sizes` (cycled); returns the pieces and the flushed rest."""
    stream = StreamDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    pieces, start, k = [], 0, 0
    while start < len(ids):
        size = sizes[k % len(sizes)] if sizes else len(ids)
        pieces.append(stream.feed(ids[start:start + size]))
        start, k = start + size, k + 1
    return pieces, stream.flush()


@settings(max_examples=150, deadline=None, derandomize=True)
@given(text=st.text(alphabet=st.sampled_from(ALPHABET) | st.characters(exclude_categories=["Cs"],
                                                                       exclude_characters="\ufffd"),
                    max_size=24),
       sizes=st.lists(st.integers(1, 4), max_size=6))
def test_stream_of_valid_text_never_shows_a_broken_character(tiny_tok, text, sizes):
    ids = tiny_tok.encode(text, add_special_tokens=False)
    pieces, rest = _stream(tiny_tok, ids, sizes)
    assert "".join(pieces) + rest == tiny_tok.decode(ids, skip_special_tokens=True) == text
    assert rest == ""  # complete text: nothing is held back at the end
    assert all("\ufffd" not in p for p in pieces)


@settings(max_examples=200, deadline=None, derandomize=True)
@given(ids=st.lists(st.integers(0, len(tiny_vocab()) - 1), max_size=30),
       sizes=st.lists(st.integers(1, 5), max_size=6), skip=st.booleans())
def test_stream_of_random_ids_concatenates_to_the_final_decode(tiny_tok, ids, sizes, skip):
    """Any ids (bytes that never form a character, specials, merges), any chunking."""
    pieces, rest = _stream(tiny_tok, ids, sizes, skip_special_tokens=skip)
    final = tiny_tok.decode(ids, skip_special_tokens=skip)
    assert "".join(pieces) + rest == final
    assert rest == final[len(final.rstrip("\ufffd")):]  # only a trailing U+FFFD run is held


def _byte_ids(data: bytes) -> list[int]:
    return [len(SPECIALS) + b for b in data]  # the tiny vocabulary lists the 256 bytes in order


def test_stream_holds_an_emoji_until_its_last_byte(tiny_tok):
    stream = StreamDetokenizer(tiny_tok)
    ids = _byte_ids("a🙂".encode())
    assert [stream.feed([i]) for i in ids] == ["a", "", "", "", "🙂"]
    assert stream.flush() == ""
    with pytest.raises(ValueError, match="feed called after flush"):
        stream.feed([5])


def test_stream_emits_a_genuine_replacement_character(tiny_tok):
    # U+FFFD spelled as its own bytes EF BF BD, and a lone invalid byte: both are real text.
    for data, want in ((b"a\xef\xbf\xbdb", "a\ufffdb"), (b"a\xffb", "a\ufffdb")):
        stream = StreamDetokenizer(tiny_tok)
        pieces = [stream.feed([i]) for i in _byte_ids(data)]
        assert pieces[-1] == "\ufffdb" and "".join(pieces) + stream.flush() == want
    stream = StreamDetokenizer(tiny_tok)
    assert stream.feed(_byte_ids(b"ok\xef\xbf\xbd")) == "ok"
    assert stream.flush() == "\ufffd"  # at the very end it comes out with the flush
    stream = StreamDetokenizer(tiny_tok)
    assert stream.feed(_byte_ids("é".encode()[:1])) == ""
    assert stream.flush() == "\ufffd"  # an unfinished character at the end: what decode gives


# ------------------------------------------------------------------------------ real SmolLM2

PARITY_STRINGS = [
    "Hello, world!",
    "The capital of France is Paris.",
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
    "Café déjà vu — naïve résumé, façade.",
    "日本語のテキストと中文字符，한국어도。",
    "Ελληνικά и русский текст; עברית ועربي",
    "emoji 🤖🚀 and a family 👩‍👩‍👧 with ZWJ",
    "def square(x):\n    return x ** 2  # power\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;",
    "   leading spaces",
    "trailing spaces   ",
    "tabs\tand\nnewlines\r\nmixed \t \n",
    "\n\n\n",
    " ",
    "",
    "Hello world! 123",
    "pi = 3.14159, e=2.71828; 1,000,000 on 2024-06-01",
    "x1y2z3 v2.0.1 0xFF",
    "ratios:½⅔²,Ⅻ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>tevjax<file_sep>setup.py<|im_end|>",
    "almost special: <|im_start| and |im_end|>",
    "don't won't it's we're I'll you've he'd",
]
# Whitespace right before a Unicode number, where transformers' GGUF tokenizer ignores the smollm
# rule: with SmolLM2's vocabulary that shows for two or more whitespace characters before an ASCII
# digit and for any whitespace before a non-ASCII numeral (" ½" -> "ĠÂ" + "½"); llama.cpp and
# SmolLM2's own tokenizer isolate every number character.
DIVERGENT_STRINGS = ["a  1", "x =  42", "[\n    1,\n    2,\n]", "total:\t\t3", "v ½ ⅔ ²", "Ⅻ ⅻ"]


def llamacpp_smollm_split(text: str) -> list[str]:
    """llama.cpp's SMOLLM pre-tokenizer: split on `\\p{N}`, then the GPT-2 regex, keeping the
    unmatched gaps as pieces; special tokens are cut out first."""
    import regex

    special = regex.compile("(" + "|".join(regex.escape(s) for s in (
        "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<repo_name>", "<file_sep>")) + ")")
    gpt2 = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)")

    def split(rx, s):
        out, pos = [], 0
        for m in rx.finditer(s):
            if m.start() > pos:
                out.append(s[pos:m.start()])
            out.append(m.group())
            pos = m.end()
        if pos < len(s):
            out.append(s[pos:])
        return out

    result = []
    for part in special.split(text):
        if not part:
            continue
        if special.fullmatch(part):
            result.append(part)
            continue
        for p in split(regex.compile(r"\p{N}"), part):
            result.extend(split(gpt2, p))
    return result


@pytest.fixture(scope="module")
def smollm_tokenizers(tmp_path_factory):
    import transformers

    from tevjax.convert.embedded import smollm2_gguf_path
    from tevjax.convert.gguf import read_gguf_metadata

    path = smollm2_gguf_path()  # installed by the Makefile; a missing package is a failure
    ours = load_tokenizer(write_tok_dir(read_gguf_metadata(path), tmp_path_factory.mktemp("smol")))
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return ours, theirs


def test_smollm2_parity_with_transformers_gguf(smollm_tokenizers):
    ours, theirs = smollm_tokenizers
    assert len(ours) == len(theirs) == 49152
    for text in PARITY_STRINGS:
        a = ours.encode(text, add_special_tokens=False)
        b = theirs.encode(text, add_special_tokens=False)
        assert a == b, (text, pieces(ours, a), pieces(theirs, b))
        assert ours.decode(a) == text


def test_smollm2_follows_llamacpp_split(smollm_tokenizers):
    """On every string, our ids equal the BPE of llama.cpp's smollm pieces; on the divergent ones
    that differs from transformers' GGUF tokenizer."""
    ours, theirs = smollm_tokenizers
    for text in PARITY_STRINGS + DIVERGENT_STRINGS:
        want = [i for p in llamacpp_smollm_split(text)
                for i in theirs.encode(p, add_special_tokens=False)]
        assert ours.encode(text, add_special_tokens=False) == want, text
    for text in DIVERGENT_STRINGS:
        a = ours.encode(text, add_special_tokens=False)
        b = theirs.encode(text, add_special_tokens=False)
        assert a != b, text
        assert ours.decode(a) == theirs.decode(b) == text
    assert pieces(ours, ours.encode("a  1")) == ["a", "ĠĠ", "1"]


def test_smollm2_chat_prompt(smollm_tokenizers):
    ours, theirs = smollm_tokenizers
    convs = [
        "What is 2+2?",
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 12"}],
        [{"role": "user", "content": "def f():\n    pass"},
         {"role": "assistant", "content": "A function."},
         {"role": "user", "content": "Explain  2 things."}],
    ]
    for conv in convs:
        msgs = [{"role": "user", "content": conv}] if isinstance(conv, str) else conv
        ids = chat_prompt_ids(ours, conv)
        ref = theirs.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
        ref = ref["input_ids"] if hasattr(ref, "keys") else ref
        # identical unless a message has whitespace before a digit (then the smollm rule wins)
        if "  2" not in str(conv):
            assert ids == list(ref), conv
        assert ours.decode(ids) == theirs.decode(list(ref))
    assert ours.decode(chat_prompt_ids(ours, "What is 2+2?")) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_bos_and_eos_are_added_where_the_file_says_llama_cpp_adds_them():
    """`tokenizer.ggml.add_bos_token` / `add_eos_token`: plain `encode` adds them (as llama.cpp and
    transformers' GGUF tokenizer do: Llama 3's files ask for BOS), `add_special_tokens=False` and
    chat prompts do not, and a file that asks for neither (SmolLM2's) gets neither. The CLI's
    plain (--no-chat) prompts take what the tokenizer adds."""
    import types

    from tevjax.cli import _encode

    plain = build_tokenizer(tiny_meta())
    bos = build_tokenizer(dict(tiny_meta(), **{"tokenizer.ggml.add_bos_token": True}))
    both = build_tokenizer(dict(tiny_meta(), **{"tokenizer.ggml.add_bos_token": True,
                                                "tokenizer.ggml.add_eos_token": True}))
    off = build_tokenizer(dict(tiny_meta(), **{"tokenizer.ggml.add_bos_token": False}))
    text = plain.encode("hello world").ids
    assert bos.encode("hello world").ids == [1, *text] and both.encode("hello world").ids == [1, *text, 2]
    assert off.encode("hello world").ids == text
    assert bos.encode("hello world", add_special_tokens=False).ids == text
    assert bos.decode(bos.encode("hello world").ids, skip_special_tokens=True) == "hello world"

    class Wrapped:  # the CLI's view of a tokenizer: transformers' encode(text, add_special_tokens=True)
        def __init__(self, tok):
            self.tok = tok

        def encode(self, text, add_special_tokens=True):
            return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    for tok, want in ((bos, [1, *text]), (plain, text)):
        assert _encode(types.SimpleNamespace(tokenizer=Wrapped(tok)), ["hello world"], chat=False) == [want]


# ------------------------------------------------------------- SentencePiece vocabularies ("llama")

# A small Llama-2-style vocabulary: <unk>, <s>, </s>, the 256 byte tokens, then pieces whose
# scores fall with their rank (merges of several characters first; single characters last, as
# SentencePiece scores them), one user-defined token.
SPM_MERGED = ["▁t", "he", "▁the", "▁a", "in", "▁in", "er", "▁w", "or", "ld", "▁wor", "▁world", "ll", "▁he",
              "▁hel", "▁hell", "▁hello", "lo", "an", "▁an", "▁and", "▁▁", "▁▁▁▁", "▁th", "at", "▁that",
              "is", "▁is", "it", "▁it", "▁s", "▁st", "▁str", "ing", "▁string", "re", "ed", "▁red"]
SPM_CHARS = ["▁", *"etaoinshrdlcumwfgypbvkxjqz", *"HTW.,!?'-()[]"]
SPM_USER = "<|tool|>"


def spm_meta(**overrides) -> dict:
    pieces = SPM_MERGED + SPM_CHARS
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces, SPM_USER]
    types = [2, 3, 3, *[6] * 256, *[1] * len(pieces), 4]
    scores = [0.0] * 259 + [-float(k) for k in range(len(SPM_MERGED))] + [-1000.0 - k for k in range(len(SPM_CHARS))]
    meta = {
        "general.architecture": "llama",
        "llama.context_length": 128,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores + [0.0],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    return {**meta, **overrides}


def llamacpp_spm(meta: dict, text: str, add_special: bool = True) -> list[int]:
    """llama.cpp's SPM tokenizer (`llama_tokenize_impl` and `llm_tokenizer_spm`), written from its
    description as a reference: special tokens are cut out of the text first; each run of text
    between them gets a leading space when `add_space_prefix` (default) says so, its spaces
    become "▁", and of the adjacent pieces whose concatenation is a token the pair with the
    highest score merges first (ties: the leftmost) until none is; a character no token spells
    becomes its UTF-8 bytes' tokens."""
    import re as _re

    tokens, types, scores = (meta[f"tokenizer.ggml.{k}"] for k in ("tokens", "token_type", "scores"))
    ids = {t: i for i, t in enumerate(tokens)}
    special = sorted((t for t, ty in zip(tokens, types) if ty in (3, 4)), key=len, reverse=True)
    bos = add_special and meta.get("tokenizer.ggml.add_bos_token", True)
    out = [meta["tokenizer.ggml.bos_token_id"]] if bos else []
    for part in _re.split("(" + "|".join(_re.escape(s) for s in special) + ")", text):
        if part in special:
            out.append(ids[part])
            continue
        if not part:
            continue  # (an empty run between two special tokens tokenizes to nothing)
        run = (" " if meta.get("tokenizer.ggml.add_space_prefix", True) else "") + part
        symbols = list(run.replace(" ", "▁"))
        while True:
            best = None
            for j in range(len(symbols) - 1):
                merged = symbols[j] + symbols[j + 1]
                if merged in ids and (best is None or scores[ids[merged]] > scores[ids[best[1]]]):
                    best = (j, merged)
            if best is None:
                break
            symbols[best[0]:best[0] + 2] = [best[1]]
        for sym in symbols:
            if sym in ids:
                out.append(ids[sym])
            else:
                out.extend(ids.get(f"<0x{b:02X}>", meta["tokenizer.ggml.unknown_token_id"]) for b in sym.encode())
    return out


SPM_STRINGS = ["hello world", "Hello World!", "the string is red", " hello", "  hello", "hello  world",
               "a\nb", "tab\there", "café 12 ok", "emoji 😀 at end", "", " ", "<s>hello</s>",
               "x<s> the", "<|tool|>call(it)", "[the, that, it's]", "thethethe", "▁literal"]


@pytest.mark.parametrize("overrides", [{}, {"tokenizer.ggml.add_space_prefix": False},
                                       {"tokenizer.ggml.add_bos_token": False}])
def test_sentencepiece_vocabularies_tokenize_as_llama_cpp(overrides):
    """A "llama" tokenizer equals llama.cpp's SPM algorithm (the reference above) on plain text,
    spaces, byte fallback, special and user-defined tokens in the text; decoding gives the text
    back, and each token spells the bytes it adds (what stop strings read)."""
    meta = spm_meta(**overrides)
    tok = build_tokenizer(meta)
    assert tok.get_vocab_size(with_added_tokens=True) == len(meta["tokenizer.ggml.tokens"])
    spelled = token_bytes(tok)
    for text in SPM_STRINGS:
        want = llamacpp_spm(meta, text)
        assert tok.encode(text).ids == want, (text, tok.encode(text).tokens, pieces_of(meta, want))
        assert tok.encode(text, add_special_tokens=False).ids == llamacpp_spm(meta, text, add_special=False)
        if "<" not in text and "▁" not in text:  # (a "▁" in the text reads back as a space, in llama.cpp too)
            ids = tok.encode(text, add_special_tokens=False).ids
            assert tok.decode(ids) == text, text
            prefix = " " if overrides.get("tokenizer.ggml.add_space_prefix", True) and text else ""
            assert b"".join(spelled[i] for i in ids) == (prefix + text).encode(), text
    if overrides.get("tokenizer.ggml.add_space_prefix", True):
        assert tok.encode("hello world").tokens[-2:] == ["▁hello", "▁world"]


@given(st.lists(st.sampled_from([*"the world isa", " ", "  ", "\n", "é", "😀", "<s>", "</s>", SPM_USER]),
                max_size=30).map("".join))
@settings(max_examples=200, deadline=None, derandomize=True)
def test_sentencepiece_equals_llama_cpp_on_random_text(text):
    meta = spm_meta()
    assert build_tokenizer(meta).encode(text).ids == llamacpp_spm(meta, text), text


def pieces_of(meta, ids):
    return [meta["tokenizer.ggml.tokens"][i] for i in ids]


def test_sentencepiece_errors_name_the_field():
    with pytest.raises(TokenizerConversionError, match="x.gguf: tokenizer metadata tokenizer.ggml.scores is missing"):
        build_tokenizer({k: v for k, v in spm_meta().items() if k != "tokenizer.ggml.scores"}, source="x.gguf")
    with pytest.raises(TokenizerConversionError, match="tokenizer.ggml.scores has 3 entries for 338 tokens"):
        build_tokenizer(spm_meta(**{"tokenizer.ggml.scores": [0.0, 1.0, 2.0]}))
    with pytest.raises(TokenizerConversionError, match="tokenizer.ggml.model='bert' is not supported"):
        build_tokenizer(spm_meta(**{"tokenizer.ggml.model": "bert"}))


@pytest.mark.parametrize("meta, message", [
    # each failed with another library's words (IndexError, tokenizers' bare Exception, AttributeError,
    # int()'s ValueError), an internal error in the CLI
    (spm_meta(**{"tokenizer.ggml.unknown_token_id": 5000}), "tokenizer.ggml.unknown_token_id=5000 is outside the "
                                                             "vocabulary of 338"),
    (spm_meta(**{"tokenizer.ggml.scores": ["a"] * 338}), "tokenizer.ggml.scores must be numbers, got 'a'"),
    (dict(tiny_meta(), **{"tokenizer.ggml.merges": MERGES + ["zz qq"]}),
     "tokenizer.ggml.merges[13] = 'zz qq' involves 'zz', which is not a token of tokenizer.ggml.tokens"),
    (dict(tiny_meta(), **{"tokenizer.ggml.merges": MERGES + ["h ll"]}),  # "hll" is no token
     "tokenizer.ggml.merges[13] = 'h ll' involves 'hll', which is not a token of tokenizer.ggml.tokens"),
    (dict(tiny_meta(), **{"tokenizer.ggml.merges": [7]}), "tokenizer.ggml.merges[0] = 7 is not 'left right'"),
    (dict(tiny_meta(), **{"tokenizer.ggml.eos_token_id": "2"}), "tokenizer.ggml.eos_token_id='2' should be a token id"),
    (spm_meta(**{"tokenizer.ggml.bos_token_id": "1"}), "tokenizer.ggml.bos_token_id='1' should be a token id"),
])
def test_malformed_tokenizer_metadata_is_refused_by_name(meta, message):
    with pytest.raises(TokenizerConversionError, match="^" + re.escape("x.gguf: " + message)):
        tokenizer_files_from_gguf(meta, source="x.gguf")


def test_a_per_layer_context_length_gives_the_tokenizer_its_length():
    """A context length stored as a (uniform) per-layer array, as the model config accepts it: int() of
    the list raised TypeError."""
    files = tokenizer_files_from_gguf(dict(tiny_meta(), **{"llama.context_length": [128, 128]}))
    assert files["tokenizer_config.json"]["model_max_length"] == 128


def test_sentencepiece_gguf_matches_transformers_and_makes_a_tokenizer_dir(tmp_path):
    """Written to a GGUF file: transformers' own GGUF tokenizer gives the same ids on text without
    special tokens and not starting with a space or a "▁" (where it adds no second "▁" and no
    space after a special token, while llama.cpp adds both), and the converted directory loads with
    `load_tokenizer`, BOS first."""
    import gguf
    import transformers

    meta = spm_meta()
    path = tmp_path / "spm.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    for name, value in ((w.add_block_count, 1), (w.add_context_length, 128), (w.add_embedding_length, 16),
                        (w.add_feed_forward_length, 32), (w.add_head_count, 2), (w.add_head_count_kv, 2)):
        name(value)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(len(meta["tokenizer.ggml.tokens"]))
    w.add_tokenizer_model("llama")
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_token_scores(meta["tokenizer.ggml.scores"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    ours = load_tokenizer(write_tok_dir(meta, tmp_path / "dir"))
    for text in SPM_STRINGS:
        if "<" in text or text.startswith((" ", "▁")):
            continue
        a, b = ours.encode(text), theirs.encode(text)
        assert a == b == llamacpp_spm(meta, text), (text, pieces_of(meta, a), pieces_of(meta, b))
        assert ours.decode(a, skip_special_tokens=True) == text
    assert ours.bos_token_id == 1 and ours.encode("hi")[0] == 1
