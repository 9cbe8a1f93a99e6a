"""Fast reductions and exact categorical sampling over large vocabularies.

Two CPU/GPU memory-traffic lessons shape this module (see experiments/verifier_latency.py):

1. An elementwise producer (a temperature scale, a mask) feeding BOTH passes of a log-sum-exp
   makes XLA materialise the scaled [N, V] array: one extra write and two extra reads of the
   largest tensor, about 3x the cost of the bare reduction. `scaled_logsumexp` takes the max of the
   raw logits (max(s * x) = s * max(x) for s > 0) so that the scale only feeds the second pass.
2. `jax.random.categorical` adds one Gumbel variate per vocabulary entry; at V = 151,936 that
   random number generation costs more than a log-sum-exp pass. `categorical` samples in two exact
   stages instead: a block of consecutive tokens with probability equal to the block's mass
   (Gumbel-max over per-block log-sum-exps), then a token within the block (Gumbel-max over the
   block). P(token) = P(block) * P(token | block); cost: one pass plus ~V / block + block variates.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["categorical", "scaled_logsumexp"]

DEFAULT_BLOCK = 512


def scaled_logsumexp(logits: jax.Array, scale: jax.Array | float = 1.0) -> jax.Array:
    """log(sum(exp(scale * logits), axis=-1)) in float32 for scale > 0, in two fused passes.

    -inf entries contribute 0. A row that is entirely -inf (or holds NaN) yields a non-finite
    result; callers mask such rows (padding) afterwards instead of sanitising the whole array.
    """
    scale = jnp.asarray(scale, jnp.float32)
    m = jnp.max(logits, axis=-1).astype(jnp.float32)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    total = jnp.sum(jnp.exp(scale * (logits.astype(jnp.float32) - m[..., None])), axis=-1)
    return scale * m + jnp.log(total)


def categorical(
    key: jax.Array, logits: jax.Array, scale: jax.Array | float = 1.0, block: int = DEFAULT_BLOCK
) -> jax.Array:
    """One draw from softmax(scale * logits) over the last axis ([V] or [..., V]); int32.

    Exact: the law is the softmax up to float32 rounding, like Gumbel-max. -inf entries have mass
    0; every row must have a finite entry (rows without one return an arbitrary in-range index).
    Leading axes are sampled independently. V <= 2 * block uses a plain Gumbel-max draw.
    """
    scale = jnp.asarray(scale, jnp.float32)
    vocab = logits.shape[-1]
    if vocab <= 2 * block:
        return jax.random.categorical(key, scale * logits.astype(jnp.float32), axis=-1).astype(jnp.int32)
    lead = logits.shape[:-1]
    num_full, tail = divmod(vocab, block)
    # Full blocks are a free reshape of the row; a short tail block is handled on its own so that
    # the big array is never padded (padding would copy it).
    main = logits[..., : num_full * block].reshape(*lead, num_full, block)
    block_lse = scaled_logsumexp(main, scale)
    if tail:
        block_lse = jnp.concatenate([block_lse, scaled_logsumexp(logits[..., num_full * block :], scale)[..., None]], -1)
    k_block, k_token = jax.random.split(key)
    b = jax.random.categorical(k_block, block_lse, axis=-1)
    row = jnp.take_along_axis(main, jnp.minimum(b, num_full - 1)[..., None, None], axis=-2)[..., 0, :]
    if tail:
        tail_row = jnp.pad(logits[..., num_full * block :], [(0, 0)] * len(lead) + [(0, block - tail)],
                           constant_values=-jnp.inf)
        row = jnp.where((b == num_full)[..., None], tail_row, row)
    t = jax.random.categorical(k_token, scale * row.astype(jnp.float32), axis=-1)
    return (b * block + t).astype(jnp.int32)
