"""Fast reductions and exact categorical sampling over large vocabularies.

Three memory-traffic and parallelism lessons shape this module (measured by
experiments/verifier_latency.py):

1. An elementwise producer (a temperature scale, a mask) feeding BOTH passes of a log-sum-exp
   makes XLA materialise the scaled [N, V] array: one extra write and two extra reads of the
   largest tensor, about 3x the cost of the bare reduction. `scaled_logsumexp` takes the max of the
   raw logits (max(s * x) = s * max(x) for s > 0) so that the scale only feeds the second pass.
2. A reduction over a few very long rows ([N, V] with N ~ 65, V ~ 150k) parallelises poorly on
   CPU; reducing [N, V / b, b] blocks (a free reshape when b divides V) and then the V / b block
   results is about 2x faster there, and costs a second, tiny stage on GPUs.
3. `jax.random.categorical` adds one Gumbel variate per vocabulary entry; at V = 151,936 that
   random number generation costs more than a log-sum-exp pass. `categorical` samples in two exact
   stages instead: a block with probability equal to its mass (Gumbel-max over the per-block
   log-sum-exps), then a token within the block (Gumbel-max over the block).
   P(token) = P(block) * P(token | block); cost: one pass plus ~V / b + b variates.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

__all__ = ["categorical", "scaled_logsumexp", "vocab_block"]


@functools.lru_cache(maxsize=None)
def vocab_block(vocab: int, lo: int = 64, hi: int = 2048) -> int | None:
    """The largest divisor of `vocab` in [lo, hi] (the block width of the two-stage reductions),
    or None when there is none or the vocabulary is too small to benefit (then one stage is used).
    Every common vocabulary has one: 32000 -> 2000, 49152 -> 2048, 128256 -> 2004, 151936 -> 1187.
    """
    if vocab < 2 * hi:
        return None
    for b in range(hi, lo - 1, -1):
        if vocab % b == 0:
            return b
    return None


def _flat_scaled_logsumexp(logits: jax.Array, scale: jax.Array) -> jax.Array:
    m = jnp.max(logits, axis=-1).astype(jnp.float32)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    total = jnp.sum(jnp.exp(scale * (logits.astype(jnp.float32) - m[..., None])), axis=-1)
    return scale * m + jnp.log(total)


def _blocks(logits: jax.Array, block: int) -> jax.Array:
    return logits.reshape(*logits.shape[:-1], logits.shape[-1] // block, block)


def scaled_logsumexp(logits: jax.Array, scale: jax.Array | float = 1.0) -> jax.Array:
    """log(sum(exp(scale * logits), axis=-1)) in float32 for scale > 0.

    -inf entries contribute 0. A row that is entirely -inf (or holds NaN) yields a non-finite
    result; callers mask such rows (padding) afterwards instead of sanitising the whole array.
    """
    scale = jnp.asarray(scale, jnp.float32)
    block = vocab_block(logits.shape[-1])
    if block is None:
        return _flat_scaled_logsumexp(logits, scale)
    block_lse = _flat_scaled_logsumexp(_blocks(logits, block), scale)
    return jax.nn.logsumexp(block_lse, axis=-1)


def categorical(key: jax.Array, logits: jax.Array, scale: jax.Array | float = 1.0) -> jax.Array:
    """One draw from softmax(scale * logits) over the last axis ([V] or [..., V]); int32.

    Exact: the law is the softmax up to float32 rounding, like Gumbel-max. -inf entries have mass
    0; every row must have a finite entry (rows without one return an arbitrary in-range index).
    Leading axes are sampled independently.
    """
    scale = jnp.asarray(scale, jnp.float32)
    block = vocab_block(logits.shape[-1])
    if block is None:
        return jax.random.categorical(key, scale * logits.astype(jnp.float32), axis=-1).astype(jnp.int32)
    x = _blocks(logits, block)  # [..., V / b, b]
    k_block, k_token = jax.random.split(key)
    b = jax.random.categorical(k_block, _flat_scaled_logsumexp(x, scale), axis=-1)
    row = jnp.take_along_axis(x, b[..., None, None], axis=-2)[..., 0, :]
    t = jax.random.categorical(k_token, scale * row.astype(jnp.float32), axis=-1)
    return (b * block + t).astype(jnp.int32)
