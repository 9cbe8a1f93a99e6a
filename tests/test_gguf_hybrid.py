"""GGUF files of Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (hybrid Gated DeltaNet targets), written from
the tiny random transformers models of `test_qwen3_next` the way llama.cpp's converter writes
them (names from llama.cpp's own table, `gguf.get_tensor_name_map`; the converter's tensor
changes restated here from its source, independently of tevjax's inverse):

* every zero-centred norm plus 1 (not the linear layers' gated norm), A_log as -exp(A_log),
  dt_bias as `ssm_dt.bias`, the conv kernel without its middle axis;
* Qwen3-Next's in_proj_qkvz split into q|k|v part by part (`attn_qkv`) and z (`attn_gate`);
* Qwen3.5's value heads reordered from grouped by key head to tiled, wherever they index a
  tensor (the test models have 2 key heads of 4 value heads, so the order matters);
* the experts stacked, and a multi-token-prediction block counted in `block_count`
  (`nextn_predict_layers`), which tevjax does not load.

The converted checkpoint must run in tevjax like the original model in transformers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gguf

from test_gguf import add_byte_level_tokenizer, close_gguf, tiny_vocab
from test_gguf_families import hf_state
from test_qwen3_next import BASE, VARIANTS, build_hf, hf_logits
from tevjax.convert.gguf import GGUFError, gguf_to_hf_dir, read_gguf

GGUF_ARCH = {"qwen3_next": "qwen3next", "qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe"}
MTP_BLOCKS = 1  # one extra block of multi-token prediction in every file


def tile(w: np.ndarray, axis: int, kheads: int, r: int, size: int) -> np.ndarray:
    """The converter's reordering of value heads from grouped by key head to tiled."""
    shape = w.shape
    grouped = w.reshape(*shape[:axis], kheads, r, size, *shape[axis + 1:])
    return np.swapaxes(grouped, axis, axis + 1).reshape(shape)


def converted(variant: str, hf: dict[str, np.ndarray], c: dict) -> dict[str, np.ndarray]:
    """What llama.cpp's converter writes, under llama.cpp names."""
    arch = GGUF_ARCH[variant]
    layers = c["num_hidden_layers"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], layers + MTP_BLOCKS)
    kh, hv, dk, dv = (c["linear_num_key_heads"], c["linear_num_value_heads"], c["linear_key_head_dim"],
                      c["linear_value_head_dim"])
    r, kd = hv // kh, kh * dk
    tiled = arch != "qwen3next" and kh != hv
    out: dict[str, np.ndarray] = {}
    experts: dict[str, list] = {}
    for name, w in hf.items():
        if ".mlp.experts." in name:  # stacked per projection, expert after expert
            layer, e, proj = name.split(".")[2], int(name.split(".")[5]), name.split(".")[6]
            experts.setdefault(f"model.layers.{layer}.mlp.experts.{proj}.weight", []).append((e, w))
            continue
        if tiled and ".linear_attn." in name:
            if "in_proj_qkv." in name:
                w = np.concatenate([w[:2 * kd], tile(w[2 * kd:], 0, kh, r, dv)])
            elif "in_proj_z." in name:
                w = tile(w, 0, kh, r, dv)
            elif "in_proj_a." in name or "in_proj_b." in name or name.endswith((".A_log", ".dt_bias")):
                w = tile(w, 0, kh, r, 1)
            elif "conv1d" in name:
                w = w.squeeze()
                w = np.concatenate([w[:2 * kd], tile(w[2 * kd:], 0, kh, r, dv)])
            elif "out_proj" in name:
                w = tile(w, 1, kh, r, dv)
        if name.endswith(".A_log"):
            w = -np.exp(w)
        elif name.endswith(".dt_bias"):
            name = name.replace(".dt_bias", ".dt_proj.bias")
        elif "conv1d" in name:
            w = w.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            w = w + np.float32(1.0)
        if "in_proj_qkvz" in name:  # per key head [q, k, v, z] -> q | k | v part by part, and z
            d = w.shape[1]
            grouped = w.reshape(kh, 2 * dk + 2 * r * dv, d)
            q, k, v, z = np.split(grouped, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
            layer = int(name.split(".")[2])
            out[f"blk.{layer}.attn_qkv.weight"] = np.concatenate([q.reshape(-1, d), k.reshape(-1, d),
                                                                 v.reshape(-1, d)])
            out[f"blk.{layer}.attn_gate.weight"] = z.reshape(-1, d)
            continue
        if name.endswith(".A_log"):
            gname = names.get_name(name)
        else:
            gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        out[gname] = np.ascontiguousarray(w, np.float32)
    for name, parts in experts.items():
        out[names.get_name(name, try_suffixes=(".weight",))] = np.stack([w for _, w in sorted(parts)])
    # The multi-token-prediction block: a few of its tensors, which reading must pass over.
    mtp = f"blk.{layers}."
    out.update({mtp + "nextn.eh_proj.weight": np.ones((c["hidden_size"], 2 * c["hidden_size"]), np.float32),
                mtp + "attn_norm.weight": np.ones(c["hidden_size"], np.float32),
                mtp + "attn_q.weight": np.ones((2 * c["num_attention_heads"] * c["head_dim"], c["hidden_size"]),
                                               np.float32)})
    return out


def write_hybrid_gguf(path: Path, variant: str, model, *, meta_drop: tuple[str, ...] = (),
                      tensors: dict[str, np.ndarray] | None = None) -> Path:
    c = {**BASE, **VARIANTS[variant][2]}
    arch = GGUF_ARCH[variant]
    w = gguf.GGUFWriter(str(path), arch)
    keys = {"block_count": c["num_hidden_layers"] + MTP_BLOCKS, "nextn_predict_layers": MTP_BLOCKS,
            "context_length": c["max_position_embeddings"], "embedding_length": c["hidden_size"],
            "attention.head_count": c["num_attention_heads"], "attention.head_count_kv": c["num_key_value_heads"],
            "attention.key_length": c["head_dim"], "attention.value_length": c["head_dim"],
            "attention.layer_norm_rms_epsilon": c["rms_norm_eps"], "rope.freq_base": model.config.rope_parameters[
                "rope_theta"] if hasattr(model.config, "rope_parameters") else model.config.rope_theta,
            "ssm.conv_kernel": 4, "ssm.state_size": c["linear_key_head_dim"],
            "ssm.group_count": c["linear_num_key_heads"], "ssm.time_step_rank": c["linear_num_value_heads"],
            "ssm.inner_size": c["linear_num_value_heads"] * c["linear_value_head_dim"],
            "full_attention_interval": 4, "rope.dimension_count": c["head_dim"] // 4}
    if "intermediate_size" in c:
        keys["feed_forward_length"] = c["intermediate_size"]
    if "num_experts" in c:
        keys.update({"expert_count": c["num_experts"], "expert_used_count": c["num_experts_per_tok"],
                     "expert_feed_forward_length": c["moe_intermediate_size"],
                     "expert_shared_feed_forward_length": c["shared_expert_intermediate_size"]})
    for key, value in keys.items():
        if key in meta_drop:
            continue
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"{arch}.{key}", value)
    if arch != "qwen3next":
        w.add_array(f"{arch}.rope.dimension_sections", [11, 11, 10, 0])
    tokens = tiny_vocab() + [f"<extra_{i}>" for i in range(c["vocab_size"] - len(tiny_vocab()))]
    add_byte_level_tokenizer(w, tokens, "qwen2")
    for name, value in (tensors if tensors is not None else converted(variant, hf_state(model), c)).items():
        w.add_tensor(name, value)
    return close_gguf(w, path)


@pytest.fixture(scope="module", params=list(GGUF_ARCH))
def hybrid_file(request, tmp_path_factory):
    variant = request.param
    model = build_hf(variant, seed=5)
    path = write_hybrid_gguf(tmp_path_factory.mktemp(variant) / f"{variant}.gguf", variant, model)
    return variant, path, model


def test_hybrid_files_read_in_hf_layout(hybrid_file):
    """Every tensor comes back under its HF name and in HF's layout (Qwen3-Next's in_proj_qkvz whole,
    Qwen3.5's value heads grouped again, A_log and the conv kernel restored, the norms less 1); the
    multi-token-prediction block is left out; the config holds the model's layer kinds, linear
    heads and rotated share."""
    variant, path, model = hybrid_file
    cfg, got = read_gguf(path)
    want = hf_state(model)
    assert set(got) == set(want)
    for name, value in got.items():
        # float32 round trips: (w + 1) - 1 for the norms, log(exp(A_log)) for A_log
        np.testing.assert_allclose(value, want[name], rtol=1e-6, atol=1e-6, err_msg=name)
    hf = model.config
    assert cfg["model_type"] == variant and cfg["num_hidden_layers"] == 4
    assert cfg["layer_types"] == hf.layer_types
    for field in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                  "linear_conv_kernel_dim", "head_dim"):
        assert cfg[field] == getattr(hf, field), field
    assert cfg["partial_rotary_factor"] == 0.25


def test_hybrid_conversion_runs_like_the_original(hybrid_file, tmp_path):
    """The converted directory, loaded by tevjax, gives the original model's logits."""
    import jax.numpy as jnp

    from tevjax.convert.hf import load_hf_target
    from tevjax.models import KVCache

    variant, path, model = hybrid_file
    ids = np.array([[5, 17, 42, 99, 3, 250, 7, 64, 11, 200]], np.int32)
    _, target = load_hf_target(gguf_to_hf_dir(path, tmp_path / "hf"))
    assert target.cfg.architecture == variant and target.cfg.linear_layers == (0, 1, 2)
    ours = target(jnp.asarray(ids), jnp.arange(ids.shape[1])[None], KVCache.init(target.cfg, 1, 16),
                  jnp.zeros((1,), jnp.int32), None).logits
    np.testing.assert_allclose(np.asarray(ours), hf_logits(model, ids), atol=2e-4, rtol=2e-4)


def test_hybrid_files_refused_by_name(tmp_path):
    """A file without the linear layers' sizes, one whose ssm_a is not -exp of anything, and one
    with an attention tensor in a linear layer are each refused with the name of what is wrong."""
    model = build_hf("qwen3_5_text", seed=1)
    c = {**BASE, **VARIANTS["qwen3_5_text"][2]}
    path = write_hybrid_gguf(tmp_path / "a.gguf", "qwen3_5_text", model, meta_drop=("ssm.state_size",))
    with pytest.raises(GGUFError, match="qwen35.ssm.state_size is missing"):
        read_gguf(path)
    tensors = converted("qwen3_5_text", hf_state(model), c)
    tensors["blk.0.ssm_a"] = np.abs(tensors["blk.0.ssm_a"])
    path = write_hybrid_gguf(tmp_path / "b.gguf", "qwen3_5_text", model, tensors=tensors)
    with pytest.raises(GGUFError, match=r"'blk\.0\.ssm_a'.*negative"):
        read_gguf(path)
    tensors = converted("qwen3_5_text", hf_state(model), c)
    tensors["blk.1.attn_k.weight"] = tensors["blk.3.attn_k.weight"]
    path = write_hybrid_gguf(tmp_path / "c.gguf", "qwen3_5_text", model, tensors=tensors)
    with pytest.raises(GGUFError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*does not have"):
        read_gguf(path)


def test_value_heads_of_every_linear_tensor_kind_come_back_grouped():
    """Qwen3.5's per-value-head vectors (dt_bias, a, b, A_log) and rows (z) come back grouped by key
    head. With 3 value heads per key head the tiling is not its own inverse (with 2 per 2 it is,
    and HF initialises dt_bias to ones, so the files above cannot tell). A zero in ssm_a is not
    -exp of anything either."""
    from types import SimpleNamespace

    from tevjax.convert.gguf import _linear_tensor

    c = dict(linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=4, linear_value_head_dim=2)
    arch = SimpleNamespace(tiled_value_heads=True)
    grouped = np.arange(6, dtype=np.float32)
    for kind in ("dt", "a", "b"):
        np.testing.assert_array_equal(_linear_tensor(kind)(tile(grouped, 0, 2, 3, 1), c, arch), grouped, kind)
    np.testing.assert_allclose(_linear_tensor("A")(-np.exp(tile(grouped, 0, 2, 3, 1)), c, arch), grouped, atol=1e-6)
    rows = np.arange(12 * 3, dtype=np.float32).reshape(12, 3)
    np.testing.assert_array_equal(_linear_tensor("z")(tile(rows, 0, 2, 3, 2), c, arch), rows)
    with pytest.raises(GGUFError, match="ssm_a holds 0"):
        _linear_tensor("A")(np.float32([-1, -1, 0, -1, -1, -1]), c, arch)
