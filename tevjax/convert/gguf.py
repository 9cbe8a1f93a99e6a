"""GGUF (llama.cpp) checkpoints -> Hugging Face layout.

A GGUF file holds a llama.cpp model: hyper-parameters and the tokenizer as key/value metadata, and
weights as tensors under llama.cpp names, often block-quantized. tevjax does not load GGUF directly:
`gguf_to_hf_dir` turns one into an ordinary HF checkpoint directory (config.json, float32
model.safetensors with standard `LlamaForCausalLM` / `Qwen2ForCausalLM` / `Qwen3ForCausalLM` /
`MixtralForCausalLM` / `Qwen3MoeForCausalLM` / `Qwen2MoeForCausalLM` / `Gemma2ForCausalLM` /
`Gemma3ForCausalLM` / `Phi3ForCausalLM` / ... / `Qwen3_5(Moe)ForCausalLM` names,
tokenizer.json, tokenizer_config.json with the file's chat template, generation_config.json), so
the HF loader -- and transformers itself, in the tests -- treat it like any other checkpoint.
Architectures: `llama` (SmolLM2 among them; Llama 3.1 onwards with the rope scaling it stores as
`rope_freqs.weight`, `_llama3_scaling`), `qwen2` (Qwen2 and Qwen2.5: q/k/v biases) and `qwen3`
(per-head q/k norms, a head size of its own), `qwen3moe` (Qwen3's attention with routed experts,
each projection of a layer's experts stacked in one tensor), `qwen2moe` (Qwen2's attention,
routed experts and a shared expert), Mixtral, which llama.cpp writes as `llama` with an
expert count (`_MIXTRAL`), `gemma2` and `gemma3` (Gemma 2, Gemma 3's text model: `_gemma_config`),
`phi3` (Phi-3: fused q|k|v and gate|up tensors, `_phi3_config`), `smollm3`, `granite` and
`granitemoe` (Llama's files with a family's own fields), `olmo2` (OLMo 2, and OLMo 3 with its
windows: `_olmo2_config`), `olmoe`, `gpt-oss` (MXFP4 experts, `_join_gpt_oss_experts`), and the
hybrids `qwen3next`,
`qwen35` and `qwen35moe` (Gated DeltaNet layers beside gated attention: `_hybrid_config`,
`_linear_tensor`, `_join_qkvz`).
`rope.scaling.type` linear and yarn become HF's `rope_scaling` of the same name (`_rope_scaling`).

Two layout facts matter (both from llama.cpp's `convert_hf_to_gguf.py`):

* ggml lists dimensions fastest-moving first, so a GGUF tensor of ggml shape [in, out] is the numpy
  (and HF) matrix (out, in); `gguf.GGUFReader` already reports the numpy order.
* llama.cpp's Llama rope rotates adjacent pairs (x0, x1), (x2, x3), ... while HF Llama rotates the
  two halves of each head (x_i, x_{i + Dh/2}). Its converter therefore permutes the rows of q_proj and
  k_proj within every head: HF row a * Dh/2 + b (half a in {0, 1}, b < Dh/2) is stored as GGUF row
  2 * b + a, i.e. `W.reshape(n_head, 2, Dh/2, in).swapaxes(1, 2)`, with n_head = the number of KV
  heads for k_proj. `read_gguf` applies the inverse (Dh: head width, as in the legend in
  `tevjax/__init__.py`). Worked example, one head of Dh = 4 rows::

      HF rows    [q0, q1, q2, q3]    halves (q0, q1) and (q2, q3)
      GGUF rows  [q0, q2, q1, q3]    rope pairs (q0, q2) and (q1, q3) made adjacent

  Qwen2, Qwen3, Gemma and Phi-3 run llama.cpp's NEOX rope, which rotates halves as HF does: their
  rows are stored unpermuted (`_Arch.permuted_rope`).

Gemma's RMSNorms scale by (1 + weight) in HF and by the weight in llama.cpp, so its converter adds
1 to every `*norm.weight`; reading subtracts it (`_Arch.norm_offset`). Some of what a Gemma file
runs with is not in its metadata but in llama.cpp's code, keyed by architecture and block count:
which layers slide, the sliding layers' rope base, and the query scale (`_gemma_config`).

Quantized tensors are dequantized to float32 with the `gguf` package; quantization blocks run along
a row, so the row permutation above commutes with dequantization. Besides the 32-value blocks
(Q8_0, Q4_0, Q4_1, Q5_0 / Q5_1, which K-quant files use for rows that are not a multiple of 256
wide, and MXFP4, GPT-OSS's experts: a power-of-two scale and 32 four-bit floats), the K-quants
of llama.cpp's Q2_K to Q6_K files are read: 256-value super-blocks with 4-bit (Q2_K), 6-bit (Q3_K,
Q4_K, Q5_K) or 8-bit (Q6_K) sub-block scales, and Q8_K (a float32 scale and int8 values), which
the `gguf` package cannot dequantize, so `_dequantize_q8_k` does it here.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from tevjax.convert.tokenizer import tokenizer_files_from_gguf
from tevjax.storage import WriteError, check_space, failure, is_no_space

__all__ = [
    "GGUFError",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_TENSOR_TYPES",
    "CONVERSION_MARKER",
    "CONVERTER_VERSION",
    "read_gguf",
    "read_gguf_metadata",
    "gguf_to_hf_dir",
    "unpermute_rope_rows",
]

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "qwen2moe", "gemma2", "gemma3", "phi3",
                           "qwen3next", "qwen35", "qwen35moe", "smollm3", "granite", "granitemoe", "olmo2",
                           "olmoe", "gpt-oss")
# ggml type names accepted by `read_gguf`; each is covered by a round-trip test. Others (Q2_K,
# Q3_K, Q5_0/Q5_1, IQ-quants, ...) are refused by name rather than dequantized untested.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                          "Q6_K", "Q8_K", "MXFP4")
# Written last into a converted directory; its presence means the directory is complete.
CONVERSION_MARKER = "tevjax_conversion.json"
# Bumped whenever the produced directory would change, so cached conversions are redone.
CONVERTER_VERSION = 2  # 2: Llama 3 files' tokenizers take whole tokens (ignore_merges) and add BOS by default


class GGUFError(ValueError):
    """A GGUF file that is missing, malformed, or describes something tevjax cannot convert."""


@dataclasses.dataclass(frozen=True)
class _Arch:
    """What a `general.architecture` means for the conversion (llama.cpp's converter and its
    per-architecture tensor lists, `gguf.constants.MODEL_TENSORS`)."""

    hf_class: str
    # llama.cpp runs Llama with adjacent-pair rope and permutes q/k rows for it (module
    # docstring); Qwen2/Qwen3 run its NEOX rope, which rotates halves as HF does, and keep the
    # HF rows.
    permuted_rope: bool
    qkv_bias: bool  # Qwen2: biases on q, k and v (`blk.N.attn_{q,k,v}.bias`)
    qk_norm: bool  # Qwen3: per-head RMSNorm on q and k (`blk.N.attn_{q,k}_norm.weight`)
    extra_config: tuple[tuple[str, Any], ...] = ()  # HF config fields the architecture's class reads
    model_type: str | None = None  # HF's model_type, where it is not the GGUF architecture's name
    # Routed experts (Qwen3-MoE): a router `blk.N.ffn_gate_inp` and every expert's projections
    # stacked in one tensor each, `blk.N.ffn_{gate,up,down}_exps` [E, out, in] (numpy order).
    experts: bool = False
    # Qwen2-MoE: a shared expert `blk.N.ffn_{gate,up,down}_shexp` and its gate `blk.N.ffn_gate_inp_shexp` [D].
    shared_expert: bool = False
    # The HF config fields of the expert count and the experts' width (Mixtral: `num_local_experts`,
    # and `intermediate_size` itself, read from feed_forward_length).
    experts_field: str = "num_experts"
    width_field: str = "moe_intermediate_size"
    # HF names where the architecture's differ from the table's Qwen-MoE names (substring swaps).
    renames: tuple[tuple[str, str], ...] = ()
    # Gemma: what llama.cpp's converter added to every `*norm.weight` (HF's norms scale by 1 + w).
    norm_offset: float = 0.0
    # Gemma: a norm after attention (`post_attention_norm`), and the MLP's input and output norms
    # (`ffn_norm`, `post_ffw_norm`), where the others' `ffn_norm` is the post-attention one.
    post_norms: bool = False
    # Phi-3: q|k|v in one tensor (`attn_qkv`) and gate|up in one (`ffn_up`), as HF stores them.
    fused: bool = False
    # The family's own HF config fields, from the metadata and the generic fields (`cfg`).
    family_config: Callable[[Path, Mapping[str, Any], dict], dict] | None = None
    # Qwen3-Next and Qwen3.5: Gated DeltaNet layers beside gated attention (`_hybrid_config`).
    hybrid: bool = False
    # Qwen3.5: value heads stored tiled rather than grouped by key head (`_untile_value_heads`).
    tiled_value_heads: bool = False
    # What becomes of the HF state once every tensor is read (Qwen3-Next's in_proj_qkvz).
    finish: Callable[[dict, dict], dict] | None = None
    # Granite MoE: the experts stay stacked, as its HF checkpoints store them (`_join_granite_experts`).
    stacked_experts: bool = False
    # OLMo: q and k normed over each whole projection (`attn_q_norm` [H Dh]), not per head.
    whole_qk_norm: bool = False
    # OLMo 2 and 3: norms after the attention and the MLP only, none before them.
    output_norms_only: bool = False
    # GPT-OSS: attention sinks and an output bias; a biased router and biased experts, gate and up
    # interleaved in HF's one stacked tensor (`_join_gpt_oss_experts`).
    gpt_oss: bool = False

    def hf(self, name: str) -> str:
        for old, new in self.renames:
            name = name.replace(old, new)
        return name


_ARCHS: dict[str, _Arch] = {
    "llama": _Arch("LlamaForCausalLM", True, False, False, (("attention_bias", False), ("mlp_bias", False))),
    "qwen2": _Arch("Qwen2ForCausalLM", False, True, False, (("use_sliding_window", False),)),
    "qwen3": _Arch("Qwen3ForCausalLM", False, False, True, (("attention_bias", False),)),
    # llama.cpp's qwen3moe graph always renormalises the picked experts' weights (Qwen3MoeConfig's
    # norm_topk_prob, false by default there, true in every released Qwen3-MoE config).
    "qwen3moe": _Arch("Qwen3MoeForCausalLM", False, False, True,
                      (("attention_bias", False), ("norm_topk_prob", True), ("decoder_sparse_step", 1)),
                      model_type="qwen3_moe", experts=True),
    # Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's biases, weights not renormalised (llama.cpp's
    # qwen2moe graph, as Qwen2MoeConfig's default), a shared expert.
    "qwen2moe": _Arch("Qwen2MoeForCausalLM", False, True, False,
                      (("use_sliding_window", False), ("norm_topk_prob", False), ("decoder_sparse_step", 1)),
                      model_type="qwen2_moe", experts=True, shared_expert=True),
    "gemma2": _Arch("Gemma2ForCausalLM", False, False, False, (("attention_bias", False),),
                    norm_offset=1.0, post_norms=True, family_config=lambda p, m, c: _gemma_config(p, m, c, "gemma2")),
    "gemma3": _Arch("Gemma3ForCausalLM", False, False, True, (("attention_bias", False),), model_type="gemma3_text",
                    norm_offset=1.0, post_norms=True, family_config=lambda p, m, c: _gemma_config(p, m, c, "gemma3")),
    "phi3": _Arch("Phi3ForCausalLM", False, False, False, (("attention_bias", False),), fused=True,
                  family_config=lambda p, m, c: _phi3_config(p, m, c)),
    # SmolLM3: Llama's layers and file, but every fourth layer unrotated, which llama.cpp hard-codes
    # (`n_no_rope_layer_step = 4`; no key says so).
    "smollm3": _Arch("SmolLM3ForCausalLM", True, False, False,
                     (("attention_bias", False), ("mlp_bias", False), ("use_sliding_window", False)),
                     family_config=lambda p, m, c: _smollm3_config(c)),
    # Granite 3.x: Llama's layers and file with four scalars, which llama.cpp requires.
    "granite": _Arch("GraniteForCausalLM", True, False, False, (("attention_bias", False), ("mlp_bias", False)),
                     family_config=lambda p, m, c: _granite_config(p, m, c, "granite")),
    "granitemoe": _Arch("GraniteMoeForCausalLM", True, False, False, (("attention_bias", False),),
                        experts=True, experts_field="num_local_experts", width_field="intermediate_size",
                        stacked_experts=True, finish=lambda c, s: _join_granite_experts(c, s),
                        family_config=lambda p, m, c: _granite_config(p, m, c, "granitemoe")),
    # OLMo 2 (and OLMo 3, which llama.cpp writes as olmo2 with windows: `_olmo2_config`) and OLMoE: no
    # q/k permutation (llama.cpp runs them with its NEOX rope); OLMoE's picked experts' weights are not
    # renormalised (its graph, as OlmoeConfig's default).
    "olmo2": _Arch("Olmo2ForCausalLM", False, False, True, (("attention_bias", False),), whole_qk_norm=True,
                   output_norms_only=True, family_config=lambda p, m, c: _olmo2_config(p, m, c)),
    "olmoe": _Arch("OlmoeForCausalLM", False, False, True,
                   (("attention_bias", False), ("norm_topk_prob", False), ("clip_qkv", None)),
                   experts=True, width_field="intermediate_size", whole_qk_norm=True),
    # GPT-OSS: llama.cpp's converter splits HF's interleaved gate|up experts into ffn_gate_exps and
    # ffn_up_exps (MXFP4 in released files), each [E, I, D] as ggml stores a matrix per expert.
    "gpt-oss": _Arch("GptOssForCausalLM", False, True, False, (("attention_bias", True),), model_type="gpt_oss",
                     experts=True, experts_field="num_local_experts", width_field="intermediate_size", gpt_oss=True,
                     finish=lambda c, s: _join_gpt_oss_experts(c, s),
                     family_config=lambda p, m, c: _gpt_oss_config(p, m, c)),
    # Qwen3-Next and Qwen3.5: llama.cpp's converter (its Qwen3NextModel and, for Qwen3.5, the value
    # head reordering base it derives from it) writes their zero-centred norms plus 1 (the gated
    # norm of the linear layers, `ssm_norm`, as it is), A_log as -exp(A_log), dt_bias as
    # `ssm_dt.bias`, the conv kernel without its middle axis, and Qwen3-Next's in_proj_qkvz as q|k|v
    # part by part (`attn_qkv`) and z (`attn_gate`). Its experts: Qwen2-MoE's layout, renormalised.
    "qwen3next": _Arch("Qwen3NextForCausalLM", False, False, True,
                       (("attention_bias", False), ("norm_topk_prob", True), ("decoder_sparse_step", 1),
                        ("mlp_only_layers", ())),
                       model_type="qwen3_next", experts=True, shared_expert=True, norm_offset=1.0, hybrid=True,
                       family_config=lambda p, m, c: _hybrid_config(p, m, c, "qwen3next"),
                       finish=lambda c, s: _join_qkvz(c, s)),
    "qwen35": _Arch("Qwen3_5ForCausalLM", False, False, True, (("attention_bias", False),),
                    model_type="qwen3_5_text", norm_offset=1.0, hybrid=True, tiled_value_heads=True,
                    family_config=lambda p, m, c: _hybrid_config(p, m, c, "qwen35")),
    "qwen35moe": _Arch("Qwen3_5MoeForCausalLM", False, False, True,
                       (("attention_bias", False), ("norm_topk_prob", True)),
                       model_type="qwen3_5_moe_text", experts=True, shared_expert=True, norm_offset=1.0,
                       hybrid=True, tiled_value_heads=True,
                       family_config=lambda p, m, c: _hybrid_config(p, m, c, "qwen35moe")),
}
assert set(_ARCHS) == set(SUPPORTED_ARCHITECTURES)
# Mixtral: llama.cpp writes it as `llama` with an expert count (convert_hf_to_gguf's LlamaModel:
# q/k permuted, `block_sparse_moe` w1 / w3 / w2 stacked as ffn_gate_exps / ffn_up_exps /
# ffn_down_exps, the experts' width as feed_forward_length), and runs it with full attention and
# the picked experts' weights renormalised, as MixtralConfig with no sliding window does.
_MIXTRAL = _Arch("MixtralForCausalLM", True, False, False, (("sliding_window", None),), model_type="mixtral",
                 experts=True, experts_field="num_local_experts", width_field="intermediate_size",
                 renames=(("mlp.experts.", "block_sparse_moe.experts."), (".gate_proj.", ".w1."), (".up_proj.", ".w3."),
                          (".down_proj.", ".w2."), ("mlp.gate.", "block_sparse_moe.gate.")))


def _arch_of(meta: Mapping[str, Any]) -> _Arch:
    """The conversion of a file's `general.architecture` (checked by `_config_from_metadata`):
    a `llama` file with experts is a Mixtral."""
    arch = meta["general.architecture"]
    return _MIXTRAL if arch == "llama" and meta.get("llama.expert_count", 0) else _ARCHS[arch]


# --------------------------------------------------------------------------------------------------
# Reading the file
# --------------------------------------------------------------------------------------------------


def _gguf():
    # Imported lazily: `gguf` is only needed by this conversion path.
    import gguf

    return gguf


def _open_reader(path: Path):
    """A `gguf.GGUFReader` over `path`, with every failure turned into a `GGUFError` naming it."""
    gguf = _gguf()
    if not path.is_file():
        raise GGUFError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFError(f"{path} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises bare ValueError/IndexError/OverflowError on garbage
        raise GGUFError(f"{path}: cannot parse the GGUF header/metadata ({type(e).__name__}: {e}); "
                        "the file is probably truncated or corrupt") from e
    # The reader memory-maps the file and slices tensor data lazily, so a file cut inside the tensor
    # data parses fine and only shows short tensors later. Check every tensor's extent up front.
    size = path.stat().st_size
    for t in reader.tensors:
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise GGUFError(f"{path} is truncated: tensor {t.name!r} needs bytes up to {end}, "
                            f"but the file has {size}")
    # Each tensor's extent follows from its shape and type; one that runs into the next tensor's
    # data has a shape or type that lies (F16 data marked F32), and would be read as garbage.
    spans = sorted((int(t.data_offset), int(t.data_offset) + int(t.n_bytes), t.name) for t in reader.tensors)
    for (_, end, name), (start, _, after) in zip(spans, spans[1:]):
        if end > start:
            raise GGUFError(f"{path}: tensor {name!r} runs {end - start} bytes into the data of tensor {after!r}; "
                            "its shape or type is wrong, or the file is corrupt")
    return reader


def _field_value(field) -> Any:
    """A metadata field as a Python value. float32 scalars become the shortest decimal that rounds
    to the same float32 (1e-05, not 9.999999747378752e-06): GGUF stores HF's decimal config values
    as float32, and that decimal is what the original config.json held."""
    gguf = _gguf()
    value = field.contents()
    if field.types and field.types[0] == gguf.GGUFValueType.FLOAT32:
        value = float(str(np.float32(value)))
    return value


def _metadata(reader) -> dict[str, Any]:
    return {name: _field_value(field) for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """All key/value metadata of a GGUF file (e.g. `llama.block_count`, `tokenizer.ggml.tokens`)."""
    return _metadata(_open_reader(Path(path)))


# --------------------------------------------------------------------------------------------------
# Config: GGUF metadata -> HF config dict (LlamaConfig, Qwen2Config, Qwen3Config, Qwen2/3MoeConfig)
# --------------------------------------------------------------------------------------------------

# (GGUF key under "<arch>.", HF config field, value type, default or _REQUIRED)
_REQUIRED = object()
_LLAMA_CONFIG_TABLE: tuple[tuple[str, str, type, Any], ...] = (
    ("block_count", "num_hidden_layers", int, _REQUIRED),
    ("embedding_length", "hidden_size", int, _REQUIRED),
    ("feed_forward_length", "intermediate_size", int, _REQUIRED),
    ("attention.head_count", "num_attention_heads", int, _REQUIRED),
    ("attention.head_count_kv", "num_key_value_heads", int, None),  # absent: no GQA
    ("attention.layer_norm_rms_epsilon", "rms_norm_eps", float, _REQUIRED),
    ("context_length", "max_position_embeddings", int, _REQUIRED),
    ("rope.freq_base", "rope_theta", float, 10000.0),  # llama.cpp's default when absent
)
# Special-token ids, copied into config.json as HF has them.
_TOKEN_ID_TABLE = (
    ("tokenizer.ggml.bos_token_id", "bos_token_id"),
    ("tokenizer.ggml.eos_token_id", "eos_token_id"),
    ("tokenizer.ggml.padding_token_id", "pad_token_id"),
)


def _uniform_int(path: Path, key: str, value: Any) -> int:
    # Some files store per-layer arrays (e.g. head_count_kv); a uniform one is a plain model.
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise GGUFError(f"{path}: metadata {key} varies per layer ({value[:8]}...), which an "
                            "HF config of a supported architecture cannot express")
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool):
        raise GGUFError(f"{path}: metadata {key} should be an integer, got {value!r}")
    return value


def _size(path: Path, meta: Mapping[str, Any], key: str, default: int | None) -> int | None:
    """The positive integer at metadata `key`, or `default` where the file has none."""
    if key not in meta:
        return default
    value = _uniform_int(path, key, meta[key])
    if value <= 0:
        raise GGUFError(f"{path}: metadata {key} should be a positive integer, got {value}")
    return value


def _config_from_metadata(path: Path, meta: Mapping[str, Any], tensor_names: set[str],
                          embed_rows: int | None) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFError(f"{path}: architecture {arch!r} is not supported "
                        f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    conv = _arch_of(meta)
    cfg: dict[str, Any] = {"architectures": [conv.hf_class], "model_type": conv.model_type or arch}
    # A MoE's dense width goes unread: its experts' own width replaces it.
    dense_width_unread = conv.experts and conv.width_field != "intermediate_size"
    for key, field, kind, default in _LLAMA_CONFIG_TABLE:
        full = f"{arch}.{key}"
        unread = key == "feed_forward_length" and dense_width_unread
        if full in meta:
            value = meta[full]
            if kind is int:
                # 0 heads divided by zero below, and no size that is read can be 0 either
                value = _uniform_int(path, full, value) if unread else _size(path, meta, full, None)
            elif not isinstance(value, (int, float)) or isinstance(value, bool):
                raise GGUFError(f"{path}: metadata {full} should be a number, got {value!r}")
            elif not math.isfinite(value) or value < 0 or (key == "rope.freq_base" and value == 0):
                # a NaN, negative or zero rope base, or a NaN or negative epsilon, gives NaN logits
                raise GGUFError(f"{path}: metadata {full} should be a finite number "
                                f"{'> 0' if key == 'rope.freq_base' else '>= 0'}, got {value!r}")
            value = kind(value)
        elif unread:
            continue  # its experts' width is its own key, and llama.cpp's converter writes this only when the
            # HF config has a dense width (Qwen3.5-MoE's has none)
        elif default is _REQUIRED:
            raise GGUFError(f"{path}: required metadata {full} is missing")
        else:
            value = default
        cfg[field] = value
    if cfg["num_key_value_heads"] is None:
        cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    cfg.update(_expert_config(path, meta, arch))
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    if n_head % n_kv:
        raise GGUFError(f"{path}: head_count {n_head} is not a multiple of head_count_kv {n_kv}")

    head_dim, value_dim = (_size(path, meta, f"{arch}.attention.{key}", default)
                           for key, default in (("key_length", cfg["hidden_size"] // n_head), ("value_length", None)))
    value_dim = head_dim if value_dim is None else value_dim
    if value_dim != head_dim:
        raise GGUFError(f"{path}: attention.key_length {head_dim} != attention.value_length "
                        f"{value_dim}; {arch} needs equal key and value head sizes")
    if head_dim % 2:
        raise GGUFError(f"{path}: head size {head_dim} is odd, so rope pairs cannot be formed")
    cfg["head_dim"] = head_dim
    rope_dims = _size(path, meta, f"{arch}.rope.dimension_count", head_dim)
    if rope_dims != head_dim and not conv.hybrid:
        raise GGUFError(f"{path}: rope.dimension_count {rope_dims} != head size {head_dim}; "
                        f"partial rotary embeddings are not supported for {arch}")
    # Llama 3.1 onwards carries its scaling as the tensor rope_freqs.weight (`_llama3_scaling`).
    freqs = "rope_freqs.weight" in tensor_names
    if freqs and arch != "llama":
        raise GGUFError(f"{path}: tensor rope_freqs.weight (per-frequency rope scaling) is not supported "
                        f"for {arch}")
    scaling = _rope_scaling(path, meta, arch, cfg["max_position_embeddings"])
    if scaling is not None and freqs:
        raise GGUFError(f"{path}: both {arch}.rope.scaling.type={scaling['rope_type']!r} and tensor "
                        "rope_freqs.weight scale the rope; a file has one or the other")

    vocab = meta.get(f"{arch}.vocab_size")
    tokens = meta.get("tokenizer.ggml.tokens")
    if vocab is None:
        vocab = len(tokens) if tokens is not None else embed_rows
    if vocab is None:
        raise GGUFError(f"{path}: cannot tell the vocabulary size (no {arch}.vocab_size, "
                        "tokenizer.ggml.tokens or token_embd.weight)")
    if embed_rows is not None and embed_rows != vocab:
        raise GGUFError(f"{path}: token_embd.weight has {embed_rows} rows but the vocabulary "
                        f"size is {vocab}")
    cfg["vocab_size"] = vocab
    cfg["tie_word_embeddings"] = "output.weight" not in tensor_names
    cfg.update(hidden_act="silu", rope_scaling=scaling, torch_dtype="float32", **dict(conv.extra_config))
    for key, field in _TOKEN_ID_TABLE:
        if key in meta:
            if isinstance(meta[key], bool) or not isinstance(meta[key], int):
                raise GGUFError(f"{path}: metadata {key} should be a token id, got {meta[key]!r}")
            cfg[field] = meta[key]
    return conv.family_config(path, meta, cfg) if conv.family_config else cfg


def _expert_config(path: Path, meta: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """The HF expert fields of a qwen3moe, qwen2moe or Mixtral (`llama` with experts) file:
    `{arch}.expert_count`, `.expert_used_count`, the Qwen-MoE experts' `.expert_feed_forward_length`
    (Mixtral's are feed_forward_length) and Qwen2-MoE's `.expert_shared_feed_forward_length`. A
    dense architecture's file with an expert count is refused by name."""
    count = meta.get(f"{arch}.expert_count", 0)
    kind = _arch_of(meta)
    if not kind.experts:
        if count:
            raise GGUFError(f"{path}: {arch}.expert_count={count}: mixture-of-experts {arch} files are not "
                            "supported (of MoE files: Mixtral's llama, qwen3moe, qwen2moe)")
        return {}
    out = {}
    keys = [("expert_count", kind.experts_field), ("expert_used_count", "num_experts_per_tok")]
    if kind.width_field != "intermediate_size":
        keys.append(("expert_feed_forward_length", kind.width_field))
    if kind.shared_expert:
        keys.append(("expert_shared_feed_forward_length", "shared_expert_intermediate_size"))
    for key, field in keys:
        if f"{arch}.{key}" not in meta:
            raise GGUFError(f"{path}: required metadata {arch}.{key} is missing")
        out[field] = _uniform_int(path, f"{arch}.{key}", meta[f"{arch}.{key}"])
    if not 0 < out["num_experts_per_tok"] <= out[kind.experts_field]:
        raise GGUFError(f"{path}: {arch}.expert_used_count {out['num_experts_per_tok']} must be in "
                        f"[1, expert_count {out[kind.experts_field]}]")
    return out


def _positive(path: Path, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise GGUFError(f"{path}: metadata {key} should be a positive number, got {value!r}")
    return float(value)


# llama.cpp's block counts of the Gemma models that scale queries by hidden / heads instead of the head
# size (the 27B models; llama-model.cpp, after gemma_pytorch's config). Their HF configs say the same
# through query_pre_attn_scalar (144 and 168), which the metadata does not carry.
_GEMMA_HIDDEN_OVER_HEADS_LAYERS = {"gemma2": 46, "gemma3": 62}
# What llama.cpp hard-codes for Gemma 3's sliding layers: every sixth layer (5, 11, ...) attends fully,
# the others slide and rotate with base 10000, unscaled. Gemma 2: layers 0, 2, 4, ... slide.
_GEMMA_FULL_EVERY = {"gemma2": 2, "gemma3": 6}
_GEMMA3_LOCAL_ROPE_THETA = 10000.0


def _gemma_config(path: Path, meta: Mapping[str, Any], cfg: dict, arch: str) -> dict:
    """A Gemma 2 or Gemma 3 file's HF config fields besides the generic ones, as llama.cpp runs the
    file (`llama-model.cpp`): the GELU MLP; the query scale; which layers slide and their window
    (Gemma 2's default 4096; Gemma 3's is required, as llama.cpp requires it); the soft caps
    (Gemma 2: attention 50 and logits 30 unless the file says otherwise; Gemma 3: logits only,
    where the file has the key); and Gemma 3's two ropes as transformers 5 nests them."""
    cfg = dict(cfg)
    del cfg["hidden_act"]
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    layers, hidden, heads = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"]
    if layers == _GEMMA_HIDDEN_OVER_HEADS_LAYERS[arch]:
        cfg["query_pre_attn_scalar"] = hidden // heads  # llama.cpp's integer division
    else:
        cfg["query_pre_attn_scalar"] = cfg["head_dim"]
    key = f"{arch}.attention.sliding_window"
    if key in meta:
        window = _uniform_int(path, key, meta[key])
        if window <= 0:
            raise GGUFError(f"{path}: metadata {key} should be positive, got {window}")
    elif arch == "gemma2":
        window = 4096
    else:
        raise GGUFError(f"{path}: required metadata {key} is missing")
    every = _GEMMA_FULL_EVERY[arch]
    cfg["sliding_window"] = window
    cfg["layer_types"] = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    caps = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0} if arch == "gemma2" else {}
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        full = f"{arch}.{name}"
        if arch == "gemma3" and name == "attn_logit_softcapping" and full in meta:
            raise GGUFError(f"{path}: metadata {full}: Gemma 3 has no attention soft cap")
        cfg[name] = _positive(path, full, meta[full]) if full in meta else caps.get(name)
    if arch == "gemma3":
        scaling = cfg.pop("rope_scaling")
        theta = cfg.pop("rope_theta")
        full_rope = {"rope_type": "default"} if scaling is None else dict(scaling)
        cfg["rope_parameters"] = {"full_attention": dict(full_rope, rope_theta=theta),
                                  "sliding_attention": {"rope_type": "default", "rope_theta": _GEMMA3_LOCAL_ROPE_THETA}}
    return cfg


def _olmo2_config(path: Path, meta: Mapping[str, Any], cfg: dict) -> dict:
    """OLMo 2, or OLMo 3 where the file has a window: the layers `sliding_window_pattern` marks (a
    flag per layer, as the converter writes it; a number is llama.cpp's period, every period-th layer
    full; absent, 4) slide, and rotate with `rope.freq_base_swa` or else the full layers' base,
    unscaled (llama.cpp's olmo2 graph)."""
    window = meta.get("olmo2.attention.sliding_window", 0)
    if not window:
        return cfg
    cfg = dict(cfg, architectures=["Olmo3ForCausalLM"], model_type="olmo3",
               sliding_window=_uniform_int(path, "olmo2.attention.sliding_window", window))
    layers = cfg["num_hidden_layers"]
    pattern = meta.get("olmo2.attention.sliding_window_pattern", 4)
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise GGUFError(f"{path}: olmo2.attention.sliding_window_pattern has {len(pattern)} entries for "
                            f"{layers} layers")
        sliding = [bool(x) for x in pattern]
    else:
        period = _uniform_int(path, "olmo2.attention.sliding_window_pattern", pattern)
        sliding = [period > 0 and i % period < period - 1 for i in range(layers)]
    cfg["layer_types"] = ["sliding_attention" if x else "full_attention" for x in sliding]
    theta, scaling = cfg.pop("rope_theta"), cfg.pop("rope_scaling")
    local = float(meta.get("olmo2.rope.freq_base_swa", theta))
    cfg["rope_parameters"] = {"full_attention": dict(scaling or {"rope_type": "default"}, rope_theta=theta),
                              "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    return cfg


def _gpt_oss_config(path: Path, meta: Mapping[str, Any], cfg: dict) -> dict:
    """GPT-OSS: its window (required, as llama.cpp requires it) in layers 0, 2, 4, ... (llama.cpp's
    swa pattern 2), the others attending fully."""
    key = "gpt-oss.attention.sliding_window"
    if key not in meta:
        raise GGUFError(f"{path}: required metadata {key} is missing")
    window = _uniform_int(path, key, meta[key])
    layers = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(cfg["num_hidden_layers"])]
    return dict(cfg, sliding_window=window, layer_types=layers)


def _join_gpt_oss_experts(cfg: dict, state: dict) -> dict:
    """GPT-OSS: HF's gate_up_proj [E, D, 2 I] (gate in the even columns, up in the odd) and its bias,
    and down_proj [E, I, D], from the converter's per-projection [E, I, D] / [E, D, I] tensors."""
    state = dict(state)
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}.mlp.experts."
        gate, up = state.pop(pre + "gate"), state.pop(pre + "up")
        joined = np.empty((gate.shape[0], gate.shape[2], 2 * gate.shape[1]), np.float32)
        joined[..., 0::2], joined[..., 1::2] = gate.transpose(0, 2, 1), up.transpose(0, 2, 1)
        state[pre + "gate_up_proj"] = joined
        gate_b, up_b = state.pop(pre + "gate_bias"), state.pop(pre + "up_bias")
        bias = np.empty((gate_b.shape[0], 2 * gate_b.shape[1]), np.float32)
        bias[:, 0::2], bias[:, 1::2] = gate_b, up_b
        state[pre + "gate_up_proj_bias"] = bias
        state[pre + "down_proj"] = np.ascontiguousarray(state.pop(pre + "down").transpose(0, 2, 1))
    return state


def _smollm3_config(cfg: dict) -> dict:
    """SmolLM3's unrotated layers as its HF config lists them (1: rotated), llama.cpp's every fourth."""
    return dict(cfg, no_rope_layers=[int((i + 1) % 4 != 0) for i in range(cfg["num_hidden_layers"])])


# Granite's four scalars: the GGUF key (under the architecture) and the HF config field.
_GRANITE_TABLE = (("attention.scale", "attention_multiplier"), ("embedding_scale", "embedding_multiplier"),
                  ("residual_scale", "residual_multiplier"), ("logit_scale", "logits_scaling"))


def _granite_config(path: Path, meta: Mapping[str, Any], cfg: dict, arch: str) -> dict:
    """Granite's scalars, each required as llama.cpp requires it."""
    cfg = dict(cfg)
    for key, field in _GRANITE_TABLE:
        if f"{arch}.{key}" not in meta:
            raise GGUFError(f"{path}: required metadata {arch}.{key} is missing")
        cfg[field] = _positive(path, f"{arch}.{key}", meta[f"{arch}.{key}"])
    return cfg


def _join_granite_experts(cfg: dict, state: dict) -> dict:
    """Granite MoE: HF's input_linear [E, 2 I, D] from the converter's gate and up experts (gate rows
    first, as GraniteMoe splits it)."""
    state = dict(state)
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}.block_sparse_moe.input_linear."
        state[pre + "weight"] = np.ascontiguousarray(np.concatenate([state.pop(pre + "gate"), state.pop(pre + "up")],
                                                                    axis=1))
    return state


def _phi3_config(path: Path, meta: Mapping[str, Any], cfg: dict) -> dict:
    """A Phi-3 file's HF config fields besides the generic ones: its window over every layer (0, as
    the converter writes for Phi-4, is none) and the context its rope was trained for."""
    cfg = dict(cfg)
    window = _uniform_int(path, "phi3.attention.sliding_window", meta.get("phi3.attention.sliding_window", 0))
    cfg["sliding_window"] = window if window > 0 else None
    key = "phi3.rope.scaling.original_context_length"
    cfg["original_max_position_embeddings"] = (_uniform_int(path, key, meta[key]) if key in meta
                                               else cfg["max_position_embeddings"])
    # Phi3Config's default pad id (32000) is a token of Phi-3's vocabulary, not of every file's.
    cfg.setdefault("pad_token_id", None)
    return cfg


# The HF names of the hybrids' linear-attention fields and the llama.cpp `ssm.*` keys they come from
# (llama.cpp's converter: state size = the key head size, group count = key heads, time step rank =
# value heads, inner size = value heads x the value head size).
_LINEAR_TABLE = (("ssm.conv_kernel", "linear_conv_kernel_dim"), ("ssm.state_size", "linear_key_head_dim"),
                 ("ssm.group_count", "linear_num_key_heads"), ("ssm.time_step_rank", "linear_num_value_heads"))


def _hybrid_config(path: Path, meta: Mapping[str, Any], cfg: dict, arch: str) -> dict:
    """A Qwen3-Next or Qwen3.5 file's HF config fields besides the generic ones: which layers are
    linear (every `full_attention_interval`-th one attends; 4 when absent, as in llama.cpp), the
    linear layers' heads and conv width (`_LINEAR_TABLE`), and the rotated share of each attention
    head (`rope.dimension_count` over the head size). A file whose block count includes
    multi-token-prediction blocks (`nextn_predict_layers`) has them left out."""
    cfg = dict(cfg)
    nextn = _uniform_int(path, f"{arch}.nextn_predict_layers", meta.get(f"{arch}.nextn_predict_layers", 0))
    layers = cfg["num_hidden_layers"] - nextn
    if layers <= 0:
        raise GGUFError(f"{path}: {arch}.nextn_predict_layers {nextn} leaves no layers of block_count "
                        f"{cfg['num_hidden_layers']}")
    cfg["num_hidden_layers"] = layers
    for key, field in _LINEAR_TABLE:
        if f"{arch}.{key}" not in meta:
            raise GGUFError(f"{path}: required metadata {arch}.{key} is missing")
        cfg[field] = _uniform_int(path, f"{arch}.{key}", meta[f"{arch}.{key}"])
    inner = _uniform_int(path, f"{arch}.ssm.inner_size", meta.get(f"{arch}.ssm.inner_size", 0))
    heads, kheads = cfg["linear_num_value_heads"], cfg["linear_num_key_heads"]
    if inner <= 0 or inner % heads or heads % kheads:
        raise GGUFError(f"{path}: {arch}.ssm.inner_size {inner} must be a positive multiple of "
                        f"ssm.time_step_rank {heads}, itself a multiple of ssm.group_count {kheads}")
    cfg["linear_value_head_dim"] = inner // heads
    every = _uniform_int(path, f"{arch}.full_attention_interval", meta.get(f"{arch}.full_attention_interval", 4))
    if every <= 0:
        raise GGUFError(f"{path}: {arch}.full_attention_interval should be positive, got {every}")
    cfg["layer_types"] = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(layers)]
    rotated = _uniform_int(path, f"{arch}.rope.dimension_count",
                           meta.get(f"{arch}.rope.dimension_count", cfg["head_dim"]))
    if not 0 < rotated <= cfg["head_dim"] or rotated % 2:
        raise GGUFError(f"{path}: {arch}.rope.dimension_count {rotated} must be even and in (0, head size "
                        f"{cfg['head_dim']}]")
    cfg["partial_rotary_factor"] = rotated / cfg["head_dim"]
    if cfg.get("rope_scaling") is not None:
        raise GGUFError(f"{path}: rope scaling ({cfg['rope_scaling']['rope_type']}) is not supported for {arch}")
    del cfg["rope_scaling"]
    if arch != "qwen3next":  # Qwen3.5's interleaved multimodal rope, which text positions make a plain one
        sections = meta.get(f"{arch}.rope.dimension_sections")
        rope = {"rope_type": "default", "rope_theta": cfg.pop("rope_theta"),
                "partial_rotary_factor": cfg["partial_rotary_factor"], "mrope_interleaved": True}
        if isinstance(sections, list) and len(sections) >= 3:
            rope["mrope_section"] = [int(x) for x in sections[:3]]
        cfg["rope_parameters"] = rope
    return cfg


def _untile_value_heads(w: np.ndarray, axis: int, c: dict, size: int) -> np.ndarray:
    """Undo llama.cpp's Qwen3.5 value-head order along `axis` (heads of `size` entries each).

    HF groups the value heads by the key head they serve, [g0 v0, g0 v1, ..., g1 v0, ...]; the
    converter stores them tiled, [g0 v0, g1 v0, ..., g0 v1, ...], where a model has fewer key heads
    than value heads (it did `reshape(Hk, r, size).swapaxes` on that axis; this swaps back)."""
    kheads, heads = c["linear_num_key_heads"], c["linear_num_value_heads"]
    if kheads == heads:
        return w
    r = heads // kheads
    shape = w.shape
    tiled = w.reshape(*shape[:axis], r, kheads, size, *shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(tiled, axis, axis + 1).reshape(shape))


def _linear_dims(c: dict) -> tuple[int, int]:
    """(key channels, value channels) of a linear layer: Hk x Dk and Hv x Dv."""
    return (c["linear_num_key_heads"] * c["linear_key_head_dim"],
            c["linear_num_value_heads"] * c["linear_value_head_dim"])


def _linear_tensor(kind: str) -> Callable[[np.ndarray, dict, _Arch], np.ndarray]:
    """The transform of a linear layer's tensor: Qwen3.5's value heads back in HF's order, and
    A_log and the conv kernel back from what the converter made of them."""
    def transform(w: np.ndarray, c: dict, arch: _Arch) -> np.ndarray:
        kd, vd = _linear_dims(c)
        dv = c["linear_value_head_dim"]
        tiled = arch.tiled_value_heads
        if kind == "qkv" and tiled:  # q | k | v rows; only v's heads were reordered
            w = np.concatenate([w[:2 * kd], _untile_value_heads(w[2 * kd:], 0, c, dv)])
        elif kind == "z" and tiled:
            w = _untile_value_heads(w, 0, c, dv)
        elif kind in ("a", "b", "dt") and tiled:
            w = _untile_value_heads(w, 0, c, 1)
        elif kind == "A":  # stored as -exp(A_log)
            if not np.all(w < 0):
                raise GGUFError(f"ssm_a holds {w.max():g}: llama.cpp stores -exp(A_log), which is negative")
            w = np.log(-w.astype(np.float64)).astype(np.float32)
            w = _untile_value_heads(w, 0, c, 1) if tiled else w
        elif kind == "conv":  # [C, K] -> HF's [C, 1, K]; the v channels' heads reordered like v's rows
            if tiled:
                w = np.concatenate([w[:2 * kd], _untile_value_heads(w[2 * kd:], 0, c, dv)])
            w = w[:, None, :]
        elif kind == "out" and tiled:  # columns are value channels
            w = _untile_value_heads(w, 1, c, dv)
        return w
    return transform


def _join_qkvz(cfg: dict, state: dict) -> dict:
    """Qwen3-Next: HF's in_proj_qkvz from the converter's q|k|v (part by part) and z. HF holds, per
    key head, its q rows, its k rows, then the v and the z rows of the value heads it serves."""
    kheads, dk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
    served = cfg["linear_num_value_heads"] // kheads * cfg["linear_value_head_dim"]
    kd = kheads * dk
    state = dict(state)
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}.linear_attn."
        if pre + "in_proj_qkv.weight" not in state:
            continue
        qkv, z = state.pop(pre + "in_proj_qkv.weight"), state.pop(pre + "in_proj_z.weight")
        d = qkv.shape[1]
        parts = [qkv[:kd].reshape(kheads, dk, d), qkv[kd:2 * kd].reshape(kheads, dk, d),
                 qkv[2 * kd:].reshape(kheads, served, d), z.reshape(kheads, served, d)]
        state[pre + "in_proj_qkvz.weight"] = np.ascontiguousarray(np.concatenate(parts, axis=1).reshape(-1, d))
    return state


# llama.cpp's `rope.scaling.*` keys and the values under which its rope equals transformers' (the
# "yarn" attention factor is llama.cpp's `attn_factor` times mscale(factor), but HF's replaces
# mscale; ext_factor -1 means "1 for yarn"). Any other value is refused, not approximated.
_NEUTRAL_YARN_KEYS = {"attn_factor": (1.0,), "yarn_attn_factor": (1.0,), "yarn_ext_factor": (1.0, -1.0),
                      "yarn_log_multiplier": (0.0,)}


def _rope_scaling(path: Path, meta: Mapping[str, Any], arch: str, context: int) -> dict[str, Any] | None:
    """The HF `rope_scaling` dict of `{arch}.rope.scaling.*` ("linear" or "yarn"), or None."""
    key = f"{arch}.rope.scaling."
    kind = meta.get(key + "type", "none")

    def number(name, default=_REQUIRED):
        if key + name not in meta:
            if default is _REQUIRED:
                raise GGUFError(f"{path}: {key}type={kind!r} needs metadata {key}{name}")
            return default
        value = meta[key + name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise GGUFError(f"{path}: metadata {key}{name} should be a positive number, got {value!r}")
        return value

    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(number("factor"))}
    if kind == "yarn":
        for name, neutral in _NEUTRAL_YARN_KEYS.items():
            if key + name in meta and meta[key + name] not in neutral:
                raise GGUFError(f"{path}: {key}{name}={meta[key + name]!r} is not supported with yarn "
                                f"(only {' or '.join(map(str, neutral))})")
        return {"rope_type": "yarn", "factor": float(number("factor")),
                "original_max_position_embeddings": _uniform_int(
                    path, key + "original_context_length", number("original_context_length", context)),
                "beta_fast": float(number("yarn_beta_fast", 32.0)),
                "beta_slow": float(number("yarn_beta_slow", 1.0))}
    raise GGUFError(f"{path}: rope scaling {key}type={kind!r} is not supported (only none, linear, yarn)")


# Llama 3.1 onwards: llama.cpp stores the rope's per-frequency divisors, computed from HF's
# `rope_scaling` "llama3" (factor, low_freq_factor, high_freq_factor, original context O), as the
# tensor `rope_freqs.weight`: 1 for wavelengths below O / high, `factor` above O / low, and
# 1 / ((1 - s) / factor + s) in between, s = (O / wavelength - low) / (high - low). The metadata
# keeps none of the four. The divisors depend on O, low and high only through their ratios
# (scaling all three by k leaves O / low, O / high and s unchanged), so O is taken as Llama 3's
# own context (or the model's, when shorter: transformers wants O below it) and the two factors
# are solved from the blended frequencies, s being a line in 1 / wavelength; the result must
# reproduce every stored divisor.
LLAMA3_ORIGINAL_CONTEXT = 8192


def _llama3_divisors(inv_freq: np.ndarray, factor: float, low: float, high: float, context: float) -> np.ndarray:
    """llama.cpp's `rope_freqs` for Llama-3 scaling (the formula above)."""
    wavelen = 2 * np.pi / inv_freq
    s = (context / wavelen - low) / (high - low)
    blended = 1.0 / ((1 - s) / factor + s)
    return np.where(wavelen < context / high, 1.0, np.where(wavelen > context / low, factor, blended))


def _llama3_scaling(path: Path, divisors: np.ndarray, cfg: dict) -> dict[str, Any]:
    """The HF `rope_scaling` dict that reproduces `rope_freqs.weight` (see above)."""
    d = np.asarray(divisors, np.float64).reshape(-1)
    head_dim = cfg["head_dim"]
    inv = 1.0 / float(cfg["rope_theta"]) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    problem = None
    if d.shape != inv.shape:
        problem = f"has {d.size} values for {inv.size} rope frequencies"
    elif not np.all(np.isfinite(d)) or d.min() < 1 - 1e-6 or d.max() <= 1 + 1e-6:
        problem = f"holds divisors from {d.min():g} to {d.max():g}, not Llama-3 scaling (1 .. factor > 1)"
    else:
        factor = float(d.max())
        blended = (d > 1 + 1e-6) & (d < factor * (1 - 1e-6))
        if blended.sum() < 2:
            problem = f"blends {int(blended.sum())} frequencies; 2 are needed to recover the scaling"
        else:
            s = (1 / d[blended] - 1 / factor) / (1 - 1 / factor)
            # s = context / (high - low) * (1 / wavelength) - low / (high - low)
            slope, offset = np.polyfit(inv[blended] / (2 * np.pi), s, 1)
            context = min(LLAMA3_ORIGINAL_CONTEXT, int(cfg["max_position_embeddings"]))
            span = context / slope  # high - low
            low = round(float(-offset * span), 6)
            high = round(low + float(span), 6)
            scaling = {"rope_type": "llama3", "factor": round(factor, 6), "low_freq_factor": low,
                       "high_freq_factor": high, "original_max_position_embeddings": context}
            again = _llama3_divisors(inv, scaling["factor"], low, high, context)
            if 0 < low < high and np.allclose(again, d, rtol=1e-4, atol=0):
                return scaling
            problem = "does not follow Llama-3 scaling (no factors reproduce it)"
    raise GGUFError(f"{path}: tensor rope_freqs.weight {problem}")


# --------------------------------------------------------------------------------------------------
# Tensors: GGUF names -> HF names, with shape checks and the rope un-permutation
# --------------------------------------------------------------------------------------------------


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head q/k row interleave (see the module docstring).

    `w` is (n_head * head_dim, in); GGUF row 2 * b + a of each head becomes HF row a * Dh/2 + b.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise GGUFError(f"cannot un-permute {w.shape} for {n_head} heads: rows not a multiple of "
                        f"2 * heads")
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclasses.dataclass(frozen=True)
class _TensorRule:
    """One row of the conversion table: a GGUF name pattern, the HF name template (`{layer}`
    filled from the pattern's group), the expected HF shape, an optional transform, and which
    architectures have the tensor (None: all)."""

    pattern: re.Pattern
    hf_name: str
    shape: Callable[[dict], tuple[int, ...]]
    transform: Callable[[np.ndarray, dict, _Arch], np.ndarray] | None = None
    applies: Callable[[_Arch], bool] | None = None

    def for_arch(self, arch: _Arch) -> bool:
        return self.applies is None or self.applies(arch)


def _q_dim(c):
    return c["num_attention_heads"] * c["head_dim"]


def _kv_dim(c):
    return c["num_key_value_heads"] * c["head_dim"]


def _rope_rows(heads: str):
    """The transform of q_proj / k_proj (`heads`: the config field of their head count)."""
    return lambda w, c, arch: unpermute_rope_rows(w, c[heads]) if arch.permuted_rope else w


def _bias(arch: _Arch) -> bool:
    return arch.qkv_bias


def _qk_norm(arch: _Arch) -> bool:  # per head
    return arch.qk_norm and not arch.whole_qk_norm


def _whole_qk_norm(arch: _Arch) -> bool:
    return arch.whole_qk_norm


def _input_norm(arch: _Arch) -> bool:
    return not arch.output_norms_only


def _n_experts(c):
    return c.get("num_experts", c.get("num_local_experts"))


def _expert_width(c):
    return c["moe_intermediate_size"] if "moe_intermediate_size" in c else c["intermediate_size"]


def _dense(arch: _Arch) -> bool:
    return not arch.experts


def _split_experts(arch: _Arch) -> bool:  # one HF tensor per expert
    return arch.experts and not arch.stacked_experts and not arch.gpt_oss


def _gpt_oss(arch: _Arch) -> bool:
    return arch.gpt_oss


def _stacked_experts(arch: _Arch) -> bool:
    return arch.stacked_experts


def _split(arch: _Arch) -> bool:  # separate q / k / v and gate / up tensors (all but Phi-3)
    return not arch.fused


def _dense_split(arch: _Arch) -> bool:
    return _dense(arch) and _split(arch)


def _fused(arch: _Arch) -> bool:
    return arch.fused


def _post_norms(arch: _Arch) -> bool:
    return arch.post_norms


def _pre_norms_only(arch: _Arch) -> bool:
    return not (arch.post_norms or arch.hybrid or arch.output_norms_only or arch.gpt_oss)


def _post_attention_norm(arch: _Arch) -> bool:  # Gemma's and OLMo's output norm; the others' MLP input norm
    return arch.post_norms or arch.hybrid or arch.output_norms_only or arch.gpt_oss


def _post_ffw_norm(arch: _Arch) -> bool:
    return arch.post_norms or arch.output_norms_only


def _hybrid(arch: _Arch) -> bool:
    return arch.hybrid


def _plain_attention(arch: _Arch) -> bool:  # separate q / k / v, no output gate in q
    return not arch.fused and not arch.hybrid


def _qwen3next(arch: _Arch) -> bool:  # b and a in one tensor
    return arch.model_type == "qwen3_next"


def _qwen35(arch: _Arch) -> bool:  # b and a apart
    return arch.hybrid and arch.model_type != "qwen3_next"


def _expert_rows(router: str, gate: str, up: str, down: str, applies: Callable[[_Arch], bool]) -> tuple:
    """A mixture of experts' router [E, D] and its experts' gate, up [E, I, D] and down [E, D, I]
    projections, each stacked in one tensor, under the family's HF names (after `model.layers.N.`)."""
    return tuple((rf"blk\.(\d+)\.{name}\.weight", "model.layers.{layer}." + hf, shape, None, applies)
                 for name, hf, shape in (
                     ("ffn_gate_inp", router, lambda c: (_n_experts(c), c["hidden_size"])),
                     ("ffn_gate_exps", gate, lambda c: (_n_experts(c), _expert_width(c), c["hidden_size"])),
                     ("ffn_up_exps", up, lambda c: (_n_experts(c), _expert_width(c), c["hidden_size"])),
                     ("ffn_down_exps", down, lambda c: (_n_experts(c), c["hidden_size"], _expert_width(c)))))


def _linear_rule(pattern: str, hf: str, shape: Callable[[dict], tuple[int, ...]], kind: str,
                 applies: Callable[[_Arch], bool] = _hybrid) -> tuple:
    return (pattern, "model.layers.{layer}.linear_attn." + hf, shape, _linear_tensor(kind), applies)


def _shared(arch: _Arch) -> bool:
    return arch.shared_expert


_TENSOR_TABLE: tuple[_TensorRule, ...] = tuple(
    _TensorRule(re.compile(p), h, s, t, a)
    for p, h, s, t, a in (
        (r"token_embd\.weight", "model.embed_tokens.weight",
         lambda c: (c["vocab_size"], c["hidden_size"]), None, None),
        (r"output_norm\.weight", "model.norm.weight", lambda c: (c["hidden_size"],), None, None),
        (r"output\.weight", "lm_head.weight", lambda c: (c["vocab_size"], c["hidden_size"]), None, None),
        (r"blk\.(\d+)\.attn_norm\.weight", "model.layers.{layer}.input_layernorm.weight",
         lambda c: (c["hidden_size"],), None, _input_norm),
        (r"blk\.(\d+)\.ffn_norm\.weight", "model.layers.{layer}.post_attention_layernorm.weight",
         lambda c: (c["hidden_size"],), None, _pre_norms_only),
        # Gemma: the attention's output norm, and the MLP's input and output norms. Qwen3-Next and
        # Qwen3.5 name their MLP's input norm as Gemma's attention output norm.
        (r"blk\.(\d+)\.post_attention_norm\.weight", "model.layers.{layer}.post_attention_layernorm.weight",
         lambda c: (c["hidden_size"],), None, _post_attention_norm),
        (r"blk\.(\d+)\.ffn_norm\.weight", "model.layers.{layer}.pre_feedforward_layernorm.weight",
         lambda c: (c["hidden_size"],), None, _post_norms),
        (r"blk\.(\d+)\.post_ffw_norm\.weight", "model.layers.{layer}.post_feedforward_layernorm.weight",
         lambda c: (c["hidden_size"],), None, _post_ffw_norm),
        (r"blk\.(\d+)\.attn_q\.weight", "model.layers.{layer}.self_attn.q_proj.weight",
         lambda c: (_q_dim(c), c["hidden_size"]), _rope_rows("num_attention_heads"), _plain_attention),
        # The hybrids' gated attention: each head's q rows, then its output gate's.
        (r"blk\.(\d+)\.attn_q\.weight", "model.layers.{layer}.self_attn.q_proj.weight",
         lambda c: (2 * _q_dim(c), c["hidden_size"]), None, _hybrid),
        (r"blk\.(\d+)\.attn_k\.weight", "model.layers.{layer}.self_attn.k_proj.weight",
         lambda c: (_kv_dim(c), c["hidden_size"]), _rope_rows("num_key_value_heads"), _split),
        (r"blk\.(\d+)\.attn_v\.weight", "model.layers.{layer}.self_attn.v_proj.weight",
         lambda c: (_kv_dim(c), c["hidden_size"]), None, _split),
        # Phi-3: q | k | v rows in one tensor, and gate | up rows in one, as HF stores them.
        (r"blk\.(\d+)\.attn_qkv\.weight", "model.layers.{layer}.self_attn.qkv_proj.weight",
         lambda c: (_q_dim(c) + 2 * _kv_dim(c), c["hidden_size"]), None, _fused),
        # Qwen3-Next's and Qwen3.5's linear layers (the arch's comment in `_ARCHS`, `_linear_tensor`);
        # Qwen3-Next's q|k|v and z are joined into its in_proj_qkvz at the end (`_join_qkvz`).
        _linear_rule(r"blk\.(\d+)\.attn_qkv\.weight", "in_proj_qkv.weight",
                     lambda c: (2 * _linear_dims(c)[0] + _linear_dims(c)[1], c["hidden_size"]), "qkv"),
        _linear_rule(r"blk\.(\d+)\.attn_gate\.weight", "in_proj_z.weight",
                     lambda c: (_linear_dims(c)[1], c["hidden_size"]), "z"),
        _linear_rule(r"blk\.(\d+)\.ssm_ba\.weight", "in_proj_ba.weight",
                     lambda c: (2 * c["linear_num_value_heads"], c["hidden_size"]), "ba", _qwen3next),
        _linear_rule(r"blk\.(\d+)\.ssm_beta\.weight", "in_proj_b.weight",
                     lambda c: (c["linear_num_value_heads"], c["hidden_size"]), "b", _qwen35),
        _linear_rule(r"blk\.(\d+)\.ssm_alpha\.weight", "in_proj_a.weight",
                     lambda c: (c["linear_num_value_heads"], c["hidden_size"]), "a", _qwen35),
        _linear_rule(r"blk\.(\d+)\.ssm_a", "A_log", lambda c: (c["linear_num_value_heads"],), "A"),
        _linear_rule(r"blk\.(\d+)\.ssm_dt\.bias", "dt_bias", lambda c: (c["linear_num_value_heads"],), "dt"),
        _linear_rule(r"blk\.(\d+)\.ssm_conv1d\.weight", "conv1d.weight",
                     lambda c: (2 * _linear_dims(c)[0] + _linear_dims(c)[1], c["linear_conv_kernel_dim"]), "conv"),
        _linear_rule(r"blk\.(\d+)\.ssm_norm\.weight", "norm.weight", lambda c: (c["linear_value_head_dim"],),
                     "norm"),
        _linear_rule(r"blk\.(\d+)\.ssm_out\.weight", "out_proj.weight",
                     lambda c: (c["hidden_size"], _linear_dims(c)[1]), "out"),
        (r"blk\.(\d+)\.ffn_up\.weight", "model.layers.{layer}.mlp.gate_up_proj.weight",
         lambda c: (2 * c["intermediate_size"], c["hidden_size"]), None, _fused),
        (r"blk\.(\d+)\.attn_output\.weight", "model.layers.{layer}.self_attn.o_proj.weight",
         lambda c: (c["hidden_size"], _q_dim(c)), None, None),
        (r"blk\.(\d+)\.ffn_gate\.weight", "model.layers.{layer}.mlp.gate_proj.weight",
         lambda c: (c["intermediate_size"], c["hidden_size"]), None, _dense_split),
        (r"blk\.(\d+)\.ffn_up\.weight", "model.layers.{layer}.mlp.up_proj.weight",
         lambda c: (c["intermediate_size"], c["hidden_size"]), None, _dense_split),
        (r"blk\.(\d+)\.ffn_down\.weight", "model.layers.{layer}.mlp.down_proj.weight",
         lambda c: (c["hidden_size"], c["intermediate_size"]), None, _dense),
        # Qwen3-MoE, Qwen2-MoE and Mixtral: the router, and each projection of every expert in one
        # [E, out, in] tensor, split into HF's one tensor per expert (Qwen-MoE names; Mixtral's by
        # `_Arch.renames`).
        *_expert_rows("mlp.gate.weight", "mlp.experts.{expert}.gate_proj.weight",
                      "mlp.experts.{expert}.up_proj.weight", "mlp.experts.{expert}.down_proj.weight", _split_experts),
        # GPT-OSS: the router and its bias, each projection's experts and biases (joined at the end,
        # `_join_gpt_oss_experts`), the attention's sinks and output bias.
        (r"blk\.(\d+)\.ffn_gate_inp\.bias", "model.layers.{layer}.mlp.router.bias",
         lambda c: (_n_experts(c),), None, _gpt_oss),
        *_expert_rows("mlp.router.weight", "mlp.experts.gate", "mlp.experts.up", "mlp.experts.down", _gpt_oss),
        (r"blk\.(\d+)\.ffn_gate_exps\.bias", "model.layers.{layer}.mlp.experts.gate_bias",
         lambda c: (_n_experts(c), _expert_width(c)), None, _gpt_oss),
        (r"blk\.(\d+)\.ffn_up_exps\.bias", "model.layers.{layer}.mlp.experts.up_bias",
         lambda c: (_n_experts(c), _expert_width(c)), None, _gpt_oss),
        (r"blk\.(\d+)\.ffn_down_exps\.bias", "model.layers.{layer}.mlp.experts.down_proj_bias",
         lambda c: (_n_experts(c), c["hidden_size"]), None, _gpt_oss),
        (r"blk\.(\d+)\.attn_sinks\.weight", "model.layers.{layer}.self_attn.sinks",
         lambda c: (c["num_attention_heads"],), None, _gpt_oss),
        (r"blk\.(\d+)\.attn_output\.bias", "model.layers.{layer}.self_attn.o_proj.bias",
         lambda c: (c["hidden_size"],), None, _gpt_oss),
        # Granite MoE: its router, and its experts stacked as HF stores them; gate and up are joined
        # into input_linear at the end (`_join_granite_experts`).
        *_expert_rows("block_sparse_moe.router.layer.weight", "block_sparse_moe.input_linear.gate",
                      "block_sparse_moe.input_linear.up", "block_sparse_moe.output_linear.weight", _stacked_experts),
        # Qwen2-MoE's shared expert, and its gate's one row, stored as a vector.
        (r"blk\.(\d+)\.ffn_gate_shexp\.weight", "model.layers.{layer}.mlp.shared_expert.gate_proj.weight",
         lambda c: (c["shared_expert_intermediate_size"], c["hidden_size"]), None, _shared),
        (r"blk\.(\d+)\.ffn_up_shexp\.weight", "model.layers.{layer}.mlp.shared_expert.up_proj.weight",
         lambda c: (c["shared_expert_intermediate_size"], c["hidden_size"]), None, _shared),
        (r"blk\.(\d+)\.ffn_down_shexp\.weight", "model.layers.{layer}.mlp.shared_expert.down_proj.weight",
         lambda c: (c["hidden_size"], c["shared_expert_intermediate_size"]), None, _shared),
        (r"blk\.(\d+)\.ffn_gate_inp_shexp\.weight", "model.layers.{layer}.mlp.shared_expert_gate.weight",
         lambda c: (c["hidden_size"],), lambda w, c, arch: w[None, :], _shared),
        # Qwen2: q/k/v biases. NEOX rope keeps HF's row order, so they need no permutation either.
        (r"blk\.(\d+)\.attn_q\.bias", "model.layers.{layer}.self_attn.q_proj.bias",
         lambda c: (_q_dim(c),), None, _bias),
        (r"blk\.(\d+)\.attn_k\.bias", "model.layers.{layer}.self_attn.k_proj.bias",
         lambda c: (_kv_dim(c),), None, _bias),
        (r"blk\.(\d+)\.attn_v\.bias", "model.layers.{layer}.self_attn.v_proj.bias",
         lambda c: (_kv_dim(c),), None, _bias),
        # Qwen3: per-head q/k RMSNorm weights, one head_dim vector each.
        (r"blk\.(\d+)\.attn_q_norm\.weight", "model.layers.{layer}.self_attn.q_norm.weight",
         lambda c: (c["head_dim"],), None, _qk_norm),
        (r"blk\.(\d+)\.attn_k_norm\.weight", "model.layers.{layer}.self_attn.k_norm.weight",
         lambda c: (c["head_dim"],), None, _qk_norm),
        # OLMo: one q and one k RMSNorm over each whole projection.
        (r"blk\.(\d+)\.attn_q_norm\.weight", "model.layers.{layer}.self_attn.q_norm.weight",
         lambda c: (_q_dim(c),), None, _whole_qk_norm),
        (r"blk\.(\d+)\.attn_k_norm\.weight", "model.layers.{layer}.self_attn.k_norm.weight",
         lambda c: (_kv_dim(c),), None, _whole_qk_norm),
    )
)


def _expected_hf_names(cfg: dict, arch: _Arch) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg["tie_word_embeddings"]:
        names.add("lm_head.weight")
    for rule in _TENSOR_TABLE:
        if "{layer}" in rule.hf_name and rule.for_arch(arch):
            names.update(arch.hf(rule.hf_name).format(layer=i, expert=e) for i in range(cfg["num_hidden_layers"])
                         for e in (range(_n_experts(cfg)) if "{expert}" in rule.hf_name else [None]))
    if arch.hybrid:  # a linear layer has no self_attn tensors, an attention layer no linear_attn ones
        kinds = cfg["layer_types"]
        names = {n for n in names if not n.startswith("model.layers.") or
                 (".self_attn." if kinds[int(n.split(".")[2])] == "linear_attention" else ".linear_attn.") not in n}
    return names


def _dequantize(path: Path, tensor) -> np.ndarray:
    gguf = _gguf()
    type_name = tensor.tensor_type.name
    if type_name not in SUPPORTED_TENSOR_TYPES:
        raise GGUFError(f"{path}: tensor {tensor.name!r} has ggml type {type_name}, which is not "
                        f"supported (supported: {', '.join(SUPPORTED_TENSOR_TYPES)})")
    try:
        if type_name == "Q8_K":
            values = _dequantize_q8_k(tensor.data)
        else:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except ValueError as e:  # the gguf package's words (a reshape) for data that cannot hold the shape
        raise GGUFError(f"{path}: tensor {tensor.name!r} of shape {tensor.shape.tolist()} (ggml order) cannot be "
                        f"read as {type_name} ({e})") from None
    # numpy order of the logical shape: ggml lists dims fastest-first.
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    if values.size != int(np.prod(shape)):
        raise GGUFError(f"{path}: tensor {tensor.name!r} dequantized to {values.size} values, "
                        f"expected {shape}")
    return np.ascontiguousarray(values.reshape(shape), dtype=np.float32)


def _dequantize_q8_k(data: np.ndarray) -> np.ndarray:
    """Flat float32 values of ggml `block_q8_K` data (ggml-common.h): per 256 values a float32
    scale d, int8 qs[256] and int16 bsums[16] (sums for dot products, unused here); y = d * qs."""
    gguf = _gguf()
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_K]  # (256, 4 + 256 + 32)
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(-1, size)
    d = blocks[:, :4].copy().view("<f4").astype(np.float32)  # [blocks, 1]
    qs = blocks[:, 4:4 + block].view(np.int8).astype(np.float32)
    return (d * qs).reshape(-1)


def _read(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, Any]]:
    """(HF config, HF state dict, raw metadata) of the GGUF file at `path`."""
    reader = _open_reader(path)
    meta = _metadata(reader)
    by_name = {t.name: t for t in reader.tensors}
    embed = by_name.get("token_embd.weight")
    embed_rows = int(embed.shape[-1]) if embed is not None and len(embed.shape) == 2 else None
    cfg = _config_from_metadata(path, meta, set(by_name), embed_rows)
    arch = _arch_of(meta)  # checked by _config_from_metadata

    factors = sorted(n for n in by_name if n in ("rope_factors_long.weight", "rope_factors_short.weight"))
    if factors:
        raise GGUFError(f"{path}: tensors {', '.join(factors)} scale the rope per frequency (LongRoPE, Phi-3's "
                        "long-context models), which is not supported")
    if "rope_freqs.weight" in by_name:  # only a Llama file gets here with one
        cfg["rope_scaling"] = _llama3_scaling(path, _dequantize(path, by_name.pop("rope_freqs.weight")), cfg)

    state: dict[str, np.ndarray] = {}
    unmapped: list[str] = []
    blocks = _uniform_int(path, f"{meta['general.architecture']}.block_count",
                          meta[f"{meta['general.architecture']}.block_count"])
    for name, tensor in by_name.items():
        block = re.match(r"blk\.(\d+)\.", name)
        if block and cfg["num_hidden_layers"] <= int(block.group(1)) < blocks:
            continue  # a multi-token-prediction block (`nextn_predict_layers`), not loaded
        for rule in _TENSOR_TABLE:
            m = rule.pattern.fullmatch(name) if rule.for_arch(arch) else None
            if m:
                break
        else:
            unmapped.append(name)
            continue
        layer = int(m.group(1)) if m.groups() else None
        if layer is not None and layer >= cfg["num_hidden_layers"]:
            raise GGUFError(f"{path}: tensor {name!r} belongs to layer {layer}, but block_count "
                            f"is {blocks}")
        hf_name = arch.hf(rule.hf_name).format(layer=layer, expert="{expert}")
        values = _dequantize(path, tensor)
        want = rule.shape(cfg)
        if values.shape == (1, *want):  # e.g. a shared expert's gate as HF's [1, D] (the converter
            values = values.reshape(want)  # writes it as it is); older files store the vector
        if values.shape != want:
            raise GGUFError(f"{path}: tensor {name!r} ({hf_name}) has shape {values.shape}, "
                            f"expected {want} from the metadata")
        try:
            values = rule.transform(values, cfg, arch) if rule.transform else values
        except GGUFError as e:
            raise GGUFError(f"{path}: tensor {name!r}: {e}") from None
        # Gemma's and the hybrids' zero-centred norms (the module docstring); not the hybrids' gated
        # norm, which scales by its weight as it is.
        if arch.norm_offset and name.endswith("norm.weight") and not name.endswith("ssm_norm.weight"):
            values = values - np.float32(arch.norm_offset)
        if "{expert}" in hf_name:  # one HF tensor per expert
            state.update((hf_name.format(expert=e), np.ascontiguousarray(v)) for e, v in enumerate(values))
        else:
            state[hf_name] = values
    if unmapped:
        early = any(re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight", n) for n in unmapped)
        hint = ("; one tensor per expert is the layout of early Mixtral files: convert it again with a current "
                "llama.cpp, which stacks them (ffn_gate_exps, ...)") if early else ""
        raise GGUFError(f"{path}: tensors with no {meta['general.architecture']} mapping: "
                        f"{', '.join(sorted(unmapped))}{hint}")
    expected = _expected_hf_names(cfg, arch)
    missing = expected - set(state)
    if missing:
        raise GGUFError(f"{path}: missing tensors for {', '.join(sorted(missing))}")
    extra = set(state) - expected
    if extra:
        raise GGUFError(f"{path}: tensors for {', '.join(sorted(extra))}, which this {meta['general.architecture']} "
                        "model does not have (a layer of the other kind?)")
    if arch.finish:
        state = arch.finish(cfg, state)
    return cfg, state, meta


def read_gguf(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read a GGUF file of a supported architecture (`SUPPORTED_ARCHITECTURES`: Llama, Qwen2, Qwen3,
    Mixtral, Qwen2/3-MoE, Gemma 2, Gemma 3, Phi-3, SmolLM3, Granite, Granite MoE, OLMo 2/3, OLMoE, GPT-OSS,
    Qwen3-Next, Qwen3.5) as an HF config dict and float32 state dict.

    Returns `(config, state)`: `config` holds the HF config fields (sizes, head_dim, rope_theta,
    rms_norm_eps, tie_word_embeddings, bos/eos/pad ids, max_position_embeddings, vocab_size);
    `state` maps standard HF names (`model.layers.0.self_attn.q_proj.weight`, ...) to float32
    arrays in HF layout (Llama's q/k rows un-permuted; Qwen2's biases, Qwen3's q/k norms, Qwen3-MoE's
    router and one tensor per expert, Gemma's norms less the 1 llama.cpp adds, Phi-3's fused tensors). With
    tied embeddings there is no `lm_head.weight`.
    Raises `GGUFError` naming the file and the offending field or tensor.
    """
    cfg, state, _ = _read(Path(path))
    return cfg, state


# --------------------------------------------------------------------------------------------------
# Writing the HF directory
# --------------------------------------------------------------------------------------------------


def _generation_config(cfg: dict, meta: Mapping[str, Any]) -> dict[str, Any]:
    gen: dict[str, Any] = {"_from_model_config": True}
    for field in ("bos_token_id", "pad_token_id"):
        if field in cfg:
            gen[field] = cfg[field]
    # llama.cpp also stops on an end-of-turn token when the file names one (chat models).
    eos = [cfg[k] for k in ("eos_token_id",) if k in cfg]
    if "tokenizer.ggml.eot_token_id" in meta and int(meta["tokenizer.ggml.eot_token_id"]) not in eos:
        eos.append(int(meta["tokenizer.ggml.eot_token_id"]))
    if eos:
        gen["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return gen


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def gguf_to_hf_dir(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *,
                   overwrite: bool = False, source_sha256: str | None = None) -> Path:
    """Convert a GGUF file into an HF checkpoint directory at `out_dir`; returns `out_dir`.

    Writes config.json, model.safetensors (float32, HF names), tokenizer.json,
    tokenizer_config.json (special tokens, chat template), generation_config.json and, last,
    `CONVERSION_MARKER` (source, its size and `source_sha256` when given, timing). Everything is
    written into a temporary sibling directory that is renamed into place, so `out_dir` either
    does not exist or is complete.
    An existing `out_dir` raises `FileExistsError` unless `overwrite=True`.
    """
    from safetensors.numpy import save_file

    src = Path(gguf_path)
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"output directory already exists: {out} (pass overwrite=True)")
    t0 = time.perf_counter()
    cfg, state, meta = _read(src)
    tok_files = tokenizer_files_from_gguf(meta, source=str(src))
    t_read = time.perf_counter() - t0

    out.parent.mkdir(parents=True, exist_ok=True)
    # The float32 weights are most of it (~4x a 4-bit GGUF): checked before a byte is written.
    need = sum(a.nbytes for a in state.values()) + sum(len(json.dumps(c)) for c in tok_files.values())
    check_space(out.parent, need, f"the conversion of {src.name}", f"nothing was written to {out}")
    # Same parent => same filesystem => the final rename is atomic.
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_json(tmp / "config.json", cfg)
        # "format": "pt" is what transformers checks before loading a safetensors file with torch.
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        # safetensors creates the file owner-only (0600); give it the mode any other file gets
        # here under the process umask, so a shared cache stays readable like its JSON files.
        os.chmod(tmp / "model.safetensors", (tmp / "config.json").stat().st_mode & 0o777)
        for name, content in tok_files.items():
            _write_json(tmp / name, content)
        _write_json(tmp / "generation_config.json", _generation_config(cfg, meta))
        st = src.stat()
        _write_json(tmp / CONVERSION_MARKER, {
            "converter_version": CONVERTER_VERSION,
            "source": str(src.resolve()),
            "source_size": st.st_size,
            "source_mtime_ns": st.st_mtime_ns,
            "source_sha256": source_sha256,
            "read_dequantize_seconds": round(t_read, 3),
            "total_seconds": round(time.perf_counter() - t0, 3),
        })
        if out.exists():  # overwrite: move the old one aside first, then swap in the new one
            trash = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out, trash)
            os.rename(tmp, out)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_no_space(e) or type(e).__name__ == "SafetensorError":  # safetensors' own type for I/O errors
            raise WriteError(f"writing the conversion of {src.name} to {out} failed ({failure(e)}); nothing was "
                             "written there") from e
        raise
    return out
