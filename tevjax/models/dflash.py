"""DFlash block-diffusion drafter (Chen, Liang, Liu 2026; public repo z-lab/dflash).

Shape letters follow the legend in `tevjax/__init__.py`. Here T counts the context tokens of one
call (the whole sequence in training), S the context cache slots, L the drafter's layers, F = n*D
the width of n concatenated target layers, and a block holds G + 1 = block_size tokens.

How the drafter reads the target (all as in the public implementation):

* Context features. For every committed token the target's hidden states after the decoder layers
  `target_layer_ids` (0-based layer index `i` = HF `hidden_states[i + 1]`, i.e. the output of
  decoder layer `i`, which is `Transformer(..., hidden_layers=ids).hidden`; see
  `features_from_output` for the one exception, the last layer) are concatenated in that order
  to `[.., F]`, projected by `fc` (no bias) and normalised by `hidden_norm`.
  Every drafter layer turns these projected features into keys/values with its own `k_proj`,
  `k_norm` and `v_proj`, and RoPE at the context token's absolute position. The context stream
  has no residual stream of its own: it is not updated from layer to layer.
* Block. `[last committed token, MASK x G]` at positions `a, .., a+G` (a = the anchor,
  the position of the last committed token), embedded with the TARGET's embedding. Queries come
  from the block only; keys/values are the cached context (positions < a: the anchor's own hidden
  state is not known yet, the target has not run on it) plus the block itself, with no causal
  mask inside the block. A final `norm` precedes the TARGET's LM head, and block positions
  `1..G` give the draft distributions for tokens `a+1 .. a+G`.

Worked example (block_size = 4, so G = 3; committed tokens t0..t5, anchor a = 5 so t5 is the last
committed token)::

    cache slots     0   1   2   3   4   5   6  ...      ctx_len = 5
    holds ctx of   t0  t1  t2  t3  t4   -   -           (features of t0..t4, RoPE at 0..4)
    block          [t5, MASK, MASK, MASK]  at positions 5, 6, 7, 8
    visible keys   slots 0..4 and all 4 block tokens, for every block query
    logits rows    positions 6, 7, 8 -> draft marginals q_1, q_2, q_3 of tokens 6, 7, 8

Training (`train_logits`) runs the same computation for M anchors of one sequence at once: the
context cache is the whole sequence's features and anchor a sees context indices `< a`, so it
equals the inference path at the same anchor.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tevjax.checks import is_int, is_real
from tevjax.models.cache import KVCache, write_slots
from tevjax.models.config import ModelConfig, RopeScaling, config_field, read_config_json, with_overrides
from tevjax.models.layers import NEG_INF, RMSNorm, Rope, SwiGLU, apply_rope, matmul_precision

__all__ = [
    "DFlashConfig",
    "DFlashDrafter",
    "DraftVocab",
    "DrafterCache",
    "check_draft_vocab",
    "default_target_layer_ids",
    "draft_vocab_from_counts",
    "features_from_hidden",
    "features_from_output",
    "grow_drafter",
    "tapped_hidden",
]

_DTYPES = ("float32", "bfloat16", "float16")
HF_ARCHITECTURE = "DFlashDraftModel"


def features_from_hidden(hidden: jax.Array) -> jax.Array:
    """[..., R, D] target hidden states (e.g. `ForwardOutput.hidden` requested with
    `hidden_layers=cfg.target_layer_ids`) -> [..., R*D] context features, concatenated in
    `target_layer_ids` order as the reference does (`cat(..., dim=-1)`)."""
    return hidden.reshape(hidden.shape[:-2] + (hidden.shape[-2] * hidden.shape[-1],))


def tapped_hidden(out, layer_ids: Sequence[int], num_target_layers: int) -> jax.Array:
    """[B, T, R, D] hidden states of the target's tapped layers from a `ForwardOutput` computed
    with `hidden_layers=layer_ids`, as the reference reads them.

    The reference taps HF `hidden_states[i + 1]`, which is decoder layer i's output except for
    the last layer: transformers replaces `hidden_states[L]` with the final-normed hidden state.
    A tap of layer L-1 (no released Qwen3/Llama drafter has one) therefore reads
    `out.final_hidden`, so such drafters see what they were trained on.
    """
    hidden = out.hidden
    if hidden.shape[-2] != len(layer_ids):
        raise ValueError(f"target output holds {hidden.shape[-2]} hidden layers, {len(layer_ids)} are tapped")
    for r, layer in enumerate(layer_ids):
        if layer == num_target_layers - 1:
            hidden = hidden.at[..., r, :].set(out.final_hidden.astype(hidden.dtype))
    return hidden


def features_from_output(out, cfg: "DFlashConfig", target_cfg: ModelConfig) -> jax.Array:
    """Context features [B, T, F] from a target `ForwardOutput` computed with
    `hidden_layers=cfg.target_layer_ids` (see `tapped_hidden`)."""
    return features_from_hidden(tapped_hidden(out, cfg.target_layer_ids, target_cfg.num_layers))


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The public default tap points: one per drafter layer, evenly spaced from 1 to L-3.

    A single drafter layer taps the middle layer L // 2. Rounding is Python's `round`, which
    reproduces the released configs: L=36, 5 layers -> (1, 9, 17, 25, 33); L=32 -> (1, 8, 15, 22, 29).
    """
    if num_draft_layers < 1:
        raise ValueError(f"num_draft_layers must be >= 1, got {num_draft_layers}")
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    if num_target_layers < 4:
        raise ValueError(f"default target_layer_ids need a target with >= 4 layers, got {num_target_layers}")
    span = num_target_layers - 4  # from layer 1 to layer L-3
    return tuple(int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))


@dataclasses.dataclass(frozen=True, kw_only=True)
class DFlashConfig:
    """Static shape, numerics and drafting fields of a DFlash drafter.

    Layer sizes are Qwen3-style (per-head q/k RMSNorm, SwiGLU, no biases). `hidden_size` and
    `vocab_size` must equal the target's: the drafter reuses the target's embedding and LM head.
    `dtype` is the compute dtype, `param_dtype` the weight storage dtype (strings, as in
    `ModelConfig`); norms, attention scores, softmax and logits are float32 regardless.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 40960
    block_size: int = 16
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    num_target_layers: int | None = None  # recorded in config.json; not needed by the math
    # Optional public `dflash_config` knobs (1.0 / None in every released Qwen3/Llama drafter):
    # block embeddings are multiplied by `input_embedding_scale`; logits by `output_multiplier`,
    # then soft-capped as cap * tanh(logits / cap) when `final_logit_softcapping` is set.
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # A reduced draft vocabulary (EAGLE-3's idea): the drafter scores only these many target
    # tokens, through the matching rows of the target's LM head (`DFlashDrafter.draft_vocab`
    # holds the ids). None: the whole vocabulary, as every released drafter.
    draft_vocab_size: int | None = None
    dtype: str = "float32"
    param_dtype: str = "float32"

    def __post_init__(self):
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "vocab_size", "max_position_embeddings", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"DFlashConfig.{name} must be a positive int, got {value!r}")
        if self.block_size < 2:
            raise ValueError(f"DFlashConfig.block_size must be >= 2 (one anchor + drafts), got {self.block_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"DFlashConfig.num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"DFlashConfig.head_dim={self.head_dim} must be even for RoPE")
        if not (math.isfinite(float(self.rms_norm_eps)) and float(self.rms_norm_eps) >= 0):
            raise ValueError(f"DFlashConfig.rms_norm_eps must be a finite number >= 0, got {self.rms_norm_eps!r}")
        # A NaN or zero here would not fail: the drafter's logits would be NaN or all equal.
        for name in ("rope_theta", "input_embedding_scale", "output_multiplier", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is None and name == "final_logit_softcapping":
                continue
            if not is_real(value) or not (math.isfinite(value) and value > 0):
                raise ValueError(f"DFlashConfig.{name} must be a finite number > 0, got {value!r}")
        # int() would read layer 1.7 as 1 and True as 1.
        if not isinstance(self.target_layer_ids, (tuple, list)) or not all(map(is_int, self.target_layer_ids)):
            raise ValueError(f"DFlashConfig.target_layer_ids must be a tuple of layer indices, got "
                             f"{self.target_layer_ids!r}")
        if not is_int(self.mask_token_id):
            raise ValueError(f"DFlashConfig.mask_token_id must be a token id, got {self.mask_token_id!r}")
        ids = tuple(int(i) for i in self.target_layer_ids)
        if not ids or any(i < 0 for i in ids):
            raise ValueError(f"DFlashConfig.target_layer_ids must be non-empty and >= 0, got {self.target_layer_ids!r}")
        if self.num_target_layers is not None and max(ids) >= self.num_target_layers:
            raise ValueError(
                f"DFlashConfig.target_layer_ids={ids} reach past num_target_layers={self.num_target_layers}"
            )
        if self.draft_vocab_size is not None and not (
                isinstance(self.draft_vocab_size, int) and not isinstance(self.draft_vocab_size, bool)
                and 1 <= self.draft_vocab_size <= self.vocab_size):
            raise ValueError(f"DFlashConfig.draft_vocab_size must be None or an int in [1, vocab_size="
                             f"{self.vocab_size}], got {self.draft_vocab_size!r}")
        if not 0 <= int(self.mask_token_id) < self.vocab_size:
            raise ValueError(f"DFlashConfig.mask_token_id={self.mask_token_id} is outside [0, vocab_size={self.vocab_size})")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"DFlashConfig.{name}={getattr(self, name)!r} is not one of {', '.join(_DTYPES)}")
        # Tuples/ints keep the config hashable: it is a static argument of jitted functions.
        object.__setattr__(self, "target_layer_ids", ids)
        object.__setattr__(self, "mask_token_id", int(self.mask_token_id))

    @property
    def num_features(self) -> int:
        """n: how many target layers are concatenated into one context feature."""
        return len(self.target_layer_ids)

    @property
    def draft_vocab_dim(self) -> int:
        """Vd: the width of the draft logits (the draft vocabulary, or the whole vocabulary)."""
        return self.vocab_size if self.draft_vocab_size is None else self.draft_vocab_size

    @property
    def feature_dim(self) -> int:
        """F = n * D: width of the concatenated context feature that `fc` projects."""
        return self.num_features * self.hidden_size

    # ------------------------------------------------------------------ constructors

    @classmethod
    def for_target(
        cls,
        target_cfg: ModelConfig,
        *,
        num_layers: int = 5,
        block_size: int = 16,
        mask_token_id: int | None = None,
        target_layer_ids: Sequence[int] | None = None,
        intermediate_size: int | None = None,
        dtype: str | None = None,
        param_dtype: str | None = None,
        draft_vocab_size: int | None = None,
    ) -> "DFlashConfig":
        """A fresh drafter for `target_cfg`, with the target's layer sizes (as the public training
        recipe builds a draft config from the target's).

        * `target_layer_ids`: default `default_target_layer_ids(L, num_layers)` (one tap per
          drafter layer, evenly from 1 to L-3), the rule behind every released drafter.
        * `mask_token_id`: required. It must be an id that text never contains, because block
          position 0 carries a real token and a collision makes the anchor look like a mask. A
          target's last embedding row is not such an id in general (SmolLM2's id 49151 is a real
          token); `tevjax.loading.mask_token_for` picks one from the tokenizer (`<empty_output>`
          for SmolLM2, the first spare row past the tokenizer for Qwen3: 151669, as released).
        * `intermediate_size`: default the target's MLP width; the drafter's layers are dense, so
          for a mixture-of-experts target it is the width of the experts one token runs
          (experts_per_token x their width: 6144 for Qwen3-30B-A3B, its config's dense width).
        """
        if mask_token_id is None:
            raise ValueError("DFlashConfig.for_target needs mask_token_id: an id that text never contains "
                             "(tevjax.loading.mask_token_for picks one from the target's tokenizer)")
        ids = (default_target_layer_ids(target_cfg.num_layers, num_layers)
               if target_layer_ids is None else tuple(int(i) for i in target_layer_ids))
        width = target_cfg.intermediate_size * max(target_cfg.experts_per_token, 1)
        return cls(
            hidden_size=target_cfg.hidden_size,
            intermediate_size=intermediate_size or width,
            num_layers=num_layers,
            num_heads=target_cfg.num_heads,
            num_kv_heads=target_cfg.num_kv_heads,
            head_dim=target_cfg.head_dim,
            vocab_size=target_cfg.vocab_size,
            rms_norm_eps=target_cfg.rms_norm_eps,
            rope_theta=target_cfg.rope_theta,
            rope_scaling=target_cfg.rope_scaling,
            max_position_embeddings=target_cfg.max_position_embeddings,
            block_size=block_size,
            target_layer_ids=ids,
            mask_token_id=mask_token_id,
            num_target_layers=target_cfg.num_layers,
            draft_vocab_size=draft_vocab_size,
            dtype=dtype or target_cfg.dtype,
            param_dtype=param_dtype or target_cfg.param_dtype,
        )

    def check_target(self, target_cfg: ModelConfig) -> None:
        """Raises ValueError when this drafter cannot read `target_cfg`'s embedding, LM head and
        hidden states."""
        problems = []
        if self.hidden_size != target_cfg.hidden_size:
            problems.append(f"hidden_size {self.hidden_size} != target hidden_size {target_cfg.hidden_size}")
        if self.vocab_size != target_cfg.vocab_size:
            problems.append(f"vocab_size {self.vocab_size} != target vocab_size {target_cfg.vocab_size}")
        if max(self.target_layer_ids) >= target_cfg.num_layers:
            problems.append(f"target_layer_ids {self.target_layer_ids} reach past the target's {target_cfg.num_layers} layers")
        if self.num_target_layers is not None and self.num_target_layers != target_cfg.num_layers:
            problems.append(f"num_target_layers {self.num_target_layers} != target num_layers {target_cfg.num_layers}")
        if problems:
            raise ValueError("DFlash drafter does not fit the target: " + "; ".join(problems))

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | str | os.PathLike, **overrides) -> "DFlashConfig":
        """Reads the public DFlash `config.json` (a dict, a file path or a checkpoint directory).

        Public layout: a Qwen3 config (`hidden_size`, `num_hidden_layers`, `num_attention_heads`,
        ...) plus `block_size` (top level, or inside `dflash_config`; default 16),
        `num_target_layers`, and `dflash_config: {"mask_token_id", "target_layer_ids"}` (the two
        drafting keys are also accepted at the top level). Unsupported variants (sliding-window
        or causal drafter layers, attention biases) raise ValueError.
        """
        c, source = read_config_json(config, what="DFlash config")
        dcfg = c.get("dflash_config") or {}
        if not isinstance(dcfg, Mapping):
            raise ValueError(f"{source}: 'dflash_config' must be an object, got {type(dcfg).__name__}")

        def drafting(key, default=None, required=False):
            # The reference reads dflash_config first and falls back to the top level.
            value = dcfg.get(key, c.get(key))
            if value is None:
                if required:
                    raise ValueError(f"{source}: required field 'dflash_config.{key}' is missing")
                return default
            return value

        layer_types = c.get("layer_types")
        if layer_types is not None and any(t != "full_attention" for t in layer_types):
            raise ValueError(
                f"{source}: layer_types {list(layer_types)} are not supported "
                "(only non-causal 'full_attention' drafter layers)"
            )
        if c.get("is_causal"):
            raise ValueError(f"{source}: is_causal=True drafters are not supported")
        if c.get("attention_bias", False):
            raise ValueError(f"{source}: attention_bias=True is not supported")
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if c.get(key) is None:
                raise ValueError(f"{source}: required field {key!r} is missing")
        # The layer fields are a Qwen3 config: reuse the target parser (RoPE dict forms, head_dim
        # default, activation checks) rather than a second copy of it.
        try:
            base = ModelConfig.from_hf_config({**c, "model_type": "qwen3"})
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from e
        ids = drafting("target_layer_ids", required=True)
        if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) for i in ids):
            raise ValueError(f"{source}: dflash_config.target_layer_ids must be a list of ints, got {ids!r}")
        mask = drafting("mask_token_id", required=True)
        if not isinstance(mask, int) or isinstance(mask, bool):
            raise ValueError(f"{source}: dflash_config.mask_token_id must be an int, got {mask!r}")

        def number(key, kind, default):  # checked as config fields are: int() read block size 16.5 as 16
            where = "dflash_config." if dcfg.get(key) is not None else ""
            return config_field({key: drafting(key)}, key, kind, source, default, prefix=where)

        softcap = number("final_logit_softcapping", float, None)
        fields = dict(
            hidden_size=base.hidden_size,
            intermediate_size=base.intermediate_size,
            num_layers=base.num_layers,
            num_heads=base.num_heads,
            num_kv_heads=base.num_kv_heads,
            head_dim=base.head_dim,
            vocab_size=base.vocab_size,
            rms_norm_eps=base.rms_norm_eps,
            rope_theta=base.rope_theta,
            rope_scaling=base.rope_scaling,
            max_position_embeddings=base.max_position_embeddings,
            block_size=number("block_size", int, 16),
            target_layer_ids=tuple(ids),
            mask_token_id=mask,
            num_target_layers=config_field(c, "num_target_layers", int, source, None),
            input_embedding_scale=number("input_embedding_scale", float, 1.0),
            output_multiplier=number("output_multiplier", float, 1.0),
            final_logit_softcapping=None if softcap is None or softcap <= 0 else softcap,
            draft_vocab_size=_optional_int(drafting("draft_vocab_size"), "dflash_config.draft_vocab_size", source),
            dtype=base.dtype,
            param_dtype=base.param_dtype,
        )
        return with_overrides(cls, fields, overrides)

    def to_hf_config(self) -> dict[str, Any]:
        """The public DFlash `config.json` dict (loadable by z-lab's `DFlashDraftModel`, which
        is a `Qwen3Config` with `block_size`, `num_target_layers` and `dflash_config`)."""
        dcfg: dict[str, Any] = {
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
        }
        # Only written when they differ from the reference defaults, so a Qwen3/Llama drafter's
        # config carries exactly the released keys.
        if self.input_embedding_scale != 1.0:
            dcfg["input_embedding_scale"] = self.input_embedding_scale
        if self.output_multiplier != 1.0:
            dcfg["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping is not None:
            dcfg["final_logit_softcapping"] = self.final_logit_softcapping
        if self.draft_vocab_size is not None:
            dcfg["draft_vocab_size"] = self.draft_vocab_size
        out: dict[str, Any] = {
            "architectures": [HF_ARCHITECTURE],
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "model_type": "qwen3",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "block_size": self.block_size,
            "dflash_config": dcfg,
            "dtype": self.param_dtype,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "hidden_size": self.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "layer_types": ["full_attention"] * self.num_layers,
            "max_position_embeddings": self.max_position_embeddings,
            "num_attention_heads": self.num_heads,
            "num_hidden_layers": self.num_layers,
            "num_key_value_heads": self.num_kv_heads,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_scaling": None,
            "rope_theta": self.rope_theta,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
            "vocab_size": self.vocab_size,
        }
        if self.num_target_layers is not None:
            out["num_target_layers"] = self.num_target_layers
        if self.rope_scaling is not None:
            out["rope_scaling"] = self.rope_scaling.to_hf()
        return out


def check_draft_vocab(ids, cfg: DFlashConfig) -> jax.Array:
    """Validated draft-vocabulary ids as int32 [Vd]: `cfg.draft_vocab_size` distinct ids in
    [0, vocab_size), strictly increasing (lookups use a binary search)."""
    x = np.asarray(ids)
    if x.dtype.kind not in "iu":
        raise ValueError(f"draft vocabulary ids must be integers, got dtype {x.dtype}")
    if x.shape != (cfg.draft_vocab_size,):
        raise ValueError(f"draft vocabulary has shape {x.shape}, the config says ({cfg.draft_vocab_size},)")
    if x.size and (x.min() < 0 or x.max() >= cfg.vocab_size):
        raise ValueError(f"draft vocabulary ids must lie in [0, {cfg.vocab_size}), got [{x.min()}, {x.max()}]")
    if np.any(np.diff(x) <= 0):
        raise ValueError("draft vocabulary ids must be strictly increasing (sorted, no repeats)")
    return jnp.asarray(x, jnp.int32)


def draft_vocab_from_counts(counts, size: int, *, always: Sequence[int] = (), never: Sequence[int] = ()) -> np.ndarray:
    """The `size` most frequent ids of `counts` [V] (ties: the lower id, which in a BPE vocabulary
    is the earlier, more frequent merge), plus every id in `always` (e.g. the end-of-turn ids) and
    none in `never` (e.g. the drafter's mask token, which text never holds), sorted: a draft
    vocabulary for `DFlashDrafter(..., draft_vocab=...)`."""
    counts = np.asarray(counts)
    if not 1 <= size <= counts.shape[0]:
        raise ValueError(f"draft vocabulary size {size} is outside [1, {counts.shape[0]}]")
    forced = sorted({int(i) for i in always})
    if len(forced) > size:
        raise ValueError(f"{len(forced)} required ids do not fit a draft vocabulary of {size}")
    banned = sorted({int(i) for i in never} - set(forced))
    if counts.shape[0] - len(banned) < size:
        raise ValueError(f"excluding {len(banned)} ids leaves fewer than {size} for the draft vocabulary")
    score = counts.astype(np.float64).copy()
    score[forced] = np.inf
    score[banned] = -np.inf
    order = np.lexsort((np.arange(counts.shape[0]), -score))
    return np.sort(order[:size]).astype(np.int32)


def _optional_int(value, name: str, source) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{source}: {name} must be an int, got {value!r}")
    return value


# The drafter's context cache has the target cache's layout ([L, B, K, S, Dh] keys and values,
# built from the config's num_layers / num_kv_heads / head_dim / dtype), so it is the same type.
# It holds context K/V only (the block's K/V are recomputed every round); slots at or beyond a
# row's `ctx_len` are ignored by the drafter, so stale entries need no clearing.
DrafterCache = KVCache


def _context_block_attention(q, k_ctx, v_ctx, ctx_visible, k_blk, v_blk):
    """Attention of block queries over [visible context | whole block], one joint softmax.

    q: [B, G + 1, H, Dh]; k_ctx, v_ctx: [B, K, S, Dh]; ctx_visible: [B, S] bool (the same for every
    query of a block); k_blk, v_blk: [B, G + 1, K, Dh], all visible (no causal mask in the block).
    Same numerics as `tevjax.models.layers.attention` (float32 scores and softmax, finite NEG_INF),
    but the context and block keys stay separate instead of being concatenated: under the
    training vmap over anchors the context is shared by every anchor, and a concatenation would
    copy it once per anchor. A block row always sees its own block, so no row is ever empty.
    """
    b, t, h, dh = q.shape
    kh, s = k_ctx.shape[1], k_ctx.shape[2]
    g = h // kh
    # The G query heads of each kv head as one [G*T, Dh] row block, as in `layers.attention`.
    qm = q.reshape(b, t, kh, g, dh).transpose(0, 2, 3, 1, 4).reshape(b, kh, g * t, dh)
    scale = 1.0 / math.sqrt(dh)
    f32 = dict(preferred_element_type=jnp.float32, precision=matmul_precision(q.dtype))
    s_ctx = jnp.einsum("bkmd,bksd->bkms", qm, k_ctx, **f32) * scale
    s_ctx = jnp.where(ctx_visible[:, None, None, :], s_ctx, NEG_INF)
    s_blk = jnp.einsum("bkmd,bukd->bkmu", qm, k_blk, **f32) * scale
    probs = jax.nn.softmax(jnp.concatenate([s_ctx, s_blk], axis=-1), axis=-1)
    p_ctx, p_blk = probs[..., :s], probs[..., s:]
    f32 = dict(preferred_element_type=jnp.float32, precision=matmul_precision(v_ctx.dtype))
    out = jnp.einsum("bkms,bksd->bkmd", p_ctx.astype(v_ctx.dtype), v_ctx, **f32)
    out = out + jnp.einsum("bkmu,bukd->bkmd", p_blk.astype(v_blk.dtype), v_blk, **f32)
    return out.reshape(b, kh, g, t, dh).transpose(0, 3, 1, 2, 4).reshape(b, t, h, dh).astype(q.dtype)


class DFlashAttention(nnx.Module):
    """q/k/v/o projections and per-head q/k RMSNorm (Qwen3 style, no biases)."""

    def __init__(self, cfg: DFlashConfig, *, rngs: nnx.Rngs):
        kw = dict(use_bias=False, dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype),
                  precision=matmul_precision(cfg.dtype), kernel_init=nnx.initializers.normal(0.02), rngs=rngs)
        d, h, k, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nnx.Linear(d, h * dh, **kw)
        self.k_proj = nnx.Linear(d, k * dh, **kw)
        self.v_proj = nnx.Linear(d, k * dh, **kw)
        self.o_proj = nnx.Linear(h * dh, d, **kw)
        nkw = dict(eps=cfg.rms_norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.q_norm = RMSNorm(dh, **nkw)
        self.k_norm = RMSNorm(dh, **nkw)
        self.num_heads, self.num_kv_heads, self.head_dim = h, k, dh

    def context_kv(self, ctx, positions, rope):
        """ctx [B, T, D] projected features, positions [B, T] -> keys, values [B, K, T, Dh] (the
        cache's heads-major layout)."""
        b, c, _ = ctx.shape
        k = self.k_norm(self.k_proj(ctx).reshape(b, c, self.num_kv_heads, self.head_dim))
        k = apply_rope(k, positions, *rope)
        v = self.v_proj(ctx).reshape(b, c, self.num_kv_heads, self.head_dim)
        return k.swapaxes(1, 2), v.swapaxes(1, 2)

    def __call__(self, x, positions, rope, k_ctx, v_ctx, ctx_visible):
        """x [B, G + 1, D] normed block stream -> attention output [B, G + 1, D]."""
        b, t, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        q = apply_rope(q, positions, *rope)
        k = apply_rope(k, positions, *rope)
        out = _context_block_attention(q, k_ctx, v_ctx, ctx_visible, k, v)
        return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim))


class DFlashLayer(nnx.Module):
    """Pre-norm decoder layer; only the block stream has a residual (the context is read-only)."""

    def __init__(self, cfg: DFlashConfig, *, rngs: nnx.Rngs):
        nkw = dict(eps=cfg.rms_norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.input_layernorm = RMSNorm(cfg.hidden_size, **nkw)
        self.self_attn = DFlashAttention(cfg, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, **nkw)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, dtype=cfg.dtype,
                          param_dtype=cfg.param_dtype, rngs=rngs)

    def __call__(self, x, positions, rope, k_ctx, v_ctx, ctx_visible):
        x = x + self.self_attn(self.input_layernorm(x), positions, rope, k_ctx, v_ctx, ctx_visible)
        return x + self.mlp(self.post_attention_layernorm(x))


class DraftVocab(nnx.Variable):
    """The ids [Vd] of a reduced draft vocabulary, strictly increasing: part of the checkpoint
    (tensor `draft_vocab`), never trained (the optimizer and the gradients take `nnx.Param` only)."""


class DFlashDrafter(nnx.Module):
    """The DFlash drafter: `fc`, `hidden_norm`, `layers[i]`, `norm` (the public tensor names).

    It owns no embedding or LM head: every entry point takes the target model (anything with
    `embed(tokens) -> [.., D]` and `logits(final_hidden, rows) -> [.., V] float32`, e.g.
    `tevjax.models.transformer.Transformer`) and reads those from it. All methods are pure reads
    of the parameters, so they can be jitted, vmapped and differentiated w.r.t. the drafter alone
    (the target is then a constant).

    Draft logits are over the drafter's vocabulary of Vd = `cfg.draft_vocab_dim` entries: the
    whole target vocabulary (index = token id), or with `cfg.draft_vocab_size` the ids in
    `draft_vocab` (index j = token draft_vocab[j]; `token_ids` and `draft_index` convert). A
    reduced vocabulary cuts the LM head, the drafter's dominant cost, by V / Vd; tokens outside
    it are never drafted, which costs acceptance but never exactness (verification reads only
    the target).
    """

    def __init__(self, cfg: DFlashConfig, *, rngs: nnx.Rngs, draft_vocab=None):
        self.cfg = cfg
        if cfg.draft_vocab_size is None:
            if draft_vocab is not None:
                raise ValueError("draft_vocab given, but the config has no draft_vocab_size")
            self.draft_vocab = None
        else:
            # Placeholder ids 0..Vd-1 until the real ones are set (from data, or a checkpoint).
            self.draft_vocab = DraftVocab(jnp.arange(cfg.draft_vocab_size, dtype=jnp.int32) if draft_vocab is None
                                          else check_draft_vocab(draft_vocab, cfg))
        self.fc = nnx.Linear(cfg.feature_dim, cfg.hidden_size, use_bias=False, dtype=jnp.dtype(cfg.dtype),
                             param_dtype=jnp.dtype(cfg.param_dtype), precision=matmul_precision(cfg.dtype),
                             kernel_init=nnx.initializers.normal(0.02), rngs=rngs)
        nkw = dict(eps=cfg.rms_norm_eps, dtype=cfg.dtype, param_dtype=cfg.param_dtype, rngs=rngs)
        self.hidden_norm = RMSNorm(cfg.hidden_size, **nkw)
        self.layers = nnx.List([DFlashLayer(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, **nkw)

    # ------------------------------------------------------------------ helpers

    def _rope(self) -> Rope:
        # A host constant recomputed per trace (cheap) instead of a module attribute, so the
        # module's state is exactly the checkpoint's tensors.
        return Rope.of(self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling)

    def _check_features(self, features):
        if features.shape[-1] != self.cfg.feature_dim:
            raise ValueError(
                f"context features have width {features.shape[-1]}, expected "
                f"{self.cfg.num_features} tapped layers x {self.cfg.hidden_size} = {self.cfg.feature_dim}"
            )

    def _embed_block(self, target, block_tokens):
        x = target.embed(block_tokens).astype(self.cfg.dtype)
        if self.cfg.input_embedding_scale != 1.0:
            x = x * jnp.asarray(self.cfg.input_embedding_scale, x.dtype)
        return x

    def vocab_ids(self) -> jax.Array | None:
        """[Vd] int32 token ids of the draft vocabulary, or None for the whole vocabulary."""
        return None if self.draft_vocab is None else self.draft_vocab[...]

    def token_ids(self, index: jax.Array) -> jax.Array:
        """Draft-vocabulary indices [...] -> target token ids [...]."""
        ids = self.vocab_ids()
        return index if ids is None else jnp.take(ids, jnp.clip(index, 0, ids.shape[0] - 1))

    def draft_index(self, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Target token ids [...] -> (draft-vocabulary index [...], inside the draft vocabulary [...]).
        Ids outside it get index 0 and False."""
        tokens = jnp.asarray(tokens, jnp.int32)
        ids = self.vocab_ids()
        if ids is None:
            return tokens, (tokens >= 0) & (tokens < self.cfg.vocab_size)
        idx = jnp.clip(jnp.searchsorted(ids, tokens), 0, ids.shape[0] - 1).astype(jnp.int32)
        inside = ids[idx] == tokens
        return jnp.where(inside, idx, 0), inside

    def head_rows(self, target) -> jax.Array | None:
        """[Vd, D] the target's LM-head rows of the reduced draft vocabulary (None for the whole
        vocabulary): a decoder gathers them once and passes them to every `__call__` as `head`."""
        ids = self.vocab_ids()
        return None if ids is None else target.head_rows(ids)

    def logits(self, target, hidden: jax.Array, head: jax.Array | None = None, *,
               select_after: bool = False) -> jax.Array:
        """Final-normed drafter hidden states [..., D] -> draft logits [..., Vd] float32 through the
        target's LM head (the draft vocabulary's rows of it, or `head` = `head_rows(target)`; then
        the optional output multiplier and soft cap).

        `select_after` scores the whole vocabulary and then takes the draft vocabulary's columns.
        Under a vocabulary-split LM head (`--mesh model=M`) this moves [..., Vd] logits between
        devices, where reading the head's rows first all-reduces a [D, Vd] slice of the weight on
        every call (experiments/results/lm_head_sharding.md); on one device it costs V / Vd times
        the matmul, so the decoder asks for it only on a mesh.
        """
        ids = self.vocab_ids()
        if select_after and ids is not None:
            logits = jnp.take(target.logits(hidden), ids, axis=-1).astype(jnp.float32)
        else:
            logits = target.logits(hidden, ids, head=head).astype(jnp.float32)
        if self.cfg.output_multiplier != 1.0:
            logits = logits * self.cfg.output_multiplier
        if self.cfg.final_logit_softcapping is not None:
            cap = self.cfg.final_logit_softcapping
            logits = cap * jnp.tanh(logits / cap)
        return logits

    def _context_kv(self, ctx, positions):
        """ctx [B, T, D] -> stacked keys, values [L, B, K, T, Dh] of every layer."""
        rope = self._rope()
        kv = [layer.self_attn.context_kv(ctx, positions, rope) for layer in self.layers]
        return jnp.stack([k for k, _ in kv]), jnp.stack([v for _, v in kv])

    def _block_hidden(self, x, positions, k_ctx, v_ctx, ctx_visible):
        """Block stream [B, G + 1, D] through every layer and the final norm -> [B, G + 1, D]."""
        rope = self._rope()
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, rope, k_ctx[i], v_ctx[i], ctx_visible)
        return self.norm(x)

    def block_tokens(self, anchor_tokens: jax.Array) -> jax.Array:
        """[...] last committed tokens -> [..., G + 1] block inputs [token, MASK, ..., MASK]."""
        anchor_tokens = jnp.asarray(anchor_tokens, jnp.int32)
        masks = jnp.full(anchor_tokens.shape + (self.cfg.block_size - 1,), self.cfg.mask_token_id, jnp.int32)
        return jnp.concatenate([anchor_tokens[..., None], masks], axis=-1)

    # ------------------------------------------------------------------ inference

    def project_context(self, features: jax.Array) -> jax.Array:
        """[B, T, F] concatenated target hidden states -> [B, T, D] = hidden_norm(fc(features))."""
        self._check_features(features)
        return self.hidden_norm(self.fc(features.astype(self.cfg.dtype)))

    def append_context(self, cache: DrafterCache, features: jax.Array, positions: jax.Array,
                       write_pos: jax.Array) -> DrafterCache:
        """Writes the context K/V of T new tokens at slots write_pos[b] + t of every layer.

        features [B, T, F]; positions [B, T] absolute positions (RoPE); write_pos [B] int.
        Writes past the cache capacity are dropped. T is static, so a caller with fewer real
        tokens in some rows pads them: padded entries land at slots >= that row's new ctx_len,
        where they are invisible and the next append overwrites them.
        """
        k, v = self._context_kv(self.project_context(features), jnp.asarray(positions, jnp.int32))
        t = features.shape[1]
        slots = jnp.asarray(write_pos, jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)  # [B, T]
        # Out-of-range slots become S, which mode="drop" ignores (a negative index would wrap).
        slots = jnp.where((slots >= 0) & (slots < cache.capacity), slots, cache.capacity)
        return DrafterCache(k=write_slots(cache.k, slots, k), v=write_slots(cache.v, slots, v))

    def hidden(self, target, block_tokens: jax.Array, positions: jax.Array, cache: DrafterCache,
               ctx_len: jax.Array) -> jax.Array:
        """[B, G, D] final-normed hidden states of block positions 1..G (see `__call__`)."""
        if block_tokens.shape[-1] != self.cfg.block_size:
            raise ValueError(f"block of {block_tokens.shape[-1]} tokens, expected block_size={self.cfg.block_size}")
        visible = jnp.arange(cache.capacity)[None, :] < jnp.asarray(ctx_len, jnp.int32)[:, None]  # [B, S]
        x = self._embed_block(target, block_tokens)
        h = self._block_hidden(x, jnp.asarray(positions, jnp.int32), cache.k, cache.v, visible)
        return h[:, 1:]

    def __call__(self, target, block_tokens: jax.Array, positions: jax.Array, cache: DrafterCache,
                 ctx_len: jax.Array, head: jax.Array | None = None) -> jax.Array:
        """Draft logits [B, G, Vd] float32 for block positions 1..G (over the draft vocabulary).

        block_tokens [B, G + 1] (normally `block_tokens(last_committed)`); positions [B, G + 1]
        (normally anchor + arange(block_size)); cache slots < ctx_len[b] are the visible context.
        Row j of the result is the drafter's distribution of the token at positions[:, j + 1].
        `head`: the pre-gathered `head_rows(target)` (same logits, no per-call gather).
        """
        return self.logits(target, self.hidden(target, block_tokens, positions, cache, ctx_len), head)

    # ------------------------------------------------------------------ training

    def train_hidden(self, target, features: jax.Array, tokens: jax.Array, anchors: jax.Array, *,
                     positions: jax.Array | None = None, context_mask: jax.Array | None = None,
                     anchor_chunk: int | None = None) -> jax.Array:
        """Block-parallel forward at M anchors per sequence -> [B, M, G, D] final hidden states.

        features [B, T, F]: target hidden states of the whole sequence; tokens [B, T];
        anchors [B, M] indices in [0, T). Anchor a's block is [tokens[a], MASK x G] at
        positions positions[a] + 0..G (positions default: arange(T)); it sees context indices
        < a (and where `context_mask` [B, T] is True) and its whole block. This is the
        inference computation at each anchor (`append_context` of the first a tokens, then
        `__call__` with ctx_len = a), run for all anchors against one shared context K/V.

        `anchor_chunk` bounds memory: anchors are processed `anchor_chunk` at a time (a
        `lax.map` over vmapped chunks); None processes all M at once.
        """
        self._check_features(features)
        b, t = tokens.shape
        m = anchors.shape[1]
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        positions = jnp.asarray(positions, jnp.int32)
        anchors = jnp.clip(jnp.asarray(anchors, jnp.int32), 0, t - 1)
        k_ctx, v_ctx = self._context_kv(self.project_context(features), positions)  # [L, B, K, T, Dh]
        anchor_tok = jnp.take_along_axis(jnp.asarray(tokens, jnp.int32), anchors, axis=1)  # [B, M]
        anchor_pos = jnp.take_along_axis(positions, anchors, axis=1)  # [B, M]
        blk_tok = self.block_tokens(anchor_tok)  # [B, M, G + 1]
        blk_pos = anchor_pos[..., None] + jnp.arange(self.cfg.block_size, dtype=jnp.int32)  # [B, M, G + 1]
        idx = jnp.arange(t, dtype=jnp.int32)

        def one_anchor(args):
            tok, pos, a = args  # [B, G + 1], [B, G + 1], [B]
            visible = idx[None, :] < a[:, None]
            if context_mask is not None:
                visible = visible & context_mask
            x = self._embed_block(target, tok)
            return self._block_hidden(x, pos, k_ctx, v_ctx, visible)[:, 1:]

        xs = (jnp.moveaxis(blk_tok, 1, 0), jnp.moveaxis(blk_pos, 1, 0), anchors.T)
        h = jax.lax.map(one_anchor, xs, batch_size=min(anchor_chunk or m, m))  # [M, B, G, D]
        return jnp.moveaxis(h, 0, 1)

    def train_logits(self, target, features: jax.Array, tokens: jax.Array, anchors: jax.Array, *,
                     positions: jax.Array | None = None, context_mask: jax.Array | None = None,
                     anchor_chunk: int | None = None) -> jax.Array:
        """`train_hidden` through the target's LM head -> [B, M, G, Vd] float32.

        Row k-1 of anchor a is the draft distribution of tokens[a + k] (the public training
        label). This materialises B*M*G*V floats; losses that only need a few logsumexps
        per row can apply the LM head to `train_hidden` in chunks instead.
        """
        h = self.train_hidden(target, features, tokens, anchors, positions=positions,
                              context_mask=context_mask, anchor_chunk=anchor_chunk)
        return self.logits(target, h)


def grow_drafter(drafter: DFlashDrafter, num_layers: int, *, rngs: nnx.Rngs) -> DFlashDrafter:
    """A copy of `drafter` with fresh layers appended up to `num_layers` that computes the same
    draft logits: each new layer's residual branches end in a zero matrix (`o_proj`, `down_proj`),
    so it starts as the identity and training grows it from there. This warm-starts a deeper
    drafter from a trained shallower one instead of from scratch; the gradient still reaches the
    new layers' other weights once their zero outputs have moved (Adam's first steps do that)."""
    old = drafter.cfg.num_layers
    if num_layers < old:
        raise ValueError(f"cannot grow a {old}-layer drafter to {num_layers} layers (only adding layers is supported)")
    cfg = dataclasses.replace(drafter.cfg, num_layers=num_layers)
    vocab = None if drafter.draft_vocab is None else np.asarray(jax.device_get(drafter.vocab_ids()))
    grown = DFlashDrafter(cfg, rngs=rngs, draft_vocab=vocab)
    for name in ("fc", "hidden_norm", "norm"):
        nnx.update(getattr(grown, name), nnx.state(getattr(drafter, name)))
    for i in range(old):
        nnx.update(grown.layers[i], nnx.state(drafter.layers[i]))
    for layer in list(grown.layers)[old:]:
        for kernel in (layer.self_attn.o_proj.kernel, layer.mlp.down_proj.kernel):
            kernel.set_value(jnp.zeros_like(kernel[...]))
    return grown
