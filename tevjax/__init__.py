"""tevjax: lossless tree speculative decoding in JAX/Flax.

Shape-letter legend, the one legend of the whole project: shape notes (`[B, N, V]`), name
suffixes (`logits_NxV`), docstrings and comments use only these letters, each only in this sense.

  B   batch rows
  T   tokens along a sequence or block
  S   cache slots
  N   tree slots (= budget + 1)
  G   draft rows per block (= block_size - 1, the maximum tree depth)
  M   anchors per training sequence
  E   anchors per sequence that get an exit-loss tree
  V   vocabulary
  D   model width
  F   feature width (n tapped layers x D)
  L   layers
  H   query heads
  K   key/value heads
  Dh  head width
  R   requested hidden layers
  P   pruned builder candidates per depth
  Ll  linear-attention layers of a hybrid target (Qwen3-Next, Qwen3.5)
  Hk  their query/key heads; Hv their value heads
  Dk  their key width; Dv their value width
  C   their conv channels (queries, keys and values); W their conv width

The tree budget and the temperature are never letters: write "budget" and "temperature"
("budget 64", "temperature 0"). Scalars and counts that are not axis sizes are words too.

Layers of the package (each knows nothing of the ones after it):
  core      `DraftTree`, `exit_law`, `verify`, `build_ddtree`, `context_chain` / `corpus_chain` / `merge_chain`,
            `truncate_logits` (top-k / top-p / min-p target laws): model-free tree math
  models    `Transformer` (Llama/Qwen/Gemma/... targets, Qwen3-Next's hybrid), `DFlashDrafter`: thin Flax NNX modules
  convert   HF safetensors, GGUF, tokenizers, DFlash checkpoints, the embedded SmolLM2 default
  decode    `Decoder`: draft -> build -> one target tree pass -> verify -> commit, jitted
  train     `generate_data`, `Trainer` / `train`: token + exit losses, one optax step over a mesh

The core names are imported eagerly; model, conversion, decoding and training names load on first use, so
`import tevjax` for the tree math does not import Flax or transformers.
"""

from __future__ import annotations

import importlib

from tevjax.builder import NgramTable, build_ddtree, context_chain, corpus_chain, merge_chain, ngram_table
from tevjax.law import ExitLaw, exit_law
from tevjax.sampling import truncate_logits
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
    "set_moe_dispatch": "tevjax.models.layers",
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
    "token_bytes": "tevjax.convert.tokenizer",
    "prepare_smollm2": "tevjax.convert.embedded",
    # decoding
    "DecodeConfig": "tevjax.decode.engine",
    "Decoder": "tevjax.decode.engine",
    "Generation": "tevjax.decode.engine",
    "Interrupted": "tevjax.decode.engine",
    "cut_text": "tevjax.decode.stops",
    "load_models": "tevjax.loading",
    "load_ngrams": "tevjax.loading",
    "load_target": "tevjax.loading",
    # training
    "RolloutConfig": "tevjax.train.rollout",
    "generate_data": "tevjax.train.rollout",
    "TrainConfig": "tevjax.train.step",
    "Trainer": "tevjax.train.step",
    "train": "tevjax.train.run",
    "export_run": "tevjax.train.run",
    "make_mesh": "tevjax.sharding",
    "param_shardings": "tevjax.sharding",
    "shard_model": "tevjax.sharding",
    "initialize_distributed": "tevjax.multihost",
}

__all__ = [
    "DraftTree",
    "ExitLaw",
    "NgramTable",
    "TreeValidationError",
    "VerifyOutput",
    "build_ddtree",
    "context_chain",
    "corpus_chain",
    "exit_law",
    "merge_chain",
    "ngram_table",
    "truncate_logits",
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
