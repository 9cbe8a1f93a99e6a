"""Target models (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3, SmolLM3, Granite, OLMo 2-3, Mixtral, Qwen2/3-MoE,
OLMoE, Granite MoE, GPT-OSS, and the hybrid Qwen3-Next and Qwen3.5) and the primitives the drafter shares with
them."""

from tevjax.models.cache import KVCache, LinearState
from tevjax.models.config import PRESETS, ModelConfig, RopeScaling
from tevjax.models.layers import (NEG_INF, RMSNorm, Rope, SparseMoE, SwiGLU, apply_rope, attention, causal_mask,
                                  matmul_precision, rope_inv_freq, set_moe_dispatch)
from tevjax.models.transformer import (
    ForwardOutput,
    Transformer,
    forward,
    full_mask,
)

__all__ = [
    "NEG_INF",
    "PRESETS",
    "ForwardOutput",
    "KVCache",
    "LinearState",
    "ModelConfig",
    "RMSNorm",
    "Rope",
    "RopeScaling",
    "SparseMoE",
    "SwiGLU",
    "Transformer",
    "apply_rope",
    "attention",
    "causal_mask",
    "forward",
    "full_mask",
    "matmul_precision",
    "rope_inv_freq",
    "set_moe_dispatch",
]
