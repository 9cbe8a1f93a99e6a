"""Hugging Face safetensors <-> tevjax target model, as one declarative table.

Each `WeightRule` maps one HF tensor name pattern (with `{i}` for the layer index) to a parameter
path of `Transformer` plus a transform, and records the HF source shape that is asserted before
the transform runs. Per-layer rules are stacked on the leading layer axis of the scanned layers.
Loading reports every unmapped and every missing tensor by name in one error, and checks that the
table covers every parameter of the model, so no parameter can stay at its random init.

HF stores `nn.Linear` weights as [out, in]; flax kernels are [in, out], hence the transposes.
The reader is torch-free (`safetensors` numpy backend; bf16 arrives as an `ml_dtypes` array).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tevjax.models.config import HYBRID, ModelConfig, read_config_json
from tevjax.models.transformer import Transformer
from tevjax.sharding import place, shardings_by_path

__all__ = [
    "CheckpointError",
    "WeightRule",
    "load_hf_target",
    "load_target_params",
    "read_safetensors_dir",
    "save_hf_target",
    "target_weight_rules",
]

SAFETENSORS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
# Non-parameter buffers some older checkpoints carry; they are recomputed, so skipping is safe.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """A checkpoint is missing, truncated, incomplete or shaped unlike the config; the message
    names the file and/or tensor."""


def checked_tensor(name: str, x) -> np.ndarray:
    """`x` as a numpy array, or a CheckpointError naming the tensor: a dtype other than a float,
    or values that are not finite. A NaN or inf weight (a corrupt file, a diverged run's export)
    otherwise reaches every output in silence: garbage text from a target; from a drafter,
    proposals that are all rejected, so decoding stays exact but slower than without it."""
    x = np.asarray(x)
    if not (np.issubdtype(x.dtype, np.floating) or x.dtype == jnp.bfloat16):
        raise CheckpointError(f"tensor {name!r} has non-float dtype {x.dtype}")
    # A float64 sum is finite when every value is (it cannot overflow from float32 or narrower
    # values), at a tenth of np.isfinite's cost; a sum that is not is checked value by value.
    with np.errstate(invalid="ignore", over="ignore"):  # inf + -inf is NaN: found below, not warned about
        total = x.sum(dtype=np.float64)
    if not np.isfinite(total):
        bad = int(x.size - np.count_nonzero(np.isfinite(x)))
        if bad:
            raise CheckpointError(f"tensor {name!r} holds {bad:,} non-finite value(s) (NaN or inf) among its "
                                  f"{x.size:,}: the checkpoint is corrupt, or was exported from a diverged run")
    return x


@dataclasses.dataclass(frozen=True)
class WeightRule:
    """One row of the conversion table."""

    hf_name: str  # HF tensor name; "{i}" is replaced by the layer index for per-layer rules
    param: tuple[str, ...]  # attribute path of the nnx.Param inside `Transformer`
    transform: str  # "identity" | "transpose" ([..., out, in] -> [..., in, out])
    hf_shape: tuple[int, ...]  # expected HF source shape, asserted before the transform
    per_layer: bool = False  # stacked over the L layers on a new leading axis
    # Rows [start, stop) of a fused HF tensor (Phi-3's qkv_proj and gate_up_proj; Granite MoE's
    # stacked experts' input_linear, [E, 2 * I, D]: rows along its second-last axis), sliced before
    # the transform; the rules that share a tensor cover its rows, and saving joins them again.
    rows: tuple[int, int] | None = None
    # Columns start::step of a tensor whose parts interleave along its last axis (GPT-OSS's experts'
    # gate_up_proj [E, D, 2 * I] and its bias: gate in the even columns, up in the odd ones);
    # saving interleaves them again.
    columns: tuple[int, int] | None = None
    # One tensor per expert ("{e}" in the name; the MoE families), stacked on an expert axis
    # after the layer axis; 0: none.
    experts: int = 0
    # The layers a per-layer rule covers, where not all: a hybrid model (Qwen3-Next) stacks its
    # attention layers and its linear-attention layers apart.
    layer_ids: tuple[int, ...] | None = None
    # Rows picked, in this order, from a tensor whose parts interleave in groups (Qwen3-Next's
    # in_proj_qkvz: q, k, v and z per key-head group), or reordered (a linear layer's q|k|v channels,
    # regrouped by key head); saving puts them back at those rows. A Conv1d weight's [C, 1, W] rows are
    # its channels (axis 0).
    row_index: tuple[int, ...] | None = None

    @property
    def rows_axis(self) -> int:
        """The axis `row_index` picks along: a depthwise Conv1d weight's channels, else axis -2."""
        return 0 if self.transform == "conv" else -2

    def names(self, num_layers: int) -> list[str]:
        """Concrete HF names this rule consumes, in layer order (and expert order within a layer)."""
        layers = (range(num_layers) if self.layer_ids is None else self.layer_ids) if self.per_layer else [None]
        return [self.hf_name.format(i=i, e=e) for i in layers for e in (range(self.experts) or [None])]

    def stack(self, converted: list[np.ndarray], num_layers: int) -> np.ndarray:
        """The converted tensors of `names` as one parameter: [L, (E,) ...] or the one tensor."""
        if not self.per_layer:
            return converted[0]
        value = np.stack(converted)
        n = num_layers if self.layer_ids is None else len(self.layer_ids)
        return value.reshape(n, self.experts, *value.shape[1:]) if self.experts else value

    def unstack(self, value: np.ndarray) -> list[np.ndarray]:
        """A parameter as the tensors of `names`, in their order (the inverse of `stack`)."""
        if not self.per_layer:
            return [value]
        return list(value.reshape(-1, *value.shape[2:]) if self.experts else value)

    def to_param(self, name: str, x: np.ndarray) -> np.ndarray:
        """HF tensor -> tevjax layout, after checking the source shape."""
        if tuple(x.shape) != self.hf_shape:
            raise CheckpointError(
                f"tensor {name!r}: expected shape {self.hf_shape}, got {tuple(x.shape)}"
            )
        if self.rows is not None:
            x = x[..., self.rows[0]:self.rows[1], :]
        if self.columns is not None:
            x = x[..., self.columns[0]::self.columns[1]]
        if self.row_index is not None:
            x = np.take(x, list(self.row_index), axis=self.rows_axis)
        return _TRANSFORMS[self.transform][0](x)

    @property
    def fused(self) -> bool:
        """Whether the rule reads a part of a tensor that other rules read the rest of."""
        return self.rows is not None or self.columns is not None or self.row_index is not None

    def to_hf(self, x: np.ndarray) -> np.ndarray:
        """tevjax layout -> HF tensor (inverse transform), or its rows for a fused tensor, checking
        the result's shape."""
        y = _TRANSFORMS[self.transform][1](x)
        want = list(self.hf_shape)
        if self.rows is not None:
            want[-2] = self.rows[1] - self.rows[0]
        if self.columns is not None:
            want[-1] //= self.columns[1]
        if self.row_index is not None:
            want[self.rows_axis] = len(self.row_index)
        want = tuple(want)
        if tuple(y.shape) != want:
            raise CheckpointError(f"{self.hf_name}: would save shape {tuple(y.shape)}, expected {want}")
        return y


_TRANSFORMS = {
    "identity": (lambda x: x, lambda x: x),
    "transpose": (lambda x: np.ascontiguousarray(np.swapaxes(x, -1, -2)),
                  lambda x: np.ascontiguousarray(np.swapaxes(x, -1, -2))),
    # A depthwise Conv1d's weight [C, 1, W] <-> [C, W].
    "conv": (lambda x: np.ascontiguousarray(x[..., 0, :]), lambda x: np.ascontiguousarray(x[..., None, :])),
}


_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}


def target_weight_rules(cfg: ModelConfig) -> list[WeightRule]:
    """The conversion table for a Llama / Mistral / Qwen2 / Qwen3 / Gemma 2 / Gemma 3 (text) /
    Phi-3 / Mixtral / Qwen2-3 MoE / SmolLM3 / Granite / OLMo 2-3 / OLMoE / Granite MoE / GPT-OSS /
    Qwen3-Next / Qwen3.5 target with this config."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    qd, kd, dh = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.head_dim
    pre = "model.layers.{i}."

    def layer(hf, param, transform, shape):
        return WeightRule(pre + hf, ("layers",) + param, transform, shape, per_layer=True)

    # Gemma names its four norms by place: its post_attention_layernorm norms the attention output,
    # and its pre_feedforward_layernorm is the pre-MLP norm that Llama names post_attention_layernorm
    # (tevjax keeps Llama's name for that role). OLMo has only the two output norms, named as Gemma's.
    pre_mlp = "pre_feedforward_layernorm" if cfg.output_norms else "post_attention_layernorm"
    # Phi-3 fuses q, k and v into one projection (rows in that order), and gate and up into another.
    fused = cfg.architecture == "phi3"

    def proj(block, name, rows, shape):  # rows [start, stop) of the fused [out, in] shape
        param = (block, name, "kernel")
        if not fused:
            return layer(f"{block}.{name}.weight", param, "transpose", (rows[1] - rows[0], *shape[1:]))
        return WeightRule(pre + f"{block}.{_FUSED[name]}.weight", ("layers",) + param, "transpose", shape,
                          per_layer=True, rows=rows)

    gate = 2 if cfg.attn_output_gate else 1  # Qwen3-Next's q_proj: each head's query, then its gate
    rules = [
        WeightRule("model.embed_tokens.weight", ("embed_tokens", "embedding"), "identity", (v, d)),
        WeightRule("model.norm.weight", ("norm", "scale"), "identity", (d,)),
        proj("self_attn", "q_proj", (0, gate * qd), (gate * qd + 2 * kd, d)),
        proj("self_attn", "k_proj", (qd, qd + kd), (qd + 2 * kd, d)),
        proj("self_attn", "v_proj", (qd + kd, qd + 2 * kd), (qd + 2 * kd, d)),
        layer("self_attn.o_proj.weight", ("self_attn", "o_proj", "kernel"), "transpose", (d, qd)),
    ]
    if cfg.moe:
        rules += _expert_rules(cfg, pre)
    else:
        rules += [
            proj("mlp", "gate_proj", (0, f), (2 * f, d)),
            proj("mlp", "up_proj", (f, 2 * f), (2 * f, d)),
            layer("mlp.down_proj.weight", ("mlp", "down_proj", "kernel"), "transpose", (d, f)),
        ]
    if cfg.qkv_biased:
        rules += [
            layer("self_attn.q_proj.bias", ("self_attn", "q_proj", "bias"), "identity", (qd,)),
            layer("self_attn.k_proj.bias", ("self_attn", "k_proj", "bias"), "identity", (kd,)),
            layer("self_attn.v_proj.bias", ("self_attn", "v_proj", "bias"), "identity", (kd,)),
        ]
    if cfg.attention_bias:
        rules.append(layer("self_attn.o_proj.bias", ("self_attn", "o_proj", "bias"), "identity", (d,)))
    if cfg.attention_sinks:
        rules.append(layer("self_attn.sinks", ("self_attn", "sinks"), "identity", (cfg.num_heads,)))
    if cfg.input_norms:
        rules += [
            layer("input_layernorm.weight", ("input_layernorm", "scale"), "identity", (d,)),
            layer(pre_mlp + ".weight", ("post_attention_layernorm", "scale"), "identity", (d,)),
        ]
    if cfg.qk_norm:  # per head, or (OLMo) over the whole projection
        q, k, width = (("q_proj_norm", "k_proj_norm", (qd, kd)) if cfg.qk_norm_whole
                       else ("q_norm", "k_norm", (dh, dh)))
        rules += [
            layer("self_attn.q_norm.weight", ("self_attn", q, "scale"), "identity", (width[0],)),
            layer("self_attn.k_norm.weight", ("self_attn", k, "scale"), "identity", (width[1],)),
        ]
    if cfg.output_norms:
        rules += [
            layer("post_attention_layernorm.weight", ("attn_output_norm", "scale"), "identity", (d,)),
            layer("post_feedforward_layernorm.weight", ("mlp_output_norm", "scale"), "identity", (d,)),
        ]
    if not cfg.tie_word_embeddings:
        rules.append(WeightRule("lm_head.weight", ("lm_head", "kernel"), "transpose", (v, d)))
    if cfg.linear_layers:
        rules = _hybrid_rules(cfg, rules, pre)
    return rules


def _hybrid_rules(cfg: ModelConfig, rules: list[WeightRule], pre: str) -> list[WeightRule]:
    """Qwen3-Next's and Qwen3.5's table: the per-layer rules above for the attention layers only; the
    MLP and norm rules again for the linear layers, into `linear_layers`; and their linear attention's
    own. Qwen3.5 stores the projections apart, as tevjax does; tevjax's q|k|v channels run key-head
    group by group (`GatedDeltaNet`).

    Qwen3-Next's `in_proj_qkvz` [2 Hk Dk + 2 Hv Dv, D] holds, per key head, that head's q and k rows and
    the rows of the Hv / Hk value heads it serves for v and then z; `in_proj_ba` [2 Hv, D] holds b
    then a, likewise per key head. They are read into the fused q|k|v projection (key-head group by
    group, the conv's channel order), z, b and a (`GatedDeltaNet`)."""
    d, lin = cfg.hidden_size, cfg.linear_layers
    att = tuple(i for i in range(cfg.num_layers) if i not in lin)
    shared = ("mlp", "input_layernorm", "post_attention_layernorm")
    out = [dataclasses.replace(r, layer_ids=att) if r.per_layer else r for r in rules]
    out += [dataclasses.replace(r, param=("linear_layers", *r.param[1:]), layer_ids=lin)
            for r in rules if r.per_layer and r.param[1] in shared]
    kh, hv, dk, dv, w = (cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim,
                         cfg.linear_conv)
    r = hv // kh
    group = 2 * dk + 2 * r * dv  # one key head's rows of in_proj_qkvz
    parts = {"q": (0, dk), "k": (dk, 2 * dk), "v": (2 * dk, 2 * dk + r * dv), "z": (2 * dk + r * dv, group)}

    def rows(parts_of_group, size, offsets):  # the rows of those parts, key-head group after group
        return tuple(g * size + j for g in range(kh) for part in parts_of_group
                     for j in range(*offsets[part]))

    qkvz = (kh * group, d)
    ba_parts = {"b": (0, r), "a": (r, 2 * r)}
    # tevjax's q|k|v channels (projection outputs, conv channels) run group by group, each key head's
    # q and k and then its value heads' v, so that a `model` split of them keeps whole groups on each
    # device; on disk they run part by part (all q, all k, all v), in each part head after head.
    kd, vd = kh * dk, hv * dv
    grouped = tuple(j for g in range(kh) for j in (*range(g * dk, (g + 1) * dk), *range(kd + g * dk, kd + (g + 1) * dk),
                                                   *range(2 * kd + g * r * dv, 2 * kd + (g + 1) * r * dv)))

    def rule(hf, param, transform, shape, **kw):
        return WeightRule(pre + "linear_attn." + hf, ("linear_layers", "linear_attn", *param), transform, shape,
                          per_layer=True, layer_ids=lin, **kw)

    if cfg.architecture == "qwen3_next":
        out += [
            rule("in_proj_qkvz.weight", ("in_proj_qkv", "kernel"), "transpose", qkvz,
                 row_index=rows("qkv", group, parts)),
            rule("in_proj_qkvz.weight", ("in_proj_z", "kernel"), "transpose", qkvz, row_index=rows("z", group, parts)),
            rule("in_proj_ba.weight", ("in_proj_b", "kernel"), "transpose", (2 * hv, d),
                 row_index=rows("b", 2 * r, ba_parts)),
            rule("in_proj_ba.weight", ("in_proj_a", "kernel"), "transpose", (2 * hv, d),
                 row_index=rows("a", 2 * r, ba_parts)),
        ]
    else:  # Qwen3.5: apart, q|k|v part by part
        out += [rule("in_proj_qkv.weight", ("in_proj_qkv", "kernel"), "transpose", (2 * kd + vd, d),
                     row_index=grouped)]
        out += [rule(f"in_proj_{name}.weight", (f"in_proj_{name}", "kernel"), "transpose", (rows_n, d))
                for name, rows_n in (("z", vd), ("b", hv), ("a", hv))]
    out += [
        rule("conv1d.weight", ("conv",), "conv", (cfg.linear_conv_channels, 1, w), row_index=grouped),
        rule("dt_bias", ("dt_bias",), "identity", (hv,)),
        rule("A_log", ("A_log",), "identity", (hv,)),
        rule("norm.weight", ("norm", "scale"), "identity", (dv,)),
        rule("out_proj.weight", ("out_proj", "kernel"), "transpose", (d, hv * dv)),
    ]
    return out


def _expert_rules(cfg: ModelConfig, pre: str) -> list[WeightRule]:
    """A mixture-of-experts MLP's rows: the router, and each expert's gate, up and down projections
    (Mixtral's w1, w3 and w2, under `block_sparse_moe`), stacked on the expert axis; Qwen2-MoE's
    shared expert and its gate. Granite MoE stores its experts stacked already: gate and up as the
    two row halves of `input_linear` [E, 2 * I, D], down as `output_linear` [E, D, I]."""
    d, f, e = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts
    if cfg.architecture == "gpt_oss":  # stacked [E, in, out] already, biases beside; gate and up interleaved
        moe = pre + "mlp."
        return [WeightRule(moe + hf, ("layers", "mlp", *param), transform, shape, per_layer=True, columns=cols)
                for hf, param, transform, shape, cols in (
                    ("router.weight", ("router", "kernel"), "transpose", (e, d), None),
                    ("router.bias", ("router", "bias"), "identity", (e,), None),
                    ("experts.gate_up_proj", ("gate_proj",), "identity", (e, d, 2 * f), (0, 2)),
                    ("experts.gate_up_proj", ("up_proj",), "identity", (e, d, 2 * f), (1, 2)),
                    ("experts.gate_up_proj_bias", ("gate_bias",), "identity", (e, 2 * f), (0, 2)),
                    ("experts.gate_up_proj_bias", ("up_bias",), "identity", (e, 2 * f), (1, 2)),
                    ("experts.down_proj", ("down_proj",), "identity", (e, f, d), None),
                    ("experts.down_proj_bias", ("down_bias",), "identity", (e, d), None))]
    if cfg.architecture == "granitemoe":
        moe = pre + "block_sparse_moe."
        return [WeightRule(moe + hf, ("layers", "mlp", *param), "transpose", shape, per_layer=True, rows=rows)
                for hf, param, shape, rows in (("router.layer.weight", ("router", "kernel"), (e, d), None),
                                               ("input_linear.weight", ("gate_proj",), (e, 2 * f, d), (0, f)),
                                               ("input_linear.weight", ("up_proj",), (e, 2 * f, d), (f, 2 * f)),
                                               ("output_linear.weight", ("down_proj",), (e, d, f), None))]
    block, names = (("block_sparse_moe", ("w1", "w3", "w2")) if cfg.architecture == "mixtral"
                    else ("mlp", ("gate_proj", "up_proj", "down_proj")))
    expert = pre + block + ".experts.{e}.{name}.weight"
    shared = []
    if cfg.shared_expert_size:  # Qwen2-MoE's shared expert and its gate
        g = cfg.shared_expert_size
        shared = [WeightRule(pre + f"mlp.{module}.weight", ("layers", "mlp", *module.split("."), "kernel"),
                             "transpose", shape, per_layer=True)
                  for module, shape in (("shared_expert.gate_proj", (g, d)), ("shared_expert.up_proj", (g, d)),
                                        ("shared_expert.down_proj", (d, g)), ("shared_expert_gate", (1, d)))]
    return shared + [
        WeightRule(pre + block + ".gate.weight", ("layers", "mlp", "router", "kernel"), "transpose", (e, d),
                   per_layer=True),
        *(WeightRule(expert.replace("{name}", hf), ("layers", "mlp", param), "transpose", shape, per_layer=True,
                     experts=e)
          for hf, param, shape in zip(names, ("gate_proj", "up_proj", "down_proj"), ((f, d), (f, d), (d, f)),
                                      strict=True)),
    ]


# ----------------------------------------------------------------------------------- reading


def _read_safetensors_file(path: str) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError, safe_open

    out: dict[str, np.ndarray] = {}
    try:
        with safe_open(path, framework="numpy") as f:
            for name in f.keys():
                try:
                    out[name] = f.get_tensor(name)
                except (TypeError, ValueError, AttributeError):  # numpy has no float8: AttributeError
                    # Older safetensors numpy backends cannot represent bf16; read that tensor
                    # through the flax backend, which yields an ml_dtypes-backed array.
                    try:
                        with safe_open(path, framework="flax") as g:
                            out[name] = np.asarray(g.get_tensor(name))
                    except (TypeError, ValueError, AttributeError):
                        raise CheckpointError(
                            f"{path}: tensor {name!r} is stored as {f.get_slice(name).get_dtype()}, which tevjax "
                            "cannot read (its weights are float32, float16 or bfloat16)") from None
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{path}: cannot read safetensors file ({e}); is it truncated or corrupt?") from e
    return out


def read_safetensors_dir(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of an HF checkpoint directory (single `model.safetensors` or sharded with
    `model.safetensors.index.json`), as numpy arrays keyed by HF name.

    Raises FileNotFoundError for a missing directory, weights file or shard, and `CheckpointError`
    for unreadable files or an index that disagrees with its shards; messages name the file.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint directory not found: {path}")
    index_path = os.path.join(path, INDEX_FILE)
    single_path = os.path.join(path, SAFETENSORS_FILE)
    if os.path.isfile(index_path):
        try:  # names the file, and the line for bad bytes or JSON
            index, _ = read_config_json(index_path, what="safetensors index")
        except ValueError as e:
            raise CheckpointError(str(e)) from e
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise CheckpointError(f"{index_path}: field 'weight_map' must map tensor names to shard "
                                  f"file names, got {weight_map!r:.80}")
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not os.path.isfile(os.path.join(path, s))]
        if missing:
            raise FileNotFoundError(f"{index_path} lists shard file(s) that do not exist in {path}: "
                                    f"{', '.join(missing)}")
        tensors: dict[str, np.ndarray] = {}
        for shard in shards:
            shard_path = os.path.join(path, shard)
            for name, x in _read_safetensors_file(shard_path).items():
                if name in tensors:
                    raise CheckpointError(f"{shard_path}: tensor {name!r} appears in more than one shard")
                tensors[name] = x
        absent = [n for n, s in weight_map.items() if n not in tensors]
        if absent:
            raise CheckpointError(f"{index_path} lists tensor(s) not found in their shard: "
                                  f"{', '.join(sorted(absent)[:20])}")
        return tensors
    if os.path.isfile(single_path):
        return _read_safetensors_file(single_path)
    present = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    raise FileNotFoundError(
        f"no weights in {path}: expected {SAFETENSORS_FILE} or {INDEX_FILE}"
        + (f" (found {', '.join(present)})" if present else "")
    )


# ----------------------------------------------------------------------------------- loading


def _param(model: nnx.Module, path: tuple[str, ...]) -> nnx.Variable:
    obj: Any = model
    for p in path:
        obj = getattr(obj, p, None)
        if obj is None:
            raise CheckpointError(f"model has no parameter {'.'.join(path)}")
    return obj


def _model_param_paths(model: nnx.Module) -> set[tuple[str, ...]]:
    return {tuple(str(p) for p in path) for path, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)}


def load_target_params(model: Transformer, state: Mapping[str, np.ndarray], *, mesh=None) -> None:
    """Fills every parameter of `model` from HF-named tensors (in place, cast to param_dtype).

    Unmapped and missing tensors are reported together by name; a wrong source shape raises
    naming the tensor with expected and actual shapes. With tied embeddings an `lm_head.weight`
    is accepted only if it equals the embedding (some exporters write the tied copy). With a
    `mesh`, each tensor goes straight from the host into its sharding (`tevjax.sharding`) as it is
    converted: no device ever holds a whole replicated copy first.
    """
    cfg: ModelConfig = model.cfg
    rules = target_weight_rules(cfg)
    covered = {r.param for r in rules}
    params = _model_param_paths(model)
    if covered != params:  # the table itself is wrong for this model: a library bug
        raise AssertionError(f"conversion table out of sync with the model: table-only "
                             f"{sorted(covered - params)}, model-only {sorted(params - covered)}")

    expected = {n for r in rules for n in r.names(cfg.num_layers)}
    extra = {n for n in state if n not in expected and not n.endswith(_IGNORED_SUFFIXES)}
    if cfg.tie_word_embeddings and "lm_head.weight" in extra:
        extra.discard("lm_head.weight")
        head = np.asarray(state["lm_head.weight"])
        emb = state.get("model.embed_tokens.weight")
        if emb is not None and (head.shape != np.shape(emb) or not np.array_equal(head, np.asarray(emb))):
            raise CheckpointError("tensor 'lm_head.weight' differs from 'model.embed_tokens.weight' but "
                                  "the config says tie_word_embeddings=True")
    missing = sorted(expected - set(state))
    if extra or missing:
        parts = []
        if missing:
            parts.append(f"missing tensor(s): {', '.join(missing)}")
        if extra:
            parts.append(f"unmapped tensor(s): {', '.join(sorted(extra))}")
        raise CheckpointError(f"checkpoint does not match a {cfg.architecture} model with "
                              f"{cfg.num_layers} layers; " + "; ".join(parts))

    dtype = jnp.dtype(cfg.param_dtype)
    shardings = shardings_by_path(model, mesh) if mesh is not None else {}
    checked: dict[str, np.ndarray] = {}  # a fused tensor is checked once for the rules that share it
    for rule in rules:
        converted = []
        for name in rule.names(cfg.num_layers):
            if not rule.fused:
                x = checked_tensor(name, state[name])
            else:
                x = checked.get(name)
                if x is None:
                    x = checked[name] = checked_tensor(name, state[name])
            converted.append(rule.to_param(name, x))
        value = rule.stack(converted, cfg.num_layers)
        var = _param(model, rule.param)
        want = tuple(var.get_value().shape)
        if tuple(value.shape) != want:  # a table bug rather than a checkpoint bug
            raise AssertionError(f"{rule.hf_name} -> {'.'.join(rule.param)}: converted shape "
                                 f"{value.shape} != parameter shape {want}")
        var.set_value(place(value, dtype, shardings.get(rule.param)))


def checkpoint_config_path(path: str | os.PathLike, what: str) -> tuple[str, str]:
    """(directory, its config.json) of a checkpoint directory; clear errors when either is missing."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{what} directory not found: {path}")
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{config_path} not found: {what} needs its config.json")
    return path, config_path


def load_hf_target(path: str | os.PathLike, *, dtype: str | None = None, mesh=None) -> tuple[ModelConfig, Transformer]:
    """Loads an HF Llama / Mistral / Qwen2 / Qwen3 / Gemma 2 / Gemma 3 (text) / Phi-3 / Mixtral /
    Qwen2-3 MoE / SmolLM3 / Granite / OLMo 2-3 / OLMoE / Granite MoE / GPT-OSS / Qwen3-Next / Qwen3.5
    checkpoint into a `Transformer`; GPT-OSS's MXFP4 experts (the released checkpoints') are
    dequantized on reading, and a multimodal Qwen3.5 file gives its text model.

    `dtype` sets both compute and storage dtypes (default: the checkpoint's `torch_dtype`).
    The model skeleton is built with `nnx.eval_shape`, so no random weights are materialised;
    with a `mesh` every weight is placed straight into its sharding.
    """
    path, config_path = checkpoint_config_path(path, "an HF checkpoint")
    overrides = {} if dtype is None else {"dtype": dtype, "param_dtype": dtype}
    cfg = ModelConfig.from_hf_config(config_path, **overrides)
    quantization = _quantization(config_path)  # an unsupported one is named before its tensors are read
    state = read_safetensors_dir(path)
    if cfg.architecture in HYBRID:
        state = _text_model_tensors(state)
    if quantization == "mxfp4":
        state = _dequantize_mxfp4_experts(state)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    try:
        load_target_params(model, state, mesh=mesh)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from e
    return cfg, model


def _text_model_tensors(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A Qwen3-Next / Qwen3.5 checkpoint's text-model tensors under tevjax's names: a multimodal
    checkpoint's `model.language_model.*` as `model.*`, without its vision tower (`model.visual.*`);
    the multi-token-prediction head (`mtp.*`), which transformers does not load either, left out."""
    out = {}
    for name, x in state.items():
        if name.startswith(("mtp.", "model.visual.")):
            continue
        out[name.replace("model.language_model.", "model.", 1)] = x
    return out


def _quantization(config_path: str) -> str | None:
    """The checkpoint's `quantization_config.quant_method`, where tevjax can read it (GPT-OSS's
    "mxfp4"); any other is refused by name rather than left to fail on tensors it cannot map."""
    c, _ = read_config_json(config_path, what="HF config")
    q = c.get("quantization_config")
    if q is None:
        return None
    method = q.get("quant_method") if isinstance(q, Mapping) else q
    if c.get("model_type") == "gpt_oss" and method == "mxfp4":
        return method
    raise CheckpointError(f"{config_path}: quantization_config quant_method={method!r} is not supported "
                          f"(tevjax reads unquantized weights, and GPT-OSS's mxfp4 experts)")


# FP4 (e2m1) code -> value: sign bit 3, then 2 exponent bits and 1 mantissa bit.
_FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       np.float32)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 (OCP microscaling FP4) -> float32: blocks [..., G, 16] uint8 hold two FP4 codes a
    byte (the low nibble first), scales [..., G] uint8 one power of two per 32 values (E8M0:
    2 ** (scale - 127)); returns [..., G * 32]."""
    b = np.asarray(blocks, np.uint8)
    if b.shape[:-1] != np.shape(scales):
        raise CheckpointError(f"MXFP4 blocks {b.shape} and scales {np.shape(scales)} do not pair up")
    codes = np.stack([b & 0x0F, b >> 4], axis=-1).reshape(*b.shape[:-1], -1)  # [..., G, 32]
    values = np.ldexp(_FP4_VALUES[codes], (np.asarray(scales, np.int32) - 127)[..., None])
    return values.reshape(*b.shape[:-2], -1).astype(np.float32)


def _dequantize_mxfp4_experts(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """GPT-OSS's MXFP4 checkpoint as its unquantized tensors: each `*_blocks` / `*_scales` pair
    ([E, out, in / 32, 16] and [E, out, in / 32]) becomes the tensor of that name, [E, in, out],
    as transformers' dequantization lays it out."""
    out = {k: v for k, v in state.items() if not k.endswith(("_blocks", "_scales"))}
    for name in (k for k in state if k.endswith("_blocks")):
        base = name.removesuffix("_blocks")
        if base + "_scales" not in state:
            raise CheckpointError(f"tensor {name!r} has no {base + '_scales'!r} beside it")
        out[base] = np.ascontiguousarray(np.swapaxes(dequantize_mxfp4(state[name], state[base + "_scales"]), -1, -2))
    stray = sorted(k for k in state if k.endswith("_scales") and k.removesuffix("_scales") + "_blocks" not in state)
    if stray:
        raise CheckpointError(f"MXFP4 scales without blocks: {', '.join(stray)}")
    return out


# ------------------------------------------------------------------------------------ saving


def save_hf_target(model: Transformer, path: str | os.PathLike) -> None:
    """Writes `config.json` and `model.safetensors` with HF names (single file, param dtype)."""
    from safetensors.numpy import save_file

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    cfg: ModelConfig = model.cfg
    tensors: dict[str, np.ndarray] = {}
    fused: dict[str, list[tuple[WeightRule, np.ndarray]]] = {}  # a fused tensor's parts
    for rule in target_weight_rules(cfg):
        value = np.asarray(jax.device_get(_param(model, rule.param).get_value()))
        names = rule.names(cfg.num_layers)
        for name, x in zip(names, rule.unstack(value), strict=True):
            if rule.fused:
                fused.setdefault(name, []).append((rule, rule.to_hf(x)))
            else:
                tensors[name] = rule.to_hf(x)
    for name, parts in fused.items():
        if parts[0][0].row_index is not None:  # parts picked by rows: put each back at its rows
            joined = np.zeros(parts[0][0].hf_shape, parts[0][1].dtype)
            axis = parts[0][0].rows_axis
            for rule, y in parts:
                np.moveaxis(joined, axis, 0)[list(rule.row_index)] = np.moveaxis(y, axis, 0)
            if sum(len(rule.row_index) for rule, _ in parts) != joined.shape[axis]:
                raise CheckpointError(f"{name}: its parts do not cover its {joined.shape[axis]} rows")
        elif parts[0][0].columns is not None:  # interleaved: part i in columns i::n
            ys = [y for _, y in sorted(parts, key=lambda p: p[0].columns[0])]
            joined = np.stack(ys, axis=-1).reshape(*ys[0].shape[:-1], -1)
        else:  # stacked rows
            joined = np.concatenate([y for _, y in sorted(parts, key=lambda p: p[0].rows[0])], axis=-2)
        tensors[name] = np.ascontiguousarray(joined)
    with open(os.path.join(path, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(cfg.to_hf_config(), f, indent=2)
    save_file(tensors, os.path.join(path, SAFETENSORS_FILE), metadata={"format": "pt"})
    # A sharded checkpoint's index, left behind, would be read instead of the file just written.
    if os.path.exists(os.path.join(path, INDEX_FILE)):
        os.remove(os.path.join(path, INDEX_FILE))
