"""Target-model configuration: one frozen dataclass for every target family (Llama to GPT-OSS and the
hybrid Qwen3-Next / Qwen3.5).

Variants are made with `dataclasses.replace`; `from_hf_config` / `to_hf_config` translate to and
from a Hugging Face `config.json` (both the legacy `rope_theta` + `rope_scaling` keys and the
transformers>=5 `rope_parameters` dict are read; the legacy form is written because every
published checkpoint and every transformers version understands it).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Mapping
from typing import Any

from tevjax.checks import is_real

__all__ = ["ModelConfig", "RopeScaling", "ROPE_TYPES", "PRESETS", "SUPPORTED_ARCHITECTURES", "read_config_json",
           "text_config", "yarn_mscale"]

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "mixtral",
                           "qwen3_moe", "qwen2_moe", "smollm3", "granite", "olmo2", "olmo3", "olmoe", "granitemoe",
                           "gpt_oss", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# Hybrid families: Gated DeltaNet linear layers beside gated full-attention layers (Qwen3-Next; Qwen3.5's
# text models, the same layers with q/k/v, z, b and a projected apart; Qwen3.5 dense or with experts).
HYBRID = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
GEMMA = ("gemma2", "gemma3_text")  # Gemma 2, and Gemma 3's text model (Gemma3ForCausalLM: the 1B model)
# Families that norm each branch's output and not its input (OLMo 2 and 3), with q/k norms over
# the whole projection rather than per head.
OLMO = ("olmo2", "olmo3")
# Families whose q/k norms run over the whole projection: OLMo's, and OLMoE's (whose branches norm
# their inputs, as Llama's do).
WHOLE_QK_NORM = (*OLMO, "olmoe")
# Families whose sliding layers rotate with a rope of their own (`ModelConfig.local_rope_theta`).
TWO_ROPES = ("gemma3_text", "olmo3")
# Mixture-of-experts families: Mistral's, Qwen3's, Qwen2's, OLMoE's, Granite's and GPT-OSS's attention
# with a routed MLP in every layer (Qwen2-MoE's with a shared expert beside the routed ones).
MOE = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "granitemoe", "gpt_oss", "qwen3_next", "qwen3_5_moe_text")
# Families with a shared expert beside the routed ones, gated by sigmoid(shared_expert_gate(x)).
SHARED_EXPERT = ("qwen2_moe", "qwen3_next", "qwen3_5_moe_text")
# Families that always renormalise the picked experts' weights (a softmax over the k highest logits).
_RENORMALISED = ("mixtral", "granitemoe", "gpt_oss", "qwen3_5_moe_text")
# Families with Granite's four scalar multipliers (`_GRANITE_FIELDS`).
GRANITE = ("granite", "granitemoe")
_DTYPES = ("float32", "bfloat16", "float16")
_HF_CLASS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
             "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
             "phi3": "Phi3ForCausalLM", "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
             "qwen2_moe": "Qwen2MoeForCausalLM",
             "smollm3": "SmolLM3ForCausalLM", "granite": "GraniteForCausalLM", "olmo2": "Olmo2ForCausalLM",
             "olmo3": "Olmo3ForCausalLM", "olmoe": "OlmoeForCausalLM",
             "granitemoe": "GraniteMoeForCausalLM", "gpt_oss": "GptOssForCausalLM",
             "qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
             "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}
_LINEAR_DIMS = ("linear_key_heads", "linear_value_heads", "linear_key_dim", "linear_value_dim", "linear_conv")
# The MLP activations: SiLU (every family but Gemma) and the tanh approximation of GELU (Gemma's
# "gelu_pytorch_tanh", which transformers also calls "gelu_new" / "gelu_fast" up to rounding: only
# the exact name is accepted).
HIDDEN_ACTS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


def read_config_json(config: Mapping[str, Any] | str | os.PathLike, *, what: str) -> tuple[dict, str]:
    """A config as a dict, from a dict, a `config.json` path or a checkpoint directory.

    Returns `(config, source)`, where `source` names the file (for error messages).
    """
    if isinstance(config, Mapping):
        return dict(config), f"{what} dict"
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{what} file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            loaded = json.load(f)
    except UnicodeDecodeError as e:
        line = e.object.count(b"\n", 0, e.start) + 1
        raise ValueError(f"{path} is not UTF-8 text: byte 0x{e.object[e.start]:02x} at line {line}, "
                         f"offset {e.start} ({e.reason})") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(loaded, Mapping):
        raise ValueError(f"{path} must hold a JSON object, got {type(loaded).__name__}")
    return dict(loaded), path


_MISSING = object()
_KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false"}


def config_field(c: Mapping[str, Any], key: str, kind: type, source: str, default: Any = _MISSING, *,
                 positive: bool = False, prefix: str = "") -> Any:
    """`c[key]` checked to be of `kind` (int, float or bool); absent or null gives `default`.

    Errors are one line naming the file (`source`) and the field (`prefix` + `key`), e.g.
    `config.json: field 'hidden_size' must be an integer, got 'sixty-four'`. An int field also
    takes an integral float (64.0); JSON booleans are never numbers.
    """
    value = c.get(key)
    if value is None:
        if default is _MISSING:
            raise ValueError(f"{source}: required field {prefix + key!r} is missing")
        return default
    if kind is bool:
        ok = isinstance(value, bool)
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        ok = False
    else:
        ok = kind is float or isinstance(value, int) or float(value).is_integer()
    if not ok:
        raise ValueError(f"{source}: field {prefix + key!r} must be {_KIND_NAMES[kind]}, got {value!r}")
    value = kind(value)
    if positive and not value > 0:
        raise ValueError(f"{source}: field {prefix + key!r} must be positive, got {value!r}")
    if positive and not math.isfinite(value):  # JSON's NaN / Infinity: a NaN rope base gave NaN logits
        raise ValueError(f"{source}: field {prefix + key!r} must be finite, got {value!r}")
    return value


def token_ids(c: Mapping[str, Any], key: str, source: str) -> tuple[int, ...]:
    """An HF token-id field that may be null, one id or a list of ids."""
    value = c.get(key)
    items = value if isinstance(value, (list, tuple)) else ([] if value is None else [value])
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise ValueError(f"{source}: field {key!r} must be a token id >= 0 or a list of them, "
                             f"got {value!r}")
    return tuple(items)


def with_overrides(cls, fields: dict[str, Any], overrides: Mapping[str, Any]):
    """`cls(**fields)` with `overrides` replacing translated fields; unknown names are an error."""
    unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise TypeError(f"from_hf_config: unknown override(s) {sorted(unknown)}")
    return cls(**{**fields, **overrides})


ROPE_TYPES = ("llama3", "linear", "yarn")
# The fields each scaling reads beyond `factor` (HF `rope_scaling` key names); the rest stay None.
_ROPE_FIELDS = {
    "llama3": ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "linear": (),
    "yarn": ("original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "truncate"),
}


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term, 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE scaling for contexts longer than pretraining's, as HF's `rope_scaling` names it.

    - `"llama3"` (Llama 3.1 onwards, the default type): keeps high frequencies, divides low ones by
      `factor` and blends in between (`low_freq_factor`, `high_freq_factor`,
      `original_max_position_embeddings`).
    - `"linear"` (position interpolation): every frequency divided by `factor`.
    - `"yarn"` (Qwen2.5 / Qwen3 long context): frequencies blended between divided and kept along
      a ramp set by `beta_fast` and `beta_slow` (default 32 and 1) over the original context, and q
      and k each scaled by `attention_factor` (default `yarn_mscale(factor)`); `truncate` (default
      true) rounds the ramp's ends to whole dimensions, as transformers and llama.cpp do.

    Fields another type does not read must stay None, so two configs that rotate alike compare equal.
    """

    factor: float
    rope_type: str = "llama3"
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float | None = None
    truncate: bool | None = None

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"RopeScaling.rope_type={self.rope_type!r} is not supported; "
                             f"supported: {', '.join(ROPE_TYPES)}")
        wanted = _ROPE_FIELDS[self.rope_type]
        stray = [f.name for f in dataclasses.fields(self)
                 if f.name not in ("factor", "rope_type", *wanted) and getattr(self, f.name) is not None]
        if stray:
            raise ValueError(f"RopeScaling: rope_type {self.rope_type!r} has no {', '.join(stray)}")
        if self.rope_type == "yarn":
            defaults = dict(beta_fast=32.0, beta_slow=1.0, truncate=True,
                            attention_factor=yarn_mscale(float(self.factor)))
            for name, value in defaults.items():
                if getattr(self, name) is None:
                    object.__setattr__(self, name, value)
        for name in ("factor", *wanted):
            value = getattr(self, name)
            if name == "truncate":
                if not isinstance(value, bool):
                    raise ValueError(f"RopeScaling.truncate must be true or false, got {value!r}")
                continue
            kind = int if name == "original_max_position_embeddings" else (int, float)
            if value is None:
                raise ValueError(f"RopeScaling: rope_type {self.rope_type!r} needs {name}")
            if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
                raise ValueError(f"RopeScaling.{name} must be a positive "
                                 f"{'int' if kind is int else 'number'}, got {value!r}")
        if self.rope_type == "llama3" and not self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"RopeScaling: low_freq_factor={self.low_freq_factor} must be below "
                             f"high_freq_factor={self.high_freq_factor}")

    def to_hf(self) -> dict[str, Any]:
        """The HF `rope_scaling` dict (`from_hf_config` reads it back to this value)."""
        return {"rope_type": self.rope_type, "factor": self.factor,
                **{name: getattr(self, name) for name in _ROPE_FIELDS[self.rope_type]}}

    @classmethod
    def from_hf(cls, src: Mapping[str, Any], *, source: str, prefix: str,
                max_position_embeddings: int) -> "RopeScaling | None":
        """Reads an HF scaling dict (`rope_scaling`, or transformers 5's `rope_parameters`); None
        for the default type. Defaults follow transformers: a YaRN original context defaults to
        `max_position_embeddings`, a missing YaRN factor to the ratio of the two, and YaRN's
        attention factor to mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are
        given."""
        rope_type = src.get("rope_type", src.get("type", "default"))
        if rope_type == "default":
            return None
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"{source}: rope_type {rope_type!r} is not supported "
                             f"(only 'default', {', '.join(repr(t) for t in ROPE_TYPES)})")

        def get(key, kind, default=_MISSING):
            return config_field(src, key, kind, source, default, positive=kind is not bool, prefix=prefix)

        fields: dict[str, Any] = {}
        if rope_type == "llama3":
            fields = {k: get(k, int if k.startswith("original") else float) for k in _ROPE_FIELDS["llama3"]}
        elif rope_type == "yarn":
            original = get("original_max_position_embeddings", int, max_position_embeddings)
            factor = get("factor", float, max_position_embeddings / original)
            # 0 is allowed and means "unset", as in transformers
            mscale, mscale_all = (config_field(src, key, float, source, 0.0, prefix=prefix)
                                  for key in ("mscale", "mscale_all_dim"))
            attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
                         if mscale and mscale_all else None)
            fields = dict(factor=factor, original_max_position_embeddings=original,
                          beta_fast=get("beta_fast", float, None), beta_slow=get("beta_slow", float, None),
                          attention_factor=get("attention_factor", float, attention),
                          truncate=get("truncate", bool, None))
        if "factor" not in fields:  # not setdefault, which would read (and require) a YaRN factor first
            fields["factor"] = get("factor", float)
        try:
            return cls(rope_type=rope_type, **fields)
        except ValueError as e:
            raise ValueError(f"{source}: {prefix.rstrip('.')}: {e}") from e


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Static shape and numerics of a decoder-only target model.

    `dtype` is the compute dtype (activations, KV cache); `param_dtype` the storage dtype of the
    weights. Norm statistics, softmax and logits are always computed in float32; float32 compute
    uses true float32 matmuls on every backend (no TF32 on GPUs: `layers.matmul_precision`).
    """

    # "llama" | "mistral" | "qwen2" | "qwen3" | "gemma2" | "gemma3_text" | "phi3" | "mixtral" | "qwen3_moe" |
    # "smollm3" | "granite" | "olmo2": one decoder; the fields below differ (Phi-3 is Llama's layers
    # with fused q/k/v and gate/up weights, a checkpoint matter; Mixtral and Qwen3-MoE are Mistral's
    # and Qwen3's with experts; SmolLM3 is Llama's with layers that attend without rotary embedding;
    # Granite Llama's with four scalar multipliers; OLMo 2 norms branch outputs, not inputs; OLMo 3
    # adds windows in three layers of four, with a rope of their own; OLMoE is Llama's layers with
    # OLMo's q/k norms over each whole projection and routed experts; Granite MoE Granite's with them;
    # GPT-OSS has attention sinks, biased experts with a clipped gate, and windows in every other layer;
    # "qwen3_next", "qwen3_5_text" and "qwen3_5_moe_text" are hybrids: Gated DeltaNet linear layers
    # (`linear_layers`) beside gated attention with a partial rope, Qwen3.5 dense or with experts)
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool
    qk_norm: bool  # RMSNorm on q and k before RoPE: per head (Qwen3, Gemma 3), or over each projection (OLMo)
    attention_bias: bool = False  # biases on the q, k, v and o projections (Llama's `attention_bias`)
    qkv_bias: bool = False  # biases on q, k and v only (Qwen2); implied by attention_bias
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    dtype: str = "float32"
    param_dtype: str = "float32"
    # Sliding-window attention (Mistral-7B-v0.1 and its fine-tunes; Qwen2/Qwen3 with
    # use_sliding_window; Gemma's local layers): in the layers `sliding_layers`, the token at position p attends only to
    # positions p - sliding_window + 1 .. p, transformers' `kv_idx > q_idx - sliding_window`.
    # None: every layer attends to the whole prefix. The cache still keeps every slot: a window
    # changes what a layer reads, not what the cache holds.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    # Gemma 2 and 3 (architectures in GEMMA only). Besides these fields they imply, as the
    # properties below say: norms that scale by 1 + weight, embeddings times sqrt(hidden_size), and
    # norms on the attention and MLP outputs before they join the residual stream.
    hidden_act: str = "silu"  # "silu" | "gelu_tanh"
    query_pre_attn_scalar: float | None = None  # scores scale by its -1/2 power (default head_dim's)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap), before the mask
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    # Gemma 3 and OLMo 3: the rope base of the sliding layers (unscaled); rope_theta and
    # rope_scaling are the full-attention layers'. None: every layer rotates alike.
    local_rope_theta: float | None = None
    # Mixture of experts (architectures in MOE only): each layer's MLP is `num_experts` gated MLPs
    # of width intermediate_size, of which a router picks `experts_per_token` per token and mixes
    # their outputs by its softmax probabilities, renormalised over the picked ones when
    # `norm_topk_prob` (always for Mixtral; Qwen3-MoE's config says). 0: a dense MLP.
    num_experts: int = 0
    experts_per_token: int = 0
    norm_topk_prob: bool = True
    # Qwen2-MoE: the width of a shared expert that every token runs besides the routed ones, its
    # output scaled by sigmoid(shared_expert_gate(x)); 0: none.
    shared_expert_size: int = 0
    # SmolLM3: the layers whose queries and keys are not rotated (NoPE; every fourth layer in
    # SmolLM3-3B), transformers' `no_rope_layers` entries that are 0.
    nope_layers: tuple[int, ...] = ()
    # Granite (IBM Granite 3.x): embeddings times embedding_multiplier, attention scores scaled by
    # attention_multiplier (instead of head_dim ** -0.5), each branch's output times
    # residual_multiplier before the residual adds it, and logits divided by logits_scaling.
    # None: the factor is not there (1, or head_dim ** -0.5 for the scores).
    embedding_multiplier: float | None = None
    attention_multiplier: float | None = None
    residual_multiplier: float | None = None
    logits_scaling: float | None = None
    # GPT-OSS: its experts' gate is clipped at swiglu_limit (up to [-limit, limit]) and gates by
    # g * sigmoid(swiglu_alpha * g). Beside these fields it implies, as properties say, attention
    # sinks and biases on the router and the experts. None: not GPT-OSS.
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None
    # Qwen3-Next: the layers in `linear_layers` (three of every four) mix tokens with Gated DeltaNet
    # linear attention (`tevjax.models.linear_attention`): linear_key_heads query/key heads of width
    # linear_key_dim, linear_value_heads value heads of width linear_value_dim, and a causal depthwise
    # convolution linear_conv tokens wide over their inputs. Its other layers are full attention with
    # a sigmoid gate on each head's output. Empty: every layer is attention.
    linear_layers: tuple[int, ...] = ()
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv: int = 0
    # The leading width of each head that RoPE rotates (Qwen3-Next: a quarter); None: all of it.
    rotary_dim: int | None = None

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"ModelConfig.architecture={self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention)"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even for RoPE")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(
                    f"ModelConfig.{name}={getattr(self, name)!r} is not one of {', '.join(_DTYPES)}"
                )
        # Tuples keep the config hashable (it is a static argument of jitted functions).
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        if not (math.isfinite(float(self.rms_norm_eps)) and float(self.rms_norm_eps) >= 0):
            raise ValueError(f"ModelConfig.rms_norm_eps must be a finite number >= 0, got {self.rms_norm_eps!r}")
        theta = self.rope_theta  # NaN, 0 or a negative base would give NaN rotations, hence NaN logits
        if not is_real(theta) or not (math.isfinite(theta) and theta > 0):
            raise ValueError(f"ModelConfig.rope_theta must be a finite number > 0, got {theta!r}")
        object.__setattr__(self, "sliding_layers", tuple(int(i) for i in self.sliding_layers))
        object.__setattr__(self, "nope_layers", tuple(int(i) for i in self.nope_layers))
        nope = self.nope_layers
        if sorted(set(nope)) != list(nope) or not all(0 <= i < self.num_layers for i in nope):
            raise ValueError(f"ModelConfig.nope_layers={nope} must be increasing layer indices in "
                             f"[0, {self.num_layers})")
        if nope and self.architecture != "smollm3":
            raise ValueError(f"ModelConfig.nope_layers={nope}: layers without rotary embedding are SmolLM3's, "
                             f"not architecture {self.architecture!r}'s")
        window, layers = self.sliding_window, self.sliding_layers
        if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
            raise ValueError(f"ModelConfig.sliding_window must be a positive int or None, got {window!r}")
        if (window is None) != (not layers):
            raise ValueError(f"ModelConfig.sliding_layers={layers} needs a sliding_window and the other way "
                             f"round (sliding_window={window!r})")
        if sorted(set(layers)) != list(layers) or not all(0 <= i < self.num_layers for i in layers):
            raise ValueError(f"ModelConfig.sliding_layers={layers} must be increasing layer indices in "
                             f"[0, {self.num_layers})")
        if layers and self.architecture in _NO_WINDOW:
            raise ValueError(f"ModelConfig: architecture {self.architecture!r} has no sliding window (its "
                             f"checkpoints attend fully); use 'mistral', 'qwen2', 'qwen3' or a Gemma")
        if self.architecture in _WINDOW_EVERYWHERE and layers and len(layers) != self.num_layers:
            raise ValueError(f"ModelConfig: a {self.architecture} window applies to every layer, got "
                             f"sliding_layers={layers} of {self.num_layers}")
        if self.architecture == "phi3" and (self.qkv_biased or self.qk_norm):
            raise ValueError("ModelConfig: architecture 'phi3' has no attention biases and no q/k norms")
        granite = [f"{n}={getattr(self, n)!r}" for n in _GRANITE_FIELDS if getattr(self, n) is not None]
        if granite and self.architecture not in GRANITE:
            raise ValueError(f"ModelConfig: {', '.join(granite)} is Granite's, not architecture "
                             f"{self.architecture!r}'s")
        if self.architecture in GRANITE:
            if self.qkv_bias or self.qk_norm:
                raise ValueError(f"ModelConfig: architecture {self.architecture!r} has no q/k/v-only biases and no "
                                 "q/k norms")
            # One form per model, so that configs compare equal however they were written: a factor
            # of 1 is no factor, and scores without a multiplier are scaled by head_dim ** -0.5.
            for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
                if getattr(self, name) == 1.0:
                    object.__setattr__(self, name, None)
            if self.attention_multiplier is None:
                object.__setattr__(self, "attention_multiplier", self.head_dim ** -0.5)
        if self.architecture in WHOLE_QK_NORM and (self.qkv_bias or not self.qk_norm):
            raise ValueError(f"ModelConfig: architecture {self.architecture!r} has q/k norms (qk_norm=True) and no "
                             f"q/k/v-only biases")
        if self.architecture == "smollm3" and (self.qkv_bias or self.qk_norm):
            raise ValueError("ModelConfig: architecture 'smollm3' has no q/k/v-only biases and no q/k norms")
        if self.hidden_act not in HIDDEN_ACTS.values():
            raise ValueError(f"ModelConfig.hidden_act={self.hidden_act!r} is not one of "
                             f"{', '.join(HIDDEN_ACTS.values())}")
        swiglu = (self.swiglu_limit, self.swiglu_alpha)
        if (None in swiglu) if self.architecture == "gpt_oss" else (swiglu != (None, None)):  # both, or neither
            raise ValueError(f"ModelConfig: swiglu_limit={self.swiglu_limit!r}, swiglu_alpha={self.swiglu_alpha!r}: "
                             f"GPT-OSS has both, and no other architecture either, not {self.architecture!r}")
        for name in ("query_pre_attn_scalar", "attn_softcap", "final_softcap", "local_rope_theta", *_GRANITE_FIELDS,
                     "swiglu_limit", "swiglu_alpha"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                          and math.isfinite(value) and value > 0):
                raise ValueError(f"ModelConfig.{name} must be a positive number or None, got {value!r}")
        if self.architecture not in GEMMA:
            own = {"hidden_act": "silu", "query_pre_attn_scalar": None, "attn_softcap": None, "final_softcap": None}
            if self.architecture not in TWO_ROPES:  # OLMo 3 has a second rope too
                own["local_rope_theta"] = None
            gemma = [f"{n}={getattr(self, n)!r}" for n, default in own.items() if getattr(self, n) != default]
            if gemma:
                raise ValueError(f"ModelConfig: {', '.join(gemma)} is Gemma's, not architecture "
                                 f"{self.architecture!r}'s (transformers would read the saved config without it)")
        elif self.qkv_bias or self.attention_bias:
            raise ValueError(f"ModelConfig: architecture {self.architecture!r} has no attention biases")
        elif self.qk_norm != (self.architecture == "gemma3_text"):
            raise ValueError(f"ModelConfig: qk_norm={self.qk_norm} does not fit architecture {self.architecture!r} "
                             f"(Gemma 3 has q/k norms, Gemma 2 none)")
        elif self.local_rope_theta is not None and self.architecture != "gemma3_text":
            raise ValueError(f"ModelConfig.local_rope_theta is Gemma 3's, not {self.architecture!r}'s")
        self._check_experts()
        self._check_linear()

    def _check_linear(self) -> None:
        object.__setattr__(self, "linear_layers", tuple(int(i) for i in self.linear_layers))
        layers, rd = self.linear_layers, self.rotary_dim
        if rd is not None and (not isinstance(rd, int) or isinstance(rd, bool) or rd <= 0 or rd % 2
                               or rd > self.head_dim):
            raise ValueError(f"ModelConfig.rotary_dim={rd!r} must be an even int in [2, head_dim={self.head_dim}]")
        if rd == self.head_dim:
            object.__setattr__(self, "rotary_dim", None)  # one form: the whole head
        dims = {n: getattr(self, n) for n in _LINEAR_DIMS}
        if self.architecture not in HYBRID:
            own = [f"{n}={v!r}" for n, v in (("linear_layers", layers), ("rotary_dim", self.rotary_dim), *dims.items())
                   if v not in ((), None, 0)]
            if own:
                raise ValueError(f"ModelConfig: {', '.join(own)} is Qwen3-Next's and Qwen3.5's, not architecture "
                                 f"{self.architecture!r}'s")
            return
        if sorted(set(layers)) != list(layers) or not all(0 <= i < self.num_layers for i in layers):
            raise ValueError(f"ModelConfig.linear_layers={layers} must be increasing layer indices in "
                             f"[0, {self.num_layers})")
        if len(layers) == self.num_layers:
            raise ValueError("ModelConfig.linear_layers: at least one layer must be full attention")
        if not self.qk_norm or self.qkv_biased:
            raise ValueError(f"ModelConfig: architecture {self.architecture!r} has per-head q/k norms and no attention "
                             f"biases")
        if not layers:
            return
        for name, value in dims.items():
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int with linear_layers, got {value!r}")
        if self.linear_value_heads % self.linear_key_heads:
            raise ValueError(f"ModelConfig.linear_value_heads={self.linear_value_heads} must be a multiple of "
                             f"linear_key_heads={self.linear_key_heads}")
        if self.linear_conv < 2:
            raise ValueError(f"ModelConfig.linear_conv={self.linear_conv} must be at least 2")

    @property
    def layer_period(self) -> tuple[str, ...]:
        """The shortest run of layer kinds ("attention" or "linear") that repeats through the model:
        the layer scan steps over whole periods (Qwen3-Next: three linear layers, then attention)."""
        kinds = ["linear" if i in self.linear_layers else "attention" for i in range(self.num_layers)]
        for p in range(1, self.num_layers + 1):
            if self.num_layers % p == 0 and kinds == kinds[:p] * (self.num_layers // p):
                return tuple(kinds[:p])
        raise AssertionError("unreachable: the whole model is a period")

    @property
    def num_attention_layers(self) -> int:
        """Layers with a key/value cache (all but the linear ones)."""
        return self.num_layers - len(self.linear_layers)

    @property
    def attn_output_gate(self) -> bool:
        """Whether each attention head's output is multiplied by sigmoid of a gate that q_proj
        computes beside the query (Qwen3-Next: q_proj is [D, H * 2 * Dh], query and gate per head)."""
        return self.architecture in HYBRID

    @property
    def linear_conv_channels(self) -> int:
        """The linear layers' convolved channels: queries, keys and values (C)."""
        return 2 * self.linear_key_heads * self.linear_key_dim + self.linear_value_heads * self.linear_value_dim

    def _check_experts(self) -> None:
        e, k = self.num_experts, self.experts_per_token
        if self.architecture not in MOE:
            if e or k:
                raise ValueError(f"ModelConfig: num_experts={e}, experts_per_token={k} need a mixture-of-experts "
                                 f"architecture ({', '.join(MOE)}), not {self.architecture!r}")
            return
        for name, value in (("num_experts", e), ("experts_per_token", k)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int for architecture "
                                 f"{self.architecture!r}, got {value!r}")
        if k > e:
            raise ValueError(f"ModelConfig.experts_per_token={k} is more than num_experts={e}")
        name = _NAMES.get(self.architecture, self.architecture)
        if self.architecture in _RENORMALISED and not self.norm_topk_prob:
            raise ValueError(f"ModelConfig: {name} always renormalises its picked experts' weights "
                             "(norm_topk_prob=False is Qwen3-MoE's option)")
        if self.architecture in _HEADS_FROM_HIDDEN and self.num_heads * self.head_dim != self.hidden_size:
            raise ValueError(f"ModelConfig: {name}'s heads are hidden_size / num_heads wide (its config has no "
                             f"head_dim), got head_dim={self.head_dim}")
        if self.architecture == "mixtral" and (self.qkv_biased or self.qk_norm):
            raise ValueError("ModelConfig: architecture 'mixtral' has no attention biases and no q/k norms")
        if self.architecture == "qwen3_moe" and not self.qk_norm:
            raise ValueError("ModelConfig: architecture 'qwen3_moe' has q/k norms (qk_norm=True)")
        if self.architecture == "qwen2_moe" and (self.qk_norm or self.attention_bias):
            raise ValueError("ModelConfig: architecture 'qwen2_moe' has no q/k norms and no o_proj bias")
        shared = self.shared_expert_size
        if not isinstance(shared, int) or isinstance(shared, bool) or shared < 0:
            raise ValueError(f"ModelConfig.shared_expert_size must be an int >= 0, got {shared!r}")
        if shared and self.architecture not in SHARED_EXPERT:
            raise ValueError(f"ModelConfig.shared_expert_size={shared}: a shared expert is Qwen2-MoE's and "
                             f"Qwen3-Next's, not "
                             f"architecture {self.architecture!r}'s")

    @property
    def norm_offset(self) -> float:
        """What every RMSNorm adds to its weight before scaling: 1 for Gemma and Qwen3-Next (zero-centred
        weights)."""
        return 1.0 if self.architecture in (*GEMMA, *HYBRID) else 0.0

    @property
    def embed_scale(self) -> float | None:
        """What embeddings are multiplied by (Gemma: sqrt(hidden_size), rounded to the weights'
        dtype as transformers rounds it; Granite: embedding_multiplier); None: nothing."""
        return self.hidden_size ** 0.5 if self.architecture in GEMMA else self.embedding_multiplier

    @property
    def embed_scale_dtype(self) -> str:
        """The dtype `embed_scale` is rounded to before it multiplies: the weights' for Gemma (a
        tensor of that dtype in transformers), float32 for Granite's (a Python float there)."""
        return self.param_dtype if self.architecture in GEMMA else "float32"

    @property
    def input_norms(self) -> bool:
        """Whether each branch norms its input (every family but OLMo, which norms only outputs)."""
        return self.architecture not in OLMO

    @property
    def attention_sinks(self) -> bool:
        """Whether each head's softmax has a learned sink logit in its denominator (GPT-OSS)."""
        return self.architecture == "gpt_oss"

    @property
    def expert_bias(self) -> bool:
        """Whether the router and the experts' projections have biases (GPT-OSS)."""
        return self.architecture == "gpt_oss"

    @property
    def qk_norm_whole(self) -> bool:
        """Whether the q/k norms run over the whole projection (OLMo, OLMoE: H * Dh and K * Dh wide)
        rather than over each head's Dh."""
        return self.qk_norm and self.architecture in WHOLE_QK_NORM

    @property
    def output_norms(self) -> bool:
        """Whether the attention and MLP outputs are normed before the residual adds them (Gemma,
        OLMo)."""
        return self.architecture in GEMMA + OLMO

    @property
    def attention_scale(self) -> float:
        """The factor on q . k: Granite's attention_multiplier, query_pre_attn_scalar ** -0.5 (Gemma),
        or head_dim ** -0.5."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """Each layer's window, 0 for full attention (the per-layer input of the layer scan)."""
        return tuple(self.sliding_window if i in self.sliding_layers else 0 for i in range(self.num_layers))

    @property
    def layer_types(self) -> list[str]:
        """transformers' `layer_types`: "sliding_attention", "full_attention" or (Qwen3-Next)
        "linear_attention" per layer."""
        return ["linear_attention" if i in self.linear_layers else "sliding_attention" if w else "full_attention"
                for i, w in enumerate(self.layer_windows)]

    @property
    def moe(self) -> bool:
        """Whether each layer's MLP is a routed mixture of experts."""
        return self.num_experts > 0

    @property
    def qkv_biased(self) -> bool:
        """Whether the q, k and v projections have biases."""
        return self.attention_bias or self.qkv_bias

    @property
    def num_params(self) -> int:
        """Parameter count implied by the shapes (embedding counted once when tied)."""
        return self._count(self.num_experts)

    @property
    def num_active_params(self) -> int:
        """Parameters one token's forward pass reads: with experts, the router's and only the
        picked experts' (Mixtral-8x7B: 12.9B of 46.7B); otherwise `num_params`."""
        return self._count(self.experts_per_token)

    def _count(self, experts: int) -> int:
        d, h, k, dh, f = (self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim,
                          self.intermediate_size)
        attn = d * h * dh + 2 * d * k * dh + h * dh * d
        if self.qkv_biased:
            attn += h * dh + 2 * k * dh
        if self.attention_bias:
            attn += d
        if self.qk_norm:
            attn += (h + k) * dh if self.qk_norm_whole else 2 * dh
        mlp = 3 * d * f if not self.moe else experts * 3 * d * f + self.num_experts * d  # experts, router rows
        if self.shared_expert_size:  # Qwen2-MoE's shared expert and its gate
            mlp += 3 * d * self.shared_expert_size + d
        if self.expert_bias:  # GPT-OSS: the router's bias, each expert's three biases; the sinks
            mlp += self.num_experts + experts * (2 * f + d)
            attn += h
        if self.attn_output_gate:  # q_proj also computes each head's gate
            attn += d * h * dh
        norms = (2 * self.input_norms + 2 * self.output_norms) * d
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        n_lin = len(self.linear_layers)
        # A linear layer: q/k/v, z, b and a projections; the conv; dt_bias and A_log; the gated norm; out.
        hv, vd, c = self.linear_value_heads, self.linear_value_dim, self.linear_conv_channels
        lin = d * (c + hv * vd + 2 * hv) + c * self.linear_conv + 2 * hv + vd + hv * vd * d
        return (self.num_layers - n_lin) * attn + n_lin * lin + self.num_layers * (mlp + norms) + embed + d

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any] | str | os.PathLike, **overrides) -> "ModelConfig":
        """Builds a config from an HF config dict, a `config.json` path or a checkpoint directory.

        `overrides` replace fields after translation (e.g. `dtype="bfloat16"`). Features this
        model does not implement (MLP biases, other RoPE types, non-SiLU MLPs, attention kinds
        besides full and sliding-window) raise `ValueError` rather than producing a silently
        different model.
        """
        c, source = read_config_json(config, what="HF config")
        c = text_config(c, source)
        model_type = c.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{source}: model_type {model_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def field(key, kind, default=_MISSING, **kw):
            return config_field(c, key, kind, source, default, **kw)

        gemma = model_type in GEMMA
        act_key = "hidden_activation" if gemma else "hidden_act"
        act = c.get(act_key) or ("gelu_pytorch_tanh" if gemma else "silu")
        if act not in HIDDEN_ACTS or (act == "silu") == gemma:
            raise ValueError(f"{source}: {act_key}={act!r} is not supported (only "
                             f"{'gelu_pytorch_tanh' if gemma else 'silu'})")
        if gemma and c.get("use_bidirectional_attention"):
            raise ValueError(f"{source}: use_bidirectional_attention=true is not supported (a decoder attends "
                             f"causally)")
        local_theta = None
        if model_type in TWO_ROPES:
            c, local_theta = _two_ropes(c, model_type, source)
        if c.get("mlp_bias", False):
            raise ValueError(f"{source}: mlp_bias=True is not supported")
        if model_type == "phi3":
            _check_phi3_rope(c, source)
        family = _experts(c, model_type, source) if model_type in MOE else {}  # the family's own fields
        if model_type == "smollm3":
            family["nope_layers"] = _nope_layers(c, source)
        if model_type in HYBRID:
            family.update(_linear_layers(c, source))
        if model_type == "gpt_oss":  # GptOssConfig's defaults
            family.update(swiglu_limit=field("swiglu_limit", float, 7.0, positive=True),
                          swiglu_alpha=field("swiglu_alpha", float, 1.702, positive=True))
        if model_type in GRANITE:  # GraniteConfig's defaults (1.0) where a key is absent
            family.update({k: field(k, float, 1.0, positive=True) for k in _GRANITE_FIELDS})
        # Qwen3-Next's layer_types name linear and full attention layers (`_linear_layers`), no windows.
        window, sliding_layers = (None, ()) if model_type in HYBRID else _sliding_window(c, model_type, source)
        if c.get("pretraining_tp", 1) not in (1, None):
            raise ValueError(f"{source}: pretraining_tp={c['pretraining_tp']} is not supported")

        # transformers>=5 nests theta and scaling into `rope_parameters`; older files use
        # top-level `rope_theta` and `rope_scaling`. Read whichever is present.
        for key in ("rope_parameters", "rope_scaling"):
            if c.get(key) is not None and not isinstance(c[key], Mapping):
                raise ValueError(f"{source}: field {key!r} must be an object, got {c[key]!r}")
        rope = dict(c.get("rope_parameters") or {})
        scaling_key = "rope_scaling" if c.get("rope_scaling") else "rope_parameters"
        scaling_src = c.get("rope_scaling") or rope
        default = functools.partial(_family_default, model_type)
        if c.get("rope_theta") is not None:
            theta = field("rope_theta", float, positive=True)
        else:
            theta = config_field(rope, "rope_theta", float, source, default("rope_theta"), positive=True,
                                 prefix="rope_parameters.")
        max_positions = field("max_position_embeddings", int, default("max_position_embeddings"), positive=True)
        scaling = (RopeScaling.from_hf(scaling_src, source=source, prefix=f"{scaling_key}.",
                                       max_position_embeddings=max_positions) if scaling_src else None)

        heads = field("num_attention_heads", int, positive=True)
        hidden = field("hidden_size", int, positive=True)
        bos = token_ids(c, "bos_token_id", source)
        if len(bos) > 1:
            raise ValueError(f"{source}: field 'bos_token_id' must be one token id, got {c['bos_token_id']!r}")
        hf_dtype = c.get("torch_dtype") or c.get("dtype")
        dtype = hf_dtype if hf_dtype in _DTYPES else "float32"
        fields = dict(
            architecture=model_type,
            vocab_size=field("vocab_size", int, positive=True),
            hidden_size=hidden,
            # Qwen3-MoE's experts are moe_intermediate_size wide (its intermediate_size is for dense
            # layers, which tevjax refuses); Mixtral's are intermediate_size wide.
            intermediate_size=field("moe_intermediate_size" if model_type in ("qwen3_moe", "qwen2_moe", "qwen3_next",
                                                                              "qwen3_5_moe_text")
                                    else "intermediate_size", int, positive=True),
            num_layers=field("num_hidden_layers", int, positive=True),
            num_heads=heads,
            # null or 0 mean "no grouping" / "derive it", as in transformers
            num_kv_heads=field("num_key_value_heads", int, 0) or heads,
            head_dim=field("head_dim", int, 0) or hidden // heads,
            rms_norm_eps=field("rms_norm_eps", float, default("rms_norm_eps")),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=field("tie_word_embeddings", bool, default("tie_word_embeddings")),
            qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe", *HYBRID, *WHOLE_QK_NORM),
            # Qwen2 has q/k/v biases and no o bias, always; its config has no key for them.
            # Qwen2-MoE's say so in qkv_bias (default true).
            attention_bias=False if model_type in ("qwen2", "qwen2_moe") else field("attention_bias", bool,
                                                                                   model_type == "gpt_oss"),
            qkv_bias=model_type == "qwen2" or (model_type == "qwen2_moe" and field("qkv_bias", bool, True)),
            max_position_embeddings=max_positions,
            eos_token_ids=token_ids(c, "eos_token_id", source),
            bos_token_id=bos[0] if bos else None,
            dtype=dtype,
            param_dtype=dtype,
            sliding_window=window,
            sliding_layers=sliding_layers,
            **family,
        )
        if model_type == "olmo3":
            fields["local_rope_theta"] = local_theta
        if model_type in HYBRID:  # Qwen3NextConfig's and Qwen3_5TextConfig's default head width
            fields["head_dim"] = field("head_dim", int, 256, positive=True)
        if gemma:  # transformers' Gemma2Config / Gemma3TextConfig defaults where a key is absent
            caps = (50.0, 30.0) if model_type == "gemma2" else (None, None)

            def cap(key, default):  # null: no cap (absent: the default)
                return None if key in c and c[key] is None else field(key, float, default, positive=True)

            fields.update(
                hidden_act=HIDDEN_ACTS[act],
                head_dim=field("head_dim", int, 256, positive=True),
                query_pre_attn_scalar=field("query_pre_attn_scalar", float, 256.0, positive=True),
                attn_softcap=cap("attn_logit_softcapping", caps[0]),
                final_softcap=cap("final_logit_softcapping", caps[1]),
                local_rope_theta=local_theta,
            )
        try:
            return with_overrides(cls, fields, overrides)
        except ValueError as e:  # cross-field checks (e.g. heads vs KV heads): name the file
            raise ValueError(f"{source}: {e}") from e

    def to_hf_config(self) -> dict[str, Any]:
        """An HF `config.json` dict that `from_hf_config` maps back to this config (and that
        transformers can build the matching `*ForCausalLM` from)."""
        eos: Any = None
        if len(self.eos_token_ids) == 1:
            eos = self.eos_token_ids[0]
        elif self.eos_token_ids:
            eos = list(self.eos_token_ids)
        out: dict[str, Any] = {
            "architectures": [_HF_CLASS[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",  # gemma2: hidden_activation (below)
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_dropout": 0.0,
            "mlp_bias": False,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "torch_dtype": self.param_dtype,
        }
        if self.rope_scaling is not None:
            out["rope_scaling"] = self.rope_scaling.to_hf()
        if self.architecture in ("llama", "qwen3", "mistral", "qwen3_moe", "smollm3", "gpt_oss", *HYBRID,
                                 *GRANITE, *WHOLE_QK_NORM):
            out["attention_bias"] = self.attention_bias
        if self.architecture in GRANITE:
            out.update({k: 1.0 if getattr(self, k) is None else getattr(self, k) for k in _GRANITE_FIELDS})
            out["attention_multiplier"] = self.attention_scale  # GraniteConfig's default, 1.0, is no default here
        if self.architecture == "smollm3":
            out.update(no_rope_layers=[int(i not in self.nope_layers) for i in range(self.num_layers)],
                       use_sliding_window=self.sliding_window is not None, layer_types=self.layer_types)
        if self.architecture in ("phi3", "smollm3"):
            # else Phi3Config's / SmolLM3Config's default (32000 / 128004), which a smaller vocabulary lacks
            out["pad_token_id"] = None
        if self.architecture != "llama":
            out["sliding_window"] = self.sliding_window
        if self.architecture in ("mixtral", "granitemoe", "gpt_oss"):
            out.update(num_local_experts=self.num_experts, num_experts_per_tok=self.experts_per_token)
        if self.architecture == "gpt_oss":
            out.update(swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha, layer_types=self.layer_types)
            if self.rope_scaling is None:  # said outright: GptOssConfig's default is YaRN by 32
                out["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta}
                del out["rope_scaling"]
        if self.architecture == "olmoe":
            out.update(num_experts=self.num_experts, num_experts_per_tok=self.experts_per_token,
                       norm_topk_prob=self.norm_topk_prob, clip_qkv=None)
        if self.architecture in _HEADS_FROM_HIDDEN:  # their config classes have neither field
            del out["sliding_window"], out["head_dim"]
        if self.architecture in ("qwen3_moe", "qwen2_moe"):
            out.update(num_experts=self.num_experts, num_experts_per_tok=self.experts_per_token,
                       norm_topk_prob=self.norm_topk_prob, moe_intermediate_size=self.intermediate_size,
                       decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=self.sliding_window is not None)
            if self.sliding_window is None:
                del out["sliding_window"]  # the configs' default (4096) is dropped without use_sliding_window
        if self.architecture == "qwen2_moe":
            out.update(shared_expert_intermediate_size=self.shared_expert_size, qkv_bias=self.qkv_bias,
                       layer_types=self.layer_types)
        if self.architecture in HYBRID:
            del out["sliding_window"], out["mlp_bias"]
            out.update(layer_types=self.layer_types,
                       linear_num_key_heads=self.linear_key_heads, linear_num_value_heads=self.linear_value_heads,
                       linear_key_head_dim=self.linear_key_dim, linear_value_head_dim=self.linear_value_dim,
                       linear_conv_kernel_dim=self.linear_conv)
            factor = (self.rotary_dim or self.head_dim) / self.head_dim
            if self.architecture == "qwen3_next":
                out.update(partial_rotary_factor=factor, norm_topk_prob=self.norm_topk_prob, decoder_sparse_step=1,
                           mlp_only_layers=[])
            else:  # Qwen3.5's configs take the factor in rope_parameters only
                out["rope_parameters"] = {"rope_type": "default", "rope_theta": self.rope_theta,
                                          "partial_rotary_factor": factor,
                                          **(self.rope_scaling.to_hf() if self.rope_scaling is not None else {})}
                del out["rope_theta"], out["rope_scaling"]
            if self.moe:
                out.update(num_experts=self.num_experts, num_experts_per_tok=self.experts_per_token,
                           moe_intermediate_size=self.intermediate_size,
                           shared_expert_intermediate_size=self.shared_expert_size)
                if self.architecture == "qwen3_5_moe_text":
                    del out["intermediate_size"]
        if self.architecture in ("qwen2", "qwen3"):
            out["use_sliding_window"] = self.sliding_window is not None
            # transformers derives the layers from max_window_layers when layer_types is absent;
            # the explicit list says any set of layers (and is read back first).
            out["max_window_layers"] = self.sliding_layers[0] if self.sliding_layers else self.num_layers
            out["layer_types"] = self.layer_types
        if self.architecture == "olmo3":
            out["layer_types"] = self.layer_types
        if self.architecture in TWO_ROPES:  # both ropes in transformers 5's per-layer-type form
            full = {"rope_type": "default", "rope_theta": self.rope_theta}
            if self.rope_scaling is not None:
                full.update(self.rope_scaling.to_hf())
            out["rope_parameters"] = {"full_attention": full, "sliding_attention": {
                "rope_type": "default", "rope_theta": self.local_rope_theta or self.rope_theta}}
            del out["rope_theta"], out["rope_scaling"]
        if self.architecture in GEMMA:
            del out["hidden_act"]
            out.update(hidden_activation=next(k for k, v in HIDDEN_ACTS.items() if v == self.hidden_act),
                       # an int where it is one: transformers' Gemma2Config checks the type
                       query_pre_attn_scalar=_int_if_whole(self.query_pre_attn_scalar or self.head_dim),
                       attn_logit_softcapping=self.attn_softcap, final_logit_softcapping=self.final_softcap,
                       attention_bias=False, layer_types=self.layer_types)
        return out


def _int_if_whole(x: float) -> int | float:
    return int(x) if float(x).is_integer() else float(x)


# Granite's scalar multipliers (`ModelConfig` fields, HF config keys of the same names).
_GRANITE_FIELDS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling")
# Families whose window, when they have one, applies to every layer.
_WINDOW_EVERYWHERE = ("mistral", "phi3", "mixtral", "qwen3_moe")
# Families with no sliding window.
_NO_WINDOW = ("llama", "granite", "olmo2", "olmoe", "granitemoe")
# Families whose configs have no head_dim: their heads are hidden_size / num_heads wide.
_HEADS_FROM_HIDDEN = ("olmoe", "granitemoe")
# Families as error messages name them.
_NAMES = {"mixtral": "Mixtral", "olmoe": "OLMoE", "granitemoe": "Granite MoE", "gpt_oss": "GPT-OSS"}
# What a config.json that leaves these keys out means: each family's transformers (5.x) config class
# defaults. Read wrongly, a hand-written or stripped config is silently another model (Mixtral at
# theta 1e4 instead of 1e6).
_BASE_DEFAULTS = {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "rope_theta": 10_000.0,
                  "tie_word_embeddings": False}
_FAMILY_DEFAULTS = {
    "mistral": {"max_position_embeddings": 131_072},
    "mixtral": {"rms_norm_eps": 1e-5, "max_position_embeddings": 131_072, "rope_theta": 1_000_000.0},
    **{t: {"max_position_embeddings": 32_768} for t in ("qwen2", "qwen3", "qwen3_moe", "qwen2_moe", *HYBRID)},
    "gemma2": {"max_position_embeddings": 8192, "tie_word_embeddings": True},
    "gemma3_text": {"max_position_embeddings": 131_072, "tie_word_embeddings": True},  # theta: `_two_ropes`
    "phi3": {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096},
    "olmo2": {"rms_norm_eps": 1e-5},
    "olmo3": {"rms_norm_eps": 1e-5},  # theta: `_two_ropes`
    "olmoe": {"rms_norm_eps": 1e-5, "max_position_embeddings": 4096},
    "gpt_oss": {"rms_norm_eps": 1e-5, "max_position_embeddings": 131_072, "rope_theta": 150_000.0},
    "smollm3": {"max_position_embeddings": 32_768, "rope_theta": 2_000_000.0, "tie_word_embeddings": True},
}


def _family_default(model_type: str, key: str):
    """transformers' default for `key` in `model_type`'s config class (`_FAMILY_DEFAULTS`)."""
    return _FAMILY_DEFAULTS.get(model_type, {}).get(key, _BASE_DEFAULTS[key])


# transformers' defaults where a config.json leaves the keys out: the window of MistralConfig,
# Qwen2Config, Qwen3Config, Gemma2Config and Gemma3TextConfig, and the Qwen configs' first windowed layer.
_HF_WINDOW = 4096
_QWEN_MAX_WINDOW_LAYERS = 28
_GEMMA3_THETAS = (1_000_000.0, 10_000.0)  # Gemma3TextConfig.default_theta: global, local
_OLMO3_THETA = 500_000.0  # Olmo3Config.default_theta


def _nope_layers(c: Mapping[str, Any], source: str) -> tuple[int, ...]:
    """SmolLM3's layers without rotary embedding: the 0 entries of `no_rope_layers`, or without that
    list every `no_rope_layer_interval`-th layer (default 4: layers 3, 7, ...), as transformers
    derives it."""
    layers_n = config_field(c, "num_hidden_layers", int, source, positive=True)
    flags = c.get("no_rope_layers")
    if flags is None:
        step = config_field(c, "no_rope_layer_interval", int, source, 4, positive=True)
        flags = [int((i + 1) % step != 0) for i in range(layers_n)]
    if not isinstance(flags, list) or len(flags) != layers_n or any(f not in (0, 1) or isinstance(f, float)
                                                                   for f in flags):
        raise ValueError(f"{source}: field 'no_rope_layers' must be a list of {layers_n} flags (1: the layer "
                         f"rotates, 0: it does not), got {flags!r}")
    return tuple(i for i, f in enumerate(flags) if not f)


def _experts(c: Mapping[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """The mixture-of-experts fields of a Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE or Granite MoE config,
    with transformers' defaults (Granite MoE's softmax over the k highest logits is Mixtral's
    renormalised top k).

    Qwen3-MoE and Qwen2-MoE layers without experts (`mlp_only_layers`, or a `decoder_sparse_step` above 1) are
    refused: every layer of the scan has one shape. `router_jitter_noise` (Mixtral) acts only in
    training and is ignored."""
    mixtral, shared = model_type in _RENORMALISED, model_type in SHARED_EXPERT
    # transformers maps num_experts and num_local_experts to one attribute; a saved config may hold either
    key = next((k for k in ("num_local_experts", "num_experts") if c.get(k) is not None),
               "num_local_experts" if mixtral else "num_experts")
    experts, per_token = {"mixtral": (8, 2), "qwen3_moe": (128, 8), "qwen2_moe": (60, 4), "olmoe": (64, 8),
                          "granitemoe": (8, 2), "gpt_oss": (128, 4), "qwen3_next": (512, 10),
                          "qwen3_5_moe_text": (256, 8)}[model_type]
    fields = dict(num_experts=config_field(c, key, int, source, experts, positive=True),
                  experts_per_token=config_field(c, "num_experts_per_tok", int, source, per_token, positive=True),
                  norm_topk_prob=True if mixtral else config_field(c, "norm_topk_prob", bool, source,
                                                                   model_type == "qwen3_next"))
    if shared:  # Qwen2MoeConfig's shared expert (default 5632 wide; 0 would mean none), Qwen3NextConfig's (512)
        fields["shared_expert_size"] = config_field(c, "shared_expert_intermediate_size", int, source,
                                                    5632 if model_type == "qwen2_moe" else 512)
    if model_type == "olmoe" and c.get("clip_qkv") is not None:
        raise ValueError(f"{source}: clip_qkv={c['clip_qkv']!r} is not supported (q, k and v unclipped)")
    if model_type in ("qwen3_moe", "qwen2_moe", "qwen3_next"):
        if c.get("mlp_only_layers"):
            raise ValueError(f"{source}: mlp_only_layers={c['mlp_only_layers']!r} is not supported (every layer "
                             f"must route to experts)")
        step = config_field(c, "decoder_sparse_step", int, source, 1, positive=True)
        if step != 1:
            raise ValueError(f"{source}: decoder_sparse_step={step} is not supported (only 1: experts in every "
                             f"layer)")
    return fields


# Multimodal wrappers whose text model tevjax runs: the released Qwen3.5 checkpoints are
# Qwen3_5(Moe)ForConditionalGeneration, their text model's config under `text_config`.
MULTIMODAL_WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def text_config(c: Mapping[str, Any], source: str) -> Mapping[str, Any]:
    """`c` itself, or for a multimodal wrapper (`MULTIMODAL_WRAPPERS`) its `text_config`, with the
    wrapper's tie_word_embeddings where the text config has none (transformers reads it there)."""
    inner = MULTIMODAL_WRAPPERS.get(c.get("model_type"))
    if inner is None:
        return c
    text = c.get("text_config")
    if not isinstance(text, Mapping):
        raise ValueError(f"{source}: model_type {c.get('model_type')!r} needs a 'text_config' object, got {text!r}")
    text = {"model_type": inner, **text}
    if "tie_word_embeddings" in c:
        text.setdefault("tie_word_embeddings", c["tie_word_embeddings"])
    return text


def _linear_layers(c: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Qwen3-Next's linear-attention fields, with Qwen3NextConfig's defaults: which layers
    (`layer_types`, else every fourth layer full attention), their heads and conv width, and the
    rotated share of each attention head (`partial_rotary_factor`, top level or in
    `rope_parameters`, default a quarter). A layer kind other than the two is refused."""
    n = config_field(c, "num_hidden_layers", int, source, positive=True)
    kinds = c.get("layer_types")
    if kinds is None:
        step = config_field(c, "full_attention_interval", int, source, 4, positive=True)
        kinds = ["linear_attention" if (i + 1) % step else "full_attention" for i in range(n)]
    if not isinstance(kinds, list) or len(kinds) != n:
        raise ValueError(f"{source}: layer_types must list num_hidden_layers={n} layer kinds, got {kinds!r}")
    odd = sorted({k for k in kinds if k not in ("linear_attention", "full_attention")}, key=str)
    if odd:
        raise ValueError(f"{source}: layer_types {odd} are not supported (only 'linear_attention' and "
                         f"'full_attention')")
    rope = c.get("rope_parameters") if isinstance(c.get("rope_parameters"), Mapping) else {}
    factor = c.get("partial_rotary_factor", rope.get("partial_rotary_factor", 0.25))
    head_dim = config_field(c, "head_dim", int, source, 256, positive=True)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ValueError(f"{source}: partial_rotary_factor={factor!r} must be a number in (0, 1]")
    return dict(linear_layers=tuple(i for i, k in enumerate(kinds) if k == "linear_attention"),
                linear_key_heads=config_field(c, "linear_num_key_heads", int, source, 16, positive=True),
                linear_value_heads=config_field(c, "linear_num_value_heads", int, source, 32, positive=True),
                linear_key_dim=config_field(c, "linear_key_head_dim", int, source, 128, positive=True),
                linear_value_dim=config_field(c, "linear_value_head_dim", int, source, 128, positive=True),
                linear_conv=config_field(c, "linear_conv_kernel_dim", int, source, 4, positive=True),
                rotary_dim=int(head_dim * factor))


def _check_phi3_rope(c: Mapping[str, Any], source: str) -> None:
    """Phi-3's ropes that tevjax refuses: a partial rotation (Phi-4-mini's 0.75), and any scaling,
    since transformers reads Phi-3's scaled ropes ("su", "yarn", "longrope") all as LongRoPE."""
    params = c.get("rope_parameters") if isinstance(c.get("rope_parameters"), Mapping) else {}
    factor = c.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    if factor not in (None, 1, 1.0):
        raise ValueError(f"{source}: partial_rotary_factor={factor!r} is not supported (only 1.0: every "
                         f"dimension rotates)")
    scaling = c.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if isinstance(scaling, Mapping) else "default"
    if kind != "default":
        raise ValueError(f"{source}: rope_type {kind!r} is not supported for model_type 'phi3' (transformers reads "
                         f"Phi-3's scaled ropes as LongRoPE)")


def _two_ropes(c: Mapping[str, Any], model_type: str, source: str) -> tuple[dict, float]:
    """Gemma 3's and OLMo 3's two ropes as transformers reads them: `rope_parameters` with a dict per
    layer type (transformers 5), or the Hub's `rope_theta` (+ `rope_scaling`) for the
    full-attention layers and, for the sliding ones, Gemma 3's `rope_local_base_freq` or OLMo 3's
    default base (Olmo3Config gives them its default_theta, not rope_theta). Returns the config with
    the full-attention rope in the form every other family uses, and the sliding layers' base
    (their rope is never scaled)."""
    c = dict(c)
    full_default, local_default = _GEMMA3_THETAS if model_type == "gemma3_text" else (_OLMO3_THETA, _OLMO3_THETA)
    params = c.get("rope_parameters")
    if isinstance(params, Mapping) and ("full_attention" in params or "sliding_attention" in params):
        for key in ("full_attention", "sliding_attention"):
            if params.get(key) is not None and not isinstance(params[key], Mapping):
                raise ValueError(f"{source}: field 'rope_parameters.{key}' must be an object, got {params[key]!r}")
        full, local = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
        full.update(c.pop("rope_scaling", None) or {})  # transformers folds a legacy scaling into the full rope
        full.setdefault("rope_theta", c.pop("rope_theta", None) or full_default)
        c["rope_parameters"] = full
        if local.get("rope_type", local.get("type", "default")) != "default":
            raise ValueError(f"{source}: rope_parameters.sliding_attention.rope_type {local.get('rope_type')!r} is "
                             f"not supported (the sliding layers rotate unscaled)")
        theta = config_field(local, "rope_theta", float, source, local_default, positive=True,
                             prefix="rope_parameters.sliding_attention.")
    else:
        c.setdefault("rope_theta", full_default)
        theta = (config_field(c, "rope_local_base_freq", float, source, local_default, positive=True)
                 if model_type == "gemma3_text" else local_default)
    return c, theta


def _sliding_window(c: Mapping[str, Any], model_type: str, source: str) -> tuple[int | None, tuple[int, ...]]:
    """(window, sliding layers) as transformers reads them from an HF config.

    Mistral: `sliding_window` applies to every layer; absent means transformers' 4096 and null
    means full attention (Mistral-7B-v0.1 and its fine-tunes: 4096; v0.2 onwards: null). Phi-3
    and Mixtral likewise, absent meaning none; Qwen3-MoE likewise, only with `use_sliding_window`.
    SmolLM3: a window only with `use_sliding_window` and a `sliding_window`, in the layers
    `layer_types` marks or else its NoPE layers.
    Qwen2 / Qwen3: a window only with `use_sliding_window`, in the layers `layer_types` marks
    "sliding_attention", or without that list in layers max_window_layers onwards. Gemma: the
    layers layer_types marks, or without it every other one from layer 0 (Gemma 2) or all but
    every sliding_window_pattern-th (Gemma 3). Llama: none.
    """
    layers_n = config_field(c, "num_hidden_layers", int, source, positive=True)
    types = c.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers_n:
            raise ValueError(f"{source}: field 'layer_types' must be a list of {layers_n} strings, got {types!r}")
        odd = sorted({str(t) for t in types} - {"full_attention", "sliding_attention"})
        if odd:
            raise ValueError(f"{source}: layer_types {odd} are not supported (only full_attention and "
                             f"sliding_attention)")
    if model_type in _NO_WINDOW:
        if types is not None and "sliding_attention" in types:
            raise ValueError(f"{source}: layer_types with sliding_attention are not supported for model_type "
                             f"{model_type!r}")
        return None, ()
    if model_type in _WINDOW_EVERYWHERE:  # one window for every layer
        if types is not None and len(set(types)) > 1:
            raise ValueError(f"{source}: layer_types mixing full and sliding attention are not supported for "
                             f"model_type {model_type!r} (transformers' model ignores them)")
        if model_type == "qwen3_moe" and not config_field(c, "use_sliding_window", bool, source, False):
            return None, ()  # Qwen3MoeConfig drops the window unless use_sliding_window
        # MistralConfig's and Qwen3MoeConfig's default window is 4096; Phi3Config's and MixtralConfig's none
        default = _HF_WINDOW if model_type in ("mistral", "qwen3_moe") else None
        if c.get("sliding_window", default) is None:
            return None, ()
        return config_field(c, "sliding_window", int, source, default, positive=True), tuple(range(layers_n))
    if model_type == "smollm3":
        # SmolLM3's attention has a window only with use_sliding_window and a sliding_window (its
        # default is none); without layer_types, in the NoPE layers.
        if not config_field(c, "use_sliding_window", bool, source, False) or c.get("sliding_window") is None:
            return None, ()
        if types is None:
            nope = _nope_layers(c, source)
            types = ["sliding_attention" if i in nope else "full_attention" for i in range(layers_n)]
    elif model_type in ("qwen2", "qwen3", "qwen2_moe"):
        if not config_field(c, "use_sliding_window", bool, source, False):
            if types is not None and "sliding_attention" in types:
                raise ValueError(f"{source}: layer_types marks sliding_attention layers but use_sliding_window is "
                                 f"false, so transformers gives them no window")
            return None, ()
        if types is None and model_type == "qwen2_moe":  # Qwen2MoeConfig: even layers below max_window_layers
            last = config_field(c, "max_window_layers", int, source, _QWEN_MAX_WINDOW_LAYERS)
            types = ["sliding_attention" if i % 2 == 0 and i < last else "full_attention" for i in range(layers_n)]
        elif types is None:
            first = config_field(c, "max_window_layers", int, source, _QWEN_MAX_WINDOW_LAYERS)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers_n)]
    elif types is None:
        # Without layer_types, Gemma 2 alternates (layers 0, 2, 4, ... slide), OLMo 3 makes every
        # fourth layer full and Gemma 3 every sliding_window_pattern-th (default 6: layers 5, 11, ...).
        pattern = ({"gemma2": 2, "olmo3": 4, "gpt_oss": 2}.get(model_type)
                   or config_field(c, "sliding_window_pattern", int, source, 6, positive=True))
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers_n)]
    layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if not layers:
        return None, ()
    default = 128 if model_type == "gpt_oss" else _HF_WINDOW  # GptOssConfig's default window is 128
    if c.get("sliding_window", default) is None:
        raise ValueError(f"{source}: sliding_window is null, but layers {list(layers)} slide (layer_types, or "
                         f"what transformers derives without it)")
    return config_field(c, "sliding_window", int, source, default, positive=True), layers


# Published numbers (Hugging Face config.json of each checkpoint). Large models store bf16.
PRESETS: dict[str, ModelConfig] = {
    # Qwen/Qwen3-4B: 4.0B parameters (tied embeddings).
    "qwen3-4b": ModelConfig(
        architecture="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
        num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, tie_word_embeddings=True, qk_norm=True,
        max_position_embeddings=40960, eos_token_ids=(151645, 151643), bos_token_id=151643,
        dtype="bfloat16", param_dtype="bfloat16",
    ),
    # Qwen/Qwen3-8B: 8.2B parameters.
    "qwen3-8b": ModelConfig(
        architecture="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, tie_word_embeddings=False, qk_norm=True,
        max_position_embeddings=40960, eos_token_ids=(151645, 151643), bos_token_id=151643,
        dtype="bfloat16", param_dtype="bfloat16",
    ),
    # meta-llama/Llama-3.1-8B(-Instruct): 8.03B parameters; eos ids of the Instruct model.
    "llama-3.1-8b": ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500_000.0,
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
        tie_word_embeddings=False, qk_norm=False, max_position_embeddings=131072,
        eos_token_ids=(128001, 128008, 128009), bos_token_id=128000,
        dtype="bfloat16", param_dtype="bfloat16",
    ),
    # Qwen/Qwen2.5-7B-Instruct: 7.61B parameters; q/k/v biases.
    "qwen2.5-7b": ModelConfig(
        architecture="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, tie_word_embeddings=False, qk_norm=False, qkv_bias=True,
        max_position_embeddings=32768, eos_token_ids=(151645,), bos_token_id=151643,
        dtype="bfloat16", param_dtype="bfloat16",
    ),
    # mistralai/Mistral-7B-Instruct-v0.3: 7.25B parameters; no sliding window.
    "mistral-7b-v0.3": ModelConfig(
        architecture="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=1_000_000.0, tie_word_embeddings=False, qk_norm=False,
        max_position_embeddings=32768, eos_token_ids=(2,), bos_token_id=1,
        dtype="bfloat16", param_dtype="bfloat16",
    ),
    # HuggingFaceTB/SmolLM2-135M: 134.5M parameters (tied embeddings); small enough for CPU.
    "smollm2-135m": ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=100_000.0, tie_word_embeddings=True, qk_norm=False,
        max_position_embeddings=8192, eos_token_ids=(2,), bos_token_id=1,
        dtype="float32", param_dtype="float32",
    ),
    # google/gemma-2-9b: 9.24B parameters (tied embeddings); a 4096-token window in the even layers.
    "gemma-2-9b": ModelConfig(
        architecture="gemma2", vocab_size=256000, hidden_size=3584, intermediate_size=14336,
        num_layers=42, num_heads=16, num_kv_heads=8, head_dim=256, rms_norm_eps=1e-6,
        rope_theta=10_000.0, tie_word_embeddings=True, qk_norm=False,
        max_position_embeddings=8192, eos_token_ids=(1,), bos_token_id=2,
        sliding_window=4096, sliding_layers=tuple(range(0, 42, 2)), hidden_act="gelu_tanh",
        query_pre_attn_scalar=256.0, attn_softcap=50.0, final_softcap=30.0,
        dtype="bfloat16", param_dtype="bfloat16",
    ),
    # google/gemma-3-1b-it: 1B parameters (tied embeddings); a 512-token window in five layers of
    # six, which rotate with base 10^4, the others with 10^6.
    "gemma-3-1b": ModelConfig(
        architecture="gemma3_text", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
        num_layers=26, num_heads=4, num_kv_heads=1, head_dim=256, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, local_rope_theta=10_000.0, tie_word_embeddings=True, qk_norm=True,
        max_position_embeddings=32768, eos_token_ids=(1, 106), bos_token_id=2,
        sliding_window=512, sliding_layers=tuple(i for i in range(26) if (i + 1) % 6), hidden_act="gelu_tanh",
        query_pre_attn_scalar=256.0, dtype="bfloat16", param_dtype="bfloat16",
    ),
    # mistralai/Mixtral-8x7B-Instruct-v0.1: 46.7B parameters, 2 of 8 experts per token (12.9B active).
    "mixtral-8x7b": ModelConfig(
        architecture="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=1_000_000.0, tie_word_embeddings=False, qk_norm=False,
        max_position_embeddings=32768, eos_token_ids=(2,), bos_token_id=1,
        num_experts=8, experts_per_token=2, dtype="bfloat16", param_dtype="bfloat16",
    ),
    # Qwen/Qwen3-30B-A3B: 30.5B parameters, 8 of 128 experts of width 768 per token (3.3B active).
    "qwen3-30b-a3b": ModelConfig(
        architecture="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=768,
        num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1_000_000.0, tie_word_embeddings=False, qk_norm=True,
        max_position_embeddings=40960, eos_token_ids=(151645,), bos_token_id=151643,
        num_experts=128, experts_per_token=8, norm_topk_prob=True, dtype="bfloat16", param_dtype="bfloat16",
    ),
    # allenai/OLMoE-1B-7B-0924: 6.9B parameters, 8 of 64 experts of width 1024 per token (1.3B
    # active), weights not renormalised, 16 heads of 128 with no grouping.
    "olmoe-1b-7b": ModelConfig(
        architecture="olmoe", vocab_size=50304, hidden_size=2048, intermediate_size=1024,
        num_layers=16, num_heads=16, num_kv_heads=16, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=10_000.0, tie_word_embeddings=False, qk_norm=True,
        max_position_embeddings=4096, eos_token_ids=(50279,), bos_token_id=None,
        num_experts=64, experts_per_token=8, norm_topk_prob=False, dtype="bfloat16", param_dtype="bfloat16",
    ),
    # openai/gpt-oss-20b: 20.9B parameters, 4 of 32 experts of width 2880 per token; sinks, a
    # 128-token window in the even layers, YaRN by 32 unrounded, the clipped gate.
    "gpt-oss-20b": ModelConfig(
        architecture="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
        num_layers=24, num_heads=64, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=150_000.0,
        rope_scaling=RopeScaling(rope_type="yarn", factor=32.0, original_max_position_embeddings=4096,
                                 beta_fast=32.0, beta_slow=1.0, truncate=False),
        tie_word_embeddings=False, qk_norm=False, attention_bias=True, max_position_embeddings=131072,
        eos_token_ids=(200002,), sliding_window=128, sliding_layers=tuple(range(0, 24, 2)),
        num_experts=32, experts_per_token=4, swiglu_limit=7.0, swiglu_alpha=1.702,
        dtype="bfloat16", param_dtype="bfloat16",
    ),
}
