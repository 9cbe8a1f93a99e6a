"""HF safetensors loading and saving: round trips, shards, bf16, and clear errors for every kind
of broken checkpoint (each message must name the file and/or tensor)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from tevjax.convert import (
    CheckpointError,
    load_hf_target,
    load_target_params,
    read_safetensors_dir,
    save_hf_target,
    target_weight_rules,
)
from tevjax.models import PRESETS, KVCache, ModelConfig, RopeScaling, Transformer, causal_mask
from tevjax.models.config import SUPPORTED_ARCHITECTURES, TWO_ROPES
from tevjax.testing import random_model, tiny_config

import torch  # noqa: E402  (test dependency, installed by the Makefile)
import transformers  # noqa: E402


def _params(model) -> dict[str, np.ndarray]:
    return {"/".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.iter_graph(model)
            if isinstance(v, nnx.Param)}


def _logits(model, tokens):
    b, t = tokens.shape
    return np.asarray(model(jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
                            KVCache.init(model.cfg, b, t), jnp.zeros((b,), jnp.int32),
                            jnp.broadcast_to(causal_mask(t), (b, t, t))).logits)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A float32 Llama checkpoint written by tevjax; tests copy it before breaking it."""
    model = random_model(tiny_config("llama", intermediate_size=96), seed=0)
    path = tmp_path_factory.mktemp("ckpt")
    save_hf_target(model, path)
    return model, path


def _copy(saved, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(saved[1], dst)
    return dst


# --------------------------------------------------------------------------------- round trips


def test_saving_over_a_sharded_checkpoint_is_what_loads(tmp_path):
    """A directory that held a sharded checkpoint (an index and its shards) loads the model saved
    into it afterwards, not the old shards its index lists."""
    old, new = random_model(tiny_config(), seed=0), random_model(tiny_config(), seed=1)
    save_hf_target(old, tmp_path)
    os.rename(tmp_path / "model.safetensors", tmp_path / "model-00001-of-00001.safetensors")
    names = load_file(tmp_path / "model-00001-of-00001.safetensors").keys()
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: "model-00001-of-00001.safetensors" for n in names}}))
    save_hf_target(new, tmp_path)
    _, loaded = load_hf_target(tmp_path)
    np.testing.assert_array_equal(np.asarray(loaded.embed_tokens.embedding.get_value()),
                                  np.asarray(new.embed_tokens.embedding.get_value()))


@pytest.mark.parametrize("arch, overrides", [
    ("llama", dict(attention_bias=True)), ("mistral", {}), ("qwen2", {}), ("qwen3", {}),
    # windows: the 9-token logits below reach past them
    ("mistral", dict(sliding_window=3, sliding_layers=(0, 1))), ("qwen2", dict(sliding_window=3, sliding_layers=(1,))),
    ("gemma2", dict(sliding_window=3, sliding_layers=(0,))),
    ("gemma3_text", dict(rope_scaling=RopeScaling(rope_type="linear", factor=2.0))),
    # Phi-3's fused q/k/v and gate/up tensors, split on loading and joined again on saving
    ("phi3", dict(sliding_window=3, sliding_layers=(0, 1))),
    # experts, one tensor each on disk, stacked on an expert axis on loading
    ("mixtral", {}), ("qwen3_moe", dict(norm_topk_prob=False)), ("qwen2_moe", {}),  # and a shared expert
    ("olmoe", {}),  # and q/k norms over each projection
    ("granitemoe", {}),  # stacked on disk, gate and up fused
    ("gpt_oss", dict(rope_scaling=RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=64,
                                              truncate=False))),  # sinks, biased experts, gate and up interleaved
    # SmolLM3's unrotated layers, and a window in one of them
    ("smollm3", dict(sliding_window=3, sliding_layers=(1,))),
    ("granite", {}),  # its four multipliers
    ("olmo2", dict(attention_bias=True)),  # output norms only, q/k norms over each projection
    ("olmo3", dict(rope_scaling=RopeScaling(rope_type="linear", factor=2.0)))])  # and two ropes, windows
def test_save_load_roundtrip_and_transformers_reads_it(arch, overrides, tmp_path):
    model = random_model(tiny_config(arch, **overrides), seed=1)
    save_hf_target(model, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    cfg, loaded = load_hf_target(tmp_path)
    assert cfg == model.cfg
    a, b = _params(model), _params(loaded)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 9)).astype(np.int32)
    with torch.no_grad():
        ref = hf.float().eval()(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(_logits(loaded, tokens), ref, atol=1e-4, rtol=0)


def test_sharded_checkpoint_matches_state_dict(tmp_path):
    config = transformers.Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      tie_word_embeddings=False, max_position_embeddings=128)
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(config)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    assert len([n for n in os.listdir(tmp_path) if n.endswith(".safetensors")]) > 2
    tensors = read_safetensors_dir(tmp_path)
    sd = {k: v.numpy() for k, v in hf.state_dict().items()}
    assert tensors.keys() == sd.keys()
    cfg, model = load_hf_target(tmp_path)
    np.testing.assert_array_equal(np.asarray(model.layers.mlp.down_proj.kernel.get_value()[1]),
                                  sd["model.layers.1.mlp.down_proj.weight"].T)
    np.testing.assert_array_equal(np.asarray(model.lm_head.kernel.get_value()), sd["lm_head.weight"].T)


def test_bf16_checkpoint(tmp_path):
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      initializer_range=0.1)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    hf.save_pretrained(tmp_path)
    tensors = read_safetensors_dir(tmp_path)
    assert tensors["model.embed_tokens.weight"].dtype == ml_dtypes.bfloat16
    want = hf.model.layers[1].self_attn.q_proj.weight.detach().float().numpy().T

    cfg, model = load_hf_target(tmp_path)
    assert cfg.dtype == "bfloat16" and cfg.param_dtype == "bfloat16"
    q = model.layers.self_attn.q_proj.kernel.get_value()
    assert q.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(q[1], np.float32), want)  # bit-exact
    cfg32, model32 = load_hf_target(tmp_path, dtype="float32")
    # `dtype` sets the storage dtype too, not only the compute dtype
    assert (cfg32.dtype, cfg32.param_dtype) == ("float32", "float32")
    assert model32.layers.self_attn.q_proj.kernel.get_value().dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(model32.layers.self_attn.q_proj.kernel.get_value()[1]), want)

    # bf16 compute stays finite and close to float32 compute on the same weights. 0.1 is about
    # ten bf16 ulps at the logit scale here (|logits| ~ 1): a fixed a-priori budget.
    tokens = np.random.default_rng(0).integers(0, 300, (1, 8)).astype(np.int32)
    lo16, lo32 = _logits(model, tokens), _logits(model32, tokens)
    assert lo16.dtype == np.float32 and np.isfinite(lo16).all()
    np.testing.assert_allclose(lo16, lo32, atol=0.1, rtol=0)


def test_tied_checkpoint_with_redundant_lm_head(tmp_path):
    model = random_model(tiny_config("qwen3"), seed=2)
    save_hf_target(model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, tmp_path / "model.safetensors")
    load_hf_target(tmp_path)  # equal copy: accepted knowingly
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1.0
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"lm_head\.weight.*differs.*tie_word_embeddings"):
        load_hf_target(tmp_path)


def test_a_target_with_non_finite_weights_is_refused_by_name(tmp_path):
    """A NaN weight makes every output garbage in silence; loading names the tensor instead. The
    fast path (a float64 sum) must not refuse finite weights whose float32 sum would overflow."""
    model = random_model(tiny_config("llama"), seed=2)
    save_hf_target(model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name][0, 0] = np.nan
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"'{re.escape(name)}' holds 1 non-finite value\(s\)"):
        load_hf_target(tmp_path)
    tensors[name][...] = 3e38  # finite, though their float32 sum is not
    save_file(tensors, tmp_path / "model.safetensors")
    load_hf_target(tmp_path)


def test_rule_table_asserts_source_shapes():
    cfg = tiny_config("qwen3")
    rules = {r.hf_name: r for r in target_weight_rules(cfg)}
    r = rules["model.layers.{i}.self_attn.k_proj.weight"]
    assert r.hf_shape == (cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size) and r.transform == "transpose"
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight.*\(32, 64\).*\(64, 32\)"):
        r.to_param("model.layers.0.self_attn.k_proj.weight", np.zeros((64, 32), np.float32))
    assert "lm_head.weight" not in rules  # tied


# -------------------------------------------------------------------------------------- errors


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_hf_target(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="nope"):
        read_safetensors_dir(tmp_path / "nope")


def test_missing_config(saved, tmp_path):
    path = _copy(saved, tmp_path)
    os.remove(path / "config.json")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_target(path)


def test_missing_weights_file(saved, tmp_path):
    path = _copy(saved, tmp_path)
    os.remove(path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors"):
        load_hf_target(path)


def test_truncated_safetensors(saved, tmp_path):
    path = _copy(saved, tmp_path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated"):
        load_hf_target(path)


def _write_shards(path, tensors, weight_map_extra=None):
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, path / shard)
        weight_map.update({k: shard for k in keys})
    weight_map.update(weight_map_extra or {})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return shards


def test_missing_shard_and_index_mismatch(saved, tmp_path):
    path = _copy(saved, tmp_path)
    tensors = load_file(path / "model.safetensors")
    os.remove(path / "model.safetensors")
    shards = _write_shards(path, tensors)
    cfg, model = load_hf_target(path)  # a well-formed sharded copy loads
    np.testing.assert_array_equal(_params(model)["norm/scale"], tensors["model.norm.weight"])

    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        **{k: s for s, ks in shards.items() for k in ks}, "model.ghost.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match="model.ghost.weight"):
        read_safetensors_dir(path)
    # A tensor in two shards (one copy stale?) is refused, not taken from whichever shard is read last.
    first, second = _write_shards(path, tensors).items()
    save_file({k: tensors[k] for k in [*second[1], first[1][0]]}, path / second[0])
    with pytest.raises(CheckpointError, match=re.escape(f"tensor '{first[1][0]}' appears in more than one shard")):
        read_safetensors_dir(path)
    _write_shards(path, tensors)
    os.remove(path / "model-00002-of-00002.safetensors")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_hf_target(path)


@pytest.mark.parametrize("content, message", [
    (b"\xff\xfe{}", r"index\.json is not UTF-8 text: byte 0xff at line 1, offset 0"),
    (b'{"weight_map": {', r"index\.json is not valid JSON: .*line 1 column 17"),
    (b'{"weight_map": [1]}', r"index\.json: field 'weight_map' must map tensor names to shard file names, got \[1\]"),
    (b'{"weight_map": {"model.norm.weight": 3}}', r"field 'weight_map' must map .* got \{'model\.norm\.weight': 3\}"),
    (b'{"metadata": {}}', r"field 'weight_map' must map .* got None"),
])
def test_broken_index_names_the_file(saved, tmp_path, content, message):
    path = _copy(saved, tmp_path)
    (path / "model.safetensors.index.json").write_bytes(content)
    with pytest.raises(CheckpointError, match=message) as e:
        load_hf_target(path)
    assert str(path / "model.safetensors.index.json") in str(e.value)


def test_wrong_shape_names_tensor_and_shapes(saved, tmp_path):
    path = _copy(saved, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 80  # checkpoint has 96
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"mlp\.(down|gate|up)_proj\.weight.*expected shape \((80, 64|64, 80)\), got \((96, 64|64, 96)\)"):
        load_hf_target(path)


def test_missing_and_unmapped_tensors_reported_together(saved, tmp_path):
    path = _copy(saved, tmp_path)
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    del tensors["lm_head.weight"]
    tensors["model.layers.1.mlp.extra.weight"] = np.zeros((3,), np.float32)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros((8,), np.float32)  # ignorable buffer
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError) as e:
        load_hf_target(path)
    msg = str(e.value)
    assert str(path) in msg
    assert "missing tensor(s): lm_head.weight, model.layers.1.mlp.up_proj.weight" in msg
    assert "unmapped tensor(s): model.layers.1.mlp.extra.weight" in msg
    assert "inv_freq" not in msg


def test_unknown_architecture(saved, tmp_path):
    path = _copy(saved, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "gpt2"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json.*'gpt2'.*llama, mistral, qwen2, qwen3"):
        load_hf_target(path)


def test_config_not_utf8_names_the_file(saved, tmp_path):
    path = _copy(saved, tmp_path)
    (path / "config.json").write_bytes(b'{"model_type": "llama",\n "note": "caf\xe9"}')
    with pytest.raises(ValueError, match=r"ckpt/config\.json is not UTF-8 text: byte 0xe9 at line 2, offset 37"):
        load_hf_target(path)
    (path / "config.json").write_text('{"model_type": "llama",\n "hidden_size": 64,,}')
    with pytest.raises(ValueError, match=r"ckpt/config\.json is not valid JSON: .*line 2 column 20"):
        load_hf_target(path)
    (path / "config.json").write_text('[{"model_type": "llama"}]')
    with pytest.raises(ValueError, match=r"ckpt/config\.json must hold a JSON object, got list"):
        load_hf_target(path)


@pytest.mark.parametrize("patch, message", [
    ({"hidden_size": "sixty-four"}, r"field 'hidden_size' must be an integer, got 'sixty-four'"),
    ({"num_hidden_layers": 2.5}, r"field 'num_hidden_layers' must be an integer, got 2\.5"),
    ({"num_attention_heads": 0}, r"field 'num_attention_heads' must be positive, got 0"),
    # JSON's NaN and Infinity passed "positive": a NaN rope base loaded and gave NaN logits.
    ({"rope_theta": float("nan")}, r"field 'rope_theta' must be positive, got nan"),
    ({"rope_theta": float("inf")}, r"field 'rope_theta' must be finite, got inf"),
    ({"vocab_size": True}, r"field 'vocab_size' must be an integer, got True"),
    ({"rms_norm_eps": "1e-5"}, r"field 'rms_norm_eps' must be a number, got '1e-05'|got '1e-5'"),
    ({"tie_word_embeddings": "false"}, r"field 'tie_word_embeddings' must be true or false, got 'false'"),
    ({"eos_token_id": "2"}, r"field 'eos_token_id' must be a token id >= 0 or a list of them, got '2'"),
    ({"eos_token_id": [2, None]}, r"field 'eos_token_id' must be a token id"),
    ({"eos_token_id": -1}, r"field 'eos_token_id' must be a token id >= 0 or a list of them, got -1"),
    ({"bos_token_id": [1, 2]}, r"field 'bos_token_id' must be one token id, got \[1, 2\]"),
    ({"rope_scaling": "llama3"}, r"field 'rope_scaling' must be an object, got 'llama3'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": "8", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}},
     r"field 'rope_scaling\.factor' must be a number, got '8'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"required field 'rope_scaling\.low_freq_factor' is missing"),
    ({"num_key_value_heads": 3}, r"config\.json: ModelConfig\.num_heads=4 must be a multiple of num_kv_heads=3"),
])
def test_config_field_errors_name_file_and_field(saved, tmp_path, patch, message):
    path = _copy(saved, tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **patch}))
    with pytest.raises(ValueError, match=message) as e:
        load_hf_target(path)
    assert str(path / "config.json") in str(e.value) and "\n" not in str(e.value)


def test_a_rope_base_the_rotations_cannot_use_is_refused_by_name():
    """A NaN, zero or negative base made every rotation angle NaN: NaN logits, no error."""
    cfg = PRESETS["smollm2-135m"]
    for bad in (float("nan"), 0.0, -1e4, float("inf"), True):
        with pytest.raises(ValueError, match=f"ModelConfig.rope_theta must be a finite number > 0, got {bad!r}"):
            dataclasses.replace(cfg, rope_theta=bad)
    assert dataclasses.replace(cfg, rope_theta=np.float32(1e4)).rope_theta == 1e4


def test_config_accepts_integral_floats_and_nulls(saved):
    config = json.loads((saved[1] / "config.json").read_text())
    cfg = ModelConfig.from_hf_config({**config, "hidden_size": 64.0, "num_key_value_heads": None,
                                      "head_dim": None, "eos_token_id": [2, 3]})
    assert cfg.hidden_size == 64 and isinstance(cfg.hidden_size, int)
    assert cfg.num_kv_heads == cfg.num_heads and cfg.eos_token_ids == (2, 3)


def test_load_target_params_direct_errors():
    cfg = tiny_config("llama")
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    good = {}
    for rule in target_weight_rules(cfg):
        for name in rule.names(cfg.num_layers):
            good[name] = np.zeros(rule.hf_shape, np.float32)
    bad = dict(good)
    bad["model.norm.weight"] = np.zeros((63,), np.float32)
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight': expected shape \(64,\), got \(63,\)"):
        load_target_params(model, bad)
    bad = dict(good)
    bad["model.embed_tokens.weight"] = np.zeros((300, 64), np.int32)
    with pytest.raises(CheckpointError, match="model.embed_tokens.weight.*non-float"):
        load_target_params(model, bad)
    extra = dict(good, **{"model.extra.weight": np.zeros((2,), np.float32)})  # nothing missing, one too many
    with pytest.raises(CheckpointError, match=r"2 layers; unmapped tensor\(s\): model\.extra\.weight$"):
        load_target_params(model, extra)
    load_target_params(model, good)
    # Every parameter was replaced (the eval_shape skeleton held no arrays) and holds the zeros.
    assert all(isinstance(v.get_value(), jax.Array) for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param))
    assert all(np.all(v == 0) for v in _params(model).values())


# -------------------------------------------------------------------------------------- config


def test_config_roundtrip_and_v5_rope_parameters():
    for name, cfg in PRESETS.items():
        assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg, name
    llama = PRESETS["llama-3.1-8b"]
    v5 = {k: v for k, v in llama.to_hf_config().items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}
    assert ModelConfig.from_hf_config(v5) == llama
    # transformers builds the same model from our dict (its own parsing of the fields).
    hf_cfg = transformers.LlamaConfig(**llama.to_hf_config())
    assert hf_cfg.rope_parameters["rope_type"] == "llama3" and hf_cfg.rope_parameters["factor"] == 8.0
    assert ModelConfig.from_hf_config(hf_cfg.to_dict()) == llama
    qwen = PRESETS["qwen3-8b"]
    assert ModelConfig.from_hf_config(transformers.Qwen3Config(**qwen.to_hf_config()).to_dict()) == qwen
    for name, hf_class in (("qwen2.5-7b", transformers.Qwen2Config), ("mistral-7b-v0.3", transformers.MistralConfig),
                           ("gemma-2-9b", transformers.Gemma2Config), ("gemma-3-1b", transformers.Gemma3TextConfig),
                           ("mixtral-8x7b", transformers.MixtralConfig),
                           ("qwen3-30b-a3b", transformers.Qwen3MoeConfig), ("olmoe-1b-7b", transformers.OlmoeConfig),
                           ("gpt-oss-20b", transformers.GptOssConfig)):
        assert ModelConfig.from_hf_config(hf_class(**PRESETS[name].to_hf_config()).to_dict()) == PRESETS[name], name
    assert ModelConfig.from_hf_config(qwen.to_hf_config(), dtype="float32").dtype == "float32"


def test_sliding_windows_are_read_as_transformers_reads_them():
    """Mistral's window covers every layer (absent: transformers' 4096; null: none); Qwen2 / Qwen3
    windows need use_sliding_window and cover the layers from max_window_layers on, or those that
    layer_types marks; each config goes back to a dict that transformers reads as the same layers."""
    mistral = tiny_config("mistral").to_hf_config()
    assert mistral["sliding_window"] is None
    assert ModelConfig.from_hf_config(mistral).sliding_window is None
    absent = {k: v for k, v in mistral.items() if k != "sliding_window"}
    assert transformers.MistralConfig(**absent).sliding_window == 4096
    cfg = ModelConfig.from_hf_config(absent)
    assert (cfg.sliding_window, cfg.sliding_layers, cfg.layer_windows) == (4096, (0, 1), (4096, 4096))
    cfg = ModelConfig.from_hf_config({**mistral, "sliding_window": 5})
    assert (cfg.sliding_window, cfg.sliding_layers) == (5, (0, 1))
    assert transformers.MistralConfig(**cfg.to_hf_config()).sliding_window == 5
    for arch, hf_class in (("qwen2", transformers.Qwen2Config), ("qwen3", transformers.Qwen3Config)):
        base = {**tiny_config(arch, num_layers=4).to_hf_config(), "layer_types": None}
        for patch, layers in [({"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}, (1, 2, 3)),
                              ({"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 4}, ()),
                              ({"use_sliding_window": False, "sliding_window": 6, "max_window_layers": 0}, ()),
                              ({"use_sliding_window": True, "sliding_window": 6,
                                "layer_types": ["sliding_attention", "full_attention"] * 2}, (0, 2))]:
            hf = hf_class(**{**base, **patch})
            want = tuple(i for i, t in enumerate(hf.layer_types) if t == "sliding_attention")
            assert want == layers, (arch, patch)
            cfg = ModelConfig.from_hf_config({**base, **patch})
            assert cfg.sliding_layers == layers and cfg.sliding_window == (6 if layers else None), (arch, patch)
            back = hf_class(**cfg.to_hf_config())
            assert back.layer_types == hf.layer_types and ModelConfig.from_hf_config(back.to_dict()) == cfg
    for kw, match in [(dict(architecture="llama", sliding_window=4, sliding_layers=(0,)), "'llama' has no sliding"),
                      (dict(architecture="mistral", sliding_window=4, sliding_layers=(1,)), "every layer"),
                      (dict(architecture="qwen2", sliding_window=4), "needs a sliding_window and the other way"),
                      (dict(architecture="qwen2", sliding_layers=(1,)), "needs a sliding_window"),
                      (dict(architecture="qwen2", sliding_window=4, sliding_layers=(1, 0)), "increasing layer"),
                      (dict(architecture="qwen2", sliding_window=4, sliding_layers=(2,)), r"in \[0, 2\)"),
                      (dict(architecture="qwen2", sliding_window=-1, sliding_layers=(0,)), "positive int")]:
        with pytest.raises(ValueError, match=match):
            tiny_config(**kw)


def test_gemma2_fields_read_as_transformers_reads_them_and_belong_to_gemma2_only():
    """Gemma 2's keys, absent, take Gemma2Config's defaults (query scalar 256, caps 50 and 30,
    windows 4096 in alternate layers, a tied head); null caps mean none. Its fields are refused on
    other families (transformers would read their saved configs without them), and so are an
    activation of the other kind and bidirectional attention."""
    full = transformers.Gemma2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2).to_dict()
    sparse = {k: v for k, v in full.items() if k not in (
        "head_dim", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping", "sliding_window",
        "layer_types", "tie_word_embeddings", "hidden_activation")}
    for c in (full, sparse):
        cfg = ModelConfig.from_hf_config(c)
        assert (cfg.head_dim, cfg.query_pre_attn_scalar, cfg.attn_softcap, cfg.final_softcap) == (
            256, 256.0, 50.0, 30.0)
        assert (cfg.sliding_window, cfg.sliding_layers, cfg.tie_word_embeddings) == (4096, (0, 2), True)
        assert cfg.hidden_act == "gelu_tanh" and cfg.attention_scale == 256 ** -0.5
        assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg
    uncapped = ModelConfig.from_hf_config({**full, "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert uncapped.attn_softcap is None and uncapped.final_softcap is None
    assert transformers.Gemma2Config(**uncapped.to_hf_config()).final_logit_softcapping is None
    for patch, match in [({"hidden_activation": "silu"}, r"hidden_activation='silu' is not supported \(only "
                                                         r"gelu_pytorch_tanh\)"),
                         ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
                         ({"sliding_window": None}, r"sliding_window is null, but layers \[0, 2\] slide"),
                         ({"attn_logit_softcapping": -1.0}, "attn_logit_softcapping")]:
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf_config({**full, **patch})
    with pytest.raises(ValueError, match=r"hidden_act='gelu_pytorch_tanh' is not supported \(only silu\)"):
        ModelConfig.from_hf_config({**tiny_config("llama").to_hf_config(), "hidden_act": "gelu_pytorch_tanh"})
    for arch, kw, match in [("llama", dict(attn_softcap=5.0), "attn_softcap=5.0 is Gemma's, not architecture "
                                                              "'llama'"),
                            ("qwen3", dict(hidden_act="gelu_tanh"), "hidden_act='gelu_tanh' is Gemma's"),
                            ("qwen3", dict(local_rope_theta=1e4), "local_rope_theta=10000.0 is Gemma's"),
                            ("gemma2", dict(local_rope_theta=1e4), "local_rope_theta is Gemma 3's, not 'gemma2'"),
                            ("gemma2", dict(qk_norm=True), "qk_norm=True does not fit architecture 'gemma2'"),
                            ("gemma3_text", dict(qk_norm=False), "qk_norm=False does not fit architecture "
                                                                 "'gemma3_text'"),
                            ("gemma3_text", dict(attention_bias=True), "'gemma3_text' has no attention biases"),
                            ("gemma2", dict(hidden_act="relu"), "hidden_act='relu' is not one of silu, gelu_tanh"),
                            ("gemma2", dict(final_softcap=0.0), "final_softcap must be a positive number")]:
        with pytest.raises(ValueError, match=match):
            tiny_config(arch, **kw)


def test_gemma3_ropes_read_as_transformers_reads_them():
    """Gemma 3's two ropes from either form: transformers 5's rope_parameters per layer type, or
    the Hub's rope_theta, rope_scaling and rope_local_base_freq (absent: 10^6 and 10^4); sliding
    layers from layer_types or sliding_window_pattern (absent: every sixth layer attends fully).
    A sliding rope with a scaling of its own is refused by name."""
    kw = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=7, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, sliding_window=4)
    new = transformers.Gemma3TextConfig(**kw, rope_scaling=dict(rope_type="linear", factor=8.0)).to_dict()
    cfg = ModelConfig.from_hf_config(new)
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling.factor) == (1e6, 1e4, 8.0)
    assert cfg.sliding_layers == (0, 1, 2, 3, 4, 6) and cfg.qk_norm and cfg.final_softcap is None
    back = transformers.Gemma3TextConfig(**cfg.to_hf_config())
    assert back.rope_parameters == new["rope_parameters"] and back.layer_types == new["layer_types"]
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg
    hub = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types")}
    for extra, want in [({}, (1e6, 1e4, None, (0, 1, 2, 3, 4, 6))),
                        (dict(rope_theta=5e5, rope_local_base_freq=2e3, sliding_window_pattern=3,
                              rope_scaling=dict(rope_type="linear", factor=2.0)), (5e5, 2e3, 2.0, (0, 1, 3, 4, 6)))]:
        cfg = ModelConfig.from_hf_config({**hub, **extra})
        assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling and cfg.rope_scaling.factor,
                cfg.sliding_layers) == want, extra
        hf = transformers.Gemma3TextConfig(**{k: v for k, v in {**hub, **extra}.items() if k != "model_type"})
        assert [t == "sliding_attention" for t in hf.layer_types] == [i in want[3] for i in range(7)]
        assert hf.rope_parameters["sliding_attention"]["rope_theta"] == want[1]
    # Per-layer-type ropes beside a legacy rope_scaling: transformers applies the scaling to the full layers' rope.
    # (read first: transformers' config class writes the scaling into the dicts it is given)
    both = {**transformers.Gemma3TextConfig(**kw).to_dict(), "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    assert ModelConfig.from_hf_config(both).rope_scaling == RopeScaling(rope_type="linear", factor=8.0)
    hf = transformers.Gemma3TextConfig(**{k: v for k, v in both.items() if k != "model_type"})
    assert hf.rope_parameters["full_attention"]["factor"] == 8.0 and "factor" not in hf.rope_parameters[
        "sliding_attention"]
    scaled_local = {**new, "rope_parameters": {**new["rope_parameters"], "sliding_attention": {
        "rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}}
    with pytest.raises(ValueError, match="sliding_attention.rope_type 'linear' is not supported"):
        ModelConfig.from_hf_config(scaled_local)


def test_phi3_ropes_other_than_plain_are_refused_by_name():
    """transformers reads Phi-3's scaled ropes (su, yarn, longrope) as LongRoPE, and Phi-4-mini
    rotates 3/4 of each head: both are refused by name, not read as something else."""
    base = tiny_config("phi3").to_hf_config()
    assert ModelConfig.from_hf_config(base) == tiny_config("phi3")
    for patch, match in [({"rope_scaling": {"type": "yarn", "factor": 2.0}}, "rope_type 'yarn' is not supported for "
                                                                            "model_type 'phi3'"),
                         ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8}}, "'longrope'"),
                         ({"partial_rotary_factor": 0.75}, "partial_rotary_factor=0.75 is not supported"),
                         ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                               "partial_rotary_factor": 0.5}},
                          "partial_rotary_factor=0.5"),
                         ({"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
                          "mixing full and sliding attention are not supported for model_type 'phi3'")]:
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf_config({**base, **patch})
    with pytest.raises(ValueError, match="'phi3' has no attention biases and no q/k norms"):
        tiny_config("phi3", qk_norm=True)


def test_experts_read_as_transformers_reads_them_and_belong_to_moe_families_only():
    """Mixtral and Qwen3-MoE configs, as written and as transformers' config classes read them:
    either key for the expert count, Qwen3-MoE's moe_intermediate_size as the experts' width, its
    window only with use_sliding_window; layers without experts and mismatched fields refused."""
    for arch, cls in (("mixtral", transformers.MixtralConfig), ("qwen3_moe", transformers.Qwen3MoeConfig),
                      ("qwen2_moe", transformers.Qwen2MoeConfig), ("olmoe", transformers.OlmoeConfig),
                      ("granitemoe", transformers.GraniteMoeConfig), ("gpt_oss", transformers.GptOssConfig)):
        for overrides in ({}, dict(sliding_window=3, sliding_layers=(0,) if arch == "qwen2_moe" else (0, 1)),
                          dict(norm_topk_prob=not tiny_config(arch).norm_topk_prob)):
            if arch in ("mixtral", "granitemoe", "gpt_oss") and overrides.get("norm_topk_prob") is False:
                continue
            if arch in ("olmoe", "granitemoe") and "sliding_window" in overrides:  # they attend fully
                continue
            if arch == "gpt_oss" and "sliding_window" in overrides:  # (its windows are every other layer's)
                overrides = dict(sliding_window=3, sliding_layers=(0,))
            cfg = tiny_config(arch, **overrides)
            out = cfg.to_hf_config()
            assert ModelConfig.from_hf_config(out) == cfg
            hf = cls(**{k: v for k, v in out.items() if k not in ("architectures", "model_type")})
            assert (getattr(hf, "num_local_experts", None) or hf.num_experts, hf.num_experts_per_tok) == (4, 2)
            assert getattr(hf, "moe_intermediate_size", hf.intermediate_size) == 32
            assert (getattr(hf, "sliding_window", None) or None) == cfg.sliding_window  # Qwen2MoeConfig: 0
            assert ModelConfig.from_hf_config({**hf.to_dict(), "model_type": arch}) == cfg
    base = tiny_config("qwen3_moe").to_hf_config()
    del base["num_experts"]
    assert ModelConfig.from_hf_config({**base, "num_local_experts": 6}).num_experts == 6  # what save_pretrained writes
    assert ModelConfig.from_hf_config(base).num_experts == 128  # Qwen3MoeConfig's default
    assert ModelConfig.from_hf_config({**base, "sliding_window": 7}).sliding_window is None  # no use_sliding_window
    mixtral = tiny_config("mixtral").to_hf_config()
    del mixtral["sliding_window"]
    assert ModelConfig.from_hf_config(mixtral).sliding_window is None  # MixtralConfig's default: none
    qwen = tiny_config("qwen3_moe").to_hf_config()
    for patch, match in [({"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\] is not supported"),
                         ({"decoder_sparse_step": 2}, "decoder_sparse_step=2 is not supported"),
                         ({"num_experts_per_tok": 5}, "experts_per_token=5 is more than num_experts=4"),
                         ({"num_experts": 0}, "'num_experts' must be positive")]:
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf_config({**qwen, **patch})
    assert ModelConfig.from_hf_config({**tiny_config("qwen2_moe").to_hf_config(), "qkv_bias": False}).qkv_bias is False
    olmoe = tiny_config("olmoe").to_hf_config()
    del olmoe["norm_topk_prob"], olmoe["num_experts"]
    assert (ModelConfig.from_hf_config(olmoe).norm_topk_prob, ModelConfig.from_hf_config(olmoe).num_experts) == (
        False, 64)  # OlmoeConfig's defaults
    with pytest.raises(ValueError, match="clip_qkv=8.0 is not supported"):
        ModelConfig.from_hf_config({**olmoe, "clip_qkv": 8.0})
    for arch, fields, match in [("llama", dict(num_experts=4, experts_per_token=2), "need a mixture-of-experts"),
                                ("qwen3_moe", dict(shared_expert_size=8),
                                 "a shared expert is Qwen2-MoE's and Qwen3-Next's"),
                                ("qwen2_moe", dict(attention_bias=True), "'qwen2_moe' has no q/k norms and no o_proj"),
                                ("mixtral", dict(num_experts=0, experts_per_token=0), "num_experts must be a positive"),
                                ("mixtral", dict(norm_topk_prob=False), "Mixtral always renormalises"),
                                ("mixtral", dict(qk_norm=True), "'mixtral' has no attention biases and no q/k norms"),
                                ("qwen3_moe", dict(qk_norm=False), "'qwen3_moe' has q/k norms"),
                                ("olmoe", dict(qk_norm=False), "'olmoe' has q/k norms"),
                                ("granitemoe", dict(norm_topk_prob=False), "Granite MoE always renormalises"),
                                ("granitemoe", dict(qk_norm=True), "'granitemoe' has no q/k/v-only biases"),
                                ("gpt_oss", dict(norm_topk_prob=False), "GPT-OSS always renormalises"),
                                ("gpt_oss", dict(swiglu_limit=None), "GPT-OSS has both"),
                                ("mixtral", dict(swiglu_limit=7.0, swiglu_alpha=1.7), "GPT-OSS has both, and no other"),
                                ("olmoe", dict(head_dim=8), "OLMoE's heads are hidden_size / num_heads wide"),
                                ("olmoe", dict(sliding_window=3, sliding_layers=(0,)), "'olmoe' has no sliding window"),
                                ("qwen3_moe", dict(sliding_window=3, sliding_layers=(1,)),
                                 "a qwen3_moe window applies to every layer")]:
        with pytest.raises(ValueError, match=match):
            tiny_config(arch, **fields)


def test_smollm3_nope_layers_and_windows_read_as_transformers_reads_them():
    """SmolLM3's layers without rotary embedding come from `no_rope_layers` (0 = unrotated) or
    every `no_rope_layer_interval`-th layer; its windows need use_sliding_window and a window, and
    sit in the NoPE layers unless layer_types says otherwise. Each config goes back to a dict that
    transformers' SmolLM3Config reads as the same layers."""
    base = tiny_config("smollm3", num_layers=8).to_hf_config()
    assert base["no_rope_layers"] == [1, 0, 1, 1, 1, 1, 1, 1]
    derived = {k: v for k, v in base.items() if k not in ("no_rope_layers", "layer_types")}
    assert ModelConfig.from_hf_config(derived).nope_layers == (3, 7)  # the default interval, 4
    assert ModelConfig.from_hf_config({**derived, "no_rope_layer_interval": 3}).nope_layers == (2, 5)
    windowed = {**derived, "use_sliding_window": True, "sliding_window": 5}
    cfg = ModelConfig.from_hf_config(windowed)
    assert (cfg.sliding_window, cfg.sliding_layers) == (5, (3, 7))
    assert ModelConfig.from_hf_config({**windowed, "sliding_window": None}).sliding_window is None
    assert ModelConfig.from_hf_config({**windowed, "use_sliding_window": False}).sliding_window is None
    for c in (base, derived, windowed, {**windowed, "layer_types": ["sliding_attention"] * 2 + ["full_attention"] * 6}):
        ours = ModelConfig.from_hf_config(c)
        hf = transformers.SmolLM3Config(**{k: v for k, v in c.items() if k not in ("architectures", "model_type")})
        assert [i for i, f in enumerate(hf.no_rope_layers) if not f] == list(ours.nope_layers)
        assert [i for i, t in enumerate(hf.layer_types) if t == "sliding_attention" and hf.use_sliding_window
                and hf.sliding_window] == list(ours.sliding_layers)
        assert ModelConfig.from_hf_config(ours.to_hf_config()) == ours
    for patch, match in [({"no_rope_layers": [1, 0]}, "'no_rope_layers' must be a list of 8 flags"),
                         ({"no_rope_layers": [2] * 8}, "'no_rope_layers' must be a list of 8 flags"),
                         ({"no_rope_layers": [1.0] * 8}, "'no_rope_layers' must be a list of 8 flags")]:
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf_config({**base, **patch})
    with pytest.raises(ValueError, match="layers without rotary embedding are SmolLM3's, not architecture 'llama'"):
        tiny_config("llama", nope_layers=(1,))
    with pytest.raises(ValueError, match=r"nope_layers=\(1, 1\) must be increasing"):
        tiny_config("smollm3", nope_layers=(1, 1))


def test_granite_multipliers_read_as_transformers_reads_them_and_belong_to_granite_only():
    """Granite's four factors from its config, GraniteConfig's 1.0 where a key is absent (scores
    then scaled by 1, not head_dim ** -0.5); one form per model, so configs written either way
    compare equal; the factors on another family are refused by name."""
    cfg = tiny_config("granite")
    out = cfg.to_hf_config()
    assert {k: out[k] for k in ("embedding_multiplier", "attention_multiplier", "residual_multiplier",
                                "logits_scaling")} == dict(embedding_multiplier=3.0, attention_multiplier=0.2,
                                                           residual_multiplier=0.5, logits_scaling=2.0)
    hf = transformers.GraniteConfig(**{k: v for k, v in out.items() if k not in ("architectures", "model_type")})
    assert ModelConfig.from_hf_config({**hf.to_dict(), "model_type": "granite"}) == cfg
    bare = {k: v for k, v in out.items() if k not in ("embedding_multiplier", "attention_multiplier",
                                                       "residual_multiplier", "logits_scaling")}
    plain = ModelConfig.from_hf_config(bare)
    assert (plain.embed_scale, plain.attention_scale, plain.residual_multiplier, plain.logits_scaling) == (
        None, 1.0, None, None)
    assert tiny_config("granite", embedding_multiplier=1.0, attention_multiplier=None) == tiny_config(
        "granite", embedding_multiplier=None, attention_multiplier=16 ** -0.5)
    with pytest.raises(ValueError, match="'residual_multiplier' must be positive"):
        ModelConfig.from_hf_config({**out, "residual_multiplier": 0})
    with pytest.raises(ValueError, match="logits_scaling=2.0 is Granite's, not architecture 'llama'"):
        tiny_config("llama", logits_scaling=2.0)
    with pytest.raises(ValueError, match="'granite' has no sliding window"):
        tiny_config("granite", sliding_window=4, sliding_layers=(0,))


def test_olmo2_config_reads_as_transformers_reads_it_and_its_norms_are_its_own():
    """OLMo 2 through Olmo2Config and back (attention biases on q/k/v/o when asked); it always has
    q/k norms, over each whole projection, and no window."""
    for overrides in ({}, dict(attention_bias=True)):
        cfg = tiny_config("olmo2", **overrides)
        out = cfg.to_hf_config()
        hf = transformers.Olmo2Config(**{k: v for k, v in out.items() if k not in ("architectures", "model_type")})
        assert ModelConfig.from_hf_config({**hf.to_dict(), "model_type": "olmo2"}) == cfg
        assert (cfg.input_norms, cfg.output_norms, cfg.qk_norm_whole) == (False, True, True)
    assert tiny_config("qwen3").qk_norm_whole is False and tiny_config("qwen3").input_norms is True
    for fields, match in [(dict(qk_norm=False), "'olmo2' has q/k norms"),
                          (dict(qkv_bias=True), "'olmo2' has q/k norms .* and no q/k/v-only biases"),
                          (dict(sliding_window=4, sliding_layers=(0,)), "'olmo2' has no sliding window")]:
        with pytest.raises(ValueError, match=match):
            tiny_config("olmo2", **fields)


def test_olmo3_ropes_and_windows_read_as_transformers_reads_them():
    """OLMo 3's windows (layer_types, else three layers of four; 4096 wide unless given) and two
    ropes (per layer type, or the Hub's rope_theta and rope_scaling, which transformers applies to
    the full-attention layers, giving the sliding ones Olmo3Config's default base), each as
    transformers' Olmo3Config reads them."""
    cfg = tiny_config("olmo3", num_layers=8, sliding_layers=(0, 1, 2, 4, 5, 6))
    legacy = {k: v for k, v in cfg.to_hf_config().items() if k not in ("rope_parameters", "layer_types",
                                                                        "sliding_window")}
    legacy.update(rope_theta=200_000.0, rope_scaling={"rope_type": "linear", "factor": 2.0})
    for c in (cfg.to_hf_config(), legacy):
        ours = ModelConfig.from_hf_config(c)
        hf = transformers.Olmo3Config(**{k: v for k, v in c.items() if k not in ("architectures", "model_type")})
        full, local = hf.rope_parameters["full_attention"], hf.rope_parameters["sliding_attention"]
        assert (ours.rope_theta, ours.local_rope_theta) == (full["rope_theta"], local["rope_theta"])
        assert (ours.rope_scaling and ours.rope_scaling.rope_type) == (full["rope_type"] if full["rope_type"] !=
                                                                       "default" else None)
        assert ours.sliding_window == hf.sliding_window
        assert list(ours.sliding_layers) == [i for i, t in enumerate(hf.layer_types) if t == "sliding_attention"]
        assert ModelConfig.from_hf_config({**hf.to_dict(), "model_type": "olmo3"}) == ours
    assert ModelConfig.from_hf_config(legacy).local_rope_theta == 500_000.0  # not the legacy rope_theta
    assert ModelConfig.from_hf_config(legacy).sliding_window == 4096
    with pytest.raises(ValueError, match="local_rope_theta=10000.0 is Gemma's, not architecture 'olmo2'"):
        tiny_config("olmo2", local_rope_theta=10_000.0)


def test_config_rejects_unsupported():
    base = tiny_config("qwen3").to_hf_config()
    for patch, match in [({"use_sliding_window": True, "sliding_window": None, "max_window_layers": 1,
                           "layer_types": None},
                          r"sliding_window is null, but layers \[1\] slide"),
                         ({"hidden_act": "gelu"}, "hidden_act"),
                         ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
                          "rope_type 'dynamic' is not supported"),
                         ({"model_type": "gemma"}, "gemma.*supported: llama, mistral, qwen2, qwen3"),
                         ({"model_type": "mistral", "sliding_window": 8, "layer_types": ["full_attention",
                                                                                          "sliding_attention"]},
                          "mixing full and sliding attention are not supported for model_type 'mistral'"),
                         ({"layer_types": ["full_attention", "sliding_attention"]},
                          "marks sliding_attention layers but use_sliding_window is false"),
                         ({"layer_types": ["full_attention", "chunked_attention"]},
                          r"layer_types \['chunked_attention'\] are not supported"),
                         ({"layer_types": ["full_attention"]}, "'layer_types' must be a list of 2 strings"),
                         ({"model_type": "llama", "layer_types": ["sliding_attention"] * 2},
                          "sliding_attention are not supported for model_type 'llama'"),
                         ({"model_type": "mistral", "sliding_window": 0}, "sliding_window"),
                         ({"num_key_value_heads": 3}, "num_heads=4 must be a multiple of num_kv_heads=3"),
                         ({"pretraining_tp": 2}, "pretraining_tp=2 is not supported")]:
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf_config({**base, **patch})
    with pytest.raises(ValueError, match="'hidden_size' is missing"):
        ModelConfig.from_hf_config({k: v for k, v in base.items() if k != "hidden_size"})
    with pytest.raises(TypeError, match="bogus"):
        ModelConfig.from_hf_config(base, bogus=1)
    with pytest.raises(ValueError, match="dtype"):
        dataclasses.replace(tiny_config(), dtype="int8")


def test_keys_a_config_leaves_out_mean_the_config_classes_defaults():
    """A config.json may leave keys out (hand-written, or saved by an older transformers): each then
    means what transformers' config class defaults it to, which tevjax must read field for field
    (a wrong default is silently another model)."""
    def read(cls, cfg, drop, **extra):
        c = {k: v for k, v in {**cfg.to_hf_config(), **extra}.items() if k not in drop}
        return ModelConfig.from_hf_config(c), cls(**{k: v for k, v in c.items() if k not in ("architectures",
                                                                                               "model_type")})

    ours, hf = read(transformers.LlamaConfig, tiny_config("llama"), ("rms_norm_eps", "max_position_embeddings"))
    assert (ours.rms_norm_eps, ours.max_position_embeddings) == (hf.rms_norm_eps, hf.max_position_embeddings)
    assert (ours.rms_norm_eps, ours.max_position_embeddings) == (1e-6, 2048)
    ours, hf = read(transformers.MixtralConfig, tiny_config("mixtral"), ("num_local_experts", "num_experts_per_tok"))
    assert (ours.num_experts, ours.experts_per_token) == (hf.num_local_experts, hf.num_experts_per_tok) == (8, 2)
    # Qwen2-MoE: q/k/v biases, a shared expert 5632 wide, windows in the even layers below max_window_layers
    ours, hf = read(transformers.Qwen2MoeConfig, tiny_config("qwen2_moe", num_layers=4),
                    ("qkv_bias", "shared_expert_intermediate_size", "layer_types", "max_window_layers"),
                    use_sliding_window=True, sliding_window=3)
    assert (ours.qkv_bias, ours.shared_expert_size) == (hf.qkv_bias, hf.shared_expert_intermediate_size) == (True, 5632)
    assert ours.layer_types == hf.layer_types == ["sliding_attention", "full_attention"] * 2
    # GPT-OSS: a 128-token window in the even layers; Qwen3-MoE with use_sliding_window: 4096 in every layer
    ours, hf = read(transformers.GptOssConfig, tiny_config("gpt_oss", num_layers=4, sliding_layers=(0, 2)),
                    ("sliding_window", "layer_types"))
    assert (ours.sliding_window, ours.layer_types) == (hf.sliding_window, hf.layer_types) and hf.sliding_window == 128
    ours, hf = read(transformers.Qwen3MoeConfig, tiny_config("qwen3_moe"), ("sliding_window",), use_sliding_window=True)
    assert (ours.sliding_window, ours.sliding_layers) == (hf.sliding_window, (0, 1)) and hf.sliding_window == 4096
    # Qwen3-Next: every fourth layer attends, heads 256 wide with a quarter rotated, renormalised experts and a
    # shared expert 512 wide
    hybrid = tiny_config("qwen3_next", num_layers=8, linear_layers=(0, 1, 2, 4, 5, 6))
    ours, hf = read(transformers.Qwen3NextConfig, hybrid, ("layer_types", "head_dim", "partial_rotary_factor",
                                                           "norm_topk_prob", "shared_expert_intermediate_size"))
    assert ours.layer_types == hf.layer_types and ours.linear_layers == (0, 1, 2, 4, 5, 6)
    assert (ours.head_dim, ours.norm_topk_prob, ours.shared_expert_size) == (
        hf.head_dim, hf.norm_topk_prob, hf.shared_expert_intermediate_size) == (256, True, 512)
    assert ours.rotary_dim == hf.head_dim * hf.rope_parameters["partial_rotary_factor"] == 64


@pytest.mark.parametrize("model_type", [t for t in SUPPORTED_ARCHITECTURES if t not in TWO_ROPES])
def test_left_out_norm_eps_positions_theta_and_tying_are_the_familys_defaults(model_type):
    """rms_norm_eps, max_position_embeddings, rope_theta and tie_word_embeddings, left out, are each
    family's own transformers defaults (Mixtral's theta 1e6 and eps 1e-5, SmolLM3's tied head, ...),
    not Llama's. Gemma 3's and OLMo 3's thetas come from their two ropes (tests above)."""
    drop = ("rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "rope_theta")
    c = {k: v for k, v in tiny_config(model_type).to_hf_config().items() if k not in drop}
    if isinstance(c.get("rope_parameters"), dict):
        c["rope_parameters"] = {k: v for k, v in c["rope_parameters"].items() if k != "rope_theta"}
    ours = ModelConfig.from_hf_config(c)
    hf = transformers.CONFIG_MAPPING[model_type](**{k: v for k, v in c.items() if k not in ("architectures",
                                                                                         "model_type")})
    assert (ours.rms_norm_eps, ours.max_position_embeddings, ours.tie_word_embeddings, ours.rope_theta) == (
        hf.rms_norm_eps, hf.max_position_embeddings, hf.tie_word_embeddings, hf.rope_parameters["rope_theta"])


def test_hybrid_rotary_share_and_multimodal_wrapper_read_as_transformers_reads_them():
    """Qwen3.5 keeps its rotated share in rope_parameters only; a whole-head rotation is one form
    (rotary_dim None) however it is written; a multimodal wrapper's tie_word_embeddings applies to its
    text model where that says nothing."""
    half = tiny_config("qwen3_5_text", rotary_dim=8)
    out = half.to_hf_config()
    assert "partial_rotary_factor" not in out and out["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert ModelConfig.from_hf_config(out) == half
    hf = transformers.Qwen3_5TextConfig(**{k: v for k, v in out.items() if k not in ("architectures", "model_type")})
    assert hf.head_dim * hf.rope_parameters["partial_rotary_factor"] == 8
    # the layer scan steps over the shortest period of layer kinds, not the whole model
    assert tiny_config("qwen3_next", num_layers=8, linear_layers=(0, 1, 2, 4, 5, 6)).layer_period == (
        "linear", "linear", "linear", "attention")
    for arch in ("qwen3_next", "qwen3_5_text"):
        whole = tiny_config(arch, rotary_dim=None)
        assert ModelConfig.from_hf_config(whole.to_hf_config()) == whole == tiny_config(arch, rotary_dim=16)
    text = {k: v for k, v in tiny_config("qwen3_5_text").to_hf_config().items()
            if k not in ("architectures", "model_type", "tie_word_embeddings")}
    for tied in (True, False):
        wrapper = {"model_type": "qwen3_5", "tie_word_embeddings": tied, "text_config": text}
        assert ModelConfig.from_hf_config(wrapper).tie_word_embeddings is tied
    for fields, match in [(dict(linear_value_heads=3), "linear_value_heads=3 must be a multiple of linear_key_heads=2"),
                          (dict(linear_conv=1), "linear_conv=1 must be at least 2")]:
        with pytest.raises(ValueError, match=match):
            tiny_config("qwen3_next", **fields)


def test_gpt_oss_mxfp4_experts_dequantize_as_transformers_does(tmp_path):
    """GPT-OSS's released checkpoints store each expert projection as MXFP4 blocks and scales:
    `dequantize_mxfp4` equals transformers' own dequantization on random codes and scales, and a
    checkpoint written that way (with its quantization_config) loads to the same parameters as the
    unquantized one holding those values; other quantizations are refused by name."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tevjax.convert.hf import dequantize_mxfp4

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 8, 2, 16), dtype=np.uint8)
    scales = rng.integers(120, 134, (3, 8, 2), dtype=np.uint8)
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    np.testing.assert_array_equal(np.swapaxes(dequantize_mxfp4(blocks, scales), -1, -2), theirs.numpy())

    model = random_model(tiny_config("gpt_oss"), seed=2)
    save_hf_target(model, tmp_path / "plain")
    state = load_file(str(tmp_path / "plain" / "model.safetensors"))
    packed = dict(state)
    for name in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, d_in, d_out = state[name].shape  # [E, in, out]
        code = rng.integers(0, 256, (e, d_out, d_in // 32, 16), dtype=np.uint8)
        scale = rng.integers(122, 130, (e, d_out, d_in // 32), dtype=np.uint8)
        state[name] = np.ascontiguousarray(np.swapaxes(dequantize_mxfp4(code, scale), -1, -2))  # what they hold
        del packed[name]
        packed[name + "_blocks"], packed[name + "_scales"] = code, scale
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    for name, tensors, extra in (("plain", state, {}),
                                 ("mxfp4", packed, {"quantization_config": {"quant_method": "mxfp4"}})):
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **extra}))
        save_file(tensors, str(tmp_path / name / "model.safetensors"))
    a, b = (_params(load_hf_target(tmp_path / name)[1]) for name in ("plain", "mxfp4"))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "fp8"}}))
    with pytest.raises(CheckpointError, match="quantization_config quant_method='fp8' is not supported"):
        load_hf_target(tmp_path / "mxfp4")
    # Blocks without their scales, scales without their blocks: refused by name, not loaded half-way.
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps({**config, **extra}))
    scales = next(k for k in packed if k.endswith("_scales"))
    blocks = scales.removesuffix("_scales") + "_blocks"
    no_scales = {k: v for k, v in packed.items() if k != scales}
    for tensors, message in ((no_scales, f"'{blocks}' has no '{scales}' beside it"),
                             ({**packed, "stray_scales": packed[scales]}, "MXFP4 scales without blocks: stray_scales")):
        save_file(tensors, str(tmp_path / "mxfp4" / "model.safetensors"))
        with pytest.raises(CheckpointError, match=re.escape(message)):
            load_hf_target(tmp_path / "mxfp4")


def test_mxfp4_is_refused_outside_gpt_oss(saved, tmp_path):
    """Only GPT-OSS's experts are read from MXFP4; another family's quantized file is refused by name
    rather than read as if its tensors were plain."""
    path = _copy(saved, tmp_path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    with pytest.raises(CheckpointError, match="quantization_config quant_method='mxfp4' is not supported"):
        load_hf_target(path)


def test_float8_weights_are_refused_by_name(saved, tmp_path):
    """An FP8 checkpoint (Qwen3-8B-FP8's layout: F8_E4M3 weights beside their scales) failed in numpy with
    AttributeError (no float8 dtype) before its quantization_config was read: an internal error. Its
    quantization is named first, and an F8 tensor without one is named with its dtype."""
    path = _copy(saved, tmp_path)
    tensors = {k: torch.from_numpy(v.copy()) for k, v in load_file(path / "model.safetensors").items()}
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    tensors[name + "_scale_inv"] = torch.ones(1)
    from safetensors.torch import save_file as save_torch

    save_torch(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8"}}))
    with pytest.raises(CheckpointError, match="quantization_config quant_method='fp8' is not supported"):
        load_hf_target(path)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=re.escape(f"{path / 'model.safetensors'}: tensor {name!r} is stored as "
                                                        "F8_E4M3, which tevjax cannot read")):
        load_hf_target(path)


def test_generation_config_eos_ids_end_generation(saved, tmp_path):
    """transformers' generate stops on generation_config.json's eos ids too (Gemma 2's <end_of_turn>, 107,
    beside config.json's <eos>, 1); load_target read config.json's only. A broken file is named."""
    from tevjax.loading import load_target

    path = _copy(saved, tmp_path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_target(str(path)).eos_ids == (2, 7)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": "7"}))
    with pytest.raises(ValueError, match=re.escape(f"{path / 'generation_config.json'}: field 'eos_token_id' must be")):
        load_target(str(path))
