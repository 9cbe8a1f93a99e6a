"""Decoder-only target model (Llama, Mistral, Qwen2, Qwen3, Gemma 2-3, Phi-3, Mixtral, Qwen2-MoE,
Qwen3-MoE, SmolLM3, Granite, OLMo 2-3, OLMoE, Granite MoE and GPT-OSS families, and the hybrid
Qwen3-Next and Qwen3.5) with a per-row KV cache.

One call handles prefill, single-token decode and the one-pass tree verification:

    out = model(tokens_BxT, positions_BxT, cache, write_pos_B, block_mask_BxTxT)

The K/V of the T new tokens go to cache slots `write_pos[b] + t`; query t sees every slot below
`write_pos[b]` (the committed prefix) and new slot `write_pos[b] + t'` iff `block_mask[b, t, t']`.
A tree pass passes `tree.ancestors` with positions `prefix_len + tree.depth`; a causal run
(prefill, one chunk of a prompt at a time) passes `block_mask=None`, which means the
lower-triangular block and takes `causal_attention`: no [T, S] mask or score matrix, keys read only
up to the run. Worked example of the combined [T, S] mask for one row with write_pos = 2, T = 3,
S = 6 and the tree block mask of a root with two children::

    block_mask        combined mask (slots 0-1 prefix, 2-4 new, 5 empty)
    [1 0 0]           [1 1 | 1 0 0 | 0]
    [1 1 0]     ->    [1 1 | 1 1 0 | 0]
    [1 0 1]           [1 1 | 1 0 1 | 0]

Sliding windows (`ModelConfig.sliding_window`, in `sliding_layers`) narrow this per layer: a
query at position p sees only keys at positions > p - window, the committed slot s holding
position s. A causal run's queries sit at slots write_pos + t, positions equal to slots.

Layers are stacked along a leading axis (created with `nnx.vmap`) and run under `jax.lax.scan`,
so a 36-layer model compiles one layer body. A hybrid model (Qwen3-Next, Qwen3.5) stacks its
Gated DeltaNet layers apart (`linear_layers`) and the scan steps over whole periods of its layer
pattern (three linear layers, then attention): one body of four layers. Its linear layers keep a
recurrent state in `KVCache.linear` instead of slots: a causal run advances it over the run's
`valid` tokens; a tree pass gives every node its root-to-node path's output
(`linear_attention.gated_delta` over the ancestor mask) and records what `KVCache.advance` needs to
run the accepted path into the state. Shape letters follow the legend in
`tevjax/__init__.py` (here T: the new tokens of one call).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tevjax.models.cache import KVCache, LinearState, write_layer
from tevjax.models.config import ModelConfig
from tevjax.models.layers import (RMSNorm, Rope, SparseMoE, SwiGLU, apply_rope, attention, causal_attention,
                                  matmul_precision, soft_cap)
from tevjax.models.linear_attention import (causal_conv, gated_delta, gated_delta_chunked, l2_normalize, last_inputs,
                                            tree_conv)

__all__ = [
    "Attention",
    "DecoderLayer",
    "ForwardOutput",
    "Transformer",
    "forward",
    "full_mask",
]

# On one CPU device, whether the layer scan takes each layer's weight slices just before their use
# (`Transformer.__call__`). Read when a forward is traced; `experiments/weight_slices.py` turns it
# off to measure what it is worth.
ORDER_WEIGHT_SLICES = True


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ForwardOutput:
    """Result of one `Transformer` call."""

    logits: jax.Array | None  # [B, T, V] float32, None when compute_logits=False
    hidden: jax.Array  # [B, T, R, D] output of decoder layer hidden_layers[r] (HF hidden_states[i+1])
    final_hidden: jax.Array  # [B, T, D] last layer output after the final norm
    cache: KVCache  # updated cache (new K/V written at write_pos + t)


class Attention(nnx.Module):
    """Grouped-query self-attention projections; Qwen3 adds per-head q/k RMSNorm before RoPE (OLMo
    one over each whole projection), Qwen2 (q/k/v) or Llama's `attention_bias` (q/k/v/o) add
    biases, and GPT-OSS attention sinks."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, h, k, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kw = dict(dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype), rngs=rngs)
        lin = dict(kw, precision=matmul_precision(cfg.dtype))
        self.num_heads, self.num_kv_heads, self.head_dim = h, k, dh
        self.scale, self.softcap = cfg.attention_scale, cfg.attn_softcap
        # Qwen3-Next: q_proj computes each head's query and then its output gate ([H, 2 * Dh] per token).
        self.gated = cfg.attn_output_gate
        self.rotary_dim = cfg.rotary_dim
        self.q_proj = nnx.Linear(d, h * dh * (2 if self.gated else 1), use_bias=cfg.qkv_biased, **lin)
        self.k_proj = nnx.Linear(d, k * dh, use_bias=cfg.qkv_biased, **lin)
        self.v_proj = nnx.Linear(d, k * dh, use_bias=cfg.qkv_biased, **lin)
        self.o_proj = nnx.Linear(h * dh, d, use_bias=cfg.attention_bias, **lin)
        whole, per_head = cfg.qk_norm_whole, cfg.qk_norm and not cfg.qk_norm_whole
        # OLMo's norm each projection's whole output, before it splits into heads; Qwen3's each head.
        self.q_proj_norm = RMSNorm(h * dh, eps=cfg.rms_norm_eps, **kw) if whole else None
        self.k_proj_norm = RMSNorm(k * dh, eps=cfg.rms_norm_eps, **kw) if whole else None
        self.q_norm = RMSNorm(dh, eps=cfg.rms_norm_eps, offset=cfg.norm_offset, **kw) if per_head else None
        self.k_norm = RMSNorm(dh, eps=cfg.rms_norm_eps, offset=cfg.norm_offset, **kw) if per_head else None
        # GPT-OSS: a learned logit per query head in each softmax's denominator (`layers.attention`).
        self.sinks = nnx.Param(jnp.zeros((h,), jnp.dtype(cfg.param_dtype))) if cfg.attention_sinks else None

    def qkv(self, x: jax.Array, positions: jax.Array, rope: Rope) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, T, D] -> q [B, T, H, Dh], k and v [B, T, K, Dh]; q and k rotated. With an output
        gate (Qwen3-Next) q is [B, T, H, 2 * Dh]: the rotated query, then the gate (`out` reads it)."""
        b, t, _ = x.shape
        q, k = self.q_proj(x), self.k_proj(x)
        if self.q_proj_norm is not None:
            q, k = self.q_proj_norm(q), self.k_proj_norm(k)
        q = q.reshape(b, t, self.num_heads, -1)
        q, gate = q[..., :self.head_dim], q[..., self.head_dim:]
        k = k.reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rotate(q, positions, rope), self._rotate(k, positions, rope)
        return (jnp.concatenate([q, gate], axis=-1) if self.gated else q), k, v

    def _rotate(self, x: jax.Array, positions: jax.Array, rope: Rope) -> jax.Array:
        if self.rotary_dim is None:
            return apply_rope(x, positions, *rope)
        r = self.rotary_dim  # Qwen3-Next rotates the leading part of each head and passes the rest
        return jnp.concatenate([apply_rope(x[..., :r], positions, *rope), x[..., r:]], axis=-1)

    def split_gate(self, q: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """`qkv`'s q -> (the query [B, T, H, Dh], the output gate [B, T, H, Dh] or None)."""
        if not self.gated:
            return q, None
        return q[..., :self.head_dim], q[..., self.head_dim:]

    def out(self, a: jax.Array, gate: jax.Array | None = None) -> jax.Array:
        """a [B, T, H, Dh] (times sigmoid(gate), where there is one) -> [B, T, D]."""
        b, t = a.shape[:2]
        if gate is not None:
            a = (a.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(a.dtype)
        return self.o_proj(a.reshape(b, t, self.num_heads * self.head_dim))


def _mlp(cfg: ModelConfig, kw: dict) -> nnx.Module:
    """A layer's MLP: routed experts in every layer (Mixtral, Qwen2/3-MoE, OLMoE, Granite MoE,
    GPT-OSS, Qwen3-Next) or one gated MLP."""
    if cfg.moe:
        gpt_oss = dict(bias=True, swiglu_limit=cfg.swiglu_limit, swiglu_alpha=cfg.swiglu_alpha)
        return SparseMoE(cfg.hidden_size, cfg.intermediate_size, cfg.num_experts, cfg.experts_per_token,
                         norm_topk_prob=cfg.norm_topk_prob, act=cfg.hidden_act, shared_size=cfg.shared_expert_size,
                         **(gpt_oss if cfg.expert_bias else {}), **kw)
    return SwiGLU(cfg.hidden_size, cfg.intermediate_size, act=cfg.hidden_act, **kw)


class DecoderLayer(nnx.Module):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(x)). With `cfg.output_norms` (Gemma)
    each branch's output is normed too: x + norm(attn(norm(x))), then + norm(mlp(norm(x))); OLMo
    norms only the outputs: x + norm(attn(x)), then + norm(mlp(x)); with
    Granite's residual_multiplier m each is scaled: x + m * attn(norm(x)), then + m * mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        kw = dict(dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype), rngs=rngs)
        norm = dict(eps=cfg.rms_norm_eps, offset=cfg.norm_offset, **kw)
        if cfg.input_norms:
            self.input_layernorm = RMSNorm(cfg.hidden_size, **norm)
            # The norm before the MLP, whatever a checkpoint calls it (Llama's post_attention_layernorm;
            # Gemma's pre_feedforward_layernorm, its post_attention_layernorm being attn_output_norm).
            self.post_attention_layernorm = RMSNorm(cfg.hidden_size, **norm)
        else:  # OLMo 2 and 3 norm no branch input
            self.input_layernorm = self.post_attention_layernorm = None
        self.self_attn = Attention(cfg, rngs=rngs)
        self.mlp = _mlp(cfg, kw)
        self.residual_multiplier = cfg.residual_multiplier
        if cfg.output_norms:
            self.attn_output_norm = RMSNorm(cfg.hidden_size, **norm)
            self.mlp_output_norm = RMSNorm(cfg.hidden_size, **norm)
        else:
            self.attn_output_norm = self.mlp_output_norm = None

    def _branch(self, y: jax.Array) -> jax.Array:
        """A branch's output as the residual adds it: times Granite's residual_multiplier."""
        if self.residual_multiplier is None:
            return y
        return (y.astype(jnp.float32) * self.residual_multiplier).astype(y.dtype)  # a float32 factor, as torch's

    def __call__(self, x, *, positions, rope, mask, cache_k, cache_v, layer, write_idx, write_pos,
                 window=None, distance=None, mlp=None):
        """One layer over the new tokens.

        x [B, T, D]; mask [B, T, S], or None for a causal run starting at slots write_pos [B];
        cache_k/v: the full [L, B, K, S, Dh] stacks (scan carry, so the write is an in-place
        scatter of T entries, not a copy of the layer's slab); layer: traced layer index;
        write_idx [B, T] slot of each new token (S = dropped). A model with sliding windows also
        passes window, the layer's (traced scalar, 0 = none), and distance [B, T, S], each query's
        position minus each slot's (for a mask; a causal run compares slots). mlp: None, or a
        function of the MLP's input that gives the MLP to run in place of self.mlp (the layer
        scan's, so that its weights are sliced once attention has run).
        """
        h = x if self.input_layernorm is None else self.input_layernorm(x)
        q, k, v = self.self_attn.qkv(h, positions, rope)
        q, gate = self.self_attn.split_gate(q)
        cache_k, cache_v = write_layer(cache_k, layer, write_idx, k), write_layer(cache_v, layer, write_idx, v)
        k_all = jax.lax.dynamic_index_in_dim(cache_k, layer, 0, keepdims=False)  # [B, K, S, Dh]
        v_all = jax.lax.dynamic_index_in_dim(cache_v, layer, 0, keepdims=False)
        k_all, v_all = k_all.astype(q.dtype), v_all.astype(q.dtype)
        sinks = None if self.self_attn.sinks is None else self.self_attn.sinks[...]
        scores = dict(scale=self.self_attn.scale, softcap=self.self_attn.softcap, sinks=sinks)
        if mask is None:
            a = causal_attention(q, k_all, v_all, write_pos, window=window, **scores)
        else:
            if window is not None:
                mask = mask & ((window == 0) | (distance < window))
            a = attention(q, k_all, v_all, mask, **scores)
        a = self.self_attn.out(a, gate)
        x = x + self._branch(a if self.attn_output_norm is None else self.attn_output_norm(a))
        h = x if self.post_attention_layernorm is None else self.post_attention_layernorm(x)
        m = (self.mlp if mlp is None else mlp(h))(h)
        x = x + self._branch(m if self.mlp_output_norm is None else self.mlp_output_norm(m))
        return x, cache_k, cache_v


class GatedDeltaNet(nnx.Module):
    """Qwen3-Next's linear attention (Gated DeltaNet): q, k and v projected together, through a
    causal depthwise conv and SiLU; q and k unit-normed per head; a decay g = -exp(A_log) *
    softplus(a + dt_bias) and a write strength beta = sigmoid(b) per value head and token; the
    gated delta rule (`linear_attention.gated_delta`); each head's output RMS-normed and gated by
    SiLU(z); out_proj. q, k and v are projected together, z, b and a apart, as Qwen3.5 stores them;
    their channels (the projection's outputs, the conv's, the conv state's) run key-head group by
    group: each key head's q and k, then the v of the Hv / Hk value heads it serves. Splitting that
    axis over `model` keeps whole groups on each device, so the layer runs head-parallel and ends in
    out_proj's one all-reduce. Loading reorders the checkpoints' q|k|v (`convert.hf`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d = cfg.hidden_size
        self.key_heads, self.value_heads = cfg.linear_key_heads, cfg.linear_value_heads
        self.key_dim, self.value_dim = cfg.linear_key_dim, cfg.linear_value_dim
        kw = dict(dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype), rngs=rngs)
        lin = dict(kw, use_bias=False, precision=matmul_precision(cfg.dtype))
        c, hv, vw = cfg.linear_conv_channels, self.value_heads, self.value_heads * self.value_dim
        self.in_proj_qkv = nnx.Linear(d, c, **lin)
        self.in_proj_z = nnx.Linear(d, vw, **lin)
        self.in_proj_b = nnx.Linear(d, hv, **lin)
        self.in_proj_a = nnx.Linear(d, hv, **lin)
        pd = jnp.dtype(cfg.param_dtype)
        self.conv = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (c, cfg.linear_conv), pd))
        self.dt_bias = nnx.Param(jnp.ones((hv,), pd))
        self.A_log = nnx.Param(jnp.log(jnp.linspace(1.0, 16.0, hv)).astype(pd))
        # The gated norm's weight multiplies as it is (initialised to 1), unlike the layer norms' 1 + w.
        self.norm = RMSNorm(self.value_dim, eps=cfg.rms_norm_eps, **kw)
        self.out_proj = nnx.Linear(vw, d, **lin)

    def __call__(self, x, *, state, conv_state, mask, depth, valid):
        """x [B, T, D]; state [B, Hv, Dk, Dv] and conv_state [B, W - 1, C]: before the run; mask:
        the tree pass's [B, T, T] ancestor-or-self mask, or None for a causal run, then `valid` [B, T]
        (None: all) marks the tokens that enter the state, a prefix of each row; depth [B, T] each
        token's steps from the run's first. -> (out [B, T, D], after): a causal run's `after` is
        (state, conv_state) past its valid tokens; a tree pass's is what `LinearState.tree_*` keep
        of each node, (x, k, v, gb)."""
        b, t, _ = x.shape
        kh, hv, dk = self.key_heads, self.value_heads, self.key_dim
        mixed = self.in_proj_qkv(x)  # [B, T, C], key-head group by group
        w = self.conv[...]
        if mask is None:
            conv = causal_conv(mixed, conv_state, w)
        else:
            conv = tree_conv(mixed, conv_state, w, mask, depth)
        # In the compute dtype, as transformers keeps it: the keys and values this pass attends with are
        # then the ones `LinearState.tree_*` records and the commit runs into the state.
        conv = jax.nn.silu(conv).astype(x.dtype).reshape(b, t, kh, -1)
        q, k = conv[..., :dk], conv[..., dk:2 * dk]
        v = conv[..., 2 * dk:].reshape(b, t, hv, self.value_dim)  # value head g * rep + j: group g's j-th
        f32 = jnp.float32
        beta = jax.nn.sigmoid(self.in_proj_b(x).astype(f32))  # [B, T, Hv]
        g = -jnp.exp(self.A_log[...].astype(f32)) * jax.nn.softplus(self.in_proj_a(x).astype(f32)
                                                                    + self.dt_bias[...].astype(f32))
        rep = hv // kh  # each query/key head serves rep consecutive value heads
        qn = jnp.repeat(l2_normalize(q), rep, axis=2) * self.key_dim ** -0.5
        kn = jnp.repeat(l2_normalize(k), rep, axis=2)
        if mask is None:
            if valid is not None:  # padding: no decay and no write, so the state stays
                g, beta = jnp.where(valid[..., None], g, 0.0), jnp.where(valid[..., None], beta, 0.0)
            out, new_state = gated_delta_chunked(qn, kn, v, g, beta, state)
            count = jnp.full((b,), t, jnp.int32) if valid is None else jnp.sum(valid, axis=1, dtype=jnp.int32)
            after = (new_state, last_inputs(conv_state, mixed, count))
        else:
            out, _ = gated_delta(qn, kn, v, g, beta, state, mask)
            after = (mixed, k, v, jnp.stack([g, beta], axis=2))
        z = self.in_proj_z(x).reshape(b, t, hv, self.value_dim)
        o = self.norm(out.astype(x.dtype)).astype(f32) * jax.nn.silu(z.astype(f32))
        return self.out_proj(o.astype(x.dtype).reshape(b, t, hv * self.value_dim)), after


class LinearDecoderLayer(nnx.Module):
    """A Qwen3-Next linear-attention layer: x + linear_attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        kw = dict(dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.dtype(cfg.param_dtype), rngs=rngs)
        norm = dict(eps=cfg.rms_norm_eps, offset=cfg.norm_offset, **kw)
        self.input_layernorm = RMSNorm(cfg.hidden_size, **norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, **norm)
        self.linear_attn = GatedDeltaNet(cfg, rngs=rngs)
        self.mlp = _mlp(cfg, kw)

    def __call__(self, x, *, lin: LinearState, layer, fresh, mask, depth, valid, mlp=None):
        """One layer over the new tokens. lin: the whole `LinearState` (scan carry); layer: this
        layer's traced index among the linear layers; fresh [B]: rows whose run starts at slot 0,
        with no prefix, whose state starts empty (a prompt placed in a reused row); mlp: as
        `DecoderLayer`'s."""
        keep = ~fresh
        state = jnp.where(keep[:, None, None, None], jax.lax.dynamic_index_in_dim(lin.state, layer, 0, False), 0.0)
        conv_state = jnp.where(keep[:, None, None], jax.lax.dynamic_index_in_dim(lin.conv, layer, 0, False), 0.0)
        a, after = self.linear_attn(self.input_layernorm(x), state=state, conv_state=conv_state.astype(x.dtype),
                                    mask=mask, depth=depth, valid=valid)
        x = x + a
        h = self.post_attention_layernorm(x)
        x = x + (self.mlp if mlp is None else mlp(h))(h)

        def put(buf, value):  # this layer's entry of a [Ll, B, ...] buffer (a tree's T nodes: the first T)
            return jax.lax.dynamic_update_slice(buf, value.astype(buf.dtype)[None], (layer,) + (0,) * (buf.ndim - 1))

        if mask is None:
            lin = dataclasses.replace(lin, state=put(lin.state, after[0]), conv=put(lin.conv, after[1]))
        else:
            t = x.shape[1]
            if t > lin.tree_slots:
                raise ValueError(f"a tree pass of {t} nodes needs a cache that records at least that many "
                                 f"(KVCache.init(..., tree_slots={t})), not {lin.tree_slots}")
            # The state the commit starts from is the one this pass read: emptied for a fresh row.
            lin = dataclasses.replace(lin, state=put(lin.state, state), conv=put(lin.conv, conv_state),
                                      **{name: put(getattr(lin, name), value)
                                         for name, value in zip(("tree_x", "tree_k", "tree_v", "tree_gb"), after)})
        return x, lin


def full_mask(block_mask: jax.Array, write_pos: jax.Array, capacity: int) -> jax.Array:
    """[B, T, S] visibility: the committed prefix (slots < write_pos) plus the block mask placed
    at slots write_pos .. write_pos + T - 1; every other slot (stale or empty) is hidden."""
    b, t, _ = block_mask.shape
    rel = jnp.arange(capacity)[None, :] - write_pos[:, None]  # [B, S] slot - write_pos
    in_block = (rel >= 0) & (rel < t)
    cols = jnp.broadcast_to(jnp.clip(rel, 0, t - 1)[:, None, :], (b, t, capacity))
    block = jnp.take_along_axis(block_mask, cols, axis=2)
    return (rel < 0)[:, None, :] | (in_block[:, None, :] & block)


class Transformer(nnx.Module):
    """Llama / Mistral / Qwen2 / Qwen3 / Gemma 2-3 / Phi-3 / Mixtral / Qwen2-3 MoE / SmolLM3 / Granite /
    OLMo 2-3 / OLMoE / Granite MoE / GPT-OSS / Qwen3-Next / Qwen3.5 decoder with stacked layers; see the
    module docstring for the call protocol."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dtype, param_dtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype,
                                      param_dtype=param_dtype, rngs=rngs)

        # One set of parameters per layer, stacked on a leading axis: the attention layers in
        # `layers`, a hybrid model's linear ones apart in `linear_layers` (they have other shapes).
        def stack(kind, n):
            @nnx.split_rngs(splits=n)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(r: nnx.Rngs):
                return kind(cfg, rngs=r)
            return make(rngs)

        self.layers = stack(DecoderLayer, cfg.num_attention_layers)
        self.linear_layers = stack(LinearDecoderLayer, len(cfg.linear_layers)) if cfg.linear_layers else None
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, dtype=dtype, param_dtype=param_dtype,
                            offset=cfg.norm_offset)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nnx.Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False, dtype=dtype,
                                      param_dtype=param_dtype, precision=matmul_precision(dtype), rngs=rngs)

    def embed(self, tokens: jax.Array) -> jax.Array:
        """tokens [...] int -> [..., D] in the compute dtype (Gemma: times sqrt(D), rounded to the
        weights' dtype first, as transformers rounds its scale to them)."""
        x = self.embed_tokens(tokens).astype(self.cfg.dtype)
        if self.cfg.embed_scale is not None:
            scale = jnp.asarray(self.cfg.embed_scale, self.cfg.embed_scale_dtype).astype(jnp.float32)
            x = (x * scale).astype(self.cfg.dtype)
        return x

    def head_rows(self, rows: jax.Array) -> jax.Array:
        """[Vd, D] the LM-head rows (or tied embedding rows) of token ids `rows` [Vd], in the compute
        dtype: what `logits(h, rows)` multiplies by, gathered once so that a caller scoring the
        same rows every round (a drafter's reduced vocabulary) can pass it back as `head`."""
        dt = jnp.dtype(self.cfg.dtype)
        if self.lm_head is None:
            return jnp.take(self.embed_tokens.embedding[...], rows, axis=0).astype(dt)
        return jnp.take(self.lm_head.kernel[...], rows, axis=1).T.astype(dt)

    def logits(self, final_hidden: jax.Array, rows: jax.Array | None = None, *,
               head: jax.Array | None = None) -> jax.Array:
        """[..., D] -> [..., V] float32 (lm_head, or the tied embedding matrix).

        `rows` [Vd] int selects vocabulary entries: the result is then [..., Vd], column j scoring
        token rows[j] (a drafter's reduced vocabulary reads only those rows of the head).
        `head` [Vd, D] = `head_rows(rows)`, when given, is used instead of gathering them again
        (the gather of Vd x D weights costs a decoding round about a fifth of a target step).
        Inputs stay in the compute dtype (bf16 tensor cores on GPU) with float32 accumulation,
        so no float32 copy of the V x D matrix is made. Granite divides them by logits_scaling;
        Gemma 2 caps them: final_softcap * tanh(logits / final_softcap).
        """
        logits = self._head(final_hidden, rows, head)
        if self.cfg.logits_scaling is not None:
            logits = logits / self.cfg.logits_scaling
        return soft_cap(logits, self.cfg.final_softcap)

    def _head(self, final_hidden: jax.Array, rows: jax.Array | None, head: jax.Array | None) -> jax.Array:
        dt = jnp.dtype(self.cfg.dtype)
        f32 = dict(preferred_element_type=jnp.float32, precision=matmul_precision(dt))
        if head is not None:
            if rows is not None and head.shape[0] != rows.shape[0]:
                raise ValueError(f"head has {head.shape[0]} rows for {rows.shape[0]} vocabulary ids")
            return jnp.einsum("...d,vd->...v", final_hidden.astype(dt), head.astype(dt), **f32)
        if self.lm_head is None:
            w = self.embed_tokens.embedding[...]
            if rows is not None:
                w = jnp.take(w, rows, axis=0)
            return jnp.einsum("...d,vd->...v", final_hidden.astype(dt), w.astype(dt), **f32)
        w = self.lm_head.kernel[...]
        if rows is not None:
            w = jnp.take(w, rows, axis=1)
        return jnp.einsum("...d,dv->...v", final_hidden.astype(dt), w.astype(dt), **f32)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        write_pos: jax.Array,
        block_mask: jax.Array | None,
        *,
        hidden_layers: tuple[int, ...] = (),
        compute_logits: bool = True,
        valid: jax.Array | None = None,
    ) -> ForwardOutput:
        """tokens, positions [B, T] int32; write_pos [B] int32; block_mask [B, T, T] bool, or None
        for a causal run (query t sees every slot up to write_pos + t; forward only).

        A model with linear layers (Qwen3-Next) also reads and writes `cache.linear`: a causal run
        updates the recurrent state with its tokens, only the `valid` [B, T] ones (a prefix of each
        row; None: all) when some are padding; a tree pass records each node's inputs for
        `KVCache.advance`. A row whose run starts at slot 0 starts from an empty state."""
        cfg = self.cfg
        if tokens.ndim != 2:
            raise ValueError(f"Transformer: tokens has shape {tuple(tokens.shape)}, expected (B, T)")
        b, t = tokens.shape
        checks = {
            "positions": (positions.shape, (b, t)),
            "write_pos": (write_pos.shape, (b,)),
            "block_mask": (block_mask.shape if block_mask is not None else (b, t, t), (b, t, t)),
            "cache.k": (cache.k.shape, (cfg.num_attention_layers, b, cfg.num_kv_heads, cache.capacity,
                                        cfg.head_dim)),
            "cache.v": (cache.v.shape, cache.k.shape),
            "valid": (valid.shape if valid is not None else (b, t), (b, t)),
        }
        if (cache.linear is None) != (not cfg.linear_layers):
            raise ValueError(f"Transformer: a model with {len(cfg.linear_layers)} linear layers needs a cache "
                             f"{'with' if cfg.linear_layers else 'without'} a linear state (KVCache.init)")
        for name, (got, want) in checks.items():
            if tuple(got) != tuple(want):
                raise ValueError(f"Transformer: {name} has shape {tuple(got)}, expected {tuple(want)}")
        if t > cache.capacity:
            # The run's own slots write_pos + t cannot all exist: the K/V of its last tokens would be
            # dropped and their queries would attend without them, giving wrong logits and no error.
            raise ValueError(f"Transformer: {t} new tokens do not fit a cache of {cache.capacity} slots per row "
                             f"(KVCache.init(..., capacity=...) must hold the prefix and every new token)")
        if not jnp.issubdtype(tokens.dtype, jnp.integer) or not jnp.issubdtype(positions.dtype, jnp.integer):
            raise ValueError(f"Transformer: tokens and positions must be integer arrays, got "
                             f"{tokens.dtype} and {positions.dtype}")
        hidden_layers = tuple(int(i) for i in hidden_layers)
        for i in hidden_layers:
            if not 0 <= i < cfg.num_layers:
                raise ValueError(f"Transformer: hidden_layers entry {i} is outside [0, {cfg.num_layers})")

        s = cache.capacity
        write_pos = write_pos.astype(jnp.int32)
        mask = full_mask(block_mask.astype(bool), write_pos, s) if block_mask is not None else None
        write_idx = write_pos[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        write_idx = jnp.where((write_idx >= 0) & (write_idx < s), write_idx, s)  # S: dropped
        ropes = _layer_ropes(cfg)
        wanted = np.asarray(hidden_layers, np.int32)  # [R] static
        windows = np.asarray(cfg.layer_windows, np.int32) if cfg.sliding_window else None  # [L] static
        distance = None
        if windows is not None and mask is not None:
            # A committed slot s holds position s (prefill writes a prompt's token i at slot i, and
            # each round commits its accepted path after the prefix); the run's own slots hold its
            # positions, a tree node's the prefix length plus its depth. Windows are over positions,
            # so a tree node sees what it would see at the end of its path's causal sequence.
            slot = jnp.arange(s, dtype=jnp.int32)[None, :]
            rel = slot - write_pos[:, None]  # [B, S]
            own = jnp.take_along_axis(positions.astype(jnp.int32), jnp.clip(rel, 0, t - 1), axis=1)
            key_pos = jnp.where((rel >= 0) & (rel < t), own, slot)
            distance = positions.astype(jnp.int32)[:, :, None] - key_pos[:, None, :]  # [B, T, S]

        x = self.embed(tokens)
        period = cfg.layer_period
        n_att, n_lin = period.count("attention"), period.count("linear")
        periods = cfg.num_layers // len(period)
        graphdef, layer_state = nnx.split(self.layers)
        lin_graphdef, lin_state = nnx.split(self.linear_layers) if n_lin else (None, None)
        # Each scan step runs one period of layers. A stack with one layer a period (every family's
        # attention but a hybrid's linear layers) is scanned as it is stacked; one with several is
        # indexed layer by layer inside the step, from the whole stack.
        #
        # XLA:CPU copies every slice of the weights it takes, and takes a slice as soon as its index
        # is known: all of a period's layers' as the step began, so their copies left the cache
        # before they were used, and each layer's MLP weights before its attention had run. On one
        # CPU device the index of a layer's weights, and of its MLP's, reads the input they are
        # applied to, so each slice is taken just before its use (`experiments/weight_slices.py`:
        # SmolLM2's one-token pass in 0.87x the time, a 9-node tree pass in 0.91x, a hybrid's step
        # in 0.47x). The index moves only where every entry of that input is NaN, and then no
        # weights change the NaN output. Not on a GPU, which runs a program's kernels in order, nor
        # over several devices, where the test would be a collective (`ORDER_WEIGHT_SLICES` turns
        # it off).
        ordered = ORDER_WEIGHT_SLICES and jax.default_backend() == "cpu" and jax.device_count() == 1

        def at(idx, x):  # a layer index that reads x where slices are ordered
            return idx + jnp.all(jnp.isnan(x)).astype(jnp.int32) if ordered else idx

        def index(stack, idx):
            return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, idx, 0, False), stack)

        def scanned(stack, n):
            return stack if n == 1 else None

        def layer_of(scanned_slice, stack, n, step, i, x):  # the i-th layer of period `step`
            return scanned_slice if n == 1 else index(stack, at(step * n + i, x))

        def mlp_of(stacked_module, stack, n, step, i):  # `DecoderLayer`'s mlp argument
            if not ordered:
                return None
            mlp_graphdef = nnx.graphdef(stacked_module.mlp)
            return lambda h: nnx.merge(mlp_graphdef, index(stack["mlp"], at(step * n + i, h)))

        grouped = (scanned(layer_state, n_att), scanned(lin_state, n_lin))
        linear_run = None
        if n_lin:
            linear_run = dict(fresh=write_pos == 0, mask=None if block_mask is None else block_mask.astype(bool),
                              depth=positions.astype(jnp.int32) - write_pos[:, None] if block_mask is not None
                              else jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)),
                              valid=None if valid is None else valid.astype(bool))

        def body(carry, xs):
            x, ck, cv, lin, buf = carry
            (att, lins), step = xs
            a_i = l_i = 0
            for kind in period:
                layer = step * len(period) + a_i + l_i  # the global layer index
                if kind == "linear":
                    weights = layer_of(lins, lin_state, n_lin, step, l_i, x)
                    x, lin = nnx.merge(lin_graphdef, weights)(
                        x, lin=lin, layer=step * n_lin + l_i,
                        mlp=mlp_of(self.linear_layers, lin_state, n_lin, step, l_i), **linear_run)
                    l_i += 1
                else:
                    window = None if windows is None else jnp.asarray(windows)[layer]
                    layer_rope = ropes
                    if not isinstance(ropes, Rope):  # this layer's row of the tables (a shared scale stays a constant)
                        inv_freq, scale = ropes
                        layer_rope = Rope(jnp.asarray(inv_freq)[layer],
                                          scale if isinstance(scale, float) else jnp.asarray(scale)[layer])
                    weights = layer_of(att, layer_state, n_att, step, a_i, x)
                    x, ck, cv = nnx.merge(graphdef, weights)(
                        x, positions=positions, rope=layer_rope, mask=mask, cache_k=ck, cache_v=cv,
                        layer=step * n_att + a_i, write_idx=write_idx, write_pos=write_pos, window=window,
                        distance=distance, mlp=mlp_of(self.layers, layer_state, n_att, step, a_i))
                    a_i += 1
                if wanted.size:
                    # Buffer of R slots written only where the layer index matches: O(R), not O(L).
                    hit = jnp.asarray(wanted) == layer
                    buf = jnp.where(hit[None, None, :, None], x[:, :, None, :], buf)
            return (x, ck, cv, lin, buf), None

        buf = jnp.zeros((b, t, len(hidden_layers), cfg.hidden_size), x.dtype)
        steps = jnp.arange(periods, dtype=jnp.int32)
        (x, ck, cv, lin, buf), _ = jax.lax.scan(body, (x, cache.k, cache.v, cache.linear, buf), (grouped, steps))
        final_hidden = self.norm(x)
        return ForwardOutput(
            logits=self.logits(final_hidden) if compute_logits else None,
            hidden=buf,
            final_hidden=final_hidden,
            cache=KVCache(k=ck, v=cv, linear=lin),
        )


def _layer_ropes(cfg: ModelConfig) -> Rope | tuple[np.ndarray, float | np.ndarray]:
    """The rope every layer rotates with: one `Rope` of static constants when the layers agree (as
    in most families, whose layers then run the ops they always ran), else static per-layer tables
    inv_freq [L, Dh / 2] and scale [L] (one float where the layers share it) that the layer scan
    indexes. Gemma 3's and OLMo 3's sliding layers have a base of their own (unscaled); SmolLM3's
    NoPE layers rotate by frequency 0, whose cos 1 and sin 0 leave q and k exactly as they are."""
    dim = cfg.rotary_dim or cfg.head_dim  # Qwen3-Next rotates a leading part of each head
    full = Rope.of(dim, cfg.rope_theta, cfg.rope_scaling)
    local = Rope.of(dim, cfg.local_rope_theta, None) if cfg.local_rope_theta else full
    unrotated = Rope(np.zeros_like(full.inv_freq), 1.0)
    per_layer = [unrotated if i in cfg.nope_layers else local if i in cfg.sliding_layers else full
                 for i in range(cfg.num_layers)]
    if all(r is per_layer[0] for r in per_layer):
        return per_layer[0]
    inv_freq = np.stack([np.asarray(r.inv_freq, np.float32) for r in per_layer])
    scales = [r.scale for r in per_layer]
    return inv_freq, scales[0] if len(set(scales)) == 1 else np.asarray(scales, np.float32)


def forward(graphdef, state, tokens, positions, cache, write_pos, block_mask, *,
            hidden_layers: tuple[int, ...] = (), compute_logits: bool = True, valid=None) -> ForwardOutput:
    """Pure-function form of `Transformer.__call__` over `nnx.split(model)`.

    Jit it with `static_argnames=("graphdef", "hidden_layers", "compute_logits")` (a GraphDef is
    hashable), splitting the model once outside the loop as in the flax gemma sampler.
    """
    return nnx.merge(graphdef, state)(tokens, positions, cache, write_pos, block_mask,
                                      hidden_layers=hidden_layers, compute_logits=compute_logits, valid=valid)
