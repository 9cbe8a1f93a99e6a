"""tevjax: lossless tree speculative decoding in JAX/Flax.

Letter legend for shapes used across the package:
  B batch, T sequence (new tokens), S cache slots, N tree nodes (root + budget), H tree depth,
  L model layers, V vocabulary, D model width, K key/value heads, Dh head width.

Layers of the package (each knows nothing of the ones after it):
  core      `DraftTree`, `exit_law`, `verify`, `build_ddtree`: model-free tree math
  models    `Transformer` (Llama/Qwen3 target), `DFlashDrafter`: thin Flax NNX modules
  convert   HF safetensors, GGUF, tokenizers, DFlash checkpoints, the embedded SmolLM2 default
  decode    `Decoder`: draft -> build -> one target tree pass -> verify -> commit, jitted

The core names are imported eagerly; model, conversion and decoding names load on first use, so
`import tevjax` for the tree math does not import Flax or transformers.
"""

from __future__ import annotations

import importlib

from tevjax.builder import build_ddtree
from tevjax.law import ExitLaw, exit_law
from tevjax.tree import DraftTree, TreeValidationError, validate_tree
from tevjax.verifiers import VerifyOutput, verify

_LAZY = {
    # models
    "ModelConfig": "tevjax.models.config",
    "RopeScaling": "tevjax.models.config",
    "PRESETS": "tevjax.models.config",
    "Transformer": "tevjax.models.transformer",
    "ForwardOutput": "tevjax.models.transformer",
    "KVCache": "tevjax.models.cache",
    "DFlashConfig": "tevjax.models.dflash",
    "DFlashDrafter": "tevjax.models.dflash",
    "DrafterCache": "tevjax.models.dflash",
    "features_from_output": "tevjax.models.dflash",
    # conversion
    "CheckpointError": "tevjax.convert.hf",
    "load_hf_target": "tevjax.convert.hf",
    "save_hf_target": "tevjax.convert.hf",
    "load_dflash": "tevjax.convert.dflash_ckpt",
    "save_dflash": "tevjax.convert.dflash_ckpt",
    "GGUFError": "tevjax.convert.gguf",
    "read_gguf": "tevjax.convert.gguf",
    "gguf_to_hf_dir": "tevjax.convert.gguf",
    "load_tokenizer": "tevjax.convert.tokenizer",
    "chat_prompt_ids": "tevjax.convert.tokenizer",
    "prepare_smollm2": "tevjax.convert.embedded",
    # decoding
    "DecodeConfig": "tevjax.decode.engine",
    "Decoder": "tevjax.decode.engine",
    "Generation": "tevjax.decode.engine",
    "load_models": "tevjax.loading",
}

__all__ = [
    "DraftTree",
    "ExitLaw",
    "TreeValidationError",
    "VerifyOutput",
    "build_ddtree",
    "exit_law",
    "validate_tree",
    "verify",
    *_LAZY,
]

__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'tevjax' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
