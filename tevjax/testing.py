"""Helpers for tests and examples: tiny configs and randomly initialised models (not for real use).

They live outside the model modules so the library's modules hold only what users run.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from tevjax.models.config import ModelConfig
from tevjax.models.transformer import Transformer

__all__ = ["forced_devices_env", "random_model", "tiny_config"]


def tiny_config(architecture: str = "llama", **overrides) -> ModelConfig:
    """A few-layer float32 config for tests (GQA 4/2 heads, vocab 300)."""
    fields = dict(
        architecture=architecture, vocab_size=300, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=architecture == "qwen3",
        qk_norm=architecture == "qwen3", qkv_bias=architecture == "qwen2", max_position_embeddings=256, eos_token_ids=(2,),
        bos_token_id=1,
    )
    if architecture == "gemma2":  # GeGLU, scores scaled by 24^-1/2 and capped, capped logits, tied head
        fields.update(hidden_act="gelu_tanh", query_pre_attn_scalar=24.0, attn_softcap=5.0, final_softcap=3.0,
                      tie_word_embeddings=True)
    if architecture == "gemma3_text":  # GeGLU, q/k norms, two ropes (layer 0 slides), tied head
        fields.update(hidden_act="gelu_tanh", query_pre_attn_scalar=24.0, qk_norm=True, tie_word_embeddings=True,
                      rope_theta=1_000_000.0, local_rope_theta=10_000.0, sliding_window=4, sliding_layers=(0,))
    if architecture in ("olmo2", "olmo3", "olmoe"):  # q/k norms over each projection (OLMo: output norms only)
        fields.update(qk_norm=True)
    if architecture == "olmo3":  # layer 0 slides and rotates with a rope of its own
        fields.update(sliding_window=4, sliding_layers=(0,), local_rope_theta=10_000.0, rope_theta=500_000.0)
    if architecture in ("granite", "granitemoe"):  # its four multipliers, none of them 1
        fields.update(embedding_multiplier=3.0, attention_multiplier=0.2, residual_multiplier=0.5, logits_scaling=2.0)
    if architecture == "smollm3":  # layer 1 without rotary embedding (NoPE), tied head
        fields.update(nope_layers=(1,), tie_word_embeddings=True)
    if architecture in ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "granitemoe"):  # 4 experts, 32 wide, 2 a token
        fields.update(intermediate_size=32, num_experts=4, experts_per_token=2,
                      qk_norm=architecture in ("qwen3_moe", "olmoe"), norm_topk_prob=architecture != "olmoe")
    if architecture == "gpt_oss":  # 4 experts, 32 wide, 2 a token; biases, sinks, a window in layer 0
        fields.update(intermediate_size=32, num_experts=4, experts_per_token=2, attention_bias=True, swiglu_limit=1.5,
                      swiglu_alpha=1.702, sliding_window=4, sliding_layers=(0,))
    if architecture == "qwen2_moe":  # Qwen2's q/k/v biases and a shared expert of width 48
        fields.update(qkv_bias=True, shared_expert_size=48)
    if architecture in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"):
        # Layer 0 Gated DeltaNet (2 key heads of 8, 4 value heads of 6, a 4-wide conv), layer 1 gated
        # attention rotating a quarter of each head; q/k norms; Qwen3-Next's and Qwen3.5-MoE's 4
        # experts, 32 wide, 2 a token, and a shared expert of width 48
        head_dim = overrides.get("head_dim", fields["head_dim"])
        fields.update(qk_norm=True, linear_layers=(0,), linear_key_heads=2, linear_value_heads=4, linear_key_dim=8,
                      linear_value_dim=6, linear_conv=4, rotary_dim=head_dim // 4)
        if architecture != "qwen3_5_text":
            fields.update(intermediate_size=32, num_experts=4, experts_per_token=2, shared_expert_size=48)
    fields.update(overrides)
    return ModelConfig(**fields)


def random_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A randomly initialised model for tests, filled from numpy (no per-op XLA compiles).

    Kernels ~ normal(0, 1/fan_in), embeddings ~ normal(0, 1/D) (so tied logits are O(1)), biases
    ~ normal(0, 0.1^2), and norms that scale by ~ 1 + normal(0, 0.1^2) rather than by ones, so a
    mis-mapped norm or q/k norm cannot go unnoticed.
    """
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(seed)
    dtype = jnp.dtype(cfg.param_dtype)
    for path, var in sorted(((tuple(map(str, p)), v) for p, v in nnx.iter_graph(model)
                             if isinstance(v, nnx.Param)), key=lambda pv: pv[0]):
        shape = var.get_value().shape
        name = path[-1]
        if name == "scale":
            # Centred so that every norm multiplies by ~1 + N(0, 0.1^2): a zero-centred family's norms add
            # their offset to the weight (Gemma, Qwen3-Next), a linear layer's gated norm does not.
            offset = 0.0 if "linear_attn" in path else cfg.norm_offset
            x = 1.0 - offset + 0.1 * rng.standard_normal(shape)
        elif name == "embedding":
            x = rng.standard_normal(shape) / np.sqrt(shape[-1])
        elif name == "bias" or name.endswith("_bias"):  # (GPT-OSS's experts' are gate_bias, ...)
            x = 0.1 * rng.standard_normal(shape)
        elif name == "sinks":  # GPT-OSS's sink logits, of the scores' size
            x = rng.standard_normal(shape)
        else:  # kernel [..., in, out]
            x = rng.standard_normal(shape) / np.sqrt(shape[-2])
        var.set_value(jnp.asarray(x, dtype))
    return model


def forced_devices_env(n: int) -> dict[str, str]:
    """The environment for a subprocess that sees `n` forced CPU devices. The caller's other XLA
    flags are kept (the test session sets some), as is everything else in its environment."""
    flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
    return {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags.strip()}
