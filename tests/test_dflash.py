"""DFlash drafter: public checkpoint format, the inference/training paths and their properties.

The fixture drafter reads a tiny Qwen3 target (6 layers, width 64) at target layers (1, 3), with
block size 4, through a checkpoint the test writes in the public format: the tensor names, [out,
in] layouts, bf16 storage and config keys of the released z-lab drafters.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

from tevjax.convert.dflash_ckpt import average_dflash, dflash_weight_rules, load_dflash, save_dflash
from tevjax.convert.hf import CheckpointError, read_safetensors_dir
from tevjax.models.cache import KVCache
from tevjax.models.config import PRESETS, RopeScaling
from tevjax.models.dflash import (
    DFlashConfig,
    DFlashDrafter,
    DrafterCache,
    default_target_layer_ids,
    features_from_hidden,
    features_from_output,
    grow_drafter,
)
from tevjax.models.transformer import ForwardOutput
from tevjax.testing import random_model, tiny_config

BS = 4  # block size of the fixture drafter
IDS = (1, 3)  # tapped target layers
MASK = 299  # last row of the tiny target's 300-token vocabulary
T = 12  # sequence length of the fixture context

# config.json of the released z-lab/Qwen3-4B-DFlash-b16 drafter (keys and values as published).
QWEN3_4B_DFLASH_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "block_size": 16,
    "bos_token_id": 151643,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "dtype": "bfloat16",
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2560,
    "initializer_range": 0.02,
    "intermediate_size": 9728,
    "layer_types": ["full_attention"] * 5,
    "max_position_embeddings": 40960,
    "max_window_layers": 5,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 5,
    "num_key_value_heads": 8,
    "num_target_layers": 36,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "transformers_version": "4.57.3",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


def _tiny_public_config() -> dict:
    """A tiny drafter config.json with the released layout (the test's 'public checkpoint')."""
    c = dict(QWEN3_4B_DFLASH_CONFIG)
    c.update(
        block_size=BS, dflash_config={"mask_token_id": MASK, "target_layer_ids": list(IDS)},
        head_dim=16, hidden_size=64, intermediate_size=96, layer_types=["full_attention"] * 2,
        max_position_embeddings=256, num_attention_heads=4, num_hidden_layers=2, num_key_value_heads=2,
        num_target_layers=6, rope_theta=10000, vocab_size=300,
    )
    return c


def _tiny_public_tensors(cfg: dict, seed: int = 0) -> dict:
    """Random bf16 tensors under the public names ([out, in] Linear weights)."""
    rng = np.random.default_rng(seed)
    d, f, dh = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    qd, kd = cfg["num_attention_heads"] * dh, cfg["num_key_value_heads"] * dh
    n = len(cfg["dflash_config"]["target_layer_ids"])

    def w(*shape, scale=0.1):
        return (rng.standard_normal(shape) * scale).astype(ml_dtypes.bfloat16)

    def norm(dim):  # not all-ones, so a norm that is skipped or misplaced cannot go unnoticed
        return (1.0 + 0.2 * rng.standard_normal(dim)).astype(ml_dtypes.bfloat16)

    out = {"fc.weight": w(d, n * d), "hidden_norm.weight": norm(d), "norm.weight": norm(d)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        out.update({
            p + "input_layernorm.weight": norm(d),
            p + "post_attention_layernorm.weight": norm(d),
            p + "self_attn.q_proj.weight": w(qd, d),
            p + "self_attn.k_proj.weight": w(kd, d),
            p + "self_attn.v_proj.weight": w(kd, d),
            p + "self_attn.o_proj.weight": w(d, qd),
            p + "self_attn.q_norm.weight": norm(dh),
            p + "self_attn.k_norm.weight": norm(dh),
            p + "mlp.gate_proj.weight": w(f, d),
            p + "mlp.up_proj.weight": w(f, d),
            p + "mlp.down_proj.weight": w(d, f),
        })
    return out


def _write_checkpoint(path, cfg: dict, tensors: dict) -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return str(path)


@pytest.fixture(scope="module")
def target():
    return random_model(tiny_config("qwen3", num_layers=6), seed=3)


@pytest.fixture(scope="module")
def public_ckpt(tmp_path_factory):
    cfg = _tiny_public_config()
    tensors = _tiny_public_tensors(cfg)
    path = _write_checkpoint(tmp_path_factory.mktemp("dflash") / "public", cfg, tensors)
    return path, cfg, tensors


@pytest.fixture(scope="module")
def drafter(public_ckpt, target):
    cfg, d = load_dflash(public_ckpt[0], target.cfg, dtype="float32", param_dtype="float32")
    return d


@pytest.fixture(scope="module")
def seq(target):
    """Target features of one random 2-row sequence: tokens [2, T], features [2, T, 2*64]."""
    tokens = jax.random.randint(jax.random.key(7), (2, T), 0, 290, dtype=jnp.int32)

    @nnx.jit
    def prefill(model, tokens):
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
        causal = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (2, T, T))
        out = model(tokens, positions, KVCache.init(model.cfg, 2, T), jnp.zeros(2, jnp.int32), causal,
                    hidden_layers=IDS, compute_logits=False)
        return features_from_hidden(out.hidden)  # layer 1 then layer 3, as the reference concatenates

    return tokens, prefill(target, tokens)


@nnx.jit(static_argnames=("anchor_chunk",))
def _train_logits(drafter, target, features, tokens, anchors, anchor_chunk=None):
    # Tests call the drafter through a few jitted entry points: compiled once, reused across tests
    # (eager calls would retrace the anchor scan on every call).
    return drafter.train_logits(target, features, tokens, anchors, anchor_chunk=anchor_chunk)


@nnx.jit
def _infer_at(drafter, target, tokens, features, anchors):
    """Inference path at per-row anchors: context appended in two chunks (as decoding appends
    it), then one block call."""
    return _infer_at_eager(drafter, target, tokens, features, anchors)


@nnx.jit
def _context_cache(drafter, features, write_pos=None):
    """All T context tokens (positions 0..T-1) appended at slots write_pos..write_pos+T-1
    (default 0) of a 16-slot cache."""
    b = features.shape[0]
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (b, T))
    write_pos = jnp.zeros(b, jnp.int32) if write_pos is None else write_pos
    return drafter.append_context(DrafterCache.init(drafter.cfg, b, 16), features, pos, write_pos)


@nnx.jit
def _call(drafter, target, block, positions, cache, ctx_len):
    return drafter(target, block, positions, cache, ctx_len)


def _infer_at_eager(drafter, target, tokens, features, anchors, *, chunks=((0, 5), (5, T))):
    b = tokens.shape[0]
    cache = DrafterCache.init(drafter.cfg, b, 16)
    for lo, hi in chunks:  # incremental appends, as decoding does them
        pos = jnp.broadcast_to(jnp.arange(lo, hi, dtype=jnp.int32), (b, hi - lo))
        cache = drafter.append_context(cache, features[:, lo:hi], pos, jnp.full((b,), lo, jnp.int32))
    rows = jnp.arange(b)
    block = drafter.block_tokens(tokens[rows, anchors])
    positions = anchors[:, None] + jnp.arange(BS, dtype=jnp.int32)
    return drafter(target, block, positions, cache, anchors)


# ----------------------------------------------------------------------------- config


def test_default_target_layer_ids_match_released_drafters():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # Qwen3-4B/8B drafters
    assert default_target_layer_ids(32, 5) == (1, 8, 15, 22, 29)  # Llama-3.1-8B drafter
    assert default_target_layer_ids(24, 1) == (12,)
    assert default_target_layer_ids(64, 2) == (1, 61)
    # Spacing that is not a whole number rounds to nearest (1 + 26/3 = 9.67 -> 10), not down.
    assert default_target_layer_ids(30, 4) == (1, 10, 18, 27)


def test_public_config_parses_and_round_trips():
    cfg = DFlashConfig.from_hf_config(QWEN3_4B_DFLASH_CONFIG)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (2560, 9728, 5)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (32, 8, 128, 151936)
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33) and cfg.mask_token_id == 151669
    assert (cfg.block_size, cfg.num_target_layers, cfg.rope_theta) == (16, 36, 1e6)
    assert cfg.dtype == cfg.param_dtype == "bfloat16"
    hf = cfg.to_hf_config()
    assert DFlashConfig.from_hf_config(hf) == cfg
    for key in ("architectures", "auto_map", "block_size", "dflash_config", "num_target_layers", "layer_types"):
        assert hf[key] == QWEN3_4B_DFLASH_CONFIG[key], key
    cfg.check_target(PRESETS["qwen3-4b"])
    # a mixture-of-experts target's drafter is dense, as wide as the experts one token runs
    assert DFlashConfig.for_target(PRESETS["qwen3-30b-a3b"], mask_token_id=151669).intermediate_size == 6144
    # Drafting keys may also sit at the top level, as the reference's fallback reads them.
    flat = {k: v for k, v in QWEN3_4B_DFLASH_CONFIG.items() if k != "dflash_config"}
    flat.update(mask_token_id=151669, target_layer_ids=[1, 9, 17, 25, 33])
    assert DFlashConfig.from_hf_config(flat) == cfg


def test_for_target_defaults():
    with pytest.raises(ValueError, match="mask_token_id"):
        DFlashConfig.for_target(PRESETS["qwen3-8b"])  # no silent default that may be a real token
    q = DFlashConfig.for_target(PRESETS["qwen3-8b"], mask_token_id=151669)
    assert q.target_layer_ids == (1, 9, 17, 25, 33) and q.num_layers == 5 and q.block_size == 16
    assert q.mask_token_id == 151669 and q.hidden_size == 4096 and q.num_target_layers == 36
    q.check_target(PRESETS["qwen3-8b"])
    ll = DFlashConfig.for_target(PRESETS["llama-3.1-8b"], block_size=10, mask_token_id=128255)
    assert ll.target_layer_ids == (1, 8, 15, 22, 29) and ll.rope_scaling == PRESETS["llama-3.1-8b"].rope_scaling
    assert DFlashConfig.from_hf_config(ll.to_hf_config()) == ll
    yarn = RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768)
    qy = DFlashConfig.for_target(dataclasses.replace(PRESETS["qwen3-8b"], rope_scaling=yarn), mask_token_id=151669)
    assert qy.rope_scaling == yarn and DFlashConfig.from_hf_config(qy.to_hf_config()) == qy
    with pytest.raises(ValueError, match="hidden_size"):
        q.check_target(PRESETS["qwen3-4b"])


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c.pop("hidden_size"), "'hidden_size'"),
        (lambda c: c["dflash_config"].pop("target_layer_ids"), "dflash_config.target_layer_ids"),
        (lambda c: c["dflash_config"].pop("mask_token_id"), "dflash_config.mask_token_id"),
        (lambda c: c.update(layer_types=["sliding_attention"] * 2), "sliding_attention"),
        (lambda c: c["dflash_config"].update(mask_token_id=300), "mask_token_id"),
        # A negative or NaN epsilon would pass loading and quietly ruin every draft.
        (lambda c: c.update(rms_norm_eps=-1e-6), "rms_norm_eps must be a finite number >= 0"),
        (lambda c: c.update(rms_norm_eps=float("nan")), "rms_norm_eps must be a finite number >= 0"),
        # So would a NaN rope base or scale (NaN drafts), and a layer id true or 1.7 (int() read layer 1).
        (lambda c: c.update(rope_theta=float("nan")), "field 'rope_theta' must be positive, got nan"),
        (lambda c: c["dflash_config"].update(input_embedding_scale=float("nan")),
         "DFlashConfig.input_embedding_scale must be a finite number > 0, got nan"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[True, 3]),
         "DFlashConfig.target_layer_ids must be a tuple of layer indices"),
        # int() and float() read block size 16.5 as 16 and 5.9 target layers as 5, and failed on
        # strings and lists with their own words, which named neither the file nor the field
        (lambda c: c.update(block_size=16.5), "field 'block_size' must be an integer, got 16.5"),
        (lambda c: c["dflash_config"].update(block_size="8"), "field 'dflash_config.block_size' must be an integer"),
        (lambda c: c.update(num_target_layers=5.9), "field 'num_target_layers' must be an integer, got 5.9"),
        (lambda c: c["dflash_config"].update(input_embedding_scale="x"),
         "field 'dflash_config.input_embedding_scale' must be a number, got 'x'"),
        (lambda c: c["dflash_config"].update(final_logit_softcapping=[1]),
         r"field 'dflash_config.final_logit_softcapping' must be a number, got \[1\]"),
    ],
)
def test_bad_config_is_rejected_by_name(edit, message):
    c = json.loads(json.dumps(_tiny_public_config()))
    edit(c)
    with pytest.raises(ValueError, match=message):
        DFlashConfig.from_hf_config(c)


def test_config_fields_the_math_cannot_use_are_refused_at_construction():
    """A zero, negative or NaN base, scale, multiplier or cap gave NaN or all-equal draft logits with
    no error; float and bool layer ids and mask tokens were truncated by int()."""
    cfg = DFlashConfig.from_hf_config(_tiny_public_config())
    for name, bad in (("rope_theta", 0.0), ("rope_theta", float("nan")), ("input_embedding_scale", float("inf")),
                      ("output_multiplier", 0.0), ("output_multiplier", -2.0), ("final_logit_softcapping", 0.0),
                      ("final_logit_softcapping", float("nan")), ("rope_theta", True)):
        with pytest.raises(ValueError, match=f"DFlashConfig.{name} must be a finite number > 0, got {bad!r}"):
            dataclasses.replace(cfg, **{name: bad})
    for name, bad in (("target_layer_ids", (1.7, 3)), ("target_layer_ids", 3), ("mask_token_id", 2.7),
                      ("mask_token_id", True)):
        with pytest.raises(ValueError, match=f"DFlashConfig.{name} must be a"):
            dataclasses.replace(cfg, **{name: bad})
    fine = dataclasses.replace(cfg, target_layer_ids=(np.int64(1), 3), mask_token_id=np.int32(5), rope_theta=1e6,
                               final_logit_softcapping=None)
    assert (fine.target_layer_ids, fine.mask_token_id) == ((1, 3), 5)


def test_context_features_layout_and_last_layer_tap():
    tcfg = tiny_config("qwen3", num_layers=6)
    hidden = jax.random.normal(jax.random.key(0), (2, 3, 2, 64))  # [B, T, R, D], R = taps
    final = jax.random.normal(jax.random.key(1), (2, 3, 64))
    out = ForwardOutput(logits=None, hidden=hidden, final_hidden=final, cache=None)
    feats = features_from_output(out, DFlashConfig.for_target(tcfg, num_layers=2, target_layer_ids=(1, 3), mask_token_id=0), tcfg)
    # Concatenated in tap order along the feature axis (the reference's torch.cat(dim=-1)).
    np.testing.assert_array_equal(np.asarray(feats), np.concatenate([hidden[:, :, 0], hidden[:, :, 1]], -1))
    np.testing.assert_array_equal(np.asarray(features_from_hidden(hidden)), np.asarray(feats))
    # HF's hidden_states[L] is the final-normed output, so a tap of the last layer reads it.
    last = features_from_output(out, DFlashConfig.for_target(tcfg, num_layers=2, target_layer_ids=(1, 5), mask_token_id=0), tcfg)
    np.testing.assert_array_equal(np.asarray(last[..., 64:]), np.asarray(final))
    np.testing.assert_array_equal(np.asarray(last[..., :64]), np.asarray(hidden[:, :, 0]))


# ----------------------------------------------------------------------------- checkpoint


def test_public_checkpoint_loads_runs_and_round_trips(public_ckpt, target, seq, tmp_path):
    path, hf_cfg, tensors = public_ckpt
    cfg, d = load_dflash(path, target.cfg)
    assert cfg.dtype == cfg.param_dtype == "bfloat16" and cfg.target_layer_ids == IDS
    # Loaded values are the file's values (transposed where the table says so).
    np.testing.assert_array_equal(np.asarray(d.fc.kernel[...]), tensors["fc.weight"].T)
    np.testing.assert_array_equal(np.asarray(d.layers[1].self_attn.k_norm.scale[...]),
                                  tensors["layers.1.self_attn.k_norm.weight"])
    tokens, feats = seq
    logits = _infer_at(d, target, tokens, feats.astype(jnp.bfloat16), jnp.array([6, 9], jnp.int32))
    assert logits.shape == (2, BS - 1, 300) and logits.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits)))

    # Save in the stored dtype: every tensor and every public config key comes back unchanged.
    save_dflash(d, cfg, tmp_path / "resaved")
    written = read_safetensors_dir(tmp_path / "resaved")
    assert set(written) == set(tensors)
    for name, x in tensors.items():
        assert written[name].dtype == x.dtype
        np.testing.assert_array_equal(written[name].view(np.uint16), x.view(np.uint16))  # bit for bit
    with open(tmp_path / "resaved" / "config.json") as fh:
        saved_cfg = json.load(fh)
    for key in ("architectures", "block_size", "dflash_config", "num_target_layers", "hidden_size",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "rms_norm_eps", "vocab_size", "dtype"):
        assert saved_cfg[key] == hf_cfg[key], key
    cfg2, d2 = load_dflash(tmp_path / "resaved", target.cfg)
    assert cfg2 == cfg
    for (p1, a), (p2, b) in zip(nnx.to_flat_state(nnx.state(d, nnx.Param)),
                                nnx.to_flat_state(nnx.state(d2, nnx.Param)), strict=True):
        assert p1 == p2
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()))

    # float32 parameters round-trip bit-exactly through an overwrite of an existing directory.
    cfg32, d32 = load_dflash(path, dtype="float32", param_dtype="float32")
    kernel = d32.layers[0].mlp.up_proj.kernel
    kernel[...] = kernel[...] + 1e-3 * jax.random.normal(jax.random.key(0), kernel[...].shape)
    save_dflash(d32, cfg32, tmp_path / "resaved")
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".resaved.tmp")]
    cfg3, d3 = load_dflash(tmp_path / "resaved")
    assert cfg3 == cfg32
    np.testing.assert_array_equal(np.asarray(d3.layers[0].mlp.up_proj.kernel[...]), np.asarray(kernel[...]))


def test_save_names_the_stored_dtype_and_drops_a_stale_index(public_ckpt, tmp_path):
    """config.json names the dtype the tensors are stored in (a float32 drafter saved as bfloat16
    loads as a bfloat16 one, as `tevjax train export` writes them), and a save into a directory
    holding a sharded checkpoint removes its index, which readers would otherwise follow."""
    cfg32, d32 = load_dflash(public_ckpt[0], dtype="float32", param_dtype="float32")
    out = tmp_path / "out"
    out.mkdir()
    index = {"metadata": {}, "weight_map": {"fc.weight": "model-00001-of-00002.safetensors"}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    save_dflash(d32, cfg32, out, dtype="bfloat16")
    assert not (out / "model.safetensors.index.json").exists()
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    cfg, d = load_dflash(out)
    assert cfg.dtype == cfg.param_dtype == "bfloat16"
    np.testing.assert_array_equal(np.asarray(d.fc.kernel[...]), np.asarray(d32.fc.kernel[...]))  # bf16 values


def test_save_refuses_another_config_and_a_non_float_dtype(drafter, tmp_path):
    """Nothing is written when the config does not describe the drafter (it would be saved beside
    weights it does not fit) or the stored dtype is not a float the loader reads."""
    other = dataclasses.replace(drafter.cfg, mask_token_id=drafter.cfg.mask_token_id - 1)
    with pytest.raises(ValueError, match="cfg differs from the drafter's own config"):
        save_dflash(drafter, other, tmp_path / "other")
    with pytest.raises(ValueError, match="dtype 'int8' is not float32, bfloat16 or float16"):
        save_dflash(drafter, drafter.cfg, tmp_path / "int8", dtype="int8")
    assert os.listdir(tmp_path) == []


def test_model_prefix_is_accepted(public_ckpt, tmp_path):
    _, hf_cfg, tensors = public_ckpt
    path = _write_checkpoint(tmp_path / "prefixed", hf_cfg, {"model." + k: v for k, v in tensors.items()})
    _, d = load_dflash(path)
    np.testing.assert_array_equal(np.asarray(d.norm.scale[...]), tensors["norm.weight"])


def test_bad_checkpoints_fail_by_name(public_ckpt, target, tmp_path):
    _, hf_cfg, tensors = public_ckpt
    missing = dict(tensors)
    del missing["layers.1.self_attn.o_proj.weight"]
    with pytest.raises(CheckpointError, match=r"missing tensor\(s\): layers\.1\.self_attn\.o_proj\.weight"):
        load_dflash(_write_checkpoint(tmp_path / "missing", hf_cfg, missing))

    wrong = dict(tensors)
    wrong["fc.weight"] = np.ascontiguousarray(wrong["fc.weight"][:, :64])  # one tapped layer instead of two
    with pytest.raises(CheckpointError, match=r"'fc\.weight': expected shape \(64, 128\), got \(64, 64\)"):
        load_dflash(_write_checkpoint(tmp_path / "shape", hf_cfg, wrong))

    nan = dict(tensors)  # a corrupt file, or an export of a diverged run
    nan["layers.0.mlp.up_proj.weight"] = nan["layers.0.mlp.up_proj.weight"].copy()
    nan["layers.0.mlp.up_proj.weight"][3, :2] = [np.nan, np.inf]
    size = nan["layers.0.mlp.up_proj.weight"].size
    with pytest.raises(CheckpointError, match=rf"'layers\.0\.mlp\.up_proj\.weight' holds 2 non-finite value\(s\) "
                                              rf"\(NaN or inf\) among its {size:,}"):
        load_dflash(_write_checkpoint(tmp_path / "nan", hf_cfg, nan))

    extra = dict(tensors)
    extra["embed_tokens.weight"] = np.zeros((300, 64), ml_dtypes.bfloat16)
    extra_path = _write_checkpoint(tmp_path / "extra", hf_cfg, extra)
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\): embed_tokens\.weight"):
        load_dflash(extra_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_dflash(extra_path, strict=False)
    assert any("embed_tokens.weight" in str(w.message) for w in caught)
    # An unexpected tensor is named as stored: the 'model.' prefix is stripped only from the drafter's own names.
    head = dict(tensors, **{"model.lm_head.weight": np.zeros((300, 64), ml_dtypes.bfloat16)})
    with pytest.raises(CheckpointError, match=r"unexpected tensor\(s\): model\.lm_head\.weight \(a DFlash "
                                              r"drafter has no embedding or LM head of its own"):
        load_dflash(_write_checkpoint(tmp_path / "head", hf_cfg, head))

    both = dict(tensors, **{"model.norm.weight": tensors["norm.weight"]})  # which one would load?
    with pytest.raises(CheckpointError, match=r"'norm\.weight' is present both with and without the 'model\.' prefix"):
        load_dflash(_write_checkpoint(tmp_path / "both", hf_cfg, both))
    buffer = dict(tensors, **{"layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32)})
    load_dflash(_write_checkpoint(tmp_path / "buffer", hf_cfg, buffer))  # a recomputed buffer is skipped, strictly too

    no_key = dict(hf_cfg)
    del no_key["num_hidden_layers"]
    with pytest.raises(ValueError, match="'num_hidden_layers'"):
        load_dflash(_write_checkpoint(tmp_path / "nokey", no_key, tensors))

    with pytest.raises(ValueError, match="target_layer_ids"):
        load_dflash(public_ckpt[0], tiny_config("qwen3", num_layers=3))  # layer 3 does not exist
    with pytest.raises(FileNotFoundError):
        load_dflash(tmp_path / "nowhere")


def test_average_is_the_weighted_mean_and_refuses_other_lineages(public_ckpt, tmp_path):
    path_a, hf_cfg, ta = public_ckpt
    tb = _tiny_public_tensors(hf_cfg, seed=1)
    path_b = _write_checkpoint(tmp_path / "b", hf_cfg, tb)
    cfg, avg = average_dflash([path_a, path_b], [0.25, 0.75])
    assert cfg.param_dtype == "float32"
    f32 = {k: v.astype(np.float32) for k, v in ta.items()}, {k: v.astype(np.float32) for k, v in tb.items()}
    np.testing.assert_allclose(np.asarray(avg.fc.kernel[...]),
                               (0.25 * f32[0]["fc.weight"] + 0.75 * f32[1]["fc.weight"]).T, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(avg.layers[1].self_attn.k_norm.scale[...]),
                               0.25 * f32[0]["layers.1.self_attn.k_norm.weight"]
                               + 0.75 * f32[1]["layers.1.self_attn.k_norm.weight"], rtol=1e-6)
    # Each drafter takes its own weight (three: the first and third are the same drafter).
    _, three = average_dflash([path_a, path_b, path_a], [0.2, 0.3, 0.5])
    np.testing.assert_allclose(np.asarray(three.fc.kernel[...]),
                               (0.7 * f32[0]["fc.weight"] + 0.3 * f32[1]["fc.weight"]).T, rtol=1e-5, atol=1e-6)
    # A drafter averaged with itself is itself, bit for bit.
    _, same = average_dflash([path_a, path_a])
    _, a32 = load_dflash(path_a, dtype="float32", param_dtype="float32")
    for (_, x), (_, y) in zip(nnx.to_flat_state(nnx.state(same, nnx.Param)),
                              nnx.to_flat_state(nnx.state(a32, nnx.Param)), strict=True):
        np.testing.assert_array_equal(np.asarray(x.get_value()), np.asarray(y.get_value()))

    other = dict(hf_cfg, dflash_config={"mask_token_id": MASK - 1, "target_layer_ids": list(IDS)})
    with pytest.raises(ValueError, match="different config"):
        average_dflash([path_a, _write_checkpoint(tmp_path / "other", other, tb)])
    vocab = dict(hf_cfg, dflash_config={"mask_token_id": MASK, "target_layer_ids": list(IDS), "draft_vocab_size": 5})
    v1 = _write_checkpoint(tmp_path / "v1", vocab, dict(ta, draft_vocab=np.array([1, 2, 3, 4, 5], np.int32)))
    v2 = _write_checkpoint(tmp_path / "v2", vocab, dict(tb, draft_vocab=np.array([1, 2, 3, 4, 6], np.int32)))
    with pytest.raises(ValueError, match="different draft vocabulary"):
        average_dflash([v1, v2])
    for weights, message in (([0.5, 0.6], "sum to 1"), ([1.5, -0.5], "positive"), ([1.0, 0.0], "positive"),
                             ([1.0], "2 weights|1 weights")):
        with pytest.raises(ValueError, match=message):
            average_dflash([path_a, path_b], weights)
    with pytest.raises(ValueError, match="at least 2"):
        average_dflash([path_a])


def test_weight_table_covers_the_module():
    cfg = DFlashConfig.from_hf_config(_tiny_public_config())
    d = nnx.eval_shape(lambda: DFlashDrafter(cfg, rngs=nnx.Rngs(0)))
    table = {r.param for r in dflash_weight_rules(cfg)}
    params = {tuple(str(p) for p in path) for path, v in nnx.iter_graph(d) if isinstance(v, nnx.Param)}
    assert table == params and len(table) == 3 + 11 * cfg.num_layers


# ----------------------------------------------------------------------------- reference parity


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, pos, theta):
    """x [T, heads, Dh] rotated at positions pos [T] (first/second half pairs)."""
    dh = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, dh, 2) / dh)
    ang = np.concatenate([pos[:, None] * inv, pos[:, None] * inv], -1)[:, None, :]
    rot = np.concatenate([-x[..., dh // 2:], x[..., : dh // 2]], -1)
    return x * np.cos(ang) + rot * np.sin(ang)


def _reference_logits(w, cfg, ctx_feat, block_emb, ctx_pos, blk_pos, head):
    """Independent float64 numpy DFlash forward written from the published description: one
    shot over the whole context (no cache, no mask: block queries see every context token and
    the whole block); context K/V through k_norm and RoPE at the context positions; no layer
    norm on the context, which is shared by all layers."""
    eps, h, k, dh = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    theta = float(cfg["rope_theta"])
    ctx = _rms(ctx_feat @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    x = block_emb
    c, t = ctx.shape[0], x.shape[0]
    for i in range(cfg["num_hidden_layers"]):
        p = {n[len(f"layers.{i}."):]: v for n, v in w.items() if n.startswith(f"layers.{i}.")}
        hs = _rms(x, p["input_layernorm.weight"], eps)
        q = _rms((hs @ p["self_attn.q_proj.weight"].T).reshape(t, h, dh), p["self_attn.q_norm.weight"], eps)
        both = np.concatenate([ctx, hs], 0)
        kk = _rms((both @ p["self_attn.k_proj.weight"].T).reshape(c + t, k, dh), p["self_attn.k_norm.weight"], eps)
        vv = (both @ p["self_attn.v_proj.weight"].T).reshape(c + t, k, dh)
        q = _rope(q, blk_pos, theta)
        kk = _rope(kk, np.concatenate([ctx_pos, blk_pos]), theta)
        kk, vv = np.repeat(kk, h // k, axis=1), np.repeat(vv, h // k, axis=1)  # query head j reads kv head j // (h/k)
        s = np.einsum("thd,shd->hts", q, kk) / np.sqrt(dh)
        att = np.exp(s - s.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", att, vv).reshape(t, h * dh) @ p["self_attn.o_proj.weight"].T
        hs = _rms(x, p["post_attention_layernorm.weight"], eps)
        gate, up = hs @ p["mlp.gate_proj.weight"].T, hs @ p["mlp.up_proj.weight"].T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ p["mlp.down_proj.weight"].T
    x = _rms(x, w["norm.weight"], eps)
    return x[1:] @ head.T


def test_parity_with_independent_reference(public_ckpt, drafter, target, seq):
    path, hf_cfg, tensors = public_ckpt
    w = {n: x.astype(np.float64) for n, x in tensors.items()}
    tokens, feats = seq
    emb = np.asarray(target.embed_tokens.embedding[...], np.float64)  # tied: also the LM head
    for row, anchor in ((0, 7), (1, 11)):
        block = np.array([int(tokens[row, anchor])] + [MASK] * (BS - 1))
        ref = _reference_logits(w, hf_cfg, np.asarray(feats[row, :anchor], np.float64), emb[block],
                                np.arange(anchor, dtype=np.float64), np.arange(anchor, anchor + BS, dtype=np.float64),
                                emb)
        got = _infer_at(drafter, target, tokens, feats, jnp.array([anchor, anchor], jnp.int32))[row]
        np.testing.assert_allclose(np.asarray(got), ref, rtol=0, atol=1e-4)  # whole-model tolerance


# ----------------------------------------------------------------------------- properties


# Anchors of the property tests: 0 (no context at all), interior ones, and T-1 (the block runs
# past the sequence end). Every test uses this one shape, so each jitted path compiles once.
ANCHORS = jnp.array([[0, 3, 7, 11], [0, 5, 6, 10]], jnp.int32)


def test_train_logits_equal_inference_path(drafter, target, seq):
    tokens, feats = seq
    train = _train_logits(drafter, target, feats, tokens, ANCHORS)
    assert train.shape == (2, 4, BS - 1, 300) and train.dtype == jnp.float32
    for m in range(ANCHORS.shape[1]):
        infer = _infer_at(drafter, target, tokens, feats, ANCHORS[:, m])
        np.testing.assert_allclose(np.asarray(train[:, m]), np.asarray(infer), rtol=1e-5, atol=1e-5)


def test_context_at_or_after_anchor_has_no_influence(drafter, target, seq):
    tokens, feats = seq
    m, a = 2, ANCHORS[:, 2]  # anchors 7 and 6
    at_or_after = (jnp.arange(T)[None, :] >= a[:, None])[..., None]  # [2, T, 1]
    base = _train_logits(drafter, target, feats, tokens, ANCHORS)[:, m]
    later = jnp.where(at_or_after, feats + 5.0 * jax.random.normal(jax.random.key(1), feats.shape), feats)
    np.testing.assert_array_equal(np.asarray(_train_logits(drafter, target, later, tokens, ANCHORS)[:, m]),
                                  np.asarray(base))
    earlier = feats.at[jnp.arange(2), a - 1].add(1.0)  # the token just before the anchor does matter
    changed = _train_logits(drafter, target, earlier, tokens, ANCHORS)[:, m]
    assert bool(jnp.all(jnp.abs(changed - base).max(axis=(1, 2)) > 1e-3))

    # Inference path: stale cache slots at or beyond ctx_len are ignored.
    cache = _context_cache(drafter, feats, jnp.zeros(2, jnp.int32))
    stale = (jnp.arange(16)[None, :] >= a[:, None])[None, :, None, :, None]  # [1, 2, 1, S, 1]
    noisy = DrafterCache(k=jnp.where(stale, 7.0, cache.k), v=jnp.where(stale, -7.0, cache.v))
    block = drafter.block_tokens(tokens[jnp.arange(2), a])
    bpos = a[:, None] + jnp.arange(BS, dtype=jnp.int32)
    np.testing.assert_array_equal(np.asarray(_call(drafter, target, block, bpos, noisy, a)),
                                  np.asarray(_call(drafter, target, block, bpos, cache, a)))


def test_append_context_writes_its_slots_and_drops_overflow(drafter, seq):
    _, feats = seq
    base = _context_cache(drafter, feats, jnp.zeros(2, jnp.int32))
    # Row 0 starts at slot 14 of 16: tokens 0 and 1 land in slots 14 and 15, the rest is dropped
    # (never wrapped around); row 1 starts at slot 3 and fills slots 3..14.
    moved = _context_cache(drafter, feats, jnp.array([14, 3], jnp.int32))
    # A negative start (slots before 0) drops those tokens too, never wrapping to the cache's end.
    early = _context_cache(drafter, feats, jnp.array([-2, 0], jnp.int32))
    for got, want, neg in ((moved.k, base.k, early.k), (moved.v, base.v, early.v)):
        got, want, neg = np.asarray(got), np.asarray(want), np.asarray(neg)  # [L, B, K, S, Dh]
        np.testing.assert_array_equal(got[:, 0, :, 14:], want[:, 0, :, :2])
        np.testing.assert_array_equal(got[:, 1, :, 3:15], want[:, 1, :, :12])
        assert not got[:, 0, :, :14].any() and not got[:, 1, :, :3].any()
        assert not got[:, 1, :, 15:].any()
        np.testing.assert_array_equal(neg[:, 0, :, :T - 2], want[:, 0, :, 2:T])
        assert not neg[:, 0, :, T - 2:].any()


def test_block_attention_is_not_causal(drafter, target, seq):
    tokens, feats = seq
    cache = _context_cache(drafter, feats, jnp.zeros(2, jnp.int32))
    a = jnp.full((2,), 8, jnp.int32)
    bpos = a[:, None] + jnp.arange(BS, dtype=jnp.int32)
    block = drafter.block_tokens(tokens[:, 8])
    base = _call(drafter, target, block, bpos, cache, a)
    # A different token in the LAST block slot changes the FIRST draft row: keys of later block
    # positions are visible to earlier queries.
    changed = _call(drafter, target, block.at[:, -1].set(5), bpos, cache, a)
    assert bool(jnp.all(jnp.abs(changed[:, 0] - base[:, 0]).max(axis=-1) > 1e-4))
    # The anchor token conditions every draft row.
    first = _call(drafter, target, block.at[:, 0].set(6), bpos, cache, a)
    assert bool(jnp.all(jnp.abs(first - base).max(axis=-1) > 1e-4))


@nnx.jit
def _train_logits_masked(drafter, target, features, tokens, anchors, context_mask):
    return drafter.train_logits(target, features, tokens, anchors, context_mask=context_mask)


def test_context_mask_hides_context_tokens(drafter, target, seq):
    """`context_mask` [B, T] False hides a context token from every anchor: its features then have no
    influence at all, and an all-True mask is no mask."""
    tokens, feats = seq
    base = _train_logits(drafter, target, feats, tokens, ANCHORS)
    everything = jnp.ones((2, T), bool)
    np.testing.assert_array_equal(np.asarray(_train_logits_masked(drafter, target, feats, tokens, ANCHORS, everything)),
                                  np.asarray(base))
    hidden = jnp.array([2, 4])  # before the later anchors of each row (3, 7, 11 and 5, 6, 10)
    mask = everything.at[jnp.arange(2), hidden].set(False)
    noisy = feats.at[jnp.arange(2), hidden].add(5.0 * jax.random.normal(jax.random.key(3), (2, feats.shape[-1])))
    masked = _train_logits_masked(drafter, target, feats, tokens, ANCHORS, mask)
    np.testing.assert_array_equal(np.asarray(_train_logits_masked(drafter, target, noisy, tokens, ANCHORS, mask)),
                                  np.asarray(masked))
    # ... while the anchors after the hidden token do see a change from hiding it.
    assert bool(jnp.all(jnp.abs(masked[:, 1:] - base[:, 1:]).max(axis=(2, 3)) > 1e-4))


class _ScaledEmbedding:
    """A target whose embedding is multiplied by `scale` (its LM head unchanged)."""

    def __init__(self, target, scale):
        self.target, self.scale = target, scale

    def embed(self, tokens):
        return self.target.embed(tokens) * self.scale

    def logits(self, hidden, rows=None, *, head=None):
        return self.target.logits(hidden, rows, head=head)


def test_optional_embedding_scale_output_multiplier_and_soft_cap(drafter, target, seq):
    """The public `dflash_config` knobs: block embeddings times input_embedding_scale, then logits
    times output_multiplier, then cap * tanh(logits / cap); parsed from config.json and written back."""
    tokens, feats = seq
    a = jnp.array([5, 9], jnp.int32)
    cache = _context_cache(drafter, feats)
    block = drafter.block_tokens(tokens[jnp.arange(2), a])
    bpos = a[:, None] + jnp.arange(BS, dtype=jnp.int32)
    knobs = dict(input_embedding_scale=1.7, output_multiplier=2.5, final_logit_softcapping=4.0)
    c = _tiny_public_config()
    c["dflash_config"] = dict(c["dflash_config"], **knobs)
    cfg = DFlashConfig.from_hf_config(c, dtype="float32", param_dtype="float32")
    assert (cfg.input_embedding_scale, cfg.output_multiplier, cfg.final_logit_softcapping) == (1.7, 2.5, 4.0)
    assert DFlashConfig.from_hf_config(cfg.to_hf_config()) == cfg
    knobbed = nnx.clone(drafter)
    knobbed.cfg = dataclasses.replace(drafter.cfg, **knobs)
    got = np.asarray(knobbed(target, block, bpos, cache, a))
    plain = np.asarray(drafter(_ScaledEmbedding(target, 1.7), block, bpos, cache, a))
    np.testing.assert_allclose(got, 4.0 * np.tanh(2.5 * plain / 4.0), rtol=1e-5, atol=1e-5)
    assert np.abs(got).max() < 4.0 and np.abs(2.5 * plain).max() > 4.0  # the cap binds somewhere
    assert np.abs(plain - np.asarray(drafter(target, block, bpos, cache, a))).max() > 1e-3  # the scale matters


def test_jit_and_vmap_match_eager(drafter, target, seq):
    tokens, feats = seq
    a = jnp.array([4, 9], jnp.int32)
    # Op-by-op reference (no jit anywhere), one append of the whole context.
    eager = _infer_at_eager(drafter, target, tokens, feats, a, chunks=((0, T),))

    # The inference step over split state, jitted once (the decode loop's form), and vmapped
    # over rows (each row a batch of one), equal the eager call.
    graphdef, state = nnx.split(drafter)

    @jax.jit
    def step(state, feats, block, bpos, ctx_len):
        d = nnx.merge(graphdef, state)
        b = feats.shape[0]
        pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (b, T))
        cache = d.append_context(DrafterCache.init(d.cfg, b, 16), feats, pos, jnp.zeros(b, jnp.int32))
        return d(target, block, bpos, cache, ctx_len)

    block = drafter.block_tokens(tokens[jnp.arange(2), a])
    bpos = a[:, None] + jnp.arange(BS, dtype=jnp.int32)
    batched = step(state, feats, block, bpos, a)
    np.testing.assert_allclose(np.asarray(batched), np.asarray(eager), rtol=1e-5, atol=1e-5)
    rows = jax.vmap(lambda f, b, p, c: step(state, f[None], b[None], p[None], c[None])[0])(feats, block, bpos, a)
    np.testing.assert_allclose(np.asarray(rows), np.asarray(eager), rtol=1e-5, atol=1e-5)


def test_gradients_reach_every_drafter_parameter_and_only_past_context(drafter, target, seq):
    tokens, feats = seq
    labels = jnp.take_along_axis(tokens, jnp.clip(ANCHORS[..., None] + jnp.arange(1, BS), 0, T - 1).reshape(2, -1),
                                 axis=1).reshape(2, 4, BS - 1)

    def cross_entropy(logits):
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], axis=-1))

    def loss(d, f):
        # anchor_chunk=2: the anchors run as a scan over vmapped chunks, as memory-bound training does.
        return cross_entropy(d.train_logits(target, f, tokens, ANCHORS, anchor_chunk=2))

    value, (grads, feat_grad) = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1)))(drafter, feats)
    # Chunking is a memory knob only: the same loss as all anchors at once.
    np.testing.assert_allclose(float(value), float(cross_entropy(_train_logits(drafter, target, feats, tokens, ANCHORS))),
                               rtol=1e-5)
    for path, g in nnx.to_flat_state(grads):
        arr = np.asarray(g.get_value())
        assert np.all(np.isfinite(arr)), path
        assert np.abs(arr).max() > 0, f"no gradient reaches {path}"
    # The features of token j influence the loss iff some anchor lies after j (anchors < T).
    seen = (jnp.arange(T)[None, :] < ANCHORS.max(axis=1)[:, None])
    influence = jnp.abs(feat_grad).max(axis=-1)  # [2, T]
    assert bool(jnp.all(jnp.where(seen, influence, 1.0) > 0))
    assert float(jnp.where(seen, 0.0, influence).max()) == 0.0


def test_bf16_drafter_and_empty_context(public_ckpt, drafter, target, seq):
    tokens, feats = seq
    _, d16 = load_dflash(public_ckpt[0], target.cfg)  # bf16 compute and storage, as published
    a = jnp.array([5, 10], jnp.int32)
    lo = _infer_at(d16, target, tokens, feats.astype(jnp.bfloat16), a)
    hi = _infer_at(drafter, target, tokens, feats, a)
    assert lo.dtype == jnp.float32
    # bf16 activations and features, the same (bf16-exact) weights: the logits stay close.
    assert float(jnp.abs(lo - hi).max()) < 0.1 * float(jnp.abs(hi).max())
    # Anchor 0 sees no context at all: the softmax still has the block, so no NaN, and two rows
    # with the same anchor token but different sequences draft the same block.
    empty = _train_logits(drafter, target, feats, tokens, ANCHORS)[:, 0]
    assert bool(jnp.all(jnp.isfinite(empty)))
    same_token = tokens.at[1, 0].set(tokens[0, 0])
    again = _train_logits(drafter, target, feats[::-1], same_token, ANCHORS)[:, 0]
    np.testing.assert_allclose(np.asarray(again[0]), np.asarray(again[1]), rtol=1e-6, atol=1e-6)


def test_grown_drafter_computes_the_same_logits_and_trains_its_new_layer(drafter, target, seq, tmp_path):
    tokens, feats = seq
    grown = grow_drafter(drafter, drafter.cfg.num_layers + 1, rngs=nnx.Rngs(0))
    assert grown.cfg.num_layers == drafter.cfg.num_layers + 1
    # The new layer's residual branches start at zero, so both paths compute the old logits exactly.
    np.testing.assert_array_equal(np.asarray(_train_logits(grown, target, feats, tokens, ANCHORS)),
                                  np.asarray(_train_logits(drafter, target, feats, tokens, ANCHORS)))
    a = jnp.array([5, 10], jnp.int32)
    np.testing.assert_array_equal(np.asarray(_infer_at(grown, target, tokens, feats, a)),
                                  np.asarray(_infer_at(drafter, target, tokens, feats, a)))
    # The old drafter is untouched (its own o_proj is not zeroed), the old layers are copies, and the
    # new layer's other weights are freshly initialised, not copies of the layer below.
    last = grown.cfg.num_layers - 1
    assert np.abs(np.asarray(drafter.layers[last - 1].self_attn.o_proj.kernel[...])).max() > 0
    np.testing.assert_array_equal(np.asarray(grown.layers[last - 1].self_attn.q_proj.kernel[...]),
                                  np.asarray(drafter.layers[last - 1].self_attn.q_proj.kernel[...]))
    q_new = np.asarray(grown.layers[last].self_attn.q_proj.kernel[...])
    assert np.abs(q_new).max() > 0
    assert not np.array_equal(q_new, np.asarray(drafter.layers[last - 1].self_attn.q_proj.kernel[...]))
    # The zero matrices get a gradient, so one optimizer step makes the layer more than the identity.
    labels = jnp.take_along_axis(tokens, jnp.clip(ANCHORS[..., None] + jnp.arange(1, BS), 0, T - 1).reshape(2, -1),
                                 axis=1).reshape(2, 4, BS - 1)

    def loss(d):
        logits = d.train_logits(target, feats, tokens, ANCHORS)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[..., None], axis=-1))

    grads = nnx.jit(nnx.grad(loss))(grown)
    for g in (grads.layers[last].self_attn.o_proj.kernel, grads.layers[last].mlp.down_proj.kernel):
        assert np.abs(np.asarray(g.get_value())).max() > 0
    # It saves and loads as an ordinary deeper drafter.
    save_dflash(grown, grown.cfg, tmp_path / "grown")
    cfg2, back = load_dflash(tmp_path / "grown", target.cfg, dtype="float32", param_dtype="float32")
    assert cfg2.num_layers == grown.cfg.num_layers
    np.testing.assert_array_equal(np.asarray(_train_logits(back, target, feats, tokens, ANCHORS)),
                                  np.asarray(_train_logits(grown, target, feats, tokens, ANCHORS)))
    with pytest.raises(ValueError, match="only adding layers"):
        grow_drafter(grown, 1, rngs=nnx.Rngs(0))


def test_mask_token_is_one_text_never_contains():
    """`mask_token_for`'s order: SmolLM2's <empty_output>; else a spare embedding row past the
    tokenizer; else Llama-3's first reserved token or Gemma's <unused0>; else a named error."""
    from tevjax.loading import mask_token_for

    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return dict(self.vocab)

        def __len__(self):
            return len(self.vocab)

    words = {f"w{i}": i for i in range(20)}
    cfg = tiny_config("llama", vocab_size=24)
    assert mask_token_for(cfg, Tok({**words, "<empty_output>": 16})) == 16
    assert mask_token_for(cfg, Tok(words)) == 20  # the first spare row
    full = tiny_config("llama", vocab_size=20)
    assert mask_token_for(full, Tok({**{f"w{i}": i for i in range(19)}, "<|reserved_special_token_0|>": 19})) == 19
    assert mask_token_for(tiny_config("gemma2", vocab_size=20), Tok({**{f"w{i}": i for i in range(18)},
                                                                   "<unused0>": 18, "<unused1>": 19})) == 18
    with pytest.raises(ValueError, match="no token that text never contains and no spare embedding rows"):
        mask_token_for(full, Tok(words))
    with pytest.raises(ValueError, match="needs the target's tokenizer"):
        mask_token_for(full, None)
