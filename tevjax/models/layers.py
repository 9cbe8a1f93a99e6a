"""Shared transformer primitives (target model and DFlash drafter).

Shape letters follow the legend in `tevjax/__init__.py` (here T: query tokens, S: key/value slots).

Numerics: every reduction that decides a probability (RMS statistics, attention scores, softmax)
runs in float32 whatever the compute dtype; masking uses the finite `NEG_INF` so a fully masked
row (padding) gives a uniform softmax instead of NaN. Every matmul states its precision
(`matmul_precision`): float32 compute means true float32 products on every backend.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from tevjax.models.config import RopeScaling

__all__ = [
    "NEG_INF",
    "RMSNorm",
    "Rope",
    "SparseMoE",
    "SwiGLU",
    "apply_rope",
    "attention",
    "causal_attention",
    "causal_mask",
    "matmul_precision",
    "rope_inv_freq",
    "set_moe_dispatch",
    "soft_cap",
]

# Finite stand-in for -inf in float32 scores. exp(NEG_INF - max) underflows to exactly 0 next to
# any real score, while a row with no visible key stays finite (uniform weights, no NaN), and it
# is far from float32's limit so subtracting a row maximum never overflows to -inf.
NEG_INF: float = -1e30


def matmul_precision(dtype) -> jax.lax.Precision:
    """The precision of a matmul whose operands have `dtype`: HIGHEST for float32, DEFAULT otherwise.

    With precision left unset, XLA may run float32 matmuls on GPUs in TF32 (operands rounded to a
    10-bit mantissa, ~1e-3 relative error): a "float32" model would then differ from the same model
    on CPU, and from transformers in float32, by far more than the parity tests' 1e-5 tolerances.
    HIGHEST keeps float32 what it says (on CPUs it changes nothing). bfloat16 and float16 operands
    use DEFAULT: their products are exact in the tensor cores' float32 accumulators, and every
    matmul whose result decides a probability asks for a float32 result (`preferred_element_type`).
    """
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


class RMSNorm(nnx.Module):
    """y = x / sqrt(mean(x^2) + eps) * (offset + scale) over the last axis; statistics in float32.

    `offset` 1 is Gemma's norm, whose stored weights are centred on zero (and initialised so)."""

    def __init__(self, dim: int, *, eps: float, dtype, param_dtype, rngs: nnx.Rngs | None = None,
                 offset: float = 0.0):
        del rngs  # deterministic init; kept so every layer has the same constructor shape
        self.eps = float(eps)
        self.offset = float(offset)
        self.dtype = jnp.dtype(dtype)  # unused by the math (output keeps the input dtype); recorded for introspection
        self.scale = nnx.Param(jnp.full((dim,), 1.0 - self.offset, jnp.dtype(param_dtype)))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        inv = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        w = self.scale[...].astype(jnp.float32)
        if self.offset:  # only where there is one, so other models run the same ops as before
            w = w + self.offset
        return (x32 * inv * w).astype(x.dtype)


class Rope(NamedTuple):
    """A model's rotary embedding as trace-time constants: `inv_freq` [Dh // 2] float32, and
    `scale`, what q and k are both multiplied by after rotation (YaRN's `attention_factor`; 1
    otherwise). transformers folds that factor into cos and sin, so its KV cache holds scaled
    keys; so does tevjax's. Inside the layer scan of a model with two ropes (Gemma 3) both can be
    the layer's traced pick of the two."""

    inv_freq: np.ndarray | jax.Array
    scale: float | jax.Array

    @classmethod
    def of(cls, head_dim: int, theta: float, scaling: RopeScaling | None) -> "Rope":
        scale = scaling.attention_factor if scaling is not None and scaling.rope_type == "yarn" else 1.0
        return cls(rope_inv_freq(head_dim, theta, scaling), float(scale))


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """[head_dim // 2] float32 inverse frequencies theta^(-2i/head_dim), scaled by `scaling`.

    - llama3: keeps high frequencies (wavelength < original_len / high_freq_factor), divides low
      frequencies (wavelength > original_len / low_freq_factor) by `factor`, and interpolates
      smoothly in between.
    - linear: divides every frequency by `factor`.
    - yarn: dimension i keeps its frequency below the ramp [lo, hi] and is divided by `factor`
      above it, blended linearly across it; lo and hi are the dimensions that turn `beta_fast`
      and `beta_slow` times over the original context (rounded outwards when `truncate`).

    Computed in float64 on the host (a static constant).
    """
    inv = 1.0 / (float(theta) ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv.astype(np.float32)
    factor = float(scaling.factor)
    if scaling.rope_type == "linear":
        inv = inv / factor
    elif scaling.rope_type == "yarn":
        old = float(scaling.original_max_position_embeddings)

        def dim_of(turns):  # the (fractional) dimension whose wavelength fits `turns` times in `old`
            return head_dim * math.log(old / (turns * 2 * math.pi)) / (2 * math.log(float(theta)))

        lo, hi = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
        if scaling.truncate:
            lo, hi = math.floor(lo), math.ceil(hi)
        lo, hi = max(lo, 0), min(hi, head_dim - 1)
        if lo == hi:
            hi += 0.001  # transformers' guard against a zero-width ramp
        ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - lo) / (hi - lo), 0, 1)
        inv = inv / factor * ramp + inv * (1 - ramp)
    else:  # llama3
        old = float(scaling.original_max_position_embeddings)
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    return inv.astype(np.float32)


def _rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq, scale: float = 1.0) -> jax.Array:
    """Rotary embedding, HF "rotate_half" layout (first and second half of Dh form the pairs).

    x: [..., T, H, Dh]; positions: [..., T] int; inv_freq: [Dh // 2] (constant or traced); `scale`
    multiplies the result (`Rope.scale`). Angles and the rotation are computed in float32; the
    result has x's dtype.
    """
    inv_freq = jnp.asarray(inv_freq, jnp.float32)
    if x.shape[-1] != 2 * inv_freq.shape[-1]:
        raise ValueError(f"apply_rope: head_dim {x.shape[-1]} != 2 * len(inv_freq) {inv_freq.shape[-1]}")
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., T, Dh/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[..., None, :]  # [..., T, 1, Dh]
    x32 = x.astype(jnp.float32)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if not isinstance(scale, (int, float)) or scale != 1.0:  # on cos and sin, where transformers puts it
        # (for the same float32 rounding); a traced scale is a layer's pick of two ropes (Gemma 3)
        cos, sin = cos * scale, sin * scale
    out = x32 * cos + _rotate_half(x32) * sin
    return out.astype(x.dtype)


# The gated MLP's activations (`ModelConfig.hidden_act`): GELU's tanh form is transformers'
# gelu_pytorch_tanh, jax's approximate GELU.
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


class SwiGLU(nnx.Module):
    """down(act(gate(x)) * up(x)), act SiLU (GELU's tanh form for Gemma: GeGLU); no biases."""

    def __init__(self, dim: int, hidden: int, *, dtype, param_dtype, rngs: nnx.Rngs, act: str = "silu"):
        self.act = act
        kw = dict(use_bias=False, dtype=jnp.dtype(dtype), param_dtype=jnp.dtype(param_dtype),
                  precision=matmul_precision(dtype), rngs=rngs)
        self.gate_proj = nnx.Linear(dim, hidden, **kw)
        self.up_proj = nnx.Linear(dim, hidden, **kw)
        self.down_proj = nnx.Linear(hidden, dim, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(ACTIVATIONS[self.act](self.gate_proj(x)) * self.up_proj(x))


MOE_DISPATCHES = ("auto", "dense", "ragged")


class SparseMoE(nnx.Module):
    """A routed mixture of E SwiGLU experts (Mixtral, Qwen2/3-MoE, OLMoE, Granite MoE, GPT-OSS): each
    token goes to the k experts with the highest router probabilities, and their outputs mix with
    those probabilities (renormalised over the k when `norm_topk_prob`). Router softmax and mixing
    weights are float32.

    Parameters: `router` (kernel [D, E]) and the experts' stacked `gate_proj` / `up_proj` [E, D, I]
    and `down_proj` [E, I, D]. With `shared_size` (Qwen2-MoE) a `shared_expert` SwiGLU of that
    width runs on every token too, its output scaled by sigmoid(`shared_expert_gate`(x)). GPT-OSS's
    experts (`bias`, `swiglu_limit`) add a bias to the router's logits and to each projection
    (`gate_bias`, `up_bias` [E, I], `down_bias` [E, D]), and gate with (clip(up) + 1) *
    g * sigmoid(alpha * g), g = min(gate, limit), up clipped to [-limit, limit].

    Two dispatches compute the same sum (up to float rounding), chosen per call:

    - "dense": every expert runs on every token and the weights are zero off the picked ones.
      E / k times the FLOPs, but three plain batched matmuls; on 2 CPU cores "ragged" took
      1.3-1.6x its time for 16-512 tokens, 8 experts of width 1024 (`experiments/moe_dispatch.py`:
      XLA:CPU expands a ragged product into a masked dense one, and the sort is extra).
    - "ragged": the N * k (token, expert) pairs are sorted by expert and each expert multiplies
      only its own rows (`jax.lax.ragged_dot`, a grouped matmul): the k / E of the FLOPs that
      routing promises, for accelerators with a grouped-matmul kernel.

    Traced under a mesh (`jax.sharding.use_abstract_mesh`, as tevjax's decoder and trainer trace)
    whose devices split the experts or their widths (`tevjax.sharding`), either dispatch runs per
    device under `shard_map`: each device runs its own experts (or width slices) on its rows of
    tokens, and the devices sum one float32 [N, D] result. Left to XLA's partitioner, each of the
    ragged dispatch's three grouped products ended in an all-reduce of [N * k, I] or [N * k, D]
    partial rows, and the dense one reduced over experts and widths in two steps
    (`experiments/results/moe_sharding.md`).

    "auto" takes "dense" on CPU and "ragged" elsewhere. A call's `dispatch` defaults to the
    module's own (`dispatch`, "auto" unless `set_moe_dispatch` chose one for a whole model). It is
    a static attribute, so it is part of the model's graph definition: programs traced for one
    dispatch are never reused for the other. Routing is per token, so a tree pass routes each node
    as the causal pass of its own path would: verification stays exact.
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, experts_per_token: int, *, norm_topk_prob: bool,
                 dtype, param_dtype, rngs: nnx.Rngs, act: str = "silu", shared_size: int = 0,
                 dispatch: str = "auto", bias: bool = False, swiglu_limit: float | None = None,
                 swiglu_alpha: float = 1.702):
        self.act, self.k, self.norm_topk_prob = act, int(experts_per_token), bool(norm_topk_prob)
        self.dispatch = _check_dispatch(dispatch)
        self.swiglu_limit, self.swiglu_alpha = swiglu_limit, float(swiglu_alpha)
        self.dtype = jnp.dtype(dtype)
        self.router = nnx.Linear(dim, num_experts, use_bias=bias, dtype=self.dtype,
                                 param_dtype=jnp.dtype(param_dtype), precision=matmul_precision(dtype), rngs=rngs)
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        pd = jnp.dtype(param_dtype)
        self.gate_proj = nnx.Param(init(rngs.params(), (num_experts, dim, hidden), pd))
        self.up_proj = nnx.Param(init(rngs.params(), (num_experts, dim, hidden), pd))
        self.down_proj = nnx.Param(init(rngs.params(), (num_experts, hidden, dim), pd))
        zeros = lambda *shape: nnx.Param(jnp.zeros(shape, pd)) if bias else None  # noqa: E731
        self.gate_bias, self.up_bias, self.down_bias = (zeros(num_experts, hidden), zeros(num_experts, hidden),
                                                        zeros(num_experts, dim))
        shared = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.shared_expert = SwiGLU(dim, shared_size, act=act, **shared) if shared_size else None
        self.shared_expert_gate = (nnx.Linear(dim, 1, use_bias=False, precision=matmul_precision(dtype), **shared)
                                   if shared_size else None)

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [N, D] -> (weights [N, k] float32, experts [N, k] int32), highest probability first
        (ties: the lower expert index, as torch.topk)."""
        logits = self.router(x).astype(jnp.float32)
        weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), self.k)
        if self.norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return weights, experts.astype(jnp.int32)

    def __call__(self, x: jax.Array, *, dispatch: str | None = None) -> jax.Array:
        """x [..., D] -> [..., D]."""
        dispatch = _check_dispatch(self.dispatch if dispatch is None else dispatch)
        if dispatch == "auto":
            dispatch = "dense" if jax.default_backend() == "cpu" else "ragged"
        shape = x.shape
        x = x.reshape(-1, shape[-1]).astype(self.dtype)  # [N, D]
        weights, experts = self.route(x)
        glu = functools.partial(_glu, act=ACTIVATIONS[self.act], limit=self.swiglu_limit, alpha=self.swiglu_alpha)
        gate, up, down = (p[...].astype(self.dtype) for p in (self.gate_proj, self.up_proj, self.down_proj))
        biases = () if self.gate_bias is None else (self.gate_bias[...].astype(self.dtype),
                                                      self.up_bias[...].astype(self.dtype))
        local = functools.partial(_dense_local if dispatch == "dense" else _ragged_local, glu=glu,
                                  num_experts=gate.shape[0])
        mesh = jax.sharding.get_abstract_mesh()
        split = _expert_split(mesh, gate.shape, down.shape, x.shape[0]) if mesh.axis_names else None
        if split is None:
            out = local(x, weights, experts, gate, up, down, *biases)
        else:
            rows, wspec, dspec, expert_axes, width_axes = split
            local = functools.partial(local, expert_axes=expert_axes, sum_axes=expert_axes + width_axes)
            bspec = P(wspec[0], wspec[2])  # [E, I] biases, split as the experts and their widths
            specs = (rows, rows, rows, wspec, wspec, dspec) + (bspec,) * len(biases)
            out = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=rows)(x, weights, experts, gate, up,
                                                                                 down, *biases)
        if self.down_bias is not None:  # once per token, after the devices' partial sums
            picked = self.down_bias[...].astype(jnp.float32)[experts]  # [N, k, D]
            out = out + jnp.einsum("nk,nkd->nd", weights, picked, precision=matmul_precision(jnp.float32))
        if self.shared_expert is not None:
            shared_gate = jax.nn.sigmoid(self.shared_expert_gate(x).astype(jnp.float32))  # [N, 1]
            out = out + shared_gate * self.shared_expert(x).astype(jnp.float32)
        return out.astype(self.dtype).reshape(shape)


def _glu(gate: jax.Array, up: jax.Array, *, act, limit: float | None, alpha: float) -> jax.Array:
    """An expert's gated unit: act(gate) * up, or with a `limit` GPT-OSS's clipped one (the class
    docstring)."""
    if limit is None:
        return act(gate) * up
    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


def _dense_local(x, weights, experts, gate, up, down, *biases, glu, num_experts: int,
                 expert_axes: tuple[str, ...] = (), sum_axes: tuple[str, ...] = ()):
    """The "dense" dispatch over one device's experts (arguments and result as `_ragged_local`):
    each of its experts runs on every token, weighted zero where the routing did not pick it."""
    prec = dict(precision=matmul_precision(x.dtype))
    own, n = gate.shape[0], x.shape[0]
    start = jax.lax.axis_index(expert_axes) * own if expert_axes else 0  # this device's first expert
    mine = experts - start
    mine = jnp.where((mine >= 0) & (mine < own), mine, own)  # another device's expert: out of range, dropped
    mix = jnp.zeros((own, n), jnp.float32).at[mine, jnp.arange(n)[:, None]].add(weights, mode="drop")  # [El, N]
    g, u = jnp.einsum("nd,edi->eni", x, gate, **prec), jnp.einsum("nd,edi->eni", x, up, **prec)
    if biases:
        g, u = g + biases[0][:, None, :], u + biases[1][:, None, :]
    h = glu(g, u)
    # Weighted before the down projection, which then sums over experts and width at once: no
    # [E, N, D] intermediate.
    h = (h * mix[:, :, None]).astype(h.dtype)
    out = jnp.einsum("eni,eid->nd", h, down, preferred_element_type=jnp.float32, **prec)
    return jax.lax.psum(out, sum_axes) if sum_axes else out


def _ragged_local(x, weights, experts, gate, up, down, *biases, glu, num_experts: int,
                  expert_axes: tuple[str, ...] = (), sum_axes: tuple[str, ...] = ()):
    """The "ragged" dispatch over one device's experts: x [N, D], the routing's weights and
    experts [N, k]; gate, up [El, D, Il] and down [El, Il, D] hold El consecutive experts (all E,
    or a device's E / n when `expert_axes` split them, inside `shard_map`) and a slice Il of their
    widths; `biases`, where the experts have them, gate's and up's [El, Il]. Returns [N, D] float32,
    summed over `sum_axes` (the axes that split experts or widths).

    The pairs are sorted by expert counted from this device's first, so its own experts' rows come
    first; `ragged_dot` leaves the rows past its groups zero, so each device's product holds
    exactly the pairs whose expert it holds."""
    prec = dict(precision=matmul_precision(x.dtype))
    n, k = experts.shape
    own = gate.shape[0]
    start = jax.lax.axis_index(expert_axes) * own if expert_axes else 0  # this device's first expert
    pairs = (experts.reshape(-1) - start) % num_experts  # [N * k], pair j is token j // k
    order = jnp.argsort(pairs, stable=True)
    sizes = jnp.bincount(pairs, length=num_experts)[:own].astype(jnp.int32)  # rows of each own expert
    rows = x[order // k]  # [N * k, D], own experts' rows first, grouped
    g, u = jax.lax.ragged_dot(rows, gate, sizes, **prec), jax.lax.ragged_dot(rows, up, sizes, **prec)
    if biases:  # each row its expert's (rows of other devices' experts are dropped by `down`)
        expert = jnp.minimum(pairs[order], own - 1)
        g, u = g + biases[0][expert], u + biases[1][expert]
    y = jax.lax.ragged_dot(glu(g, u), down, sizes, preferred_element_type=jnp.float32, **prec)  # [N * k, D]
    y = jnp.zeros_like(y).at[order].set(y).reshape(n, k, -1)  # back to pair order
    out = jnp.einsum("nkd,nk->nd", y, weights, preferred_element_type=jnp.float32, **prec)
    return jax.lax.psum(out, sum_axes) if sum_axes else out


def _expert_split(mesh, gate_shape, down_shape, tokens: int):
    """How `mesh` (the abstract mesh a model is traced under) splits a routed MLP, from the
    sharding table (`tevjax.sharding`): (rows spec, gate/up spec, down spec, the mesh axes that
    split the experts, those that split their widths), or None when no device holds less than all
    of them. Rows are split as the batch is where that divides the N tokens."""
    from tevjax.sharding import logical_sharding, mesh_axes

    wspec = logical_sharding(mesh, ("experts", "embed", "mlp"), gate_shape, what="the experts").spec
    dspec = logical_sharding(mesh, ("experts", "mlp", "embed"), down_shape, what="the experts").spec
    names = lambda entry: () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)  # noqa: E731
    expert_axes, width_axes = names(wspec[0]), names(wspec[2])
    if math.prod(mesh.shape[a] for a in expert_axes + width_axes) == 1:
        return None
    batch = mesh_axes(mesh, "batch")
    rows = P(batch if batch and tokens % math.prod(mesh.shape[a] for a in batch) == 0 else None, None)
    return rows, wspec, dspec, expert_axes, width_axes


def _check_dispatch(dispatch: str) -> str:
    if dispatch not in MOE_DISPATCHES:
        raise ValueError(f"SparseMoE: dispatch={dispatch!r} is not one of 'auto', 'dense', 'ragged'")
    return dispatch


def set_moe_dispatch(model: nnx.Module, dispatch: str) -> int:
    """Sets the dispatch ("auto", "dense" or "ragged") of every `SparseMoE` in `model`, in place;
    returns how many it set (0 for a dense model). Set it before a `Decoder` or `Trainer` splits
    the model: the dispatch is part of the graph definition they trace."""
    _check_dispatch(dispatch)
    found = [m for _, m in nnx.iter_graph(model) if isinstance(m, SparseMoE)]
    for m in found:
        m.dispatch = dispatch
    return len(found)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float | None = None,
              softcap: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """Masked grouped-query dot-product attention.

    q: [B, T, H, Dh]; k, v: [B, K, S, Dh] (the cache's heads-major layout) with H % K == 0 (query
    head h reads kv head h // (H/K), the HF `repeat_kv` order); mask: [B, T, S] bool, True =
    visible. Returns [B, T, H, Dh] in q's dtype. Scores (times `scale`, default 1/sqrt(Dh); then
    softcap * tanh(scores / softcap) where a `softcap` is given, Gemma 2's) and softmax are
    float32; masked scores are NEG_INF, so a row with nothing visible averages v uniformly
    instead of producing NaN. `sinks` [H] (GPT-OSS): one more logit per head in each softmax's
    denominator, attending to no value (a row with nothing visible then gives 0).
    """
    b, t, h, dh = q.shape
    kh, s = k.shape[1], k.shape[2]
    if h % kh:
        raise ValueError(f"attention: {h} query heads is not a multiple of {kh} kv heads")
    if mask.shape != (b, t, s):
        raise ValueError(f"attention: mask shape {mask.shape} != (B, T, S) = {(b, t, s)}")
    g = h // kh
    # The G query heads that share a kv head stack into one [G*T, Dh] row block, so each kv head
    # costs one (G*T x Dh) @ (Dh x S) product, as in `causal_attention`. Per-head [T x S]
    # products (a 5-axis einsum) took 11.1 ms against 7.7 for a budget-8 tree pass over 512
    # slots, 30 SmolLM2 layers on 2 CPU cores (the whole pass: ~52 ms).
    qg = q.reshape(b, t, kh, g, dh).transpose(0, 2, 3, 1, 4).reshape(b, kh, g * t, dh)
    scores = jnp.einsum("bkmd,bksd->bkms", qg, k, preferred_element_type=jnp.float32,
                        precision=matmul_precision(q.dtype))
    scores = soft_cap(scores.reshape(b, kh, g, t, s) * (1.0 / math.sqrt(dh) if scale is None else scale), softcap)
    scores = jnp.where(mask[:, None, None, :, :], scores, NEG_INF)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        sink = sinks.astype(jnp.float32).reshape(kh, g)[None, :, :, None, None]
        top = jnp.maximum(jnp.max(scores, axis=-1, keepdims=True), sink)
        e = jnp.exp(scores - top)
        probs = e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - top))
    probs = probs.reshape(b, kh, g * t, s)
    out = jnp.einsum("bkms,bksd->bkmd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32, precision=matmul_precision(v.dtype))
    return out.reshape(b, kh, g, t, dh).transpose(0, 3, 1, 2, 4).reshape(b, t, h, dh).astype(q.dtype)


def soft_cap(scores: jax.Array, softcap: float | None) -> jax.Array:
    """softcap * tanh(scores / softcap) (None: scores as they are): Gemma 2's bound on attention
    scores and on logits."""
    return scores if softcap is None else jnp.tanh(scores / softcap) * softcap


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, first: jax.Array, *, key_block: int = 512,
                     query_block: int = 512, window: jax.Array | int | None = None, scale: float | None = None,
                     softcap: float | None = None, sinks: jax.Array | None = None) -> jax.Array:
    """`attention` for a causal run of T new tokens, without a [T, S] mask or score matrix.

    q: [B, T, H, Dh]; k, v: [B, K, S, Dh], the whole cache with the run's own K/V already written
    at slots first[b] + t; first: [B] int. Query t of row b sees exactly the slots <= first[b] + t
    (the committed prefix and the causal part of its run): what `attention` computes with the
    `full_mask` of a lower-triangular block mask, up to float rounding. With a `window` W (a scalar,
    traced or not; 0 means none) it sees only the slots > first[b] + t - W, a sliding window over
    slots, which are positions in a causal run. `scale`, `softcap` and `sinks` are `attention`'s
    (a sink joins the running softmax's denominator at the end: exp(sink - max) beside its sum).

    Why a second path: prefill over a long prompt is a causal run, and a [T, S] score matrix per
    layer (plus the boolean mask) is what made an 8k-token prompt peak at 10 GB. Here the queries
    go in tiles of `query_block` tokens (one tile when it does not divide T), and each tile reads
    keys in blocks of `key_block` slots with a running (flash-style) softmax, visiting only the
    blocks below its own last query (loops with traced trip counts), so a chunk at the start of a
    long prompt does not pay for the empty slots after it, nor a tile for the diagonal blocks of
    the tiles after it. Blocks that every query of a tile sees whole skip the mask; only the
    diagonal ones are masked. Forward only: the loops are `while_loop`s.

    Worked example, S = 10, key_block = 4, one tile, T = 2, first = 5 (queries at slots 5 and 6)::

        blocks visited  j = 0: slots 0-3 (unmasked)   j = 1: slots 4-7 (masked)   (slots 8-9 never read)
        query at 5      sees 0-3                      sees 4, 5
        query at 6      sees 0-3                      sees 4, 5, 6

    A last block that would run past S is read at S - key_block instead (a clamped slice); its
    slots below j * key_block were counted by the previous block and are masked out. Unmasked
    blocks lie wholly inside the cache, so a clamped block is always a masked one (padding rows
    can have queries past the cache).

    With a window the visits start at the block of the tile's earliest visible slot, and the blocks
    up to the first one that every query of the tile sees whole are masked too: the loops are
    masked [lo, mid), unmasked [mid, whole), masked [whole, end).

    Measured on 2 CPU cores, one layer of SmolLM2 (9/3 heads) over an 8,192-token prompt in chunks
    of 1,024: tiles and blocks of 512 with unmasked prefix blocks took 0.75-0.94 s against
    0.99-1.12 s for one tile with blocks of 256, all masked (torch's SDPA: ~0.7 s).
    """
    b, t, h, dh = q.shape
    kh, s = k.shape[1], k.shape[2]
    if h % kh:
        raise ValueError(f"causal_attention: {h} query heads is not a multiple of {kh} kv heads")
    g = h // kh
    kb = min(int(key_block), s)
    tq = min(int(query_block), t)
    if t % tq:
        tq = t
    n = t // tq
    # Query tiles as [N, B, K, G*tq, Dh]: the G query heads sharing a kv head stack into one row
    # block, so each key block costs one (G*tq x Dh) @ (Dh x kb) matmul per kv head. Measured at
    # S = 8192 (SmolLM2's 9/3 heads): 35-40% faster than per-head [T x kb] products.
    tiles = q.reshape(b, n, tq, kh, g, dh).transpose(1, 0, 3, 4, 2, 5).reshape(n, b, kh, g * tq, dh)
    first = jnp.asarray(first, jnp.int32)
    scale = 1.0 / math.sqrt(dh) if scale is None else float(scale)
    if window is not None:  # 0 (a layer without a window): as wide as any cache
        window = jnp.asarray(window, jnp.int32)
        window = jnp.where(window > 0, window, jnp.int32(2**30))

    def tile(args):
        qi, i = args
        query_slot = first[:, None] + i * tq + jnp.arange(tq, dtype=jnp.int32)  # [B, tq]
        row_slot = jnp.tile(query_slot, (1, g))  # [B, G*tq], row g * tq + t is query t of head g
        # Blocks holding any visible slot: up to the tile's last query slot (capped at the cache);
        # of those, the first `whole` end at or below every row's first query slot and inside the
        # cache (a clamped last block always takes the masked path).
        num_blocks = (jnp.minimum(jnp.max(query_slot) + 1, s) + kb - 1) // kb
        whole = jnp.minimum((jnp.min(query_slot[:, 0]) + 1) // kb, s // kb)
        mid = 0
        if window is not None:
            # The block of the earliest slot a query of the tile sees (at least one block is
            # visited, so a query that sees nothing, past the cache, averages v and is not NaN),
            # and the first block whose every slot each query of the tile sees.
            lo = jnp.minimum(jnp.maximum(jnp.min(query_slot[:, 0]) - window + 1, 0) // kb, num_blocks - 1)
            mid = jnp.clip((jnp.maximum(jnp.max(query_slot) - window + 1, 0) + kb - 1) // kb, lo, whole)

        def step(j, carry, masked: bool):
            m, l, acc = carry  # [B, K, G*tq] running max and sum, [B, K, G*tq, Dh] weighted values
            start = jnp.minimum(j * kb, s - kb)
            kj = jax.lax.dynamic_slice_in_dim(k, start, kb, axis=2)  # [B, K, kb, Dh]
            vj = jax.lax.dynamic_slice_in_dim(v, start, kb, axis=2)
            scores = soft_cap(jnp.einsum("bkqd,bksd->bkqs", qi, kj, preferred_element_type=jnp.float32,
                                        precision=matmul_precision(q.dtype)) * scale, softcap)
            if masked:
                slot = start + jnp.arange(kb, dtype=jnp.int32)
                visible = (slot >= j * kb)[None, None, :] & (slot[None, None, :] <= row_slot[:, :, None])
                if window is not None:
                    visible &= slot[None, None, :] > row_slot[:, :, None] - window
                scores = jnp.where(visible[:, None], scores, NEG_INF)
            m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
            # Without a window block 0 holds slot 0, visible to every query, so m is a real score
            # from the first block on and masked entries (NEG_INF - m) contribute exactly 0 after
            # it. With one, a query's first blocks can be all masked: they add weight 1 per slot
            # until its first real score, whose correction exp(NEG_INF - m) then zeroes them.
            p = jnp.exp(scores - m_new[..., None])
            corr = jnp.exp(m - m_new)
            acc = acc * corr[..., None] + jnp.einsum("bkqs,bksd->bkqd", p.astype(v.dtype), vj,
                                                     preferred_element_type=jnp.float32,
                                                     precision=matmul_precision(v.dtype))
            return m_new, l * corr + jnp.sum(p, axis=-1), acc

        init = (jnp.full((b, kh, g * tq), NEG_INF, jnp.float32), jnp.zeros((b, kh, g * tq), jnp.float32),
                jnp.zeros((b, kh, g * tq, dh), jnp.float32))
        carry = init if window is None else jax.lax.fori_loop(lo, mid, lambda j, c: step(j, c, True), init)
        carry = jax.lax.fori_loop(mid, whole, lambda j, c: step(j, c, False), carry)
        m, l, acc = jax.lax.fori_loop(whole, num_blocks, lambda j, c: step(j, c, True), carry)
        if sinks is not None:  # row g * tq + t is head g's: [K, G*tq]
            l = l + jnp.exp(jnp.repeat(sinks.astype(jnp.float32).reshape(kh, g), tq, axis=1)[None] - m)
        return acc / l[..., None]

    out = jax.lax.map(tile, (tiles, jnp.arange(n, dtype=jnp.int32)))  # [N, B, K, G*tq, Dh]
    out = out.reshape(n, b, kh, g, tq, dh).transpose(1, 0, 4, 2, 3, 5)
    return out.reshape(b, t, h, dh).astype(q.dtype)


def causal_mask(t: int) -> jax.Array:
    """[t, t] bool lower-triangular: query i sees keys 0..i."""
    return jnp.tril(jnp.ones((t, t), dtype=bool))
