"""GGUF files of Gemma 2, Gemma 3 and Phi-3, written from a tiny random transformers model the way
llama.cpp's converter writes them: tensor names from llama.cpp's own table
(`gguf.get_tensor_name_map`, not tevjax's), 1 added to every Gemma norm, Phi-3's fused q|k|v and
gate|up tensors as HF stores them, and only the metadata keys the converter writes for the family
(what llama.cpp takes from its code instead -- which layers slide, Gemma 3's local rope base, the
query scale -- is left out of the file, as it is in released files).

The converted checkpoint must run, in tevjax and in transformers, like the original model with
its weights rounded through the file's storage types.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import gguf
from gguf import GGMLQuantizationType as Q

from test_gguf import (CHAT_TEMPLATE, add_byte_level_tokenizer, close_gguf, encode_tensor, expected_values,
                       llamacpp_permute, tiny_vocab)
from tevjax.convert.gguf import GGUFError, _config_from_metadata, _generation_config, gguf_to_hf_dir, read_gguf

SIZES = dict(vocab_size=272, hidden_size=64, intermediate_size=96, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)

# Each family's tiny model. Its values are chosen so that a reader falling back on a default would
# be caught: Gemma's query scale is its head size (32; transformers' default is 256), the soft caps
# are low enough to bite, the windows are shorter than the test sequence, Gemma 3's full layers
# rotate with a base and a linear scaling of their own.
FAMILIES = {
    "gemma2": dict(SIZES, num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=32, sliding_window=4,
                   attn_logit_softcapping=5.0, final_logit_softcapping=3.0, rope_theta=10000.0),
    "gemma3": dict(SIZES, num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32, sliding_window=4,
                   final_logit_softcapping=3.0,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "phi3": dict(SIZES, num_hidden_layers=2, sliding_window=4, original_max_position_embeddings=128,
                 rope_theta=100.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=None),
    # SmolLM3: layer 3 of 4 unrotated; Granite: all four scalars away from 1.
    "smollm3": dict(SIZES, num_hidden_layers=4, rope_parameters={"rope_type": "default", "rope_theta": 100.0},
                    bos_token_id=1, eos_token_id=2, pad_token_id=None),
    "granite": dict(SIZES, num_hidden_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 100.0},
                    attention_multiplier=0.3, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=4.0,
                    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=None),
    "granitemoe": dict(SIZES, num_hidden_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 100.0},
                       attention_multiplier=0.3, embedding_multiplier=2.0, residual_multiplier=0.5,
                       logits_scaling=4.0, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
                       bos_token_id=1, eos_token_id=2, pad_token_id=None),
    # OLMo 3: layers 0-2 slide, 3 attends fully; both rotate with the file's base (llama.cpp's graph).
    "olmo2": dict(SIZES, num_hidden_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 100.0},
                  bos_token_id=1, eos_token_id=2, pad_token_id=None),
    "olmo3": dict(SIZES, num_hidden_layers=4, sliding_window=4,
                  rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 100.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
                  bos_token_id=1, eos_token_id=2, pad_token_id=None),
    "olmoe": dict(SIZES, num_hidden_layers=2, rope_parameters={"rope_type": "default", "rope_theta": 100.0},
                  num_experts=4, num_experts_per_tok=2, bos_token_id=1, eos_token_id=2, pad_token_id=None),
    # GPT-OSS: YaRN as llama.cpp runs it (truncated ramp bounds, transformers' default but not
    # GPT-OSS's own config's), experts in MXFP4 as released files store them.
    "gpt_oss": dict(SIZES, intermediate_size=64, num_hidden_layers=2, head_dim=16, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=4, bos_token_id=1, eos_token_id=2, pad_token_id=None,
                    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True, "rope_theta": 1000.0}),
}
# The GGUF architecture of each family, where it is not the family's name.
GGUF_ARCH = {"olmo3": "olmo2", "gpt_oss": "gpt-oss"}
CLASSES = {"gemma2": ("Gemma2Config", "Gemma2ForCausalLM"), "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
           "phi3": ("Phi3Config", "Phi3ForCausalLM"), "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
           "granite": ("GraniteConfig", "GraniteForCausalLM"),
           "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM"), "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
           "olmo3": ("Olmo3Config", "Olmo3ForCausalLM"), "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
           "gpt_oss": ("GptOssConfig", "GptOssForCausalLM")}
# Families written as llama.cpp's LlamaModel writes them: q and k rows permuted for its rope.
PERMUTED = ("smollm3", "granite", "granitemoe")
# transformers' in-memory names of Granite MoE's tensors, and its checkpoints' (what GGUF files are
# converted from, and what tevjax reads).
GRANITE_MOE_NAMES = {"block_sparse_moe.router.weight": "block_sparse_moe.router.layer.weight",
                     "block_sparse_moe.experts.gate_up_proj": "block_sparse_moe.input_linear.weight",
                     "block_sparse_moe.experts.down_proj": "block_sparse_moe.output_linear.weight"}
IDS = np.array([[5, 17, 42, 99, 3, 250, 7, 64, 11, 200, 31, 8]], np.int32)  # longer than every window


def hf_model(arch: str, seed: int = 0):
    """A tiny transformers model of the family with every weight random (norms included, so that
    an offset would show)."""
    import torch
    import transformers

    config = getattr(transformers, CLASSES[arch][0])(**FAMILIES[arch])
    config._attn_implementation = "eager"  # soft caps need it in transformers
    torch.manual_seed(seed)
    model = getattr(transformers, CLASSES[arch][1])(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model


def checkpoint_name(name: str, back: bool = False) -> str:
    """transformers' in-memory name -> the checkpoint's (`back`: the other way)."""
    for memory, disk in GRANITE_MOE_NAMES.items():
        name = name.replace(disk, memory) if back else name.replace(memory, disk)
    return name


def hf_state(model) -> dict[str, np.ndarray]:
    """The model's tensors as its checkpoint holds them (a tied head is the embedding; OLMoE's
    experts one tensor each, which transformers stacks in memory)."""
    state = {}
    for k, v in model.state_dict().items():
        w = v.detach().numpy().astype(np.float32)
        if model.config.model_type == "gpt_oss":  # its checkpoints stack the experts as transformers does
            state[k] = w
        elif k.endswith("mlp.experts.gate_up_proj"):
            f = w.shape[1] // 2
            for e in range(w.shape[0]):
                state[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = w[e, :f]
                state[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = w[e, f:]
        elif k.endswith("mlp.experts.down_proj"):
            state.update((k.replace("down_proj", f"{e}.down_proj.weight"), w[e]) for e in range(w.shape[0]))
        else:
            state[checkpoint_name(k)] = w
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def storage_type(name: str, shape: tuple[int, ...]) -> Q:
    """Norms and vectors in F32 as llama.cpp keeps them; matrices alternate Q8_0 / F16 / BF16."""
    if len(shape) == 1:
        return Q.F32
    return (Q.Q8_0, Q.F16, Q.BF16)[sum(map(ord, name)) % 3]


def write_family_gguf(path: Path, arch: str, state: dict[str, np.ndarray], *, meta_drop: tuple[str, ...] = (),
                      meta_extra: dict | None = None, extra_tensors: dict[str, np.ndarray] | None = None
                      ) -> tuple[Path, dict[str, Q]]:
    """`state` written as convert_hf_to_gguf writes the family; returns the file and each HF
    tensor's storage type."""
    c = FAMILIES[arch]
    n = c["num_hidden_layers"]
    family, arch = arch, GGUF_ARCH.get(arch, arch)
    names = gguf.get_tensor_name_map(
        gguf.MODEL_ARCH[{"granitemoe": "GRANITE_MOE", "gpt-oss": "GPT_OSS"}.get(arch, arch.upper())], n)
    w = gguf.GGUFWriter(str(path), arch)
    keys = {
        "context_length": c["max_position_embeddings"], "embedding_length": c["hidden_size"], "block_count": n,
        "feed_forward_length": c["intermediate_size"], "attention.head_count": c["num_attention_heads"],
        "attention.head_count_kv": c["num_key_value_heads"], "attention.layer_norm_rms_epsilon": c["rms_norm_eps"],
    }
    if "sliding_window" in c:
        keys["attention.sliding_window"] = c["sliding_window"]
    if arch in PERMUTED:
        keys["rope.freq_base"] = c["rope_parameters"]["rope_theta"]
    if arch.startswith("granite"):
        keys.update({"attention.scale": c["attention_multiplier"], "embedding_scale": c["embedding_multiplier"],
                     "residual_scale": c["residual_multiplier"], "logit_scale": c["logits_scaling"]})
    if arch == "granitemoe":
        keys.update({"expert_count": c["num_local_experts"], "expert_used_count": c["num_experts_per_tok"]})
    if arch.startswith("olmo"):
        keys["rope.freq_base"] = 100.0
    if family == "olmo3":  # the converter's flag per layer
        w.add_array("olmo2.attention.sliding_window_pattern", [(i + 1) % 4 != 0 for i in range(n)])
    if arch == "olmoe":
        keys.update({"expert_count": c["num_experts"], "expert_used_count": c["num_experts_per_tok"]})
    if arch == "gpt-oss":
        rope = c["rope_parameters"]
        keys.update({"expert_count": c["num_local_experts"], "expert_used_count": c["num_experts_per_tok"],
                     "expert_feed_forward_length": c["intermediate_size"], "attention.key_length": c["head_dim"],
                     "attention.value_length": c["head_dim"], "rope.freq_base": rope["rope_theta"],
                     "rope.scaling.type": "yarn", "rope.scaling.factor": rope["factor"],
                     "rope.scaling.original_context_length": rope["original_max_position_embeddings"]})
    if arch.startswith("gemma"):
        keys.update({"attention.key_length": c["head_dim"], "attention.value_length": c["head_dim"],
                     "final_logit_softcapping": c["final_logit_softcapping"]})
    if arch == "gemma2":
        keys["attn_logit_softcapping"] = c["attn_logit_softcapping"]
    if arch == "gemma3":
        full = c["rope_parameters"]["full_attention"]
        keys.update({"rope.freq_base": full["rope_theta"], "rope.scaling.type": "linear",
                     "rope.scaling.factor": full["factor"]})
    if arch == "phi3":
        head = c["hidden_size"] // c["num_attention_heads"]
        keys.update({"rope.scaling.original_context_length": c["original_max_position_embeddings"],
                     "rope.dimension_count": head, "rope.freq_base": c["rope_theta"]})
    keys.update(meta_extra or {})
    for key, value in keys.items():
        if key in meta_drop:
            continue
        full_key = f"{arch}.{key}"
        if isinstance(value, str):
            w.add_string(full_key, value)
        elif isinstance(value, float):
            w.add_float32(full_key, value)
        else:
            w.add_uint32(full_key, value)
    add_byte_level_tokenizer(w, tiny_vocab(), "smollm")
    w.add_chat_template(CHAT_TEMPLATE)
    w.add_pad_token_id(0)  # as released files have one (transformers' Phi-3 default, 32000, is outside this vocabulary)
    types = {}
    experts: dict[str, list] = {}
    for hf, value in state.items():
        types[hf] = storage_type(hf, value.shape)
        if arch == "gpt-oss" and ".mlp.experts." in hf:  # the converter's split, each [E, I, D] / [E, D, I]
            for name, part in gpt_oss_experts(hf, value).items():
                data, raw = encode_tensor(part, Q.MXFP4 if part.ndim == 3 else Q.F32)
                w.add_tensor(name, data, raw_dtype=raw)
            continue
        if ".mlp.experts." in hf:  # stacked per projection, expert after expert, in one storage type
            layer, e, proj = hf.split(".")[2], int(hf.split(".")[5]), hf.split(".")[6]
            types[hf] = storage_type(f"{layer}.{proj}", value.shape)
            experts.setdefault(f"blk.{layer}.ffn_{proj.removesuffix('_proj')}_exps.weight", []).append((e, value, hf))
            continue
        if hf.endswith("input_linear.weight"):  # Granite MoE: gate and up experts apart
            layer = hf.split(".")[2]
            for part, half in zip(("gate", "up"), np.split(value, 2, axis=1), strict=True):
                data, raw = encode_tensor(np.ascontiguousarray(half), types[hf])
                w.add_tensor(f"blk.{layer}.ffn_{part}_exps.weight", data, raw_dtype=raw)
            continue
        name = names.get_name(hf + (".weight" if hf.endswith(".sinks") else ""), try_suffixes=(".weight", ".bias"))
        assert name is not None, hf
        if arch.startswith("gemma") and hf.endswith("norm.weight"):
            value = value + np.float32(1.0)  # the converter's Gemma norm shift
        if arch in PERMUTED and hf.endswith(("q_proj.weight", "k_proj.weight")):
            value = llamacpp_permute(value, c["num_attention_heads" if "q_proj" in hf else "num_key_value_heads"])
        data, raw = encode_tensor(value, types[hf])
        w.add_tensor(name, data, raw_dtype=raw)
    for name, parts in experts.items():
        data, raw = encode_tensor(np.stack([v for _, v, _ in sorted(parts, key=lambda x: x[0])]), types[parts[0][2]])
        w.add_tensor(name, data, raw_dtype=raw)
    for name, value in (extra_tensors or {}).items():
        w.add_tensor(name, value)
    return close_gguf(w, path), types


def gpt_oss_experts(hf: str, value: np.ndarray) -> dict[str, np.ndarray]:
    """llama.cpp's converter on a GPT-OSS expert tensor: HF's gate_up_proj [E, D, 2 I] (gate in the
    even columns) becomes ffn_gate_exps and ffn_up_exps [E, I, D], its bias two [E, I]; down_proj
    [E, I, D] becomes ffn_down_exps [E, D, I]."""
    layer = hf.split(".")[2]
    if hf.endswith("gate_up_proj"):
        rows = value.transpose(0, 2, 1)
        return {f"blk.{layer}.ffn_gate_exps.weight": np.ascontiguousarray(rows[:, 0::2]),
                f"blk.{layer}.ffn_up_exps.weight": np.ascontiguousarray(rows[:, 1::2])}
    if hf.endswith("gate_up_proj_bias"):
        return {f"blk.{layer}.ffn_gate_exps.bias": np.ascontiguousarray(value[:, 0::2]),
                f"blk.{layer}.ffn_up_exps.bias": np.ascontiguousarray(value[:, 1::2])}
    if hf.endswith("down_proj"):
        return {f"blk.{layer}.ffn_down_exps.weight": np.ascontiguousarray(value.transpose(0, 2, 1))}
    return {f"blk.{layer}.ffn_down_exps.bias": value}


def mxfp4_round(w: np.ndarray) -> np.ndarray:
    """`w` [E, rows, cols] through MXFP4 and back, row by row (blocks of 32 along the last axis)."""
    return gguf.quants.dequantize(gguf.quants.quantize(w, Q.MXFP4), Q.MXFP4).reshape(w.shape)


def stored_values(arch: str, state: dict[str, np.ndarray], types: dict[str, Q]) -> dict[str, np.ndarray]:
    """What an exact reader returns: each tensor rounded through its storage type, and a Gemma norm
    as (w + 1) - 1 in float32."""
    shifted = {k: (v + np.float32(1.0) if arch.startswith("gemma") and k.endswith("norm.weight") else v)
               for k, v in state.items()}
    out = expected_values(shifted, types)
    for k, v in state.items():  # GPT-OSS's experts: rounded as the converter's [E, I, D] / [E, D, I] rows
        if k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            out[k] = mxfp4_round(np.ascontiguousarray(v.transpose(0, 2, 1))).transpose(0, 2, 1)
        elif k.endswith(("mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias")):
            out[k] = v
    return {k: (v - np.float32(1.0) if arch.startswith("gemma") and k.endswith("norm.weight") else v)
            for k, v in out.items()}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_file(request, tmp_path_factory):
    arch = request.param
    model = hf_model(arch, seed=3)
    state = hf_state(model)
    path, types = write_family_gguf(tmp_path_factory.mktemp(arch) / f"{arch}.gguf", arch, state)
    return arch, path, model, stored_values(arch, state, types)


def test_family_files_read_in_hf_layout(family_file):
    """Every tensor comes back under its HF name, exactly its storage type's rounding (Gemma's
    norms less the 1 the converter added); the config holds what llama.cpp runs the file with,
    which here is what the original model's config says."""
    arch, path, model, want = family_file
    cfg, got = read_gguf(path)
    assert set(got) == set(want)
    for name, value in got.items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)
    hf = model.config
    assert cfg["architectures"] == [CLASSES[arch][1]]
    assert cfg["model_type"] == hf.model_type
    assert cfg.get("sliding_window") == getattr(hf, "sliding_window", None)
    if arch.startswith("gemma"):
        assert cfg["hidden_activation"] == "gelu_pytorch_tanh" and "hidden_act" not in cfg
        assert cfg["query_pre_attn_scalar"] == hf.query_pre_attn_scalar == 32
        assert cfg["layer_types"] == hf.layer_types
        assert (cfg["attn_logit_softcapping"], cfg["final_logit_softcapping"]) == (
            hf.attn_logit_softcapping, hf.final_logit_softcapping)
        assert cfg["tie_word_embeddings"] is True
    if arch == "gemma3":
        assert cfg["rope_parameters"] == hf.rope_parameters
        assert "rope_theta" not in cfg and "rope_scaling" not in cfg
    if arch == "phi3":
        assert cfg["original_max_position_embeddings"] == 128 and cfg["tie_word_embeddings"] is False
    if arch == "smollm3":
        assert cfg["no_rope_layers"] == hf.no_rope_layers == [1, 1, 1, 0]
    if arch.startswith("granite"):
        for field in ("attention_multiplier", "embedding_multiplier", "residual_multiplier", "logits_scaling"):
            assert cfg[field] == pytest.approx(getattr(hf, field)), field
    if arch == "olmo3":
        assert cfg["layer_types"] == hf.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
        assert cfg["rope_parameters"] == hf.rope_parameters
    if arch == "olmoe":
        assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["norm_topk_prob"]) == (4, 2, False)
    if arch == "gpt_oss":
        assert cfg["layer_types"] == hf.layer_types == ["sliding_attention", "full_attention"]
        assert (cfg["num_local_experts"], cfg["intermediate_size"]) == (4, 64)
        assert cfg["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                       "beta_fast": 32.0, "beta_slow": 1.0}


def test_family_conversion_runs_like_the_original(family_file, tmp_path):
    """The converted directory, loaded by tevjax and by transformers, gives the original model's
    logits (its weights rounded as the file stores them) over a sequence longer than the windows."""
    import jax.numpy as jnp
    import torch
    import transformers

    from tevjax.convert.hf import load_hf_target
    from tevjax.models import KVCache

    arch, path, model, want = family_file
    memory = {checkpoint_name(k, back=True): v for k, v in want.items() if not re.search(r"\.mlp\.experts\.\d+\.", k)}
    for layer in range(model.config.num_hidden_layers):  # OLMoE: back to transformers' stacked experts
        pre = f"model.layers.{layer}.mlp.experts."
        count = sum(k.startswith(pre) and k.endswith(".down_proj.weight") for k in want)
        if count:
            memory[pre + "gate_up_proj"] = np.stack([np.concatenate([want[f"{pre}{e}.gate_proj.weight"],
                                                                     want[f"{pre}{e}.up_proj.weight"]])
                                                     for e in range(count)])
            memory[pre + "down_proj"] = np.stack([want[f"{pre}{e}.down_proj.weight"] for e in range(count)])
    with torch.no_grad():
        loaded = model.load_state_dict({k: torch.as_tensor(v) for k, v in memory.items()}, strict=False)
        assert not loaded.unexpected_keys and set(loaded.missing_keys) <= {"lm_head.weight"}, loaded
        if model.config.tie_word_embeddings:
            model.tie_weights()
        reference = model(torch.as_tensor(IDS, dtype=torch.long)).logits.numpy()
    out = gguf_to_hf_dir(path, tmp_path / "hf")
    _, target = load_hf_target(out)
    assert target.cfg.architecture == model.config.model_type
    ours = target(jnp.asarray(IDS), jnp.arange(IDS.shape[1])[None], KVCache.init(target.cfg, 1, 16),
                  jnp.zeros((1,), jnp.int32), None).logits
    np.testing.assert_allclose(np.asarray(ours), reference, atol=2e-4, rtol=2e-4)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32,
                                                               attn_implementation="eager")
    with torch.no_grad():
        converted = theirs(torch.as_tensor(IDS, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(converted, reference, atol=2e-4, rtol=2e-4)


def test_family_tensors_read_like_transformers_gguf_loader(family_file):
    """transformers' own GGUF reader, a second reader of the same file, agrees on every tensor it
    loads."""
    import torch
    import transformers

    arch, path, _, _ = family_file
    if arch not in ("gemma2", "gemma3", "phi3"):
        pytest.skip(f"transformers has no GGUF reader for {arch}")
    _, got = read_gguf(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32)
    theirs = {k: v.numpy() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        theirs.pop("lm_head.weight", None)
    assert set(theirs) == set(got)
    for name, value in got.items():
        np.testing.assert_array_equal(value, theirs[name], err_msg=name)


def _meta(arch: str, layers: int, hidden: int, heads: int, head: int, **extra) -> dict:
    meta = {"general.architecture": arch, f"{arch}.block_count": layers, f"{arch}.embedding_length": hidden,
            f"{arch}.feed_forward_length": 4 * hidden, f"{arch}.attention.head_count": heads,
            f"{arch}.attention.head_count_kv": heads // 2, f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
            f"{arch}.context_length": 8192, f"{arch}.attention.key_length": head,
            f"{arch}.attention.value_length": head, f"{arch}.attention.sliding_window": 4096,
            f"{arch}.vocab_size": 256}
    meta.update({f"{arch}.{k}": v for k, v in extra.items()})
    return meta


@pytest.mark.parametrize("arch, layers, hidden, heads, head, scalar", [
    ("gemma2", 26, 2304, 8, 256, 256),   # Gemma 2 2B: the head size
    ("gemma2", 46, 4608, 32, 128, 144),  # Gemma 2 27B: hidden / heads, as its HF config says
    ("gemma3", 26, 1152, 4, 256, 256),   # Gemma 3 1B
    ("gemma3", 62, 5376, 32, 128, 168),  # Gemma 3 27B
])
def test_gemma_query_scale_follows_llama_cpp(arch, layers, hidden, heads, head, scalar):
    """The query scale is not in the metadata: llama.cpp takes hidden / heads for the 27B models (by
    block count) and the head size otherwise, which is what each released HF config says."""
    cfg = _config_from_metadata(Path("x.gguf"), _meta(arch, layers, hidden, heads, head), set(), None)
    assert cfg["query_pre_attn_scalar"] == scalar


def test_gemma_defaults_where_the_file_is_silent():
    """Gemma 2 without the keys: llama.cpp's (and transformers') window 4096 and caps 50 / 30, layers
    0, 2, 4, ... sliding; Gemma 3 without a logit cap has none, and its sliding layers rotate with
    base 10000 whatever the file's base."""
    meta = _meta("gemma2", 4, 64, 4, 16)
    del meta["gemma2.attention.sliding_window"]
    cfg = _config_from_metadata(Path("x.gguf"), meta, set(), None)
    assert (cfg["sliding_window"], cfg["attn_logit_softcapping"], cfg["final_logit_softcapping"]) == (4096, 50.0, 30.0)
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] * 2
    cfg = _config_from_metadata(Path("x.gguf"), _meta("gemma3", 7, 64, 4, 16, **{"rope.freq_base": 1e6}), set(), None)
    assert (cfg["attn_logit_softcapping"], cfg["final_logit_softcapping"]) == (None, None)
    assert cfg["layer_types"] == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert cfg["rope_parameters"] == {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}


@pytest.mark.parametrize("arch, change, match", [
    ("gemma3", {"drop": "gemma3.attention.sliding_window"}, "sliding_window is missing"),
    ("gemma3", {"gemma3.attn_logit_softcapping": 50.0}, "no attention soft cap"),
    ("gemma2", {"gemma2.final_logit_softcapping": 0.0}, "final_logit_softcapping should be a positive"),
    ("gemma2", {"gemma2.attention.sliding_window": 0}, "sliding_window should be positive"),
])
def test_gemma_metadata_refused_by_name(arch, change, match):
    meta = _meta(arch, 4, 64, 4, 16)
    meta.pop(change.pop("drop", None), None)
    meta.update(change)
    with pytest.raises(GGUFError, match=match):
        _config_from_metadata(Path("x.gguf"), meta, set(), None)


def test_phi3_without_a_window_and_longrope_refused(tmp_path):
    """Phi-4's files say window 0: none. Phi-3's long-context files carry LongRoPE's per-frequency
    factors as tensors, which are refused by name."""
    meta = _meta("phi3", 2, 64, 4, 16, **{"attention.sliding_window": 0})
    cfg = _config_from_metadata(Path("x.gguf"), meta, set(), None)
    # No window; and no pad token where the file names none (Phi3Config's default, 32000, is Phi-3's).
    assert cfg["sliding_window"] is None and cfg["pad_token_id"] is None
    state = hf_state(hf_model("phi3"))
    head = SIZES["hidden_size"] // SIZES["num_attention_heads"]
    factors = {name: np.ones(head // 2, np.float32) for name in ("rope_factors_long.weight",
                                                                  "rope_factors_short.weight")}
    path, _ = write_family_gguf(tmp_path / "phi3.gguf", "phi3", state, extra_tensors=factors)
    with pytest.raises(GGUFError, match="rope_factors_long.weight, rope_factors_short.weight .*LongRoPE"):
        read_gguf(path)


def test_generic_metadata_defaults_and_refusals():
    """Keys a file may leave out, as llama.cpp reads them: no head_count_kv is no grouping, no
    rope.scaling.original_context_length (Phi-3) the model's context; OLMo 3's window period as a number
    (every period-th layer attends fully). What HF's classes cannot express is refused by name: key and
    value head sizes that differ, a partial rotation outside the hybrids, more experts per token than
    experts, per-layer sizes that vary."""
    meta = _meta("qwen3", 2, 64, 4, 16)
    del meta["qwen3.attention.head_count_kv"]
    cfg = _config_from_metadata(Path("x.gguf"), meta, set(), None)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 4, 16)
    # a per-layer array is a plain model where it is uniform
    assert _config_from_metadata(Path("x.gguf"), {**meta, "qwen3.attention.head_count_kv": [2, 2]}, set(),
                                 None)["num_key_value_heads"] == 2
    for change, match in [({"qwen3.attention.value_length": 32}, "key_length 16 != attention.value_length 32"),
                          ({"qwen3.attention.head_count_kv": [2, 1]}, r"head_count_kv varies per layer \(\[2, 1\]"),
                          ({"qwen3.rope.dimension_count": 8}, "rope.dimension_count 8 != head size 16; partial")]:
        with pytest.raises(GGUFError, match=match):
            _config_from_metadata(Path("x.gguf"), {**meta, **change}, set(), None)
    with pytest.raises(GGUFError, match=r"expert_used_count 5 must be in \[1, expert_count 4\]"):
        _config_from_metadata(Path("x.gguf"), _meta("qwen3moe", 2, 64, 4, 16, expert_count=4, expert_used_count=5,
                                                    expert_feed_forward_length=32), set(), None)
    phi3 = _meta("phi3", 2, 64, 4, 16, **{"attention.sliding_window": 0})
    assert _config_from_metadata(Path("x.gguf"), phi3, set(), None)["original_max_position_embeddings"] == 8192
    phi3["phi3.rope.scaling.original_context_length"] = 4096
    assert _config_from_metadata(Path("x.gguf"), phi3, set(), None)["original_max_position_embeddings"] == 4096
    # the vocabulary: vocab_size, else the token list, else the embedding's rows; these must agree with it
    assert _config_from_metadata(Path("x.gguf"), meta, set(), 256)["vocab_size"] == 256
    assert _config_from_metadata(Path("x.gguf"), {k: v for k, v in meta.items() if k != "qwen3.vocab_size"}, set(),
                                 300)["vocab_size"] == 300
    with pytest.raises(GGUFError, match="token_embd.weight has 300 rows but the vocabulary size is 256"):
        _config_from_metadata(Path("x.gguf"), meta, set(), 300)
    olmo3 = _meta("olmo2", 8, 64, 4, 16, **{"attention.sliding_window_pattern": 4})
    cfg = _config_from_metadata(Path("x.gguf"), olmo3, set(), None)
    assert cfg["model_type"] == "olmo3" and cfg["layer_types"] == (["sliding_attention"] * 3 + ["full_attention"]) * 2


@pytest.mark.parametrize("change, match", [
    # 0 heads (or KV heads) divided by zero: ZeroDivisionError, an internal error in the CLI
    ({"qwen3.attention.head_count_kv": 0}, "metadata qwen3.attention.head_count_kv should be a positive integer, got 0"),
    ({"qwen3.attention.head_count": 0}, "metadata qwen3.attention.head_count should be a positive integer, got 0"),
    ({"qwen3.block_count": 0}, "metadata qwen3.block_count should be a positive integer, got 0"),
    # a head size of the wrong type failed in `%` (TypeError), a negative one only as a partial rope
    ({"qwen3.attention.key_length": "16"}, "metadata qwen3.attention.key_length should be an integer, got '16'"),
    ({"qwen3.attention.key_length": -16, "qwen3.attention.value_length": -16},
     "metadata qwen3.attention.key_length should be a positive integer, got -16"),
    ({"qwen3.rope.dimension_count": 16.0}, "metadata qwen3.rope.dimension_count should be an integer, got 16.0"),
    # converted, cached, and only refused when loading, naming the cache's config.json
    ({"qwen3.rope.freq_base": float("nan")}, "metadata qwen3.rope.freq_base should be a finite number > 0, got nan"),
    ({"qwen3.rope.freq_base": 0.0}, "metadata qwen3.rope.freq_base should be a finite number > 0, got 0.0"),
    ({"qwen3.attention.layer_norm_rms_epsilon": -1e-6},
     "metadata qwen3.attention.layer_norm_rms_epsilon should be a finite number >= 0, got -1e-06"),
    ({"tokenizer.ggml.bos_token_id": "1"}, "metadata tokenizer.ggml.bos_token_id should be a token id, got '1'"),
])
def test_metadata_no_model_can_have_is_refused_by_name(change, match):
    with pytest.raises(GGUFError, match="^" + re.escape("x.gguf: " + match)):
        _config_from_metadata(Path("x.gguf"), {**_meta("qwen3", 2, 64, 4, 16), **change}, set(), None)


def test_generation_config_stops_on_the_end_of_turn_token_too():
    """llama.cpp stops on a chat model's end-of-turn token besides its eos; named once where they are one."""
    cfg = {"bos_token_id": 1, "eos_token_id": 2}
    assert _generation_config(cfg, {"tokenizer.ggml.eot_token_id": 7})["eos_token_id"] == [2, 7]
    assert _generation_config(cfg, {"tokenizer.ggml.eot_token_id": 2})["eos_token_id"] == 2
    assert _generation_config(cfg, {}) == {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2}


def test_hybrid_metadata_refused_by_name():
    """A Qwen3.5 file whose linear layers' sizes do not divide (value heads of a fractional width, or
    not whole per key head), or whose rope is scaled (unsupported for the hybrids), is refused by name."""
    ssm = {"ssm.conv_kernel": 4, "ssm.state_size": 8, "ssm.group_count": 2, "ssm.time_step_rank": 4,
           "ssm.inner_size": 24, "rope.dimension_count": 4}
    cfg = _config_from_metadata(Path("x.gguf"), _meta("qwen35", 4, 64, 4, 16, **ssm), set(), None)
    assert (cfg["linear_value_head_dim"], cfg["partial_rotary_factor"]) == (6, 0.25)
    for change, match in [({"ssm.inner_size": 25}, "ssm.inner_size 25 must be a positive multiple"),
                          ({"ssm.time_step_rank": 3, "ssm.inner_size": 18}, "ssm.inner_size 18 must be a positive"),
                          ({"rope.scaling.type": "linear", "rope.scaling.factor": 2.0},
                           r"rope scaling \(linear\) is not supported for qwen35")]:
        with pytest.raises(GGUFError, match=match):
            _config_from_metadata(Path("x.gguf"), _meta("qwen35", 4, 64, 4, 16, **{**ssm, **change}), set(), None)
