"""GGUF -> HF conversion on tiny GGUF files written here with `gguf.GGUFWriter`.

The files are written the way llama.cpp's converter writes them: llama.cpp tensor names, q/k rows
permuted per head for llama.cpp's rope (`llamacpp_permute`, written here from that converter's
published formula, independently of the inverse in `tevjax.convert.gguf`), and a mix of
F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 tensors. `read_gguf` must return the original HF layout: exactly the
float32 dequantization of each quantized HF tensor, within the quantizer's error bound of the
original. transformers' own GGUF loader is a second, independent reader of the same files.

K-quants (Q4_K, Q5_K, Q6_K, Q8_K): the `gguf` package can dequantize but not quantize them (and
cannot dequantize Q8_K at all), so `k_quantize` below is a plain quantizer written from the block
structs of llama.cpp's ggml-common.h, and `k_dequantize` the matching decoder, computed from the
integer codes rather than the packed bytes. A model with 256-wide rows (one super-block per row)
is written with them and must read back exactly as `k_dequantize` says.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

import gguf

from gguf import GGMLQuantizationType as Q  # noqa: E402

from tevjax.convert.gguf import (  # noqa: E402
    CONVERSION_MARKER,
    GGUFError,
    gguf_to_hf_dir,
    read_gguf,
)

TINY = dict(vocab_size=272, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-5, rope_theta=10000.0)
HEAD_DIM = TINY["hidden_size"] // TINY["num_attention_heads"]

# A byte-level BPE vocabulary: 3 control tokens, the 256 byte-alphabet symbols, then merges.
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ Ġ", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d",
          "1 2", "Ġ 1", "ĠĠ Ġ"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")


def byte_alphabet() -> list[str]:
    """GPT-2's byte alphabet in byte order (printable latin-1 bytes stand for themselves)."""
    keep = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    out, extra = [], 0
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


def tiny_vocab() -> list[str]:
    merged = [m.replace(" ", "") for m in MERGES]
    tokens = SPECIALS + byte_alphabet() + merged
    assert len(tokens) == TINY["vocab_size"]
    return tokens


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf `permute`: per head, rows [first half | second half] become
    interleaved pairs, for llama.cpp's adjacent-pair rope."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def tiny_state(seed: int = 0, tied: bool = False, sizes: dict | None = None, arch: str = "llama"
               ) -> dict[str, np.ndarray]:
    """HF-named weights of a tiny model; `arch` "qwen2" adds q/k/v biases, "qwen3" q/k norms."""
    rng = np.random.default_rng(seed)
    c = TINY if sizes is None else sizes
    d, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    head_dim = c.get("head_dim", d // c["num_attention_heads"])
    qd, kvd = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim

    def mat(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    state = {"model.embed_tokens.weight": mat(v, d),
             "model.norm.weight": 1.0 + mat(d)}
    if not tied:
        state["lm_head.weight"] = mat(v, d)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        state.update({
            p + "input_layernorm.weight": 1.0 + mat(d),
            p + "post_attention_layernorm.weight": 1.0 + mat(d),
            p + "self_attn.q_proj.weight": mat(qd, d),
            p + "self_attn.k_proj.weight": mat(kvd, d),
            p + "self_attn.v_proj.weight": mat(kvd, d),
            p + "self_attn.o_proj.weight": mat(d, qd),
            p + "mlp.gate_proj.weight": mat(f, d),
            p + "mlp.up_proj.weight": mat(f, d),
            p + "mlp.down_proj.weight": mat(d, f),
        })
        if arch == "qwen2":
            state.update({p + "self_attn.q_proj.bias": mat(qd), p + "self_attn.k_proj.bias": mat(kvd),
                          p + "self_attn.v_proj.bias": mat(kvd)})
        if arch == "qwen3":
            state.update({p + "self_attn.q_norm.weight": 1.0 + mat(head_dim),
                          p + "self_attn.k_norm.weight": 1.0 + mat(head_dim)})
    return state


# HF name suffix -> llama.cpp name suffix
HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",  # Qwen3-MoE's router
}

# Every supported storage type appears at least once; norms stay F32 as llama.cpp keeps them.
TYPES = {
    "model.embed_tokens.weight": Q.Q8_0,
    "lm_head.weight": Q.Q4_0,
    "model.layers.0.self_attn.q_proj.weight": Q.Q4_1,
    "model.layers.0.self_attn.k_proj.weight": Q.Q4_0,
    "model.layers.0.self_attn.v_proj.weight": Q.Q8_0,
    "model.layers.0.self_attn.o_proj.weight": Q.F16,
    "model.layers.0.mlp.gate_proj.weight": Q.BF16,
    "model.layers.0.mlp.up_proj.weight": Q.Q4_1,
    "model.layers.0.mlp.down_proj.weight": Q.Q8_0,
    "model.layers.1.self_attn.q_proj.weight": Q.Q8_0,
    "model.layers.1.self_attn.k_proj.weight": Q.Q4_1,
    "model.layers.1.self_attn.v_proj.weight": Q.F32,
    "model.layers.1.self_attn.o_proj.weight": Q.Q5_0,
    "model.layers.1.mlp.gate_proj.weight": Q.Q5_1,
    "model.layers.1.mlp.up_proj.weight": Q.BF16,
    "model.layers.1.mlp.down_proj.weight": Q.Q4_1,
}


def gguf_name(hf: str) -> str:
    if hf in HF_TO_GGUF:
        return HF_TO_GGUF[hf]
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{HF_TO_GGUF[rest]}"


def encode_tensor(w: np.ndarray, t: Q) -> tuple[np.ndarray, Q | None]:
    if w.dtype == np.uint8:  # blocks packed already, in storage type t
        return w, t
    if t == Q.F32:
        return w, None
    if t == Q.F16:
        return w.astype(np.float16), None
    if t in K_QUANTS:
        return k_pack(t, k_quantize(w, t)), t
    if t in (Q.IQ4_NL, Q.IQ4_XS, Q.IQ2_XXS):  # all-zero blocks: the reader must refuse the type, not the data
        return np.zeros(gguf.quant_shape_to_byte_shape(w.shape, t), np.uint8), t
    return gguf.quants.quantize(w, t), t


# ------------------------------------------------------------------------------ Qwen3-MoE and Qwen2-MoE

# 4 experts, 2 per token. transformers' GGUF reader does not read the experts' widths from a file
# and builds its config's defaults (Qwen3-MoE: 768; Qwen2-MoE: 1408, and 5632 for the shared
# expert), so the independent check needs those widths.
MOE_SIZES = {
    "qwen3moe": dict(TINY, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=768),
    "qwen2moe": dict(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=1408,
                     shared_expert_intermediate_size=5632),
}
# Each stacked expert tensor in its own storage type (quantization blocks run along a row, so a
# stacked tensor quantizes as its experts would one by one).
MOE_TYPES = {"gate_proj": Q.Q8_0, "up_proj": Q.F16, "down_proj": Q.Q4_1}


def moe_state(seed: int = 0, arch: str = "qwen3moe") -> dict[str, np.ndarray]:
    """A Qwen3-MoE (or Qwen2-MoE) model's HF tensors: Qwen3's (Qwen2's) attention, a router, one
    tensor per expert, and Qwen2-MoE's shared expert and its gate."""
    rng = np.random.default_rng(seed)
    c = MOE_SIZES[arch]
    attention = "qwen3" if arch == "qwen3moe" else "qwen2"
    state = {k: v for k, v in tiny_state(seed, sizes=c, arch=attention).items() if ".mlp." not in k}
    d, f, e = c["hidden_size"], c["moe_intermediate_size"], c["num_experts"]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp."
        state[p + "gate.weight"] = (rng.standard_normal((e, d)) * 0.3).astype(np.float32)
        for j in range(e):
            for name, shape in (("gate_proj", (f, d)), ("up_proj", (f, d)), ("down_proj", (d, f))):
                state[p + f"experts.{j}.{name}.weight"] = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if arch == "qwen2moe":
            g = c["shared_expert_intermediate_size"]
            for name, shape in (("gate_proj", (g, d)), ("up_proj", (g, d)), ("down_proj", (d, g))):
                state[p + f"shared_expert.{name}.weight"] = (rng.standard_normal(shape) * 0.05).astype(np.float32)
            state[p + "shared_expert_gate.weight"] = (rng.standard_normal((1, d)) * 0.3).astype(np.float32)
    return state


def write_moe_gguf(path: Path, state: dict[str, np.ndarray], arch: str = "qwen3moe", **kw) -> Path:
    """`state` as llama.cpp writes a qwen3moe or qwen2moe file: each projection of a layer's experts
    stacked into one [E, out, in] tensor, `blk.N.ffn_{gate,up,down}_exps.weight`; Qwen2-MoE's shared
    expert as `blk.N.ffn_{gate,up,down}_shexp.weight` and its gate's row as the vector
    `blk.N.ffn_gate_inp_shexp.weight`."""
    c = MOE_SIZES[arch]
    plain = {k: v for k, v in state.items() if ".experts." not in k and ".shared_expert" not in k}
    extra = {}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp."
        for name, short in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
            experts = [state[f"{p}experts.{j}.{name}.weight"] for j in range(c["num_experts"])]
            extra[f"blk.{i}.ffn_{short}_exps.weight"] = (np.stack(experts), MOE_TYPES[name])
            if p + f"shared_expert.{name}.weight" in state:
                extra[f"blk.{i}.ffn_{short}_shexp.weight"] = (state[p + f"shared_expert.{name}.weight"], Q.Q8_0)
        if p + "shared_expert_gate.weight" in state:
            extra[f"blk.{i}.ffn_gate_inp_shexp.weight"] = state[p + "shared_expert_gate.weight"][0]
    return write_gguf(path, plain, arch=arch, meta_overrides=c, pre="qwen2", extra_tensors=extra, **kw)


@pytest.fixture(scope="module", params=["qwen3moe", "qwen2moe"])
def moe_file(request, tmp_path_factory) -> tuple[str, Path, dict[str, np.ndarray]]:
    arch = request.param
    state = moe_state(seed=5, arch=arch)
    return arch, write_moe_gguf(tmp_path_factory.mktemp("moe") / f"{arch}.gguf", state, arch=arch), state


def test_moe_files_read_in_hf_layout_like_transformers(moe_file):
    """A qwen3moe (qwen2moe) file reads as a Qwen3-MoE (Qwen2-MoE) checkpoint: its expert fields
    (weights renormalised or not, as llama.cpp runs each), the router, each stacked expert tensor
    split into HF's one tensor per expert, and Qwen2-MoE's shared expert and gate row, each exactly
    its storage type's rounding; transformers' own GGUF reader (which fuses gate and up) holds the
    same numbers."""
    import torch
    import transformers

    arch, path, state = moe_file
    c = MOE_SIZES[arch]
    cfg, got = read_gguf(path)
    assert (cfg["model_type"], cfg["architectures"]) == {"qwen3moe": ("qwen3_moe", ["Qwen3MoeForCausalLM"]),
                                                         "qwen2moe": ("qwen2_moe", ["Qwen2MoeForCausalLM"])}[arch]
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (
        4, 2, c["moe_intermediate_size"])
    assert cfg["norm_topk_prob"] is (arch == "qwen3moe")
    assert cfg.get("shared_expert_intermediate_size") == c.get("shared_expert_intermediate_size")
    assert set(got) == set(state)
    types = dict(TYPES, **{k: MOE_TYPES[k.split(".")[-2]] for k in state if ".experts." in k},
                 **{k: Q.Q8_0 for k in state if ".shared_expert." in k})
    want = expected_values(state, types)
    for name, value in got.items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)

    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32)
    theirs = {k: v.numpy() for k, v in model.state_dict().items()}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp.experts."
        ours = {n: np.stack([got[f"{p}{j}.{n}.weight"] for j in range(4)]) for n in ("gate_proj", "up_proj",
                                                                                   "down_proj")}
        np.testing.assert_array_equal(theirs.pop(p + "gate_up_proj"), np.concatenate([ours["gate_proj"],
                                                                                     ours["up_proj"]], axis=1))
        np.testing.assert_array_equal(theirs.pop(p + "down_proj"), ours["down_proj"])
    assert set(theirs) == {k for k in got if ".experts." not in k}
    for name, value in theirs.items():
        np.testing.assert_array_equal(value, got[name], err_msg=name)


def test_moe_conversion_runs_in_tevjax_like_transformers(moe_file, tmp_path):
    """The converted directory loads as tevjax's Qwen3-MoE (Qwen2-MoE) target and gives
    transformers' logits."""
    arch, path, _ = moe_file
    cfg = assert_runs_like_transformers(gguf_to_hf_dir(path, tmp_path / "hf"))
    assert (cfg.architecture, cfg.num_experts, cfg.experts_per_token, cfg.intermediate_size) == (
        {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}[arch], 4, 2, MOE_SIZES[arch]["moe_intermediate_size"])
    assert cfg.shared_expert_size == MOE_SIZES[arch].get("shared_expert_intermediate_size", 0)


MIXTRAL_SIZES = dict(TINY, num_experts=4, num_experts_per_tok=2)


def mixtral_state(seed: int = 0) -> dict[str, np.ndarray]:
    """A Mixtral model's HF tensors: Llama's attention, a router and one w1 / w3 / w2 per expert."""
    rng = np.random.default_rng(seed)
    c = MIXTRAL_SIZES
    state = {k: v for k, v in tiny_state(seed).items() if ".mlp." not in k}
    d, f = c["hidden_size"], c["intermediate_size"]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}.block_sparse_moe."
        state[p + "gate.weight"] = (rng.standard_normal((4, d)) * 0.3).astype(np.float32)
        for j in range(4):
            for name, shape in (("w1", (f, d)), ("w3", (f, d)), ("w2", (d, f))):
                state[p + f"experts.{j}.{name}.weight"] = (rng.standard_normal(shape) * 0.1).astype(np.float32)
    return state


def write_mixtral_gguf(path: Path, state: dict[str, np.ndarray], **kw) -> Path:
    """`state` as llama.cpp's convert_hf_to_gguf writes Mixtral: a `llama` file with an expert count
    and used count (the experts' width is feed_forward_length), q/k permuted, the router as
    `ffn_gate_inp` and w1 / w3 / w2 of every expert stacked as `ffn_gate_exps` / `ffn_up_exps` /
    `ffn_down_exps`."""
    c = MIXTRAL_SIZES
    plain = {k: v for k, v in state.items() if ".block_sparse_moe." not in k}
    extra = {}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}.block_sparse_moe."
        extra[f"blk.{i}.ffn_gate_inp.weight"] = state[p + "gate.weight"]
        for w, short, t in (("w1", "gate", Q.Q8_0), ("w3", "up", Q.F16), ("w2", "down", Q.Q4_1)):
            experts = [state[f"{p}experts.{j}.{w}.weight"] for j in range(c["num_experts"])]
            extra[f"blk.{i}.ffn_{short}_exps.weight"] = (np.stack(experts), t)
    return write_gguf(path, plain, meta_overrides=c, omit=("moe_intermediate_size",), extra_tensors=extra, **kw)


def test_mixtral_files_read_as_mixtral_and_run_like_transformers(tmp_path):
    """A Mixtral GGUF (`llama` with experts; transformers has no GGUF reader for it) reads as a
    Mixtral checkpoint: its expert fields, Llama's q/k rows unpermuted, the router and each stacked
    expert tensor split into w1 / w3 / w2, each exactly its storage type's rounding; the converted
    directory gives transformers' Mixtral logits in tevjax."""
    state = mixtral_state(seed=6)
    path = write_mixtral_gguf(tmp_path / "mixtral.gguf", state)
    cfg, got = read_gguf(path)
    assert (cfg["model_type"], cfg["architectures"]) == ("mixtral", ["MixtralForCausalLM"])
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["intermediate_size"]) == (
        4, 2, TINY["intermediate_size"])
    assert cfg["sliding_window"] is None and "num_experts" not in cfg and "moe_intermediate_size" not in cfg
    assert set(got) == set(state)
    types = dict(TYPES, **{k: {"w1": Q.Q8_0, "w3": Q.F16, "w2": Q.Q4_1}[k.split(".")[-2]]
                           for k in state if ".experts." in k})
    want = expected_values(state, types)
    for name, value in got.items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)
    tcfg = assert_runs_like_transformers(gguf_to_hf_dir(path, tmp_path / "hf"))
    assert (tcfg.architecture, tcfg.num_experts, tcfg.experts_per_token, tcfg.norm_topk_prob) == (
        "mixtral", 4, 2, True)


def test_expert_files_refused_by_name(tmp_path):
    """A dense architecture's file with an expert count is refused, as are an early Mixtral file
    (one tensor per expert) and a qwen3moe file without its experts' width or its router."""
    path = write_gguf(tmp_path / "qwen2e.gguf", tiny_state(arch="qwen2"), arch="qwen2", meta_overrides=dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=96))
    with pytest.raises(GGUFError, match=r"qwen2\.expert_count=8: mixture-of-experts qwen2 files are not supported"):
        read_gguf(path)
    state = mixtral_state()
    early = {f"blk.{i}.ffn_{short}.{j}.weight": state[f"model.layers.{i}.block_sparse_moe.experts.{j}.{w}.weight"]
             for i in range(2) for j in range(4) for w, short in (("w1", "gate"), ("w3", "up"), ("w2", "down"))}
    early.update({f"blk.{i}.ffn_gate_inp.weight": state[f"model.layers.{i}.block_sparse_moe.gate.weight"]
                  for i in range(2)})
    path = write_gguf(tmp_path / "early.gguf", {k: v for k, v in state.items() if ".block_sparse_moe." not in k},
                      meta_overrides=MIXTRAL_SIZES, omit=("moe_intermediate_size",), extra_tensors=early)
    with pytest.raises(GGUFError, match=r"blk\.0\.ffn_down\.0\.weight.*early Mixtral files: convert it again"):
        read_gguf(path)
    state = moe_state()
    path = write_moe_gguf(tmp_path / "nowidth.gguf", state, omit=("moe_intermediate_size",))
    with pytest.raises(GGUFError, match=r"required metadata qwen3moe\.expert_feed_forward_length is missing"):
        read_gguf(path)
    del state["model.layers.1.mlp.gate.weight"]
    path = write_moe_gguf(tmp_path / "norouter.gguf", state)
    with pytest.raises(GGUFError, match=r"missing tensors for model\.layers\.1\.mlp\.gate\.weight"):
        read_gguf(path)


# ------------------------------------------------------------------------------ K-quant blocks

K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q8_K)
QK_K = 256


def _f16(x):
    return np.asarray(x, np.float32).astype(np.float16)


def k_quantize(w: np.ndarray, t: Q) -> dict[str, np.ndarray]:
    """Integer codes and scales of a plain K-quantizer (round to nearest; not llama.cpp's search).

    Per super-block of 256 values: Q4_K/Q5_K have 8 sub-blocks of 32 with 6-bit scale `sc` and
    min `m` under fp16 `d`, `dmin` (value = d*sc*q - dmin*m, q in [0, 15] or [0, 31]); Q6_K has 16
    sub-blocks of 16 with int8 scales under fp16 `d` (value = d*sc*q, q in [-32, 31]); Q8_K has a
    float32 `d` (value = d*q, q int8)."""
    x = np.asarray(w, np.float32).reshape(-1, QK_K)
    if t == Q.Q8_K:
        d = np.abs(x).max(1, keepdims=True) / 127
        q = np.clip(np.round(x / np.where(d > 0, d, 1)), -128, 127)
        return {"d": d.astype(np.float32), "q": q.astype(np.int8)}
    if t == Q.Q6_K:
        g = x.reshape(-1, 16, 16)
        scale = np.abs(g).max(-1) / 31
        d = _f16(scale.max(1, keepdims=True) / 127)
        sc = np.clip(np.round(scale / np.where(d > 0, d, 1).astype(np.float32)), 0, 127)
        step = (d.astype(np.float32) * sc)[..., None]
        q = np.clip(np.round(g / np.where(step > 0, step, 1)), -32, 31)
        return {"d": d, "sc": sc.astype(np.int8), "q": q.reshape(-1, QK_K).astype(np.int8)}
    nmax = 15 if t == Q.Q4_K else 31
    g = x.reshape(-1, 8, 32)
    mn = np.maximum(-g.min(-1), 0)
    scale = (g.max(-1) + mn) / nmax
    d, dmin = _f16(scale.max(1, keepdims=True) / 63), _f16(mn.max(1, keepdims=True) / 63)
    d32, dmin32 = d.astype(np.float32), dmin.astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d32 > 0, d32, 1)), 0, 63)
    m = np.clip(np.round(mn / np.where(dmin32 > 0, dmin32, 1)), 0, 63)
    step = (d32 * sc)[..., None]
    q = np.clip(np.round((g + (dmin32 * m)[..., None]) / np.where(step > 0, step, 1)), 0, nmax)
    return {"d": d, "dmin": dmin, "sc": sc.astype(np.uint8), "m": m.astype(np.uint8),
            "q": q.reshape(-1, QK_K).astype(np.uint8)}


def k_dequantize(t: Q, c: dict[str, np.ndarray]) -> np.ndarray:
    """Values [blocks, 256] from the codes, in ggml's float32 order of operations."""
    if t == Q.Q8_K:
        return c["d"] * c["q"].astype(np.float32)
    if t == Q.Q6_K:
        step = c["d"].astype(np.float32) * c["sc"].astype(np.float32)  # [blocks, 16]
        return np.repeat(step, 16, axis=1) * c["q"].astype(np.float32)
    step = c["d"].astype(np.float32) * c["sc"].astype(np.float32)  # [blocks, 8]
    offset = c["dmin"].astype(np.float32) * c["m"].astype(np.float32)
    return np.repeat(step, 32, axis=1) * c["q"].astype(np.float32) - np.repeat(offset, 32, axis=1)


def _pack_scales_k4(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The 12 bytes of 8 six-bit scales and mins (ggml's get_scale_min_k4, inverted): bytes 0-3
    hold sc[0:4] and the top two bits of sc[4:8], bytes 4-7 m[0:4] and the top bits of m[4:8],
    bytes 8-11 the low nibbles of sc[4:8] (low) and m[4:8] (high)."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    return out


def k_pack(t: Q, c: dict[str, np.ndarray]) -> np.ndarray:
    """The ggml block bytes [blocks, type_size] of the codes (structs of ggml-common.h)."""
    q = c["q"]
    n = q.shape[0]
    if t == Q.Q8_K:  # float d; int8 qs[256]; int16 bsums[16]
        bsums = q.astype(np.int16).reshape(n, 16, 16).sum(-1).astype("<i2")
        parts = [c["d"].astype("<f4").view(np.uint8), q.view(np.uint8), bsums.view(np.uint8)]
    elif t == Q.Q6_K:  # uint8 ql[128]; uint8 qh[64]; int8 scales[16]; half d
        u = (q.astype(np.int16) + 32).astype(np.uint8).reshape(n, 2, 4, 32)  # halves of 128
        lo = u & 0xF
        ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=2)
        hi = u >> 4
        qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
        parts = [ql.reshape(n, 128), qh.reshape(n, 64), c["sc"].view(np.uint8),
                 c["d"].astype("<f2").view(np.uint8)]
    else:  # half d; half dmin; uint8 scales[12]; (Q5_K: uint8 qh[32];) uint8 qs[128]
        sub = q.reshape(n, 8, 32)
        qs = (sub[:, 0::2] & 0xF) | ((sub[:, 1::2] & 0xF) << 4)  # sub-blocks 2k, 2k+1 share bytes
        parts = [c["d"].astype("<f2").view(np.uint8), c["dmin"].astype("<f2").view(np.uint8),
                 _pack_scales_k4(c["sc"], c["m"])]
        if t == Q.Q5_K:  # bit s of qh[l] is the fifth bit of element l of sub-block s
            parts.append(sum(((sub[:, s] >> 4) & 1) << s for s in range(8)).astype(np.uint8))
        parts.append(qs.reshape(n, 128))
    out = np.concatenate(parts, axis=1)
    assert out.shape[1] == gguf.GGML_QUANT_SIZES[t][1], (t.name, out.shape)
    return out


def k_error_bound(w: np.ndarray, t: Q) -> np.ndarray:
    """Per-element bound on |k_dequantize(k_quantize(w)) - w|: half a step, plus the range a
    sub-block scale rounded to a whole multiple of the super-block scale d can miss (up to half
    of d per level) and, for Q4_K/Q5_K, half of dmin from rounding the min."""
    c = k_quantize(w, t)
    n = c["q"].shape[0]
    if t == Q.Q8_K:
        bound = np.repeat(0.5 * c["d"], QK_K, axis=1)
    elif t == Q.Q6_K:
        d = c["d"].astype(np.float32)
        bound = np.repeat(0.5 * d * c["sc"] + 0.5 * 32 * d, 16, axis=1)
    else:
        nmax = 15 if t == Q.Q4_K else 31
        d, dmin = c["d"].astype(np.float32), c["dmin"].astype(np.float32)
        bound = np.repeat(0.5 * d * c["sc"] + 0.5 * nmax * d + 0.5 * dmin, 32, axis=1)
    return (bound.reshape(n, QK_K) + 1e-6).reshape(w.shape)


def write_gguf(path: Path, state: dict[str, np.ndarray], *, arch: str = "llama",
               types: dict[str, Q] | None = None, meta_overrides: dict | None = None,
               extra_tensors: dict[str, np.ndarray] | None = None, tokenizer: bool = True,
               pre: str = "smollm", omit: tuple[str, ...] = (), add_bos: bool | None = None,
               spm: dict | None = None, eot: int | None = None) -> Path:
    """Writes `state` (HF layout and names) as llama.cpp would: renamed, q/k permuted (for its
    Llama rope; Qwen2/Qwen3 run its NEOX rope and keep HF's rows), quantized. A `head_dim` in
    `meta_overrides` is written as the attention key/value length (Qwen3's). `spm`: a
    SentencePiece tokenizer's metadata (`test_tokenizer.spm_meta`) instead of the byte-level one."""
    types = TYPES if types is None else types
    c = dict(TINY, **(meta_overrides or {}))
    head_dim = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    if "hidden_size" not in omit:
        w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_dimension_count(head_dim)
    if "head_dim" in c:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if "num_experts" in c:
        w.add_expert_count(c["num_experts"])
        w.add_expert_used_count(c["num_experts_per_tok"])
        if "moe_intermediate_size" not in omit:
            w.add_expert_feed_forward_length(c["moe_intermediate_size"])
        if "shared_expert_intermediate_size" in c:
            w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    w.add_vocab_size(c["vocab_size"])
    if "rope_scaling_type" in c:
        w.add_string(f"{arch}.rope.scaling.type", c["rope_scaling_type"])
    for key, value in c.get("rope_scaling_meta", {}).items():  # "<arch>.rope.scaling.<key>", as llama.cpp types it
        (w.add_uint32 if key == "original_context_length" else w.add_float32)(f"{arch}.rope.scaling.{key}", value)
    if spm is not None or tokenizer:
        tokens = spm["tokenizer.ggml.tokens"] if spm else tiny_vocab()
        w.add_tokenizer_model("llama" if spm else "gpt2")
        w.add_token_list(tokens)
        w.add_token_types(spm["tokenizer.ggml.token_type"] if spm else [3 if t in SPECIALS else 1 for t in tokens])
        if spm:  # SentencePiece: scores, no merges (both vocabularies put <unk>/<s>/</s> or theirs at 0-2)
            w.add_token_scores(spm["tokenizer.ggml.scores"])
        else:
            w.add_tokenizer_pre(pre)
            w.add_token_merges(MERGES)
            w.add_pad_token_id(2)
            w.add_chat_template(CHAT_TEMPLATE)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        if eot is not None:
            w.add_eot_token_id(eot)
        if add_bos is not None:
            w.add_add_bos_token(add_bos)
    for hf, value in state.items():
        if arch != "llama":
            pass
        elif hf.endswith("q_proj.weight"):
            value = llamacpp_permute(value, c["num_attention_heads"])
        elif hf.endswith("k_proj.weight"):
            value = llamacpp_permute(value, c["num_key_value_heads"])
        data, raw = encode_tensor(value, types.get(hf, Q.F32))
        w.add_tensor(gguf_name(hf), data, raw_dtype=raw)
    for name, value in (extra_tensors or {}).items():
        if isinstance(value, tuple):  # (values, storage type)
            data, raw = encode_tensor(*value)
            w.add_tensor(name, data, raw_dtype=raw)
        else:
            w.add_tensor(name, value)
    return close_gguf(w, path)


def close_gguf(w: gguf.GGUFWriter, path: Path) -> Path:
    """Write out what `w` holds to `path`."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def add_byte_level_tokenizer(w: gguf.GGUFWriter, tokens: list[str], pre: str) -> None:
    """The tiny byte-level vocabulary's metadata (`tokens` may extend it), <|endoftext|> as bos and
    <|im_start|> as eos as the other files here have them."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def expected_values(state: dict[str, np.ndarray], types=None) -> dict[str, np.ndarray]:
    """What an exact reader returns: each HF tensor rounded through its storage type."""
    types = TYPES if types is None else types
    out = {}
    for hf, w in state.items():
        t = types.get(hf, Q.F32)
        if t == Q.F32:
            out[hf] = w
        elif t == Q.F16:
            out[hf] = w.astype(np.float16).astype(np.float32)
        elif t in K_QUANTS:
            out[hf] = k_dequantize(t, k_quantize(w, t)).reshape(w.shape)
        else:
            out[hf] = gguf.quants.dequantize(gguf.quants.quantize(w, t), t).astype(np.float32)
    return out


def error_bound(w: np.ndarray, t: Q) -> np.ndarray:
    """Per-element bound on |dequant(quant(w)) - w| from the block formats (32 values per block;
    fp16 scales add a relative 2^-11 on top of half a quantization step)."""
    if t == Q.F32:
        return np.zeros_like(w)
    if t in K_QUANTS:
        return k_error_bound(w, t)
    if t == Q.F16:
        return np.abs(w) * 2.0 ** -11 + 1e-7
    if t == Q.BF16:
        return np.abs(w) * 2.0 ** -8
    blocks = w.reshape(w.shape[0], -1, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    spread = blocks.max(-1, keepdims=True) - blocks.min(-1, keepdims=True)
    step = {Q.Q8_0: amax / 127, Q.Q4_0: amax / 8, Q.Q5_0: amax / 16, Q.Q4_1: spread / 15, Q.Q5_1: spread / 31}[t]
    levels = {Q.Q8_0: 127, Q.Q4_0: 8, Q.Q5_0: 16, Q.Q4_1: 15, Q.Q5_1: 31}[t]
    # Q4_0 (Q5_0) maps [-amax, amax] onto 16 (32) levels -8..7 (-16..15), so a value near the side
    # opposite the extreme is clamped to the top level: up to one full step of error there, half a
    # step elsewhere.
    steps = 1.0 if t in (Q.Q4_0, Q.Q5_0) else 0.5
    bound = step * (steps + levels * 2.0 ** -10) + 1e-6
    return np.broadcast_to(bound, blocks.shape).reshape(w.shape)


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    state = tiny_state(seed=0)
    path = write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", state)
    return path, state


# ------------------------------------------------------------------------------ read_gguf


def test_read_gguf_config(tiny_file):
    path, _ = tiny_file
    cfg, _ = read_gguf(path)
    for key, value in TINY.items():
        assert cfg[key] == value, key
    assert cfg["model_type"] == "llama"
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["head_dim"] == HEAD_DIM
    assert cfg["tie_word_embeddings"] is False
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 2)
    # float32 metadata comes back as the decimal it was written from, not 9.99999974e-06
    assert repr(cfg["rms_norm_eps"]) == "1e-05"


def test_read_gguf_restores_hf_layout_exactly(tiny_file):
    path, state = tiny_file
    _, got = read_gguf(path)
    want = expected_values(state)
    assert set(got) == set(state)
    for name, value in got.items():
        assert value.dtype == np.float32, name
        assert value.shape == state[name].shape, name
        np.testing.assert_array_equal(value, want[name], err_msg=name)


def test_read_gguf_within_quantization_bound(tiny_file):
    path, state = tiny_file
    _, got = read_gguf(path)
    for name, value in got.items():
        t = TYPES.get(name, Q.F32)
        err = np.abs(value - state[name])
        bound = error_bound(state[name], t)
        assert np.all(err <= bound), (name, t.name, float((err - bound).max()))
    # The bound is tight enough to catch a layout bug: a q_proj left in llama.cpp's row order
    # is far outside it.
    q = "model.layers.1.self_attn.q_proj.weight"
    wrong = llamacpp_permute(got[q], TINY["num_attention_heads"])
    assert not np.all(np.abs(wrong - state[q]) <= error_bound(state[q], TYPES[q]))


def test_unpermute_worked_example():
    # One head of 4 rows: GGUF stores HF rows [q0, q1, q2, q3] as [q0, q2, q1, q3].
    from tevjax.convert.gguf import unpermute_rope_rows

    hf = np.arange(8, dtype=np.float32).reshape(4, 2)
    stored = llamacpp_permute(hf, 1)
    np.testing.assert_array_equal(stored[:, 0], [0, 4, 2, 6])
    np.testing.assert_array_equal(unpermute_rope_rows(stored, 1), hf)
    # GQA: k_proj uses the KV head count, 2 heads x 6 rows.
    k = np.random.default_rng(1).standard_normal((12, 3)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rope_rows(llamacpp_permute(k, 2), 2), k)
    assert not np.array_equal(unpermute_rope_rows(llamacpp_permute(k, 2), 1), k)
    with pytest.raises(GGUFError, match=r"rows not a multiple of 2 \* heads"):  # head_dim 3: no row pairs
        unpermute_rope_rows(np.zeros((6, 2), np.float32), 2)


def test_read_gguf_tied_embeddings(tmp_path):
    state = tiny_state(seed=3, tied=True)
    path = write_gguf(tmp_path / "tied.gguf", state)
    cfg, got = read_gguf(path)
    assert cfg["tie_word_embeddings"] is True
    assert "lm_head.weight" not in got
    assert set(got) == set(state)


def assert_read_like_transformers(path: Path) -> None:
    """`read_gguf` and transformers' own GGUF reader (dequantize + its reverse permute) agree
    bit for bit on every tensor of `path`."""
    import torch
    import transformers  # (gguf_file loading also needs accelerate, a test dependency)
    _, got = read_gguf(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    theirs = {k: v.numpy() for k, v in model.state_dict().items()}
    assert set(theirs) == set(got)
    for name, value in got.items():
        np.testing.assert_array_equal(value, theirs[name], err_msg=name)


def test_matches_transformers_gguf_loader(tiny_file):
    assert_read_like_transformers(tiny_file[0])


# ------------------------------------------------------------------------------ Qwen2 and Qwen3

# Qwen3's head size is its own (128 for every Qwen3 model, transformers' default): here 8x the
# hidden size over the heads, so a reader that derived it would get every attention shape wrong.
QWEN_SIZES = {"qwen2": dict(TINY), "qwen3": dict(TINY, head_dim=128)}


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def qwen_file(request, tmp_path_factory) -> tuple[str, Path, dict[str, np.ndarray]]:
    arch = request.param
    state = tiny_state(seed=11, sizes=QWEN_SIZES[arch], arch=arch)
    path = write_gguf(tmp_path_factory.mktemp(arch) / f"{arch}.gguf", state, arch=arch,
                      meta_overrides=QWEN_SIZES[arch], pre="qwen2")
    return arch, path, state


def test_qwen_files_read_in_hf_layout(qwen_file):
    """Config and tensors of a Qwen2 file (q/k/v biases) and a Qwen3 file (q/k norms, head size
    128): HF names, rows as HF has them (no rope permutation), each tensor exactly its storage
    type's rounding, and transformers' own GGUF reader agrees bit for bit."""
    arch, path, state = qwen_file
    cfg, got = read_gguf(path)
    assert cfg["model_type"] == arch
    assert cfg["architectures"] == [{"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]]
    assert cfg["head_dim"] == QWEN_SIZES[arch].get("head_dim", HEAD_DIM)
    assert set(got) == set(state)
    want = expected_values(state)
    for name, value in got.items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)
    assert_read_like_transformers(path)


def test_qwen_conversion_runs_in_tevjax_like_transformers(qwen_file, tmp_path):
    """The converted directory is a checkpoint both tevjax and transformers load: the same logits
    over a token sequence (tevjax's causal run against transformers' forward)."""
    arch, path, _ = qwen_file
    cfg = assert_runs_like_transformers(gguf_to_hf_dir(path, tmp_path / "hf"))
    assert cfg.architecture == arch and cfg.head_dim == QWEN_SIZES[arch].get("head_dim", HEAD_DIM)


def assert_runs_like_transformers(out: Path):
    """tevjax's target loaded from the converted directory `out` gives transformers' logits over a
    token sequence (a causal run against transformers' forward); returns its config."""
    import jax.numpy as jnp
    import torch
    import transformers

    from tevjax.convert.hf import load_hf_target
    from tevjax.models import KVCache

    _, target = load_hf_target(out)
    ids = np.array([[5, 17, 42, 99, 3, 250, 7, 64]], np.int32)
    ours = target(jnp.asarray(ids), jnp.arange(ids.shape[1])[None], KVCache.init(target.cfg, 1, 16),
                  jnp.zeros((1,), jnp.int32), None).logits
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    with torch.no_grad():
        theirs = model(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=2e-4, rtol=2e-4)
    return target.cfg


def test_qwen2_pre_tokenizer_splits_like_transformers(tmp_path):
    """`tokenizer.ggml.pre` "qwen2": the rebuilt tokenizer encodes like transformers' GGUF
    tokenizer of the same file, and unlike the GPT-2 split where they differ (digits one at a
    time, so the "1 2" merge never applies)."""
    import transformers

    from tevjax.convert.gguf import read_gguf_metadata
    from tevjax.convert.tokenizer import build_tokenizer, load_tokenizer

    path = write_gguf(tmp_path / "q2.gguf", tiny_state(seed=2, arch="qwen2"), arch="qwen2", pre="qwen2")
    ours = load_tokenizer(gguf_to_hf_dir(path, tmp_path / "hf"))
    theirs = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = ["hello world 12", "hello  12\n\n world", "HELLO'S world!!\n", " 1212 hello", "(hello)world 3",
             "<|im_start|>hello<|im_end|>"]
    for text in texts:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
    gpt2 = build_tokenizer(dict(read_gguf_metadata(path), **{"tokenizer.ggml.pre": "gpt-2"}))
    assert ours.encode("12") == [ours.convert_tokens_to_ids("1"), ours.convert_tokens_to_ids("2")]
    assert gpt2.encode("12").ids == [ours.convert_tokens_to_ids("12")]


def test_qwen35_pre_tokenizer_keeps_combining_marks_in_words(tmp_path):
    """`tokenizer.ggml.pre` "qwen35" (Qwen3.5's files): Qwen2's split, except that combining marks
    (Devanagari's vowel signs and virama, a decomposed accent) stay inside their word, where Qwen2's
    split cuts the word at each of them."""
    from tevjax.convert.gguf import read_gguf_metadata
    from tevjax.convert.tokenizer import build_tokenizer

    path = write_gguf(tmp_path / "q35.gguf", tiny_state(seed=2, arch="qwen2"), arch="qwen2", pre="qwen35")
    meta = read_gguf_metadata(path)

    def words(pre: str, text: str) -> list[str]:
        tok = build_tokenizer(dict(meta, **{"tokenizer.ggml.pre": pre}))
        return [text[a:b] for _, (a, b) in tok.pre_tokenizer.pre_tokenize_str(text)]

    text = "नमस्ते दुनिया, cafe\u0301 12!"
    assert words("qwen35", text) == ["नमस्ते", " दुनिया", ",", " cafe\u0301", " ", "1", "2", "!"]
    assert words("qwen2", text)[:4] == ["नमस", "्त", "े", " द"]
    assert words("qwen35", "!!\u0301") == ["!!", "\u0301"]  # a mark is no punctuation: it ends the run


def test_pre_tokenizer_aliases_split_as_their_group(tmp_path):
    """llama.cpp's other names for GPT-2's split ("phi-2", "mpt", "olmo") and Llama 3's ("smaug-bpe",
    "dbrx") split text exactly as the group's first name does."""
    from tevjax.convert.gguf import read_gguf_metadata
    from tevjax.convert.tokenizer import SUPPORTED_PRE_TOKENIZERS, build_tokenizer

    meta = read_gguf_metadata(write_gguf(tmp_path / "a.gguf", tiny_state(seed=2)))
    text = "Hello world's 12345 times!!\n\n  tabs\tand CamelCase"

    def split(pre):
        tok = build_tokenizer(dict(meta, **{"tokenizer.ggml.pre": pre}))
        return [piece for piece, _ in tok.pre_tokenizer.pre_tokenize_str(text)]

    groups = {"gpt-2": ("phi-2", "mpt", "olmo"), "smollm": ("starcoder", "refact", "codeshell"),
              "qwen2": ("deepseek-r1-qwen",), "llama-bpe": ("llama3", "llama-v3", "smaug-bpe", "dbrx"),
              "gpt-4o": ("llama4",), "qwen35": (), "tekken": ()}
    assert {p for g, aliases in groups.items() for p in (g, *aliases)} == set(SUPPORTED_PRE_TOKENIZERS)
    for group, aliases in groups.items():
        for alias in aliases:
            assert split(alias) == split(group), alias
    # the groups differ on this text (qwen35 only on combining marks), so no alias can join the wrong one
    assert len({tuple(split(g)) for g in groups if g != "qwen35"}) == len(groups) - 1
    assert [p for p in split("llama-bpe") if p.isdigit()] == ["123", "45"]  # digits in runs of up to three


def test_tekken_pre_tokenizer_splits_by_case_as_llama_cpp(tmp_path):
    """`tokenizer.ggml.pre` "tekken" (Mistral Nemo / Small 3 files, `llama` architecture): a word
    splits where a capital follows lower case, digits one at a time, a slash stays with its
    punctuation; a capital that is not ASCII counts as llama.cpp's regex counts it (with lower case)."""
    from tevjax.convert.gguf import read_gguf_metadata
    from tevjax.convert.tokenizer import build_tokenizer

    meta = read_gguf_metadata(write_gguf(tmp_path / "t.gguf", tiny_state(seed=2)))
    tok = build_tokenizer(dict(meta, **{"tokenizer.ggml.pre": "tekken"}))

    def words(text):
        return [text[a:b] for _, (a, b) in tok.pre_tokenizer.pre_tokenize_str(text)]

    assert words("HTTPServer CamelCase hello 123 a/b") == [
        "HTTPServer", " Camel", "Case", " hello", " ", "1", "2", "3", " a", "/b"]
    assert words("aÉb") == ["aÉb"]  # the original tokenizer.json splits "a" | "Éb"
    assert tok.encode("hello").ids[0] == 1  # BOS, as llama.cpp adds it for Tekken


def test_gpt4o_pre_tokenizer_keeps_contractions_and_digit_triples(tmp_path):
    """`tokenizer.ggml.pre` "gpt-4o" (GPT-OSS's o200k): letter runs split by case with an English
    contraction kept on the word, digits in runs of up to three, no BOS unless the file asks."""
    from tevjax.convert.gguf import read_gguf_metadata
    from tevjax.convert.tokenizer import build_tokenizer

    meta = read_gguf_metadata(write_gguf(tmp_path / "o.gguf", tiny_state(seed=2)))
    tok = build_tokenizer(dict(meta, **{"tokenizer.ggml.pre": "gpt-4o"}))
    text = "I'm HTTPServer 12345 can't CamelCase"
    words = [text[a:b] for _, (a, b) in tok.pre_tokenizer.pre_tokenize_str(text)]
    assert words == ["I'm", " HTTPServer", " ", "123", "45", " can't", " Camel", "Case"]
    assert tok.encode("hello").ids[0] != 1


def test_llama3_group_takes_whole_tokens_and_adds_bos(tmp_path):
    """llama.cpp's Llama 3 pre-tokenizers ("llama-bpe", "llama3", "llama-v3") take a piece that is
    itself a token whole even where no merge makes it, and add BOS when the file does not say; "smaug-bpe"
    (SmolLM3) splits the same way but merges as BPE does and adds nothing unasked."""
    from tevjax.convert.gguf import read_gguf_metadata
    from tevjax.convert.tokenizer import build_tokenizer

    path = write_gguf(tmp_path / "l3.gguf", tiny_state(seed=2), pre="llama-bpe")
    meta = dict(read_gguf_metadata(path))
    # a normal token no merge reaches ("wor" is only a step towards " world")
    meta["tokenizer.ggml.tokens"] = [*meta["tokenizer.ggml.tokens"], "wor"]
    meta["tokenizer.ggml.token_type"] = [*meta["tokenizer.ggml.token_type"], 1]
    whole = len(meta["tokenizer.ggml.tokens"]) - 1
    for pre in ("llama-bpe", "llama3", "llama-v3"):
        assert build_tokenizer(dict(meta, **{"tokenizer.ggml.pre": pre})).encode("wor").ids == [1, whole], pre
    smaug = build_tokenizer(dict(meta, **{"tokenizer.ggml.pre": "smaug-bpe"}))
    assert smaug.encode("wor").ids == [meta["tokenizer.ggml.tokens"].index(t) for t in ("w", "or")]  # "o r" merges
    asked = build_tokenizer(dict(meta, **{"tokenizer.ggml.add_bos_token": False}))
    assert asked.encode("wor").ids == [whole]


def llamacpp_rope_freqs(head_dim: int, theta: float, factor: float, low: float, high: float,
                        context: float) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's `rope_freqs` for a Llama 3.1+ `rope_scaling` (written here from
    that converter's published loop, independently of `tevjax.convert.gguf`)."""
    out = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim):
        wavelen = 2 * np.pi / freq
        if wavelen < context / high:
            out.append(1.0)
        elif wavelen > context / low:
            out.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


# With head size 16 and theta 1e4 the 8 wavelengths run 6.3 .. 19,869: for a context of 64,
# frequency 0 is kept, 1 and 2 are blended and the rest divided by the factor.
LLAMA3_ROPE = dict(factor=4.0, low=1.0, high=4.0, context=64.0)


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    """A Llama file with `rope_freqs.weight` (Llama 3.1 onwards) and the "llama-bpe" pre-tokenizer:
    the converted config's "llama3" rope scaling gives tevjax and transformers the file's rope
    (base frequencies over the stored divisors), both run the converted checkpoint to the same
    logits, and its tokenizer encodes like transformers' GGUF tokenizer (digits in runs of three,
    and BOS first, which the file asks for).
    Divisors that Llama-3 scaling cannot produce are refused by name, and so is the tensor in a
    Qwen file."""
    import jax.numpy as jnp
    import torch
    import transformers

    from tevjax.convert.hf import load_hf_target
    from tevjax.convert.tokenizer import load_tokenizer
    from tevjax.models import KVCache
    from tevjax.models.layers import rope_inv_freq

    divisors = llamacpp_rope_freqs(HEAD_DIM, TINY["rope_theta"], **LLAMA3_ROPE)
    assert 1.0 < divisors[1] < divisors[2] < LLAMA3_ROPE["factor"] == divisors[3]  # the layout above
    path = write_gguf(tmp_path / "l3.gguf", tiny_state(seed=5), pre="llama-bpe", add_bos=True,
                      extra_tensors={"rope_freqs.weight": divisors})
    cfg, _ = read_gguf(path)
    # The context taken is the model's 128 (below Llama 3's 8192), so the factors are twice the
    # written ones: the same rope (their ratios to the context are what it depends on).
    assert cfg["rope_scaling"] == {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0,
                                   "high_freq_factor": 8.0, "original_max_position_embeddings": 128}
    want = (1.0 / TINY["rope_theta"] ** (np.arange(0, HEAD_DIM, 2) / HEAD_DIM)) / divisors
    out = gguf_to_hf_dir(path, tmp_path / "hf")
    _, target = load_hf_target(out)
    np.testing.assert_allclose(rope_inv_freq(HEAD_DIM, target.cfg.rope_theta, target.cfg.rope_scaling), want,
                               rtol=1e-5)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    np.testing.assert_allclose(model.model.rotary_emb.inv_freq.numpy(), want, rtol=1e-5)
    ids = np.arange(3, 3 + 40, dtype=np.int32)[None] * 5 % 270  # 40 positions: the slow frequencies turn
    ours = target(jnp.asarray(ids), jnp.arange(ids.shape[1])[None], KVCache.init(target.cfg, 1, 64),
                  jnp.zeros((1,), jnp.int32), None).logits
    with torch.no_grad():
        theirs = model(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=2e-4, rtol=2e-4)

    ours_tok = load_tokenizer(out)
    theirs_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in ["hello world 12345", "hello  1212\n\n world", "HELLO'S world!!\n", " 121 2 hello"]:
        assert ours_tok.encode(text) == theirs_tok.encode(text), text  # BOS: the file asks for it
        assert ours_tok.encode(text)[0] == 1 and ours_tok.encode(text, add_special_tokens=False) == \
            theirs_tok.encode(text, add_special_tokens=False), text
    assert ours_tok.convert_ids_to_tokens(ours_tok.encode("12345", add_special_tokens=False)) == ["12", "3", "4", "5"]

    for bad, message in ((np.full(8, 0.5, np.float32), "holds divisors from 0.5 to 0.5"),
                         (np.array([1, 1, 1, 1, 4, 4, 4, 4], np.float32), "blends 0 frequencies"),
                         (divisors[:4], "has 4 values for 8 rope frequencies"),
                         # blended divisors that fall as the wavelength grows: no low < high
                         (np.array([1, 3, 1.5, 4, 4, 4, 4, 4], np.float32), "no factors reproduce it")):
        path = write_gguf(tmp_path / "bad.gguf", tiny_state(seed=5), extra_tensors={"rope_freqs.weight": bad})
        with pytest.raises(GGUFError, match=rf"bad\.gguf: tensor rope_freqs\.weight .*{re.escape(message)}"):
            read_gguf(path)
    path = write_gguf(tmp_path / "q.gguf", tiny_state(seed=5, arch="qwen2"), arch="qwen2",
                      extra_tensors={"rope_freqs.weight": divisors})
    with pytest.raises(GGUFError, match=r"q\.gguf: tensor rope_freqs\.weight \(per-frequency rope scaling\) is not "
                                        r"supported for qwen2"):
        read_gguf(path)


def test_a_gguf_file_is_a_cli_target(qwen_file, tmp_path, monkeypatch, capsys):
    """`--target file.gguf`: converted once into the cache (named after the file), then decoded
    like any target: TEV's greedy tokens equal autoregressive decoding of the converted directory.
    A missing file is one line."""
    import json

    from tevjax.cli import main
    from tevjax.decode import DecodeConfig, Decoder
    from tevjax.loading import load_models

    arch, path, _ = qwen_file
    monkeypatch.setenv("TEVJAX_CACHE", str(tmp_path / "cache"))
    code = main(["generate", "--target", str(path), "--prompt-ids", "5,17,42", "--max-new-tokens", "6", "--budget",
                 "3", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    entries = list((tmp_path / "cache").glob(f"{arch}-v*"))
    assert len(entries) == 1 and f"converted to {entries[0]}" in err
    models = load_models(str(entries[0]), with_drafter=False)
    want = Decoder(models.target, None, DecodeConfig(max_new_tokens=6, eos_ids=models.eos_ids)).generate([[5, 17, 42]])
    assert json.loads(out.strip().splitlines()[-1])["tokens"] == want[0].tokens
    code = main(["generate", "--target", str(tmp_path / "none.gguf"), "--prompt-ids", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "--target" in err and "no such GGUF file" in err and len(err.strip().splitlines()) == 1


def test_a_gguf_targets_end_of_turn_token_ends_generation(tmp_path, monkeypatch):
    """llama.cpp stops on a file's end-of-turn token besides its eos (Gemma's <end_of_turn>); the
    conversion wrote it to generation_config.json only, which nothing read, so decoding ran past it."""
    from tevjax.loading import load_target

    monkeypatch.setenv("TEVJAX_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "chat.gguf", tiny_state(), types={}, eot=1)
    assert load_target(str(path)).eos_ids == (1, 2)


def test_a_sentencepiece_gguf_is_a_cli_target(tmp_path, monkeypatch, capsys):
    """A Llama-2-style file (`tokenizer.ggml.model` "llama": SentencePiece BPE) converts and runs:
    `generate --prompt` tokenizes as llama.cpp does (BOS, then the pieces), and its greedy tokens
    equal autoregressive decoding of the converted directory."""
    import json

    from test_tokenizer import llamacpp_spm, spm_meta
    from tevjax.cli import main
    from tevjax.decode import DecodeConfig, Decoder
    from tevjax.loading import load_models

    meta = spm_meta()
    sizes = dict(TINY, vocab_size=len(meta["tokenizer.ggml.tokens"]))
    path = write_gguf(tmp_path / "spm.gguf", tiny_state(seed=3, sizes=sizes), meta_overrides=sizes, spm=meta)
    monkeypatch.setenv("TEVJAX_CACHE", str(tmp_path / "cache"))
    code = main(["generate", "--target", str(path), "--prompt", "hello world", "--no-chat", "--max-new-tokens", "5",
                 "--budget", "3", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    entry, = (tmp_path / "cache").glob("spm-v*")
    models = load_models(str(entry), with_drafter=False)
    prompt = llamacpp_spm(meta, "hello world")
    assert models.tokenizer.encode("hello world") == prompt and prompt[0] == 1
    want = Decoder(models.target, None, DecodeConfig(max_new_tokens=5, eos_ids=models.eos_ids)).generate([prompt])
    got = json.loads(out.strip().splitlines()[-1])
    assert got["tokens"] == want[0].tokens, (got, want[0].tokens)


# ------------------------------------------------------------------------------ K-quants

# One 256-value super-block per row: every matrix of this model has rows of 256.
K_SIZES = dict(TINY, hidden_size=256, intermediate_size=256)
K_TYPES = {
    "model.embed_tokens.weight": Q.Q4_K,
    "lm_head.weight": Q.Q6_K,
    "model.layers.0.self_attn.q_proj.weight": Q.Q4_K,
    "model.layers.0.self_attn.k_proj.weight": Q.Q5_K,
    "model.layers.0.self_attn.v_proj.weight": Q.Q6_K,
    "model.layers.0.self_attn.o_proj.weight": Q.Q8_K,
    "model.layers.0.mlp.gate_proj.weight": Q.Q5_K,
    "model.layers.0.mlp.up_proj.weight": Q.Q4_K,
    "model.layers.0.mlp.down_proj.weight": Q.Q6_K,
    "model.layers.1.self_attn.q_proj.weight": Q.Q8_K,
    "model.layers.1.self_attn.k_proj.weight": Q.Q4_K,
    "model.layers.1.self_attn.v_proj.weight": Q.Q5_K,
    "model.layers.1.self_attn.o_proj.weight": Q.Q6_K,
    "model.layers.1.mlp.gate_proj.weight": Q.Q4_K,
    "model.layers.1.mlp.up_proj.weight": Q.Q8_K,
    "model.layers.1.mlp.down_proj.weight": Q.Q5_K,
}


@pytest.fixture(scope="module")
def k_file(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    state = tiny_state(seed=7, sizes=K_SIZES)
    state["model.layers.0.mlp.up_proj.weight"][:3] = np.abs(state["model.layers.0.mlp.up_proj.weight"][:3])
    state["model.layers.1.mlp.down_proj.weight"][5] = 0.0  # an all-zero super-block
    path = write_gguf(tmp_path_factory.mktemp("kq") / "k.gguf", state, types=K_TYPES,
                      meta_overrides=K_SIZES)
    return path, state


def test_k_quant_known_blocks():
    """Blocks built by hand from ggml-common.h decode to the formula, through the same code
    `read_gguf` uses (gguf's dequantizers for Q4_K/Q5_K/Q6_K, tevjax's for Q8_K)."""
    from tevjax.convert.gguf import _dequantize_q8_k

    e = np.arange(QK_K)
    sc, m = np.arange(1, 9, dtype=np.uint8)[None], np.arange(8, dtype=np.uint8)[None]
    # ggml's 12 scale bytes for sc = 1..8, m = 0..7 (layout comment in gguf.quants.Q4_K)
    assert _pack_scales_k4(sc, m).tolist() == [[1, 2, 3, 4, 0, 1, 2, 3, 0x45, 0x56, 0x67, 0x78]]
    for t, nmax in ((Q.Q4_K, 15), (Q.Q5_K, 31)):
        codes = {"d": _f16([[1.0]]), "dmin": _f16([[0.5]]), "sc": sc, "m": m,
                 "q": (e % (nmax + 1)).astype(np.uint8)[None]}
        want = (e // 32 + 1) * (e % (nmax + 1)) - 0.5 * (e // 32)
        np.testing.assert_array_equal(gguf.quants.dequantize(k_pack(t, codes), t)[0], want)
    codes = {"d": _f16([[0.25]]), "sc": np.arange(-8, 8, dtype=np.int8)[None],
             "q": (e % 64 - 32).astype(np.int8)[None]}
    np.testing.assert_array_equal(gguf.quants.dequantize(k_pack(Q.Q6_K, codes), Q.Q6_K)[0],
                                  0.25 * (e // 16 - 8) * (e % 64 - 32))
    codes = {"d": np.float32([[0.5]]), "q": (e - 128).astype(np.int8)[None]}
    np.testing.assert_array_equal(_dequantize_q8_k(k_pack(Q.Q8_K, codes)), 0.5 * (e - 128))


@pytest.mark.parametrize("t", K_QUANTS)
def test_k_quantizer_matches_ggml_decoding(t):
    """The test's packer agrees with the decoders on random data (guards the helpers)."""
    from tevjax.convert.gguf import _dequantize_q8_k

    w = (np.random.default_rng(1).standard_normal((4, 2 * QK_K)) * 0.3).astype(np.float32)
    codes = k_quantize(w, t)
    raw = k_pack(t, codes).reshape(4, -1)
    got = _dequantize_q8_k(raw) if t == Q.Q8_K else gguf.quants.dequantize(raw, t)
    np.testing.assert_array_equal(got.reshape(w.shape), k_dequantize(t, codes).reshape(w.shape))
    assert np.all(np.abs(got.reshape(w.shape) - w) <= k_error_bound(w, t))


def test_read_gguf_k_quants_exactly_and_within_bound(k_file):
    path, state = k_file
    cfg, got = read_gguf(path)
    assert (cfg["hidden_size"], cfg["head_dim"]) == (256, 64)
    want = expected_values(state, K_TYPES)
    assert set(got) == set(state)
    for name, value in got.items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)
        t = K_TYPES.get(name, Q.F32)
        assert np.all(np.abs(value - state[name]) <= error_bound(state[name], t)), (name, t.name)
    # the bound still catches a q_proj left in llama.cpp's row order
    q = "model.layers.0.self_attn.q_proj.weight"
    wrong = llamacpp_permute(got[q], K_SIZES["num_attention_heads"])
    assert not np.all(np.abs(wrong - state[q]) <= error_bound(state[q], K_TYPES[q]))


def test_k_quants_match_transformers_gguf_loader(tmp_path):
    """transformers reads Q4_K/Q5_K/Q6_K (not Q8_K) files too; it agrees bit for bit."""
    types = {k: (Q.Q8_0 if t == Q.Q8_K else t) for k, t in K_TYPES.items()}
    assert_read_like_transformers(write_gguf(tmp_path / "k.gguf", tiny_state(seed=8, sizes=K_SIZES),
                                             types=types, meta_overrides=K_SIZES))


def low_k_blocks(t: Q, n: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """`n` random Q2_K or Q3_K super-blocks: their ggml bytes [n, type_size] and their 256 values
    each, computed from the integer codes (ggml-common.h's block_q2_K / block_q3_K and
    dequantize_row_q2_K / q3_K as read there, not the gguf package). Value v of a block sits in
    16-value sub-block v // 16; its low two bits in qs[32 (v // 128) + v % 32] at bit 2 ((v % 128) // 32);
    Q3_K's third bit in hmask[v % 32] at bit v // 32, set meaning +0 and clear meaning -4."""
    v = np.arange(QK_K)
    low = rng.integers(0, 4, (n, QK_K))
    qs = np.zeros((n, 64), np.uint8)
    np.add.at(qs, (slice(None), 32 * (v // 128) + v % 32), (low << (2 * ((v % 128) // 32))).astype(np.uint8))
    d = rng.uniform(0.01, 0.1, (n, 1)).astype(np.float16).astype(np.float32)
    if t == Q.Q2_K:  # uint8 scales[16] (scale | min << 4); uint8 qs[64]; half d; half dmin
        sc, mn = rng.integers(0, 16, (n, 16)), rng.integers(0, 16, (n, 16))
        dmin = rng.uniform(0.01, 0.1, (n, 1)).astype(np.float16).astype(np.float32)
        values = (d * sc[:, v // 16]).astype(np.float32) * low - (dmin * mn[:, v // 16]).astype(np.float32)
        parts = [(sc | (mn << 4)).astype(np.uint8), qs, d.astype("<f2").view(np.uint8),
                 dmin.astype("<f2").view(np.uint8)]
    else:  # uint8 hmask[32]; uint8 qs[64]; uint8 scales[12] (16 six-bit scales, offset 32); half d
        high = rng.integers(0, 2, (n, QK_K))
        hmask = np.zeros((n, 32), np.uint8)
        np.add.at(hmask, (slice(None), v % 32), (high << (v // 32)).astype(np.uint8))
        s6 = rng.integers(0, 64, (n, 16))
        packed = np.zeros((n, 12), np.uint8)
        packed[:, :8] = (s6[:, :8] & 0xF) | ((s6[:, 8:] & 0xF) << 4)
        packed[:, 8:] = ((s6[:, 0:4] >> 4) | ((s6[:, 4:8] >> 4) << 2) | ((s6[:, 8:12] >> 4) << 4)
                         | ((s6[:, 12:16] >> 4) << 6))
        values = (d * (s6[:, v // 16] - 32)).astype(np.float32) * (low - 4 * (1 - high))
        parts = [hmask, qs, packed, d.astype("<f2").view(np.uint8)]
    out = np.concatenate(parts, axis=1)
    assert out.shape[1] == gguf.GGML_QUANT_SIZES[t][1], (t.name, out.shape)
    return out, values.astype(np.float32)


@pytest.mark.parametrize("t", [Q.Q2_K, Q.Q3_K])
def test_q2_k_and_q3_k_read_as_their_block_formats_say(tmp_path, t):
    """Q2_K and Q3_K tensors (llama.cpp's Q2_K and Q3_K_M files) read back as the codes their
    bytes hold say (`low_k_blocks`); one 256-wide row is one super-block."""
    rows = K_SIZES["intermediate_size"]
    data, want = low_k_blocks(t, rows, np.random.default_rng(int(t)))
    state = tiny_state(seed=7, sizes=K_SIZES)
    del state["model.layers.1.mlp.up_proj.weight"]
    path = write_gguf(tmp_path / "low.gguf", state, types={k: Q.F32 for k in state}, meta_overrides=K_SIZES,
                      extra_tensors={"blk.1.ffn_up.weight": (data, t)})
    np.testing.assert_allclose(read_gguf(path)[1]["model.layers.1.mlp.up_proj.weight"], want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("t", [Q.IQ4_XS, Q.IQ2_XXS])
def test_other_k_quants_refused_by_name(tmp_path, t):
    types = dict(K_TYPES, **{"model.layers.1.mlp.up_proj.weight": t})
    path = write_gguf(tmp_path / "k.gguf", tiny_state(sizes=K_SIZES), types=types,
                      meta_overrides=K_SIZES)
    with pytest.raises(GGUFError, match=rf"'blk\.1\.ffn_up\.weight' has ggml type {t.name}, which is "
                                        r"not supported \(supported: .*Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K, MXFP4\)"):
        read_gguf(path)


# ------------------------------------------------------------------------------ bad inputs


def test_missing_file(tmp_path):
    path = tmp_path / "nope.gguf"
    with pytest.raises(GGUFError, match="not found.*nope.gguf"):
        read_gguf(path)


def test_not_a_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 definitely a zip file")
    with pytest.raises(GGUFError, match="model.gguf is not a GGUF file"):
        read_gguf(path)


@pytest.mark.parametrize("keep", [6, 200, 0.5, -1])
def test_truncated_file(tiny_file, tmp_path, keep):
    """Cut inside the header, inside the metadata, halfway and one byte short of the end."""
    src, _ = tiny_file
    data = src.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else (keep if keep > 0 else len(data) + keep)
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:n])
    with pytest.raises(GGUFError, match="cut.gguf"):
        read_gguf(path)


def patch_tensor_info(path: Path, name: str, *, dims: tuple[int, ...] | None = None, ggml_type: Q | None = None
                      ) -> None:
    """Rewrite a tensor's ggml dims or type in place (its GGUF tensor info: the name's u64 length and
    bytes, u32 n_dims, u64 dims fastest first, u32 type, u64 offset), as a file whose header lies."""
    import struct

    data = bytearray(path.read_bytes())
    key = name.encode()
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    n = struct.unpack_from("<I", data, at)[0]
    if dims is not None:
        assert len(dims) == n
        struct.pack_into(f"<{n}Q", data, at + 4, *dims)
    if ggml_type is not None:
        struct.pack_into("<I", data, at + 4 + 8 * n, int(ggml_type))
    path.write_bytes(bytes(data))


def test_a_tensor_whose_header_lies_is_refused_by_name(tiny_file, tmp_path):
    """F16 data marked F32 ran into the next tensor's bytes and was read as weights with no error; a
    quantized tensor with a zero dimension failed inside the gguf package (a bare ValueError)."""
    src, _ = tiny_file
    path = tmp_path / "lie.gguf"
    path.write_bytes(src.read_bytes())
    patch_tensor_info(path, "blk.0.attn_output.weight", ggml_type=Q.F32)  # stored as F16 (TYPES)
    with pytest.raises(GGUFError, match=r"lie\.gguf: tensor 'blk\.0\.attn_output\.weight' runs 8192 bytes into the "
                                        r"data of tensor '[^']+'; its shape or type is wrong"):
        read_gguf(path)
    path.write_bytes(src.read_bytes())
    patch_tensor_info(path, "blk.0.attn_v.weight", dims=(0, 32))  # Q8_0, ggml dims (64, 32)
    with pytest.raises(GGUFError, match=r"lie\.gguf: tensor 'blk\.0\.attn_v\.weight' of shape \[0, 32\] \(ggml order\) "
                                        r"cannot be read as Q8_0"):
        read_gguf(path)


def test_unsupported_architecture(tmp_path):
    path = write_gguf(tmp_path / "g.gguf", tiny_state(), arch="gptneox")
    with pytest.raises(GGUFError, match=r"architecture 'gptneox' is not supported \(supported: llama, qwen2, qwen3, "
                                       r"qwen3moe, qwen2moe, gemma2, gemma3, phi3, qwen3next, qwen35, qwen35moe, "
                                       r"smollm3, granite, granitemoe, olmo2, olmoe, gpt-oss\)"):
        read_gguf(path)


def test_mxfp4_tensors_read_as_the_block_format_says(tmp_path):
    """MXFP4 (GPT-OSS's experts in llama.cpp's files): each block of 32 values is one E8M0 scale byte
    e and 16 bytes of 4-bit E2M1 codes, value j from the low nibble of byte j and value j + 16 from
    its high nibble; a code k means FP4[k] * 2^(e - 127), FP4 = 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their
    negatives (ggml-common.h's block_mxfp4, decoded here from the integer codes, not the gguf package)."""
    rng = np.random.default_rng(4)
    rows, cols = TINY["intermediate_size"], TINY["hidden_size"]
    scales = rng.integers(120, 135, size=(rows, cols // 32)).astype(np.uint8)
    codes = rng.integers(0, 16, size=(rows, cols // 32, 32)).astype(np.uint8)
    packed = np.concatenate([scales[..., None], codes[..., :16] | (codes[..., 16:] << 4)], axis=-1)
    fp4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float64)
    want = (fp4[codes] * 2.0 ** (scales[..., None].astype(np.float64) - 127)).reshape(rows, cols)
    state = tiny_state(seed=9)
    name = "model.layers.1.mlp.gate_proj.weight"
    del state[name]
    path = write_gguf(tmp_path / "mx.gguf", state, extra_tensors={"blk.1.ffn_gate.weight": (
        packed.reshape(rows, -1), Q.MXFP4)}, types={k: Q.F32 for k in state})
    np.testing.assert_array_equal(read_gguf(path)[1][name], want.astype(np.float32))


def test_cli_help_names_every_supported_architecture():
    from tevjax.cli import TARGET_HELP
    from tevjax.convert.gguf import SUPPORTED_ARCHITECTURES

    listed = TARGET_HELP.split(".gguf file (", 1)[1].rstrip(")").split(", ")
    assert listed == list(SUPPORTED_ARCHITECTURES)


def test_unsupported_tensor_type(tmp_path):
    types = dict(TYPES, **{"model.layers.1.mlp.up_proj.weight": Q.IQ4_NL})
    path = write_gguf(tmp_path / "iq4.gguf", tiny_state(), types=types)
    with pytest.raises(GGUFError, match=r"'blk\.1\.ffn_up\.weight' has ggml type IQ4_NL"):
        read_gguf(path)


def test_unmapped_tensor(tmp_path):
    extra = {"blk.0.attn_q.bias": np.zeros(64, np.float32)}
    path = write_gguf(tmp_path / "bias.gguf", tiny_state(), extra_tensors=extra)
    with pytest.raises(GGUFError, match=r"no llama mapping: blk\.0\.attn_q\.bias"):
        read_gguf(path)
    # A Qwen3 file has no biases either (Qwen2's are its own), and needs its q/k norms.
    qwen3 = tiny_state(sizes=dict(TINY, head_dim=128), arch="qwen3")
    path = write_gguf(tmp_path / "q3bias.gguf", qwen3, arch="qwen3", meta_overrides={"head_dim": 128},
                      extra_tensors={"blk.0.attn_q.bias": np.zeros(512, np.float32)})
    with pytest.raises(GGUFError, match=r"no qwen3 mapping: blk\.0\.attn_q\.bias"):
        read_gguf(path)
    del qwen3["model.layers.1.self_attn.k_norm.weight"]
    path = write_gguf(tmp_path / "q3hole.gguf", qwen3, arch="qwen3", meta_overrides={"head_dim": 128})
    with pytest.raises(GGUFError, match=r"missing tensors for model\.layers\.1\.self_attn\.k_norm\.weight"):
        read_gguf(path)


def test_tensor_past_the_last_block(tmp_path):
    extra = {"blk.2.attn_norm.weight": np.ones(64, np.float32)}  # block_count is 2
    path = write_gguf(tmp_path / "past.gguf", tiny_state(), extra_tensors=extra)
    with pytest.raises(GGUFError, match=r"'blk\.2\.attn_norm\.weight' belongs to layer 2, but block_count is 2"):
        read_gguf(path)


def test_dequantized_values_take_the_reversed_ggml_shape():
    """ggml lists dims fastest first; a size that disagrees with them is refused by name (a stand-in
    tensor: gguf's reader sizes the data from the shape itself)."""
    from types import SimpleNamespace

    from tevjax.convert.gguf import _dequantize

    values = np.arange(6, dtype=np.float32)
    good = SimpleNamespace(name="t", tensor_type=Q.F32, data=values, shape=np.array([3, 2]))
    np.testing.assert_array_equal(_dequantize(Path("x.gguf"), good), values.reshape(2, 3))
    bad = SimpleNamespace(name="t", tensor_type=Q.F32, data=values, shape=np.array([4, 2]))
    with pytest.raises(GGUFError, match=r"'t' dequantized to 6 values, expected \(2, 4\)"):
        _dequantize(Path("x.gguf"), bad)


def test_missing_tensor(tmp_path):
    state = tiny_state()
    del state["model.layers.1.mlp.up_proj.weight"]
    path = write_gguf(tmp_path / "hole.gguf", state)
    with pytest.raises(GGUFError, match=r"missing tensors for model\.layers\.1\.mlp\.up_proj"):
        read_gguf(path)


def test_shape_disagrees_with_metadata(tmp_path):
    path = write_gguf(tmp_path / "ff.gguf", tiny_state(),
                      meta_overrides={"intermediate_size": 128})
    with pytest.raises(GGUFError, match=r"'blk\.0\.ffn_gate\.weight'.*\(96, 64\), expected \(128, 64\)"):
        read_gguf(path)


def test_missing_metadata(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", tiny_state(), omit=("hidden_size",))
    with pytest.raises(GGUFError, match=r"m\.gguf: required metadata llama\.embedding_length"):
        read_gguf(path)


def llamacpp_yarn_inv_freq(head_dim: int, theta: float, factor: float, context: int, beta_fast: float = 32.0,
                           beta_slow: float = 1.0) -> np.ndarray:
    """The per-position angle rate of llama.cpp's YaRN rope (ggml's `rope_yarn` with ext_factor 1
    and `ggml_rope_yarn_corr_dims`, written here independently of `tevjax.models.layers`)."""
    def corr_dim(turns):
        return head_dim * np.log(context / (turns * 2 * np.pi)) / (2 * np.log(theta))

    low, high = max(0.0, np.floor(corr_dim(beta_fast))), min(head_dim - 1.0, np.ceil(corr_dim(beta_slow)))
    out = []
    for i0 in range(0, head_dim, 2):
        extrap = theta ** (-i0 / head_dim)
        mix = 1 - min(1.0, max(0.0, (i0 // 2 - low) / max(0.001, high - low)))  # weight of the unscaled rate
        out.append(extrap / factor * (1 - mix) + extrap * mix)
    return np.asarray(out)


@pytest.mark.parametrize("arch, meta, want_type", [
    ("llama", {"rope_scaling_type": "linear", "rope_scaling_meta": {"factor": 4.0}}, "linear"),
    # original context 32 of 128: with head size 16 and theta 1e4, dimension 0 keeps its rate,
    # 1 is blended and 2-7 are divided by the factor
    ("qwen3", {"rope_scaling_type": "yarn", "rope_scaling_meta": {"factor": 4.0, "original_context_length": 32}},
     "yarn"),
    # llama.cpp's neutral values of its other YaRN keys, and betas of the file's own
    ("qwen2", {"rope_scaling_type": "yarn", "rope_scaling_meta": {
        "factor": 2.0, "attn_factor": 1.0, "yarn_ext_factor": -1.0, "yarn_log_multiplier": 0.0,
        "yarn_beta_fast": 16.0, "yarn_beta_slow": 2.0}}, "yarn"),
])
def test_rope_scaling_metadata_becomes_rope_scaling(tmp_path, arch, meta, want_type):
    """`rope.scaling.type` linear / yarn: the converted config's scaling gives the rate llama.cpp
    rotates at (its formula, written out above), and tevjax and transformers run the converted
    checkpoint to the same logits at positions past the original context."""
    import jax.numpy as jnp
    import torch
    import transformers

    from tevjax.convert.hf import load_hf_target
    from tevjax.models import KVCache
    from tevjax.models.layers import Rope

    path = write_gguf(tmp_path / "rs.gguf", tiny_state(seed=3, arch=arch), arch=arch, meta_overrides=meta)
    cfg, _ = read_gguf(path)
    m = meta["rope_scaling_meta"]
    assert cfg["rope_scaling"]["rope_type"] == want_type and cfg["rope_scaling"]["factor"] == m["factor"]
    base = TINY["rope_theta"] ** (-np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
    if want_type == "linear":
        want, scale = base / m["factor"], 1.0
    else:
        context = m.get("original_context_length", TINY["max_position_embeddings"])
        want = llamacpp_yarn_inv_freq(HEAD_DIM, TINY["rope_theta"], m["factor"], context,
                                      m.get("yarn_beta_fast", 32.0), m.get("yarn_beta_slow", 1.0))
        scale = 0.1 * np.log(m["factor"]) + 1  # llama.cpp's mscale with attn_factor 1
        assert (want < base).any() and (want == base).any()  # the ramp leaves some rates alone
    out = gguf_to_hf_dir(path, tmp_path / "hf")
    _, target = load_hf_target(out)
    rope = Rope.of(HEAD_DIM, target.cfg.rope_theta, target.cfg.rope_scaling)
    np.testing.assert_allclose(rope.inv_freq, want, rtol=1e-6)
    assert rope.scale == pytest.approx(scale, rel=1e-6)

    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = np.arange(3, 3 + 48, dtype=np.int32)[None] * 7 % 270  # 48 positions, past the context of 32
    ours = target(jnp.asarray(ids), jnp.arange(ids.shape[1])[None], KVCache.init(target.cfg, 1, 64),
                  jnp.zeros((1,), jnp.int32), None).logits
    with torch.no_grad():
        theirs = model(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(np.asarray(ours), theirs, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("meta, match", [
    ({"rope_scaling_type": "longrope"}, r"rope scaling llama\.rope\.scaling\.type='longrope' is not supported"),
    ({"rope_scaling_type": "linear"}, r"type='linear' needs metadata llama\.rope\.scaling\.factor"),
    ({"rope_scaling_type": "linear", "rope_scaling_meta": {"factor": -2.0}}, r"factor should be a positive number"),
    ({"rope_scaling_type": "yarn", "rope_scaling_meta": {"factor": 4.0, "attn_factor": 2.0}},
     r"llama\.rope\.scaling\.attn_factor=2\.0 is not supported with yarn \(only 1\.0\)"),
    ({"rope_scaling_type": "yarn", "rope_scaling_meta": {"factor": 4.0, "yarn_log_multiplier": 0.1}},
     r"yarn_log_multiplier=0\.1.* is not supported with yarn"),
])
def test_rope_scaling_refused(tmp_path, meta, match):
    path = write_gguf(tmp_path / "rs.gguf", tiny_state(), meta_overrides=meta)
    with pytest.raises(GGUFError, match=r"rs\.gguf: " + ".*" + match):
        read_gguf(path)


def test_rope_scaling_and_rope_freqs_refused_together(tmp_path):
    divisors = llamacpp_rope_freqs(HEAD_DIM, TINY["rope_theta"], **LLAMA3_ROPE)
    path = write_gguf(tmp_path / "both.gguf", tiny_state(), extra_tensors={"rope_freqs.weight": divisors},
                      meta_overrides={"rope_scaling_type": "linear", "rope_scaling_meta": {"factor": 2.0}})
    with pytest.raises(GGUFError, match=r"both llama\.rope\.scaling\.type='linear' and tensor rope_freqs"):
        read_gguf(path)


# ------------------------------------------------------------------------------ gguf_to_hf_dir


def test_gguf_to_hf_dir_contents(tiny_file, tmp_path):
    from safetensors.numpy import load_file

    path, _ = tiny_file
    out = gguf_to_hf_dir(path, tmp_path / "hf")
    assert out == tmp_path / "hf"
    names = {p.name for p in out.iterdir()}
    assert names == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                     "generation_config.json", CONVERSION_MARKER}
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no temp directory left behind
    cfg, state = read_gguf(path)
    assert json.loads((out / "config.json").read_text()) == cfg
    saved = load_file(str(out / "model.safetensors"))
    assert set(saved) == set(state)
    for k, v in state.items():
        np.testing.assert_array_equal(saved[k], v, err_msg=k)
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"] == CHAT_TEMPLATE
    assert (tok_cfg["bos_token"], tok_cfg["eos_token"], tok_cfg["pad_token"]) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>")
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (1, 2)
    marker = json.loads((out / CONVERSION_MARKER).read_text())
    assert marker["source_size"] == path.stat().st_size
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes


def test_gguf_to_hf_dir_refuses_existing_and_overwrites(tiny_file, tmp_path):
    path, _ = tiny_file
    out = tmp_path / "hf"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    with pytest.raises(FileExistsError, match="hf"):
        gguf_to_hf_dir(path, out)
    gguf_to_hf_dir(path, out, overwrite=True)
    assert not (out / "stale.txt").exists()
    assert (out / CONVERSION_MARKER).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_failed_conversion_leaves_nothing(tmp_path):
    types = dict(TYPES, **{"model.embed_tokens.weight": Q.IQ4_NL})
    path = write_gguf(tmp_path / "bad.gguf", tiny_state(), types=types)
    with pytest.raises(GGUFError):
        gguf_to_hf_dir(path, tmp_path / "out" / "hf")
    # neither the output nor a temporary sibling of it exists
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_hf_dir_loads_in_transformers_like_the_gguf(tiny_file, tmp_path):
    """transformers reads the converted directory with no missing/unexpected keys, and its logits
    equal those of transformers' own GGUF load of the same file."""
    import torch
    import transformers
    path, _ = tiny_file
    out = gguf_to_hf_dir(path, tmp_path / "hf")
    ours, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), dtype=torch.float32, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    ids = torch.tensor([[1, 40, 7, 200, 3, 99, 12, 2]])
    with torch.no_grad():
        a = ours(ids).logits.numpy()
        b = theirs(ids).logits.numpy()
    np.testing.assert_array_equal(a, b)
