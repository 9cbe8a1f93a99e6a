"""Tokenizers for converted checkpoints: GGUF vocabulary -> tokenizer.json, and ChatML prompts.

A GGUF file carries its tokenizer as metadata (`tokenizer.ggml.*`): the token strings, their types
(1 normal, 3 control, 4 user-defined), the BPE merges, the special-token ids, the pre-tokenizer
name (`tokenizer.ggml.pre`) and the chat template. `tokenizer_files_from_gguf` rebuilds from them
the `tokenizer.json` / `tokenizer_config.json` pair of an HF directory, so `load_tokenizer` can open
it with transformers' `PreTrainedTokenizerFast` (no torch needed).

Two kinds are supported: byte-level BPE (`tokenizer.ggml.model == "gpt2"`: the GPT-2, StarCoder,
SmolLM, Qwen and Llama 3 families), whose token strings are already spelled in the GPT-2 byte
alphabet ("Ġt" for " t"), and SentencePiece BPE (`"llama"`: Llama 2, Mistral, TinyLlama), whose
pieces spell spaces as "\u2581" and carry scores instead of merges (`_sentencepiece`). What follows
about pre-tokenizers is byte-level BPE's.

The pre-tokenizer decides where BPE may not merge across. llama.cpp names it in
`tokenizer.ggml.pre` and implements each name as a list of split regexes (`llama-vocab.cpp`):

* "gpt-2" (and "phi-2", "mpt", "olmo"): the GPT-2 split
  `'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)`.
* "smollm", "starcoder", "refact", "codeshell": first isolate every digit (`\\p{N}`), then the GPT-2
  split. This is also what SmolLM2's original `tokenizer.json` does (a `Digits(individual_digits)`
  pre-tokenizer before `ByteLevel`), so the two agree.
* "qwen2" and "deepseek-r1-qwen" (Qwen2, Qwen2.5, Qwen3 and their distillations): Qwen2's own split
  regex (`QWEN2_SPLIT`: case-insensitive contractions, a letter run with at most one leading
  non-letter, one digit at a time, punctuation runs with their line breaks, whitespace), then
  byte-level BPE with no regex of its own, as Qwen2's `tokenizer.json` has it.
* "llama-bpe", "llama3" and "llama-v3" (Llama 3): the same, but digits in runs of up to three
  (`LLAMA3_SPLIT`); a piece that is a token is taken whole (`ignore_merges`), and BOS is added
  unless the file says otherwise. "smaug-bpe" (SmolLM3) and "dbrx": the same split only.
* "qwen35" (Qwen3.5): Qwen2's, with combining marks kept inside letter runs (`QWEN35_SPLIT`).
* "tekken" (Mistral Nemo, Mistral Small 3): letter runs split by case, as llama.cpp approximates
  them (`TEKKEN_SPLIT`); whole tokens and BOS as Llama 3's.
* "gpt-4o" and "llama4" (o200k: GPT-OSS): Tekken's letter runs with their contractions, digits in
  threes (`GPT4O_SPLIT`).

Note: transformers' own GGUF tokenizer conversion (5.x) does not know "smollm" and falls back to
the plain GPT-2 split, which lets whitespace before a number character join its piece. With
SmolLM2's vocabulary (no merge involves an ASCII digit) the two differ for two or more whitespace
characters before an ASCII digit ("a  1": llama.cpp/SmolLM2 -> [a, ĠĠ, 1], transformers' GGUF
path -> [a, Ġ, Ġ, 1]) and for any whitespace before a non-ASCII numeral (" ½" -> [Ġ, Â½] vs
[ĠÂ, ½]). tevjax follows llama.cpp and the original tokenizer; `tests/test_tokenizer.py` pins
both behaviours.

`encode` (with its default `add_special_tokens=True`) adds BOS and EOS where the file's
`tokenizer.ggml.add_bos_token` / `add_eos_token` say llama.cpp adds them, as transformers' GGUF
path does: Llama 3's files ask for BOS; SmolLM2's and Qwen's do not (the ChatML template already
starts every prompt with `<|im_start|>`, SmolLM2's BOS). Chat prompts are encoded without them
(`chat_prompt_ids`): a template writes its own.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "TokenizerConversionError",
    "SUPPORTED_PRE_TOKENIZERS",
    "QWEN2_SPLIT",
    "QWEN35_SPLIT",
    "LLAMA3_SPLIT",
    "TEKKEN_SPLIT",
    "GPT4O_SPLIT",
    "build_tokenizer",
    "tokenizer_files_from_gguf",
    "load_tokenizer",
    "chat_prompt_ids",
    "StreamDetokenizer",
    "token_bytes",
]

# GGUF token types (llama.cpp `llama_token_type`).
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4

# Qwen2's pre-tokenizer split (its tokenizer.json, and llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Llama 3's: Qwen2's, but digits in runs of up to three (llama.cpp's LLAMA_VOCAB_PRE_TYPE_LLAMA3).
LLAMA3_SPLIT = QWEN2_SPLIT.replace(r"|\p{N}|", r"|\p{N}{1,3}|", 1)
# Qwen3.5's: Qwen2's, with combining marks (\p{M}: accents, vowel signs) inside a letter run rather
# than split off it (its tokenizer.json, and llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN35).
QWEN35_SPLIT = (QWEN2_SPLIT.replace(r"?\p{L}+|", r"?[\p{L}\p{M}]+|", 1)
                .replace(r"[^\s\p{L}\p{N}]+", r"[^\s\p{L}\p{M}\p{N}]+", 1))
# Mistral's Tekken (Mistral Nemo, Mistral Small 3), as llama.cpp runs it: its tokenizer.json splits
# letters by case classes (\p{Lu}... / \p{Ll}...), which llama.cpp's regex engine lacks, so it runs
# "a letter that is not ASCII lowercase" / "not ASCII uppercase" instead (LLAMA_VOCAB_PRE_TYPE_TEKKEN).
# The two agree on ASCII text; on other capitals they differ ("aÉb" is one piece here, two in the
# original), and this is llama.cpp's.
def _case_split(after_letters: str, digits: str) -> str:
    """The split of Tekken's kind: two letter-run alternatives (capitals then lowercase, or the
    reverse), each followed by `after_letters`, then digit runs `digits` and the rest."""
    upper_then_lower = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    lower_then_upper = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    return (upper_then_lower + after_letters + "|" + lower_then_upper + after_letters + "|" + digits
            + r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


TEKKEN_SPLIT = _case_split("", r"\p{N}")
# o200k (GPT-OSS, Llama 4), as llama.cpp runs it: Tekken's letter runs, each with a trailing English
# contraction, and digits in runs of up to three (LLAMA_VOCAB_PRE_TYPE_GPT4O).
GPT4O_SPLIT = _case_split(r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?", r"\p{N}{1,3}")
# tokenizer.ggml.pre -> the split before byte-level BPE (see module docstring): "gpt2" (ByteLevel's
# GPT-2 regex), "digits" (every digit isolated, then the GPT-2 regex), or a regex of its own.
SUPPORTED_PRE_TOKENIZERS: dict[str, str] = {
    "gpt-2": "gpt2",
    "phi-2": "gpt2",  # these three are llama.cpp's names for GPT-2's split too
    "mpt": "gpt2",
    "olmo": "gpt2",
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    "codeshell": "digits",
    "qwen2": QWEN2_SPLIT,
    "deepseek-r1-qwen": QWEN2_SPLIT,
    "qwen35": QWEN35_SPLIT,
    "llama-bpe": LLAMA3_SPLIT,
    "llama3": LLAMA3_SPLIT,
    "llama-v3": LLAMA3_SPLIT,
    "smaug-bpe": LLAMA3_SPLIT,  # SmolLM3's files
    "dbrx": LLAMA3_SPLIT,
    "tekken": TEKKEN_SPLIT,
    "gpt-4o": GPT4O_SPLIT,
    "llama4": GPT4O_SPLIT,
}
# llama.cpp's Llama 3 group and Tekken: a piece that is itself a token is taken whole, without
# merging (`ignore_merges`, as their tokenizer.json files have it), and BOS is added unless the file
# says not to. Not "smaug-bpe" or "dbrx", which share only Llama 3's split.
_LLAMA3_GROUP = ("llama-bpe", "llama3", "llama-v3", "tekken")


class TokenizerConversionError(ValueError):
    """GGUF tokenizer metadata that is missing or describes an unsupported tokenizer."""


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (bytes that are printable latin-1 map
    to themselves, the rest to U+0100 onwards in order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_tokenizer(meta: Mapping[str, Any], *, source: str = "GGUF metadata"):
    """A `tokenizers.Tokenizer` equivalent to the one described by GGUF `tokenizer.ggml.*` metadata.

    `source` only names the origin in error messages (e.g. the GGUF path).
    """
    from tokenizers import AddedToken, processors

    def need(key):
        if key not in meta:
            raise TokenizerConversionError(f"{source}: tokenizer metadata {key} is missing")
        return meta[key]

    kind = need("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise TokenizerConversionError(
            f"{source}: tokenizer.ggml.model={kind!r} is not supported (only byte-level BPE, 'gpt2', and "
            "SentencePiece BPE, 'llama')")
    tokens: list[str] = list(need("tokenizer.ggml.tokens"))
    types: list[int] = list(meta.get("tokenizer.ggml.token_type", [_NORMAL] * len(tokens)))
    if len(types) != len(tokens):
        raise TokenizerConversionError(f"{source}: tokenizer.ggml.token_type has {len(types)} "
                                       f"entries for {len(tokens)} tokens")
    if kind == "llama":
        tok = _sentencepiece(meta, tokens, need("tokenizer.ggml.scores"), source)
    else:
        tok = _byte_level(meta, tokens, types, list(need("tokenizer.ggml.merges")), source)

    def added(which):  # the id llama.cpp adds to any text when the file says so (`add_bos_token`), else None
        i = meta.get(f"tokenizer.ggml.{which}_token_id")
        # A SentencePiece vocabulary that does not say gets BOS, as llama.cpp gives it.
        default = which == "bos" and (kind == "llama" or meta.get("tokenizer.ggml.pre") in _LLAMA3_GROUP)
        is_id = isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(tokens)  # else refused by name
        return i if meta.get(f"tokenizer.ggml.add_{which}_token", default) and is_id else None  # in the HF files

    bos, eos = added("bos"), added("eos")
    if bos is not None or eos is not None:
        head = [tokens[bos]] if bos is not None else []
        tail = [tokens[eos]] if eos is not None else []
        single = [*head, "$A", *tail]
        pair = [*single, *(f"{t}:1" for t in head), "$B:1", *(f"{t}:1" for t in tail)]
        template = processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair),
                                                 special_tokens=[(tokens[i], i) for i in (bos, eos) if i is not None])
        tok.post_processor = (template if tok.post_processor is None
                              else processors.Sequence([tok.post_processor, template]))
    # Control tokens (<|im_start|>, <s>, ...) are matched whole in raw text and skipped when decoding
    # with skip_special_tokens; user-defined ones are matched whole but kept. Both reuse their ids.
    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty == _CONTROL]
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise TokenizerConversionError(f"{source}: rebuilt vocabulary has "
                                       f"{tok.get_vocab_size(with_added_tokens=True)} entries, "
                                       f"expected {len(tokens)}")
    return tok


def _byte_level(meta: Mapping[str, Any], tokens: list[str], types: list[int], merges_raw: list[str], source: str):
    """Byte-level BPE (`tokenizer.ggml.model` "gpt2"), with the split `tokenizer.ggml.pre` names."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    pre = meta.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in SUPPORTED_PRE_TOKENIZERS:
        raise TokenizerConversionError(
            f"{source}: tokenizer.ggml.pre={pre!r} is not supported "
            f"(supported: {', '.join(sorted(SUPPORTED_PRE_TOKENIZERS))})")

    alphabet = set(_byte_alphabet().values())
    spell = _byte_alphabet()
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        if types[i] == _NORMAL and not set(tok) <= alphabet:
            # A normal token written in raw UTF-8 rather than the byte alphabet: respell it so BPE,
            # which works on byte-alphabet strings, can produce it.
            tok = "".join(spell[b] for b in tok.encode("utf-8"))
        if tok in vocab:
            raise TokenizerConversionError(f"{source}: token {tok!r} appears twice "
                                           f"(ids {vocab[tok]} and {i})")
        vocab[tok] = i
    merges = []
    for k, m in enumerate(merges_raw):
        parts = m.split(" ") if isinstance(m, str) else []
        if len(parts) != 2:
            raise TokenizerConversionError(f"{source}: tokenizer.ggml.merges[{k}] = {m!r} is not "
                                           "'left right'")
        # tokenizers refuses these with a bare Exception that names neither the file nor the merge
        unknown = [t for t in (*parts, "".join(parts)) if t not in vocab]
        if unknown:
            raise TokenizerConversionError(f"{source}: tokenizer.ggml.merges[{k}] = {m!r} involves {unknown[0]!r}, "
                                           "which is not a token of tokenizer.ggml.tokens")
        merges.append((parts[0], parts[1]))

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                               ignore_merges=pre in _LLAMA3_GROUP))
    split = SUPPORTED_PRE_TOKENIZERS[pre]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split in ("gpt2", "digits"))
    if split == "digits":
        # `Digits` isolates each Unicode number character, like llama.cpp's `\p{N}` split.
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif split == "gpt2":
        tok.pre_tokenizer = byte_level
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level])
    tok.decoder = decoders.ByteLevel()
    # ByteLevel only fixes offsets; BOS / EOS are added where the file says llama.cpp adds them
    # (see module docstring).
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _sentencepiece(meta: Mapping[str, Any], tokens: list[str], scores, source: str):
    """SentencePiece BPE (`tokenizer.ggml.model` "llama": Llama 2, Mistral, TinyLlama), as
    llama.cpp's SPM tokenizer runs it (`llm_tokenizer_spm`): spaces become "\u2581", with one in
    front of every run of text between special tokens when `tokenizer.ggml.add_space_prefix`
    says so (its default); then, of the adjacent pieces whose concatenation is a token, the pair
    with the highest score merges first, until none is; a character no token spells is spelled
    by its UTF-8 bytes' tokens ("<0x0A>").

    That is BPE with one merge per way of cutting a token into two tokens, ranked by the token's
    score: the model below (ties of equal scores, where llama.cpp takes the leftmost pair, are
    ranked by the pieces' ids). Decoding turns "\u2581" back into spaces, bytes into text, and
    drops the space the prefix added."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    bad = [x for x in scores if isinstance(x, bool) or not isinstance(x, (int, float))]
    if bad:
        raise TokenizerConversionError(f"{source}: tokenizer.ggml.scores must be numbers, got {bad[0]!r}")
    scores = [float(x) for x in scores]
    if len(scores) != len(tokens):
        raise TokenizerConversionError(f"{source}: tokenizer.ggml.scores has {len(scores)} entries for "
                                       f"{len(tokens)} tokens")
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if t in vocab:
            raise TokenizerConversionError(f"{source}: token {t!r} appears twice (ids {vocab[t]} and {i})")
        vocab[t] = i
    ranked = sorted(((-scores[i], vocab[t[:cut]], vocab[t[cut:]]), t[:cut], t[cut:])
                    for t, i in vocab.items() for cut in range(1, len(t)) if t[:cut] in vocab and t[cut:] in vocab)
    unk = _special_id(meta, "tokenizer.ggml.unknown_token_id", len(tokens), source)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for _, a, b in ranked], byte_fallback=True,
                               fuse_unk=True, unk_token=None if unk is None else tokens[unk]))
    # llama.cpp puts the space in front of each run of raw text (after every special token too),
    # and puts it there even when the text starts with a space: a normalizer does both (tokenizers'
    # Metaspace would skip the second).
    escape = normalizers.Replace(" ", "\u2581")
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), escape]) if prefix else escape
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if prefix else steps)
    return tok


# The special tokens a GGUF file names by id: the tokenizer_config.json field, the `tokenizer.ggml.*` key.
_SPECIAL_IDS = (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
                ("pad_token", "padding_token_id"))


def _special_id(meta: Mapping[str, Any], key: str, n_tokens: int, source: str) -> int | None:
    """The token id at metadata `key` (None where absent), refused by name unless an id of the vocabulary."""
    idx = meta.get(key)
    if idx is None:
        return None
    if isinstance(idx, bool) or not isinstance(idx, int):
        raise TokenizerConversionError(f"{source}: {key}={idx!r} should be a token id")
    if not 0 <= idx < n_tokens:
        raise TokenizerConversionError(f"{source}: {key}={idx} is outside the vocabulary of {n_tokens}")
    return idx


def tokenizer_files_from_gguf(meta: Mapping[str, Any], *, source: str = "GGUF metadata"
                              ) -> dict[str, Any]:
    """`{"tokenizer.json": ..., "tokenizer_config.json": ...}` (JSON-ready objects) for an HF dir."""
    tok = build_tokenizer(meta, source=source)
    tokens = meta["tokenizer.ggml.tokens"]
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
    }
    for name, key in _SPECIAL_IDS:
        idx = _special_id(meta, f"tokenizer.ggml.{key}", len(tokens), source)
        if idx is not None:
            config[name] = tokens[idx]
    arch = meta.get("general.architecture")
    context = meta.get(f"{arch}.context_length")
    context = context[0] if isinstance(context, list) and context else context  # a per-layer array (uniform)
    if isinstance(context, int) and not isinstance(context, bool):
        config["model_max_length"] = context
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    return {"tokenizer.json": json.loads(tok.to_str()), "tokenizer_config.json": config}


def load_tokenizer(hf_dir: str | os.PathLike):
    """transformers' `PreTrainedTokenizerFast` for an HF directory (needs tokenizer.json).

    A damaged tokenizer.json / tokenizer_config.json raises a one-line ValueError naming the file
    and the problem (bytes that are not UTF-8, invalid JSON with its line and column, a missing
    or mistyped field, a chat_template that is not a string), never transformers' bare KeyError.
    """
    # Only the tokenizer is used, so transformers' advisory that PyTorch is absent is noise.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers import PreTrainedTokenizerFast

    path = Path(hf_dir)
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in {path}")
    try:
        tok = PreTrainedTokenizerFast.from_pretrained(str(path))
    except Exception as e:  # transformers and tokenizers raise bare KeyError, TypeError, Exception
        _diagnose_tokenizer_files(path)  # the files are only re-read when loading failed
        raise ValueError(f"{path}: cannot load the tokenizer from tokenizer.json and "
                         f"tokenizer_config.json ({type(e).__name__}: {e})") from e
    template = tok.chat_template  # a string, or {name: string} for named templates
    named = isinstance(template, dict) and all(isinstance(v, str) for v in template.values())
    if template is not None and not (isinstance(template, str) or named):
        raise ValueError(f"{path / 'tokenizer_config.json'}: field 'chat_template' must be a Jinja "
                         f"template string, got {template!r:.60}")
    # Prompt lengths are checked by the decoder and the CLI, against the target's positions less
    # the new tokens and tree slots, with an error that names the prompt. transformers' own check
    # would print first, at the tokenizer's limit, that the model will fail with indexing errors.
    tok.model_max_length = int(1e30)  # transformers' value for "no limit" (VERY_LARGE_INTEGER)
    return tok


def _diagnose_tokenizer_files(path: Path) -> None:
    """Raises ValueError naming the tokenizer file of `path` that is broken, and how."""
    from tokenizers import Tokenizer

    from tevjax.models.config import read_config_json

    tok_file = path / "tokenizer.json"
    spec, _ = read_config_json(tok_file, what="tokenizer")  # UTF-8, JSON syntax, an object
    for key, kind, noun in (("model", Mapping, "an object"), ("added_tokens", list, "a list")):
        if key not in spec:
            raise ValueError(f"{tok_file}: required field {key!r} is missing")
        if not isinstance(spec[key], kind):
            raise ValueError(f"{tok_file}: field {key!r} must be {noun}, got {spec[key]!r:.60}")
    try:
        Tokenizer.from_str(tok_file.read_text(encoding="utf-8"))
    except Exception as e:  # tokenizers reports schema errors as a bare Exception with a position
        raise ValueError(f"{tok_file}: not a tokenizer the tokenizers library can read ({e})") from e
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (path / name).is_file():
            read_config_json(path / name, what="tokenizer config")


_ROLES = ("system", "user", "assistant")


def _messages(messages: str | Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or set(m) - {"role", "content"} or "role" not in m:
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}")
        if m["role"] not in _ROLES:
            raise ValueError(f"messages[{i}]['role'] = {m['role']!r}, expected one of {_ROLES}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}]['content'] must be a string, got {m.get('content')!r}")
        out.append({"role": m["role"], "content": m["content"]})
    if not out:
        raise ValueError("messages is empty")
    return out


def chat_prompt_ids(tokenizer, messages: str | Sequence[Mapping[str, str]], *,
                    add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a chat rendered with the tokenizer's chat template (ChatML for SmolLM2).

    `messages` is a user text or a list of `{"role", "content"}` dicts. The rendered text is
    tokenized without added special tokens: the template itself writes `<|im_start|>` etc.
    """
    import jinja2

    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("tokenizer has no chat_template (tokenizer_config.json 'chat_template')")
    try:
        text = tokenizer.apply_chat_template(_messages(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except jinja2.TemplateError as e:  # a broken template in a user's tokenizer_config.json
        line = f" at template line {e.lineno}" if getattr(e, "lineno", None) else ""
        detail = (e.message or str(e)).splitlines()[0]
        raise ValueError(f"{_template_origin(tokenizer)}: chat_template fails{line} "
                         f"({type(e).__name__}: {detail})") from e
    return list(tokenizer.encode(text, add_special_tokens=False))


def _template_origin(tokenizer) -> str:
    """The file a loaded tokenizer's chat template came from, for error messages."""
    where = Path(getattr(tokenizer, "name_or_path", "") or ".")
    if not where.is_dir():
        return "tokenizer"
    jinja = where / "chat_template.jinja"  # transformers' separate-file form wins when present
    return str(jinja if jinja.is_file() else where / "tokenizer_config.json")


def _decoder_kinds(spec) -> set[str]:
    """The decoder types of a tokenizer.json "decoder" entry, a Sequence's members included."""
    if not spec:
        return set()
    if spec.get("type") == "Sequence":
        return set().union(*(_decoder_kinds(d) for d in spec.get("decoders", [])))
    return {spec.get("type")}


def token_bytes(tokenizer) -> list[bytes]:
    """The bytes each token id spells in decoded text (`decode(..., skip_special_tokens=True)`):
    empty for special tokens. What stop strings are matched against (`tevjax.decode.stops`).

    Two decoder families are supported:
    - byte-level BPE (a "ByteLevel" decoder: GPT-2, SmolLM, Qwen, Llama 3 and every tokenizer built
      from a GGUF file): a token written in GPT-2's byte alphabet spells those bytes; one with any
      other character spells its own UTF-8, as the tokenizers library decodes it;
    - SentencePiece-style ("Metaspace", or "Replace" with "ByteFallback": Llama 2, Mistral):
      "<0x0A>" spells the byte 0x0A and "\u2581" a space. The space such a decoder strips from the
      start of the whole text is kept: a token spells what it adds in the middle of a text.
    Other decoders (WordPiece, CTC, ...) raise ValueError naming the decoder.
    """
    import json

    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)  # transformers' fast tokenizer, or tokenizers'
    spec = json.loads(backend.to_str())
    kinds = _decoder_kinds(spec.get("decoder"))
    size = backend.get_vocab_size(with_added_tokens=True)
    special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
    names = [backend.id_to_token(i) for i in range(size)]
    if "ByteLevel" in kinds:
        inverse = {c: b for b, c in _byte_alphabet().items()}

        def spell(name: str) -> bytes:
            if all(c in inverse for c in name):
                return bytes(inverse[c] for c in name)
            return name.encode("utf-8")
    elif "Metaspace" in kinds or "ByteFallback" in kinds:
        def spell(name: str) -> bytes:
            if len(name) == 6 and name.startswith("<0x") and name.endswith(">"):
                try:
                    return bytes([int(name[3:5], 16)])
                except ValueError:
                    pass
            return name.replace("\u2581", " ").encode("utf-8")
    else:
        raise ValueError(f"cannot spell this tokenizer's tokens as bytes: its decoder is "
                         f"{sorted(kinds) or 'missing'} (supported: byte-level BPE, 'ByteLevel'; SentencePiece-style, "
                         f"'Metaspace' or 'ByteFallback')")
    return [b"" if i in special or names[i] is None else spell(names[i]) for i in range(size)]


_REPLACEMENT = "\ufffd"


class StreamDetokenizer:
    """Incremental detokenization for streaming: fed token ids, returns only completed text.

    A byte-level BPE token can end inside a multi-byte UTF-8 character (an emoji is four bytes,
    often four tokens). Decoding such a prefix yields U+FFFD for the incomplete bytes, and
    printing it would show "\ufffd" where the finished text has the emoji. `feed` therefore
    decodes all ids so far and emits text only up to the start of the trailing run of U+FFFD
    characters, holding that run back until later ids complete it (or until `flush`).

    Why this is exact: a UTF-8 decoder that replaces bad bytes (tokenizers' `from_utf8_lossy`,
    like Python's errors="replace") ends its output in U+FFFD whenever the input ends in an
    incomplete or invalid sequence; so text that ends in any other character ends on a
    character boundary, and decoding more bytes only appends to it. The streamed pieces are thus
    always a prefix of the final text, and `flush` returns the rest: for any ids and any
    chunking, `"".join(feed(c) for c in chunks) + flush() == tokenizer.decode(ids, ...)`.
    A genuine U+FFFD (the bytes EF BF BD, or bytes that never form a character) is only delayed:
    it is emitted as soon as a different character follows it, else by `flush`.

    The guarantee needs a decoder that never rewrites text it has already produced, which holds
    for byte-level BPE (every tokenizer tevjax builds from a GGUF file) and for transformers'
    BPE tokenizers, where `clean_up_tokenization_spaces` is ignored. Each `feed` decodes the
    whole sequence, O(T) per call, which is negligible next to a decoding round.
    """

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._emitted = 0  # characters of the decoded text already returned
        self._flushed = False

    @property
    def text(self) -> str:
        """The decoded text of every id fed so far (what `flush` completes the stream to)."""
        return self._tokenizer.decode(self._ids, skip_special_tokens=self._skip_special_tokens)

    def feed(self, ids: Sequence[int]) -> str:
        """Appends `ids`; returns the newly completed text (possibly empty)."""
        if self._flushed:  # flushed text may end in U+FFFD that more bytes would have changed
            raise ValueError("StreamDetokenizer.feed called after flush; start a new stream")
        self._ids.extend(int(i) for i in ids)
        text = self.text
        end = len(text.rstrip(_REPLACEMENT))
        if end <= self._emitted:
            return ""
        piece, self._emitted = text[self._emitted:end], end
        return piece

    def flush(self) -> str:
        """Ends the stream: returns the held-back rest, after which the returned pieces
        concatenate to `text`."""
        self._flushed = True
        text = self.text
        piece, self._emitted = text[self._emitted:], len(text)
        return piece
