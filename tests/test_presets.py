"""Full-size presets build abstractly (`nnx.eval_shape`, no weights allocated), have the published
parameter counts, and trace a forward pass with the expected output shapes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from tevjax.models import PRESETS, KVCache, Transformer, forward

# Published totals (model cards / safetensors metadata of the HF checkpoints).
PUBLISHED = {
    "qwen3-4b": 4.0e9,  # Qwen/Qwen3-4B: "Number of Parameters: 4.0B"
    "qwen3-8b": 8.2e9,  # Qwen/Qwen3-8B: "Number of Parameters: 8.2B"
    "llama-3.1-8b": 8.03e9,  # meta-llama/Llama-3.1-8B: 8.03B
    "qwen2.5-7b": 7.61e9,  # Qwen/Qwen2.5-7B-Instruct: "Number of Parameters: 7.61B"
    "mistral-7b-v0.3": 7.25e9,  # mistralai/Mistral-7B-Instruct-v0.3: 7.25B (safetensors metadata)
    "smollm2-135m": 134.5e6,  # HuggingFaceTB/SmolLM2-135M: 134.5M (card rounds to 135M)
    "gemma-2-9b": 9.24e9,  # google/gemma-2-9b: 9.24B (safetensors metadata)
    "gemma-3-1b": 1.0e9,  # google/gemma-3-1b-it: "1B"
    "mixtral-8x7b": 46.7e9,  # mistralai/Mixtral-8x7B-Instruct-v0.1: 46.7B (safetensors metadata)
    "qwen3-30b-a3b": 30.5e9,  # Qwen/Qwen3-30B-A3B: "30.5B in total"
    "olmoe-1b-7b": 6.92e9,  # allenai/OLMoE-1B-7B-0924: 6.92B (safetensors metadata); the paper's "6.9B"
    "gpt-oss-20b": 20.91e9,  # openai/gpt-oss-20b: the model card's "20.91B" total
}
# ... and what one token reads, for the mixture-of-experts presets (the others: the total).
ACTIVE = {"mixtral-8x7b": 12.9e9, "qwen3-30b-a3b": 3.3e9,  # Mistral's "12.9B active"; Qwen's "3.3B activated"
          "olmoe-1b-7b": 1.3e9,  # the OLMoE paper's "1.3B active"
          # the model card's 3.61B active leaves out the embedding table (a token reads one row of it),
          # which one token's pass here counts whole, as Qwen's and Mistral's figures do
          "gpt-oss-20b": 3.61e9 + 201088 * 2880}


def test_presets_listed():
    assert set(PRESETS) == set(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_parameter_count(name):
    cfg = PRESETS[name]
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    leaves = [v.get_value() for _, v in nnx.iter_graph(abstract) if isinstance(v, nnx.Param)]
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves), "eval_shape must not allocate"
    assert all(x.dtype == jnp.dtype(cfg.param_dtype) for x in leaves)
    count = sum(x.size for x in leaves)
    assert count == cfg.num_params
    assert abs(count - PUBLISHED[name]) / PUBLISHED[name] < 0.01, (name, count)
    active = ACTIVE.get(name, PUBLISHED[name])
    assert abs(cfg.num_active_params - active) / active < 0.02, (name, cfg.num_active_params)
    if cfg.tie_word_embeddings:
        assert abstract.lm_head is None
    # Layers are stacked for the scan: one leading axis of size L on every layer parameter.
    assert abstract.layers.self_attn.q_proj.kernel.get_value().shape == (
        cfg.num_layers, cfg.hidden_size, cfg.num_heads * cfg.head_dim)


@pytest.mark.parametrize("name,layers", [("qwen3-8b", (1, 9, 17, 25, 33)), ("llama-3.1-8b", (1, 8, 15, 22, 29)),
                                         ("qwen3-30b-a3b", (1, 12, 23, 34, 45)), ("gpt-oss-20b", (1, 6, 11, 16, 21))])
def test_preset_forward_traces(name, layers):
    """A 64-node tree pass over a 4096-slot cache, traced only (DFlash target layer ids)."""
    cfg = PRESETS[name]
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    b, t, s = 2, 64, 4096
    cache = jax.eval_shape(lambda: KVCache.init(cfg, b, s))
    out = jax.eval_shape(
        lambda st, c: forward(graphdef, st, jnp.zeros((b, t), jnp.int32), jnp.zeros((b, t), jnp.int32), c,
                              jnp.zeros((b,), jnp.int32), jnp.ones((b, t, t), bool), hidden_layers=layers),
        state, cache)
    assert out.logits.shape == (b, t, cfg.vocab_size) and out.logits.dtype == jnp.float32
    assert out.hidden.shape == (b, t, len(layers), cfg.hidden_size) and out.hidden.dtype == jnp.bfloat16
    assert out.final_hidden.shape == (b, t, cfg.hidden_size)
    assert out.cache.k.shape == (cfg.num_layers, b, cfg.num_kv_heads, s, cfg.head_dim)
    assert out.cache.k.dtype == jnp.bfloat16
