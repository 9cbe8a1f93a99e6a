"""tevjax target model vs transformers (torch CPU, float32) on tiny random checkpoints.

Each HF model is built locally from a config, its norm weights randomised (HF initialises them
to ones, which would hide a mis-mapped norm), saved with `save_pretrained` (safetensors) and
loaded back through `tevjax.convert.load_hf_target`. Tolerances are fixed: 1e-4 whole model,
1e-5 per module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import torch  # noqa: E402  (test dependency, installed by the Makefile)
import transformers  # noqa: E402

from flax import nnx  # noqa: E402

from tevjax.convert import load_hf_target  # noqa: E402
from tevjax.models import (  # noqa: E402
    NEG_INF,
    KVCache,
    RMSNorm,
    RopeScaling,
    apply_rope,
    attention,
    causal_mask,
    forward,
    rope_inv_freq,
)

FWD = jax.jit(forward, static_argnames=("graphdef", "hidden_layers", "compute_logits"))

BASE = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
            max_position_embeddings=256, initializer_range=0.1, bos_token_id=1, eos_token_id=2)

VARIANTS = {
    # Plain Llama, untied head.
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(tie_word_embeddings=False, rope_theta=10000.0)),
    # Llama-3 rope scaling (original length 64 puts the 16-dim head's frequencies in all three
    # bands: kept, interpolated and divided), attention biases, untied head.
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM",
                    dict(tie_word_embeddings=False, rope_theta=10000.0, attention_bias=True,
                         rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=64))),
    # Qwen3: q/k norm, tied embeddings, head_dim (32) != hidden / heads (16).
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(tie_word_embeddings=True, head_dim=32, rope_theta=1_000_000.0)),
    # Qwen2 (Qwen2.5): biases on q/k/v but not o, tied embeddings.
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(tie_word_embeddings=True, rope_theta=1_000_000.0)),
    # Linear rope scaling (position interpolation), untied head.
    "llama-linear-rope": ("LlamaConfig", "LlamaForCausalLM",
                          dict(tie_word_embeddings=False, rope_theta=10000.0,
                               rope_scaling=dict(rope_type="linear", factor=4.0))),
    # YaRN (Qwen3's long-context setting): with head size 32, theta 1e4 and an original length of
    # 64 the ramp spans dimensions 0-5 of 16, and q and k are scaled by 0.1 ln 4 + 1.
    "qwen3-yarn": ("Qwen3Config", "Qwen3ForCausalLM",
                   dict(tie_word_embeddings=True, head_dim=32, rope_theta=10000.0,
                        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64))),
    # Mistral (v0.2 onwards): Llama's layers with full attention; head_dim (8) given.
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(tie_word_embeddings=False, head_dim=8, sliding_window=None, rope_theta=1_000_000.0)),
    # Mistral-7B-v0.1's sliding window (every layer), 5 wide: the 13-token parity runs reach past it.
    "mistral-window": ("MistralConfig", "MistralForCausalLM",
                       dict(tie_word_embeddings=False, head_dim=8, sliding_window=5, rope_theta=1_000_000.0)),
    # Qwen2 with use_sliding_window: a 4-wide window in layers 1-2 (max_window_layers 1), layer 0 full.
    "qwen2-window": ("Qwen2Config", "Qwen2ForCausalLM",
                     dict(tie_word_embeddings=True, rope_theta=1_000_000.0, use_sliding_window=True, sliding_window=4,
                          max_window_layers=1)),
    # Gemma 2: zero-centred norms on both sides of attention and MLP, GeGLU, scaled embeddings,
    # scores scaled by query_pre_attn_scalar and soft-capped, capped logits, and a window in layers
    # 0 and 2. Caps of 2 and 3 bind often on these random weights (Gemma 2's own: 50 and 30).
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(tie_word_embeddings=True, head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
                    attn_logit_softcapping=2.0, final_logit_softcapping=3.0, rope_theta=10000.0,
                    attn_implementation="eager")),
    # Gemma 3's text model: Gemma 2's layers without caps, q/k norms, and two ropes: layers 0 and 1
    # slide (window 4, base 10^4), layer 2 attends fully with linearly scaled base-10^6 rope.
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(tie_word_embeddings=True, head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
                    sliding_window_pattern=3, rope_scaling=dict(rope_type="linear", factor=4.0),
                    attn_implementation="eager")),
    # Phi-3: Llama's layers with q/k/v and gate/up fused in the checkpoint, and Phi-3-mini-4k's
    # window on every layer (2047 there, 5 here).
    "phi3": ("Phi3Config", "Phi3ForCausalLM",
             dict(tie_word_embeddings=False, rope_theta=10000.0, sliding_window=5, pad_token_id=0)),
    # Mixtral: Mistral's layers with 4 experts of width 96, 2 per token, weights renormalised over
    # them; a 5-wide window on every layer (MixtralConfig's default is none).
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2, rope_theta=1_000_000.0,
                     sliding_window=5)),
    # Qwen3-MoE: Qwen3's layers with 6 experts of width 24, 3 per token, weights not renormalised
    # (norm_topk_prob false, Qwen3MoeConfig's default), tied head; use_sliding_window puts a
    # 4-wide window on every layer.
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(tie_word_embeddings=True, num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
                       norm_topk_prob=False, rope_theta=1_000_000.0, use_sliding_window=True, sliding_window=4)),
    # Qwen2-MoE: Qwen2's layers (q/k/v biases) with 4 experts of width 24, 2 per token, weights not
    # renormalised, and a shared expert of width 40 gated by a sigmoid; even layers below
    # max_window_layers 2 slide (use_sliding_window: layer 0, window 4); tied head.
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(tie_word_embeddings=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                       shared_expert_intermediate_size=40, rope_theta=1_000_000.0, use_sliding_window=True,
                       sliding_window=4, max_window_layers=2)),
    # SmolLM3: Llama's layers, layer 1 of 3 without rotary embedding (NoPE: no_rope_layer_interval 2),
    # and there a 4-wide window (use_sliding_window puts SmolLM3's windows in its NoPE layers); tied.
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM",
                dict(tie_word_embeddings=True, rope_theta=1_000_000.0, no_rope_layer_interval=2,
                     use_sliding_window=True, sliding_window=4, pad_token_id=0)),
    # Granite (3.x): Llama's layers with embeddings times 6, scores times 0.15 (not 16^-1/2), each
    # branch times 0.4 before the residual adds it, logits divided by 3; untied head.
    "granite": ("GraniteConfig", "GraniteForCausalLM",
                dict(tie_word_embeddings=False, rope_theta=10000.0, embedding_multiplier=6.0,
                     attention_multiplier=0.15, residual_multiplier=0.4, logits_scaling=3.0)),
    # OLMo 2: norms on the attention and MLP outputs and none on their inputs, q/k norms over each
    # whole projection (64 and 32 wide), biases on q/k/v/o (attention_bias); untied head.
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM",
              dict(tie_word_embeddings=False, rope_theta=500_000.0, attention_bias=True, pad_token_id=0)),
    # OLMo 3: OLMo 2's layers with a 4-wide window in layers 0 and 1 (layer 2 attends fully), which
    # rotate unscaled with base 10^4 while layer 2 rotates with YaRN-scaled base 5 x 10^5.
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM",
              dict(tie_word_embeddings=False, pad_token_id=0, sliding_window=4,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                   rope_parameters={"full_attention": dict(rope_type="yarn", rope_theta=500_000.0, factor=4.0,
                                                           original_max_position_embeddings=64),
                                    "sliding_attention": dict(rope_type="default", rope_theta=10_000.0)})),
    # OLMoE: Llama's pre-norm layers with OLMo's q/k norms over each whole projection (64 and 32
    # wide), 4 experts of width 96, 2 per token, weights not renormalised (OlmoeConfig's default);
    # untied head.
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                   rope_theta=10_000.0, pad_token_id=0)),
    # Granite MoE: Granite's multipliers (as "granite") with 4 experts of width 96, 2 per token,
    # stacked on disk (gate and up fused in input_linear), mixed by a softmax over the 2 highest
    # logits; untied head.
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM",
                   dict(tie_word_embeddings=False, rope_theta=10000.0, embedding_multiplier=6.0,
                        attention_multiplier=0.15, residual_multiplier=0.4, logits_scaling=3.0,
                        num_local_experts=4, num_experts_per_tok=2)),
    # GPT-OSS: attention sinks, q/k/v/o biases, a 4-wide window in layers 0 and 2 (layer_types'
    # default), YaRN unrounded (truncate false), 4 experts of width 96, 2 per token, with router and
    # expert biases and the clipped gate (limit 1.5 so that it clips); untied head.
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                     sliding_window=4, swiglu_limit=1.5, pad_token_id=0,
                     rope_parameters=dict(rope_type="yarn", rope_theta=150_000.0, factor=4.0, beta_fast=32.0,
                                          beta_slow=1.0, truncate=False, original_max_position_embeddings=64))),
}
EXPERTS = {"mixtral": (4, 2, True, 96), "qwen3-moe": (6, 3, False, 24),  # E, k, norm_topk_prob, width
           "qwen2-moe": (4, 2, False, 24), "olmoe": (4, 2, False, 96), "granitemoe": (4, 2, True, 96),
           "gpt-oss": (4, 2, True, 96)}

HEAD_DIM = {"qwen3": 32, "qwen3-yarn": 32, "mistral": 8, "mistral-window": 8}
WINDOWS = {"mistral-window": (5, (0, 1, 2)), "qwen2-window": (4, (1, 2)), "gemma2": (4, (0, 2)), "gemma3": (4, (0, 1)),
           "phi3": (5, (0, 1, 2)), "mixtral": (5, (0, 1, 2)), "qwen3-moe": (4, (0, 1, 2)), "smollm3": (4, (1,)),
           "qwen2-moe": (4, (0,)),
           "olmo3": (4, (0, 1)), "gpt-oss": (4, (0, 2))}
# The generation test's weights: seed 0 unless its answers never repeat (then no round would take
# more than one token, and tree nodes below the root would go unchecked).
GENERATE_SEED = {"olmo3": 3}
ROPE_TYPE = {"llama3-rope": "llama3", "llama-linear-rope": "linear", "qwen3-yarn": "yarn", "gemma3": "linear",
             "olmo3": "yarn", "gpt-oss": "yarn"}


def build_hf(variant: str, seed: int = 0):
    cfg_cls, model_cls, extra = VARIANTS[variant]
    config = getattr(transformers, cfg_cls)(**BASE, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):  # a router: decisive picks (Qwen3-MoE's starts at zero)
                p.copy_(torch.randn_like(p) / 4.0)
            elif name.endswith("bias"):  # GPT-OSS's expert biases (`*_proj_bias`) start at zero too
                p.copy_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=list(VARIANTS))
def hf_pair(request, tmp_path_factory):
    hf = build_hf(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    cfg, model = load_hf_target(path)
    return request.param, hf, cfg, model


def test_config_translation(hf_pair):
    variant, hf, cfg, _ = hf_pair
    assert cfg.architecture == VARIANTS[variant][0].removesuffix("Config").lower().replace(
        "gemma3text", "gemma3_text").replace("qwen3moe", "qwen3_moe").replace("qwen2moe", "qwen2_moe").replace(
        "gptoss", "gpt_oss")
    assert cfg.num_layers == 3 and cfg.num_kv_heads == 2 and cfg.vocab_size == 300
    assert cfg.head_dim == HEAD_DIM.get(variant, 16)
    assert cfg.qk_norm == variant.startswith(("qwen3", "gemma3", "olmo"))
    assert (cfg.input_norms, cfg.qk_norm_whole) == {"olmoe": (True, True)}.get(
        variant, (False, True) if variant.startswith("olmo") else (True, False))
    assert cfg.tie_word_embeddings == variant.startswith(("qwen", "gemma", "smollm3"))
    assert cfg.nope_layers == ((1,) if variant == "smollm3" else ())
    assert cfg.attention_bias == (variant in ("llama3-rope", "olmo2", "gpt-oss"))
    assert cfg.qkv_biased == variant.startswith(("llama3-rope", "qwen2", "olmo2", "gpt-oss"))
    assert cfg.shared_expert_size == (40 if variant == "qwen2-moe" else 0)
    biases = {k.split(".", 3)[-1] for k in hf.state_dict() if k.endswith(".bias") and ".mlp." not in k}
    assert biases == ({"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"} if cfg.qkv_biased
                      else set()) | ({"self_attn.o_proj.bias"} if cfg.attention_bias else set()), biases
    assert (cfg.rope_scaling and cfg.rope_scaling.rope_type) == ROPE_TYPE.get(variant)
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    assert (cfg.sliding_window, cfg.sliding_layers) == WINDOWS.get(variant, (None, ()))
    gemma = variant.startswith("gemma")
    assert (cfg.hidden_act, cfg.query_pre_attn_scalar, cfg.attn_softcap, cfg.final_softcap) == {
        "gemma2": ("gelu_tanh", 24.0, 2.0, 3.0), "gemma3": ("gelu_tanh", 24.0, None, None)}.get(
        variant, ("silu", None, None, None))
    assert (cfg.norm_offset, cfg.output_norms, cfg.embed_scale) == (
        (1.0, True, 8.0) if gemma else (0.0, variant in ("olmo2", "olmo3"), 6.0 if variant.startswith("granite")
                                        else None))
    plain = (24 ** -0.5 if gemma else cfg.head_dim ** -0.5, None, None)
    assert (cfg.attention_scale, cfg.residual_multiplier, cfg.logits_scaling) == (
        (0.15, 0.4, 3.0) if variant.startswith("granite") else plain)
    assert (cfg.rope_theta, cfg.local_rope_theta) == {"gemma3": (1e6, 1e4), "olmo3": (5e5, 1e4)}.get(
        variant, (cfg.rope_theta, None))
    assert (cfg.num_experts, cfg.experts_per_token, cfg.norm_topk_prob, cfg.intermediate_size) == EXPERTS.get(
        variant, (0, 0, True, 96))
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


def test_whole_model_parity(hf_pair):
    """Every decoder layer's output and the logits match HF within 1e-4 (two rows, 13 tokens)."""
    _, hf, cfg, model = hf_pair
    rng = np.random.default_rng(0)
    b, t = 2, 13
    tokens = rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32)
    with torch.no_grad():
        ref = hf(torch.from_numpy(tokens.astype(np.int64)), output_hidden_states=True)
    ref_hidden = [h.numpy() for h in ref.hidden_states]
    ref_logits = ref.logits.numpy()

    graphdef, state = nnx.split(model)
    out = FWD(graphdef, state, jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
              KVCache.init(cfg, b, 16), jnp.zeros((b,), jnp.int32), jnp.broadcast_to(causal_mask(t), (b, t, t)),
              hidden_layers=tuple(range(cfg.num_layers)))
    assert out.logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out.logits), ref_logits, atol=1e-4, rtol=0)
    for i in range(cfg.num_layers - 1):
        np.testing.assert_allclose(np.asarray(out.hidden[:, :, i]), ref_hidden[i + 1], atol=1e-4, rtol=0,
                                   err_msg=f"decoder layer {i}")
    # transformers reports the last entry after the final norm; tevjax's final_hidden is that.
    np.testing.assert_allclose(np.asarray(out.final_hidden), ref_hidden[-1], atol=1e-4, rtol=0)
    # ... and the raw last-layer output, normed, is the same thing.
    np.testing.assert_allclose(np.asarray(jax.jit(model.norm)(out.hidden[:, :, -1])), ref_hidden[-1],
                               atol=1e-4, rtol=0)
    # Embedding output (HF hidden_states[0]).
    np.testing.assert_allclose(np.asarray(jax.jit(model.embed)(jnp.asarray(tokens))), ref_hidden[0], atol=1e-6, rtol=0)


def test_jit_matches_eager():
    """The split/merge jitted form gives the same logits as the eager module call."""
    from tevjax.testing import random_model, tiny_config

    cfg = tiny_config("qwen3")
    model = random_model(cfg, seed=7)
    b, t = 1, 7
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (b, t)), jnp.int32)
    args = (tokens, jnp.arange(t, dtype=jnp.int32)[None], KVCache.init(cfg, b, 8),
            jnp.zeros((1,), jnp.int32), causal_mask(t)[None])
    eager = model(*args).logits
    graphdef, state = nnx.split(model)
    out = FWD(graphdef, state, *args)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(eager), atol=1e-5, rtol=0)


# ------------------------------------------------------------------------- per-module, 1e-5


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_experts_dispatches_equal_a_per_token_reference(norm_topk_prob):
    """Both dispatches of `SparseMoE` (every expert on every token; tokens grouped by expert through
    `ragged_dot`) equal a float64 per-token loop: the k most probable experts (ties: the lower
    index), their softmax weights renormalised over the k or not, their SwiGLU outputs mixed. One
    row's router is zeroed by its input, so all its experts tie."""
    from tevjax.models.layers import SparseMoE, set_moe_dispatch

    d, f, e, k = 16, 24, 5, 2
    moe = SparseMoE(d, f, e, k, norm_topk_prob=norm_topk_prob, dtype="float32", param_dtype="float32",
                    rngs=nnx.Rngs(3))
    x = np.random.default_rng(4).standard_normal((2, 7, d)).astype(np.float32)
    x[1, 3] = 0.0  # router logits all 0: a four-way tie past the first pick
    w_r, gate, up, down = (np.asarray(a, np.float64) for a in (moe.router.kernel[...], moe.gate_proj[...],
                                                              moe.up_proj[...], moe.down_proj[...]))
    want = np.zeros(x.shape)
    for idx in np.ndindex(*x.shape[:2]):
        v = x[idx].astype(np.float64)
        logits = v @ w_r
        p = np.exp(logits - logits.max())
        p /= p.sum()
        picked = sorted(range(e), key=lambda j: (-p[j], j))[:k]
        weights = p[picked] / (p[picked].sum() if norm_topk_prob else 1.0)
        for j, wj in zip(picked, weights):
            g = v @ gate[j]
            want[idx] += wj * ((g / (1 + np.exp(-g))) * (v @ up[j])) @ down[j]
    graphdef, state = nnx.split(moe)
    for dispatch in ("dense", "ragged", "auto"):
        got = jax.jit(lambda st, x: nnx.merge(graphdef, st)(x, dispatch=dispatch))(state, jnp.asarray(x))
        assert got.shape == x.shape and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=0, err_msg=dispatch)
    with pytest.raises(ValueError, match="dispatch='sparse' is not one of"):
        moe(jnp.asarray(x), dispatch="sparse")
    with pytest.raises(ValueError, match="dispatch='grouped' is not one of"):
        set_moe_dispatch(moe, "grouped")
    assert moe.dispatch == "auto"  # a refused name changes nothing
    # A call naming none runs the module's own dispatch, which is part of the graph definition (so
    # a program traced for one is never reused for the other).
    assert set_moe_dispatch(moe, "ragged") == 1 and moe.dispatch == "ragged"
    assert nnx.graphdef(moe) != graphdef
    np.testing.assert_allclose(np.asarray(moe(jnp.asarray(x))), want, atol=1e-5, rtol=0)
    moe.dispatch = "grouped"  # set past the check: the call names it
    with pytest.raises(ValueError, match="dispatch='grouped' is not one of"):
        moe(jnp.asarray(x))


def test_biased_clipped_experts_dispatches_agree():
    """GPT-OSS's experts (router, gate, up and down biases, the clipped gate) sum the same under both
    dispatches: the parity models run only "dense" on CPU, so this is what checks "ragged"'s per-row
    pick of the gate and up biases. Biases are drawn at 0.5 so that each one moves the result."""
    from tevjax.models.layers import SparseMoE

    moe = SparseMoE(16, 24, 5, 2, norm_topk_prob=True, dtype="float32", param_dtype="float32", rngs=nnx.Rngs(5),
                    bias=True, swiglu_limit=1.0)
    rng = np.random.default_rng(6)
    for p in (moe.router.bias, moe.gate_bias, moe.up_bias, moe.down_bias):
        p[...] = jnp.asarray(0.5 * rng.standard_normal(p[...].shape), jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 7, 16)), jnp.float32)
    graphdef, state = nnx.split(moe)
    run = jax.jit(lambda st, x, dispatch: nnx.merge(graphdef, st)(x, dispatch=dispatch), static_argnums=2)
    np.testing.assert_allclose(np.asarray(run(state, x, "ragged")), np.asarray(run(state, x, "dense")), atol=1e-5,
                               rtol=0)


def test_rmsnorm_zero_centred_init_multiplies_by_one():
    """A new norm with Gemma's offset stores zeros and so scales by 0 + 1, as a plain norm's ones do:
    `tiny_config` models and new drafters for a Gemma target start from that init."""
    x = jnp.asarray(np.random.default_rng(7).normal(size=(2, 3, 24)) * 3, jnp.float32)
    plain = RMSNorm(24, eps=1e-6, dtype="float32", param_dtype="float32")
    gemma = RMSNorm(24, eps=1e-6, dtype="float32", param_dtype="float32", offset=1.0)
    assert not np.asarray(gemma.scale[...]).any() and (np.asarray(plain.scale[...]) == 1).all()
    want = np.asarray(x) / np.sqrt((np.asarray(x) ** 2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(np.asarray(gemma(x)), want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(plain(x)), want, atol=1e-5, rtol=0)


def test_gemma_embedding_scale_is_rounded_to_the_weights_dtype():
    """Gemma multiplies embeddings by sqrt(D) rounded to the weights' dtype, as transformers' bf16
    tensor is: sqrt(48) = 6.928... is 6.9375 in bf16 (0.14% off, which bf16 checkpoints' logits show).
    The parity models' sqrt(64) = 8 is exact in every dtype, so only this checks the rounding."""
    from tevjax.testing import random_model, tiny_config

    model = random_model(tiny_config("gemma2", hidden_size=48, param_dtype="bfloat16"), seed=1)
    table = np.asarray(model.embed_tokens.embedding[...].astype(jnp.float32))[:12]
    got = np.asarray(jax.jit(model.embed)(jnp.arange(12, dtype=jnp.int32)), np.float32)
    np.testing.assert_array_equal(got, table * np.float32(6.9375))


def test_rmsnorm_matches_hf():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    rng = np.random.default_rng(2)
    x = rng.normal(size=(3, 5, 24)).astype(np.float32) * 3
    w = (1 + 0.3 * rng.normal(size=(24,))).astype(np.float32)
    ref_mod = Qwen3RMSNorm(24, eps=1e-6)
    with torch.no_grad():
        ref_mod.weight.copy_(torch.from_numpy(w))
        ref = ref_mod(torch.from_numpy(x)).numpy()
    ours = RMSNorm(24, eps=1e-6, dtype="float32", param_dtype="float32")
    ours.scale[...] = jnp.asarray(w)
    np.testing.assert_allclose(np.asarray(ours(jnp.asarray(x))), ref, atol=1e-5, rtol=0)
    # bf16 in, bf16 out (statistics are still float32).
    assert ours(jnp.asarray(x, jnp.bfloat16)).dtype == jnp.bfloat16


ROPE_SCALINGS = {
    "none": None,
    # original length 64 puts the 16-dim head's frequencies in all three bands
    "llama3": dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64),
    "linear": dict(rope_type="linear", factor=4.0),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
    # every YaRN option set: a ramp with fractional ends, and an attention factor of its own
    "yarn-options": dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=128, beta_fast=16.0,
                         beta_slow=2.0, attention_factor=1.3, truncate=False),
    # transformers' DeepSeek form: the attention factor from mscale and mscale_all_dim
    "yarn-mscale": dict(rope_type="yarn", factor=16.0, original_max_position_embeddings=32, mscale=1.0,
                        mscale_all_dim=0.5),
    # mscale without mscale_all_dim: transformers ignores it (the attention factor is mscale(factor))
    "yarn-mscale-only": dict(rope_type="yarn", factor=16.0, original_max_position_embeddings=32, mscale=2.0),
    # an original length of 4 puts both ends of the ramp below dimension 0: clamped there, the ramp has
    # zero width, which transformers widens by 0.001 (else dimension 0 would be 0 / 0)
    "yarn-zero-width": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=4),
    # a ramp from dimension 3 to 17, whose top end clamps to head_dim - 1 = 15 (a steeper ramp)
    "yarn-clamped-top": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=2**30, beta_fast=2.0**22),
}


@pytest.mark.parametrize("kind", list(ROPE_SCALINGS))
def test_rope_matches_hf(kind):
    """tevjax's frequencies and rotated q equal transformers' for each rope scaling, at positions
    up to 250 (past every original length); the attention factor is on the rotated values, as
    transformers puts it on cos and sin."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    from tevjax.models import ModelConfig
    from tevjax.models.layers import Rope

    hf_scaling = ROPE_SCALINGS[kind]
    extra = {} if hf_scaling is None else dict(rope_scaling=dict(hf_scaling))
    config = transformers.LlamaConfig(**{**BASE, "num_hidden_layers": 1}, rope_theta=10000.0, **extra)
    scaling = ModelConfig.from_hf_config(config.to_dict()).rope_scaling
    assert (scaling and scaling.rope_type) == (hf_scaling and hf_scaling["rope_type"])
    emb = LlamaRotaryEmbedding(config)
    rope = Rope.of(16, 10000.0, scaling)
    np.testing.assert_allclose(rope.inv_freq, emb.inv_freq.numpy(), rtol=1e-6, atol=0)
    assert rope.scale == pytest.approx(emb.attention_scaling, rel=1e-12)
    if scaling is not None:  # the scaling really changed the low frequencies
        assert not np.allclose(rope.inv_freq, rope_inv_freq(16, 10000.0, None))
    assert (rope.scale != 1.0) == kind.startswith("yarn")

    rng = np.random.default_rng(3)
    b, t, h, dh = 2, 9, 4, 16
    q = rng.normal(size=(b, t, h, dh)).astype(np.float32)
    pos = rng.integers(0, 250, (b, t))
    with torch.no_grad():
        cos, sin = emb(torch.from_numpy(q), torch.from_numpy(pos))
        # HF layout is [B, H, T, Dh]; unsqueeze_dim=1 broadcasts cos over heads.
        ref, _ = apply_rotary_pos_emb(torch.from_numpy(q).transpose(1, 2), torch.from_numpy(q).transpose(1, 2),
                                      cos, sin)
    ours = apply_rope(jnp.asarray(q), jnp.asarray(pos, jnp.int32), *rope)
    # 1e-5 of float32 angle rounding, grown by the attention factor like the values themselves
    np.testing.assert_allclose(np.asarray(ours), ref.transpose(1, 2).numpy(), atol=1e-5 * max(rope.scale, 1), rtol=0)


def test_rope_scaling_round_trips_and_refusals():
    """Each scaling's HF dict reads back to the same value; YaRN fills transformers' defaults; a
    field of another type, a missing one or an unknown type is refused by name."""
    from tevjax.models import ModelConfig

    for kind, hf_scaling in ROPE_SCALINGS.items():
        if hf_scaling is None:
            continue
        cfg = ModelConfig.from_hf_config(transformers.LlamaConfig(**BASE, rope_scaling=dict(hf_scaling)).to_dict())
        assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg, kind
        assert cfg.to_hf_config()["rope_scaling"]["rope_type"] == hf_scaling["rope_type"]
    yarn = RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)
    assert (yarn.beta_fast, yarn.beta_slow, yarn.truncate) == (32.0, 1.0, True)
    assert yarn.attention_factor == pytest.approx(0.1 * np.log(4.0) + 1)
    # YaRN without an original length: transformers' default, max_position_embeddings (256 here).
    cfg = ModelConfig.from_hf_config({**transformers.LlamaConfig(**BASE).to_dict(),
                                      "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    assert cfg.rope_scaling.original_max_position_embeddings == 256
    # YaRN without a factor (absent or null): transformers' default, max_position_embeddings over the original
    # length (256 / 64), which also sets the attention factor.
    for factor in ({}, {"factor": None}):
        cfg = ModelConfig.from_hf_config({**transformers.LlamaConfig(**BASE).to_dict(), "rope_scaling": {
            "rope_type": "yarn", "original_max_position_embeddings": 64, **factor}})
        assert cfg.rope_scaling.factor == 4.0, factor
        assert cfg.rope_scaling.attention_factor == pytest.approx(0.1 * np.log(4.0) + 1)
    for kw, match in [(dict(rope_type="linear", factor=2.0, beta_fast=4.0), "'linear' has no beta_fast"),
                      (dict(rope_type="llama3", factor=2.0), "'llama3' needs low_freq_factor"),
                      (dict(rope_type="llama3", factor=2.0, low_freq_factor=4.0, high_freq_factor=1.0,
                            original_max_position_embeddings=8), "low_freq_factor=4.0 must be below high_freq_factor"),
                      (dict(rope_type="yarn", factor=0.0, original_max_position_embeddings=8),
                       "factor must be a positive"),
                      (dict(rope_type="yarn", factor=2.0, original_max_position_embeddings=8, truncate=1),
                       "truncate must be true or false"),
                      (dict(rope_type="dynamic", factor=2.0), "'dynamic' is not supported")]:
        with pytest.raises(ValueError, match=match):
            RopeScaling(**kw)
    with pytest.raises(ValueError, match=r"rope_type 'longrope' is not supported \(only 'default', 'llama3'"):
        ModelConfig.from_hf_config({**transformers.LlamaConfig(**BASE).to_dict(),
                                    "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})


def test_attention_matches_torch_sdpa():
    rng = np.random.default_rng(4)
    b, t, s, h, k, dh = 2, 5, 11, 6, 2, 8
    q = rng.normal(size=(b, t, h, dh)).astype(np.float32)
    kk = rng.normal(size=(b, s, k, dh)).astype(np.float32)
    v = rng.normal(size=(b, s, k, dh)).astype(np.float32)
    mask = rng.random((b, t, s)) < 0.6
    mask[..., 0] = True  # torch SDPA returns NaN for fully masked rows; keep one key per row
    rep = h // k  # HF repeat_kv: query head j reads kv head j // rep
    with torch.no_grad():
        ref = torch.nn.functional.scaled_dot_product_attention(
            torch.from_numpy(q).transpose(1, 2),
            torch.from_numpy(kk).transpose(1, 2).repeat_interleave(rep, dim=1),
            torch.from_numpy(v).transpose(1, 2).repeat_interleave(rep, dim=1),
            attn_mask=torch.from_numpy(mask)[:, None],
        ).transpose(1, 2).numpy()
    # tevjax's caches are heads-major: [B, K, S, Dh]
    ours = attention(jnp.asarray(q), jnp.asarray(kk).swapaxes(1, 2), jnp.asarray(v).swapaxes(1, 2), jnp.asarray(mask))
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-5, rtol=0)


def test_attention_fully_masked_row_is_finite():
    """A padding row with no visible key gives a finite (uniform) average, never NaN."""
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.normal(size=(1, 2, 2, 4)), jnp.bfloat16)
    kv = jnp.asarray(rng.normal(size=(1, 1, 3, 4)), jnp.bfloat16)  # [B, K, S, Dh]
    mask = jnp.asarray([[[True, False, True], [False, False, False]]])
    out = attention(q, kv, kv, mask)
    assert out.dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(out, np.float32)).all()
    np.testing.assert_allclose(np.asarray(out[0, 1], np.float32),
                               np.broadcast_to(np.asarray(kv, np.float32)[0, 0].mean(0), (2, 4)), atol=2e-2)
    assert NEG_INF > float(jnp.finfo(jnp.float32).min) / 2 and NEG_INF < -1e20


@pytest.mark.parametrize("variant", list(WINDOWS))
def test_windowed_causal_runs_and_tree_passes_match_hf(variant, tmp_path):
    """With sliding windows, what the decoder runs equals transformers on each path's own sequence:
    a prompt prefilled in two causal chunks (the second reads the first through the cache, past
    the window), then a tree pass over the cached prefix whose nodes sit at prefix + depth, two
    branches at each of the first two depths, one branch running past the window again."""
    hf = build_hf(variant)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    cfg, model = load_hf_target(tmp_path)
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(6)
    seq = rng.integers(3, cfg.vocab_size, 16).astype(np.int32)

    def hf_logits(tokens):
        with torch.no_grad():
            return hf(torch.from_numpy(np.asarray(tokens, np.int64))[None]).logits[0].numpy()

    cache, s = KVCache.init(cfg, 1, 32), 32
    prefill = []
    for start, end in ((0, 4), (4, 11)):  # chunks of 4 and 7 tokens
        t = end - start
        out = FWD(graphdef, state, jnp.asarray(seq[None, start:end]), jnp.arange(start, end, dtype=jnp.int32)[None],
                  cache, jnp.asarray([start], jnp.int32), None)
        cache = out.cache
        prefill.append(np.asarray(out.logits[0]))
    np.testing.assert_allclose(np.concatenate(prefill), hf_logits(seq[:11]), atol=1e-4, rtol=0)

    # Tree over the 10 cached tokens: node 0 = seq[10] (the root, depth 0), children seq[11] and a
    # stray token, under seq[11] seq[12] and another stray, then seq[13], seq[14] below seq[12].
    stray = [int(t) for t in rng.integers(3, cfg.vocab_size, 2)]
    tokens = [seq[10], seq[11], stray[0], seq[12], stray[1], seq[13], seq[14]]
    parents = [-1, 0, 0, 1, 1, 3, 5]
    depth, anc = [], np.zeros((7, 7), bool)
    for i, p in enumerate(parents):
        depth.append(0 if p < 0 else depth[p] + 1)
        anc[i] = anc[p] if p >= 0 else False
        anc[i, i] = True
    prefix = 10
    out = FWD(graphdef, state, jnp.asarray([tokens], jnp.int32), jnp.asarray([[prefix + d for d in depth]], jnp.int32),
              cache, jnp.asarray([prefix], jnp.int32), jnp.asarray(anc[None]))
    for i in range(7):
        path = [tokens[j] for j in range(7) if anc[i, j]]  # ancestors in depth order (parents come first)
        want = hf_logits(np.concatenate([seq[:prefix], path]))[-1]
        np.testing.assert_allclose(np.asarray(out.logits[0, i]), want, atol=1e-4, rtol=0, err_msg=f"node {i}")
    assert max(depth) + prefix + 1 > 2 * WINDOWS[variant][0]  # the deepest path reaches past two windows


def test_windowed_tree_node_sees_by_position_not_slot():
    """A tree node's window is over positions: an ancestor that sits at a later slot than its position
    (siblings took the slots before it) drops out of the window by its depth. Here node 4 (depth 2) sits
    at slot prefix + 4, and node 9 (depth 7) must not see it with window 4 (distance 5), as the causal
    run over its path does not; every node on that path gets the path's causal logits."""
    from tevjax.testing import random_model, tiny_config

    model = random_model(tiny_config("mistral", sliding_window=4, sliding_layers=(0, 1)), seed=2)
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(4)
    prefix, parents = 6, [-1, 0, 0, 0, 1, 4, 5, 6, 7, 8]  # nodes 2, 3: stray siblings of node 1
    tokens = rng.integers(3, 300, prefix + len(parents)).astype(np.int32)
    depth = [0] * len(parents)
    anc = np.eye(len(parents), dtype=bool)
    for i, par in enumerate(parents):
        if par >= 0:
            depth[i], anc[i] = depth[par] + 1, anc[i] | anc[par]
    pre = FWD(graphdef, state, jnp.asarray(tokens[None, :prefix]), jnp.arange(prefix, dtype=jnp.int32)[None],
              KVCache.init(model.cfg, 1, 32), jnp.zeros((1,), jnp.int32), None)
    positions = jnp.asarray([[prefix + d for d in depth]], jnp.int32)
    tree = FWD(graphdef, state, jnp.asarray(tokens[None, prefix:]), positions, pre.cache,
               jnp.asarray([prefix], jnp.int32), jnp.asarray(anc[None]))
    path = [i for i in range(len(parents)) if anc[9, i]]  # 0, 1, 4, ..., 9
    seq = np.concatenate([tokens[:prefix], tokens[prefix:][path]])
    ref = FWD(graphdef, state, jnp.asarray(seq[None]), jnp.arange(len(seq), dtype=jnp.int32)[None],
              KVCache.init(model.cfg, 1, 32), jnp.zeros((1,), jnp.int32), None)
    for node in path:
        np.testing.assert_allclose(np.asarray(tree.logits[0, node]), np.asarray(ref.logits[0, prefix + depth[node]]),
                                   atol=1e-4, rtol=0, err_msg=f"node {node}")


# Every window kind decodes in the slow suite; the default one runs Mistral's (every layer), Gemma
# 3's (some layers, two ropes) and Mixtral's (with experts), ~8 s each on 2 cores.
@pytest.mark.parametrize("variant", [v if v in ("mistral-window", "gemma3", "mixtral") else
                                     pytest.param(v, marks=pytest.mark.slow)
                                     for v in WINDOWS])
def test_windowed_decoding_equals_transformers_generate(variant, tmp_path):
    """Greedy decoding of a windowed target, autoregressive and speculative (TEV over a fresh
    drafter and the context chain: trees with several branches, and rounds of several tokens),
    gives transformers' greedy tokens, for prompts of two lengths in one batch whose answers run
    several windows long."""
    from tevjax.decode import DecodeConfig, Decoder
    from tevjax.models.dflash import DFlashConfig, DFlashDrafter

    hf = build_hf(variant, GENERATE_SEED.get(variant, 0))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    cfg, model = load_hf_target(tmp_path)
    prompts = [[5, 17, 42, 8, 99, 23, 61, 7, 150], [3, 250, 14, 77]]
    hf.generation_config.eos_token_id = None  # 20 tokens each; tevjax's DecodeConfig has no eos_ids either
    want = []
    for prompt in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=20, do_sample=False, pad_token_id=0)
        want.append(out[0, len(prompt):].tolist())
    assert [len(w) for w in want] == [20, 20]
    kw = dict(max_new_tokens=20, prompt_bucket=16, capacity=64)
    ar = Decoder(model, None, DecodeConfig(**kw)).generate(prompts)
    assert [g.tokens for g in ar] == want
    drafter = DFlashDrafter(DFlashConfig.for_target(cfg, num_layers=1, block_size=4, mask_token_id=299),
                            rngs=nnx.Rngs(1))
    spec = Decoder(model, drafter, DecodeConfig(verifier="tev", budget=8, lookup=8, **kw)).generate(prompts)
    assert [g.tokens for g in spec] == want
    # Some rounds take more than one token (the context chain finds the answers' repeats), so
    # windowed tree nodes below the root were accepted, not only the roots' own steps.
    assert sum(g.rounds for g in spec) < 40
