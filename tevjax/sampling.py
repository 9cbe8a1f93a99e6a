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
4. XLA:CPU's sort and `lax.top_k` are slow on long rows: about 70-85 ms for [9, 49152], more than
   a whole speculative round of SmolLM2. `truncate_logits` therefore finds its top-k and top-p cut
   by bisection over the float32 bit patterns (32 masked sums, ~2-4 ms there), which is exact: it
   lands on a logit value itself, not an approximation of one.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from tevjax.checks import is_int, is_real
from tevjax.tree import concrete_temperature, valid_temperature

__all__ = ["categorical", "check_truncation", "inverse_temperature", "scaled_logsumexp", "scaled_lse_parts",
           "truncate_logits", "truncates", "vocab_block"]

# The smallest normal float32. Above a temperature of 1 / _MIN_SCALE (~8.5e37, still a valid one) 1 / temperature
# is subnormal, which XLA flushes to 0 (and a traced +inf gives 0 outright); then a masked logit makes
# 0 * -inf = NaN, the whole row's law turns NaN and the masked token is the one drawn. At this floor
# -inf * scale stays -inf, and finite logits scale to ~0: uniform over the unmasked tokens.
_MIN_SCALE = float(np.finfo(np.float32).tiny)


def inverse_temperature(temperature) -> jax.Array:
    """float32 1 / temperature for the sampling laws (1 where temperature <= 0 or NaN: callers take
    the greedy path there), never below the smallest normal float32 (see `_MIN_SCALE`)."""
    t = jnp.asarray(temperature, jnp.float32)
    return jnp.maximum(1.0 / jnp.where(t > 0, t, 1.0), _MIN_SCALE)


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


def _row_max(logits: jax.Array) -> jax.Array:
    # float32 max over the last axis, 0 where it is not finite (an all -inf padding row, NaN)
    m = jnp.max(logits, axis=-1).astype(jnp.float32)
    return jnp.where(jnp.isfinite(m), m, 0.0)


def _flat_lse_parts(logits: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    m = _row_max(logits)
    return m, jnp.log(jnp.sum(jnp.exp(scale * (logits.astype(jnp.float32) - m[..., None])), axis=-1))


def _blocks(logits: jax.Array, block: int) -> jax.Array:
    return logits.reshape(*logits.shape[:-1], logits.shape[-1] // block, block)


def _block_parts(blocks: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(each block's max and shifted log-sum-exp [..., V / b], the row's max m [...]) of [..., V / b, b]
    blocks. m comes from the block results, not another pass: blocks that are all -inf do not count."""
    block_max, block_lse = _flat_lse_parts(blocks, scale)
    return block_max, block_lse, _row_max(jnp.where(block_lse == -jnp.inf, -jnp.inf, block_max))


def _block_weights(block_max: jax.Array, block_lse: jax.Array, m: jax.Array, scale: jax.Array) -> jax.Array:
    # Each block's log-mass relative to the row's shift m: block_lse + scale * (block_max - m). An
    # all -inf block stays -inf (its block_max is a stand-in 0 that may exceed m); NaN stays NaN.
    return jnp.where(block_lse == -jnp.inf, -jnp.inf, block_lse + scale * (block_max - m[..., None]))


def scaled_lse_parts(logits: jax.Array, scale: jax.Array | float = 1.0) -> tuple[jax.Array, jax.Array]:
    """(m, s) with log(sum(exp(scale * logits), axis=-1)) = scale * m + s, for scale > 0; float32.

    m is the row's largest logit and s = log(sum(exp(scale * (logits - m)))), which lies in
    [0, log V]. A log-probability is then scale * (x - m) - s: unlike scale * x - lse, it neither
    overflows (finite logits beyond ~3.4e38 * temperature made lse +inf and the law NaN) nor loses
    the law's detail to rounding (at a logit of 30 and temperature 1e-4, scale * x is 3e5, whose
    float32 spacing of 0.03 shifted every probability by up to 3%).
    -inf entries contribute 0. A row that is entirely -inf (or holds NaN) yields a non-finite s;
    callers mask such rows (padding) afterwards instead of sanitising the whole array.
    """
    scale = jnp.asarray(scale, jnp.float32)
    block = vocab_block(logits.shape[-1])
    if block is None:
        return _flat_lse_parts(logits, scale)
    block_max, block_lse, m = _block_parts(_blocks(logits, block), scale)
    return m, jax.nn.logsumexp(_block_weights(block_max, block_lse, m, scale), axis=-1)


def scaled_logsumexp(logits: jax.Array, scale: jax.Array | float = 1.0) -> jax.Array:
    """log(sum(exp(scale * logits), axis=-1)) in float32 for scale > 0 (`scaled_lse_parts`, whose
    split form the sampling laws use; this sum overflows for logits beyond ~3.4e38 / scale)."""
    m, s = scaled_lse_parts(logits, scale)
    return jnp.asarray(scale, jnp.float32) * m + s


def categorical(key: jax.Array, logits: jax.Array, scale: jax.Array | float = 1.0) -> jax.Array:
    """One draw from softmax(scale * logits) over the last axis ([V] or [..., V]); int32.

    Exact: the law is the softmax up to float32 rounding, like Gumbel-max; the logits are shifted
    by their maximum before scaling, so huge logits or small temperatures neither overflow nor
    round the Gumbel noise away. -inf entries have mass 0; every row must have a finite entry
    (rows without one return an arbitrary in-range index). Leading axes are sampled independently.
    """
    scale = jnp.asarray(scale, jnp.float32)
    block = vocab_block(logits.shape[-1])
    if block is None:
        x = logits.astype(jnp.float32) - _row_max(logits)[..., None]
        return jax.random.categorical(key, scale * x, axis=-1).astype(jnp.int32)
    x = _blocks(logits, block)  # [..., V / b, b]
    k_block, k_token = jax.random.split(key)
    block_max, block_lse, m = _block_parts(x, scale)
    b = jax.random.categorical(k_block, _block_weights(block_max, block_lse, m, scale), axis=-1)
    row = jnp.take_along_axis(x, b[..., None, None], axis=-2)[..., 0, :].astype(jnp.float32)
    shift = jnp.take_along_axis(block_max, b[..., None], axis=-1)
    t = jax.random.categorical(k_token, scale * (row - shift), axis=-1)
    return (b * block + t).astype(jnp.int32)


def check_truncation(top_k, top_p, min_p) -> tuple[int, float, float]:
    """(top_k, top_p, min_p) as an int and two floats, or a ValueError/TypeError naming the bad one.

    top_k: an int >= 0 (0: off); top_p: in (0, 1] (1: off); min_p: in [0, 1) (0: off).
    """
    if not is_int(top_k):
        raise TypeError(f"top_k must be an int (0: off), got {top_k!r} ({type(top_k).__name__})")
    for name, value in (("top_p", top_p), ("min_p", min_p)):
        if not is_real(value):
            raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: off), got {top_k}")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] (1: off), got {top_p!r}")
    if not (math.isfinite(min_p) and 0 <= min_p < 1):
        raise ValueError(f"min_p must be in [0, 1) (0: off), got {min_p!r}")
    return int(top_k), float(top_p), float(min_p)


def truncates(top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> bool:
    """Whether any of the settings cuts anything: top_k > 0, top_p < 1 or min_p > 0."""
    return top_k > 0 or top_p < 1 or min_p > 0


def _order_keys(x: jax.Array) -> jax.Array:
    """int32 keys in the order of the float32 values (-0.0 just below +0.0; NaN at the ends)."""
    i = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(i < 0, i ^ jnp.int32(0x7FFFFFFF), i)


def _largest_cut(keys: jax.Array, weight: jax.Array, target: jax.Array) -> jax.Array:
    """[..., 1] the largest key t with sum(weight[keys >= t]) >= target, per row.

    The sum only shrinks as t grows, and t = the row's least key holds every weight, so bisection
    over [least key, greatest key] finds it; 32 halvings cover any int32 span. The weights are
    non-negative; the result is a key that occurs in the row (the cut sits on a value).
    """
    lo = jnp.min(keys, axis=-1, keepdims=True)
    hi = jnp.max(keys, axis=-1, keepdims=True)

    def halve(_, bounds):
        lo, hi = bounds
        # The upper midpoint of [lo, hi] without int32 overflow.
        mid = (lo >> 1) + (hi >> 1) + ((lo | hi) & 1)
        held = jnp.sum(jnp.where(keys >= mid, weight, 0.0), axis=-1, keepdims=True) >= target
        return jnp.where(held, mid, lo), jnp.where(held, hi, mid - 1)

    lo, _ = jax.lax.fori_loop(0, 32, halve, (lo, hi))
    return lo


def truncate_logits(logits: jax.Array, temperature=1.0, *, top_k=0, top_p=1.0, min_p=0.0) -> jax.Array:
    """`logits` [..., V] with -inf outside the tokens that top-k, then top-p, then min-p keep.

    The target law of truncated sampling is softmax(truncate_logits(x, t, ...) / t). Applied in
    Hugging Face's order (temperature, top-k, top-p, min-p) and with its rules, up to ties:
    - top-k keeps the tokens whose logit is at least the k-th largest;
    - top-p keeps a token when the tokens more probable than it (after top-k) hold less than
      top_p of the mass: the smallest most-probable set with mass >= top_p;
    - min-p keeps the tokens with probability >= min_p times the largest.
    Tokens tied at a cut are all kept or all cut, so the kept set depends on the values alone,
    never on a sort order (Hugging Face's sort may keep part of a tie). The most probable token is
    always kept, so greedy decoding is unchanged by any setting.

    top_k, top_p and min_p are static Python numbers (`check_truncation`), or arrays that
    broadcast against `logits.shape[:-1]` (one setting per row, e.g. [B, 1] for [B, N, V] logits;
    traced, not checked: 0 / 1 / 0 leave a row uncut); `temperature` may be traced. A row without
    a finite entry (padding) comes back all -inf. Jittable, vmap-composable; the dtype of `logits`
    is kept; with every static setting off, `logits` itself is returned.
    """
    # Integer logits would fail inside with "cannot convert float infinity to integer", a scalar
    # with an IndexError: name the argument instead.
    if np.ndim(logits) < 1 or not jnp.issubdtype(jnp.result_type(logits), jnp.floating):
        raise TypeError(f"truncate_logits: logits must be a floating [..., V] array, got shape {np.shape(logits)} "
                        f"and dtype {jnp.result_type(logits)}")
    # A concrete scalar follows the one rule (valid_temperature); per-row arrays are not checked.
    t_host = concrete_temperature(temperature, scalar=False)
    if t_host is not None and not valid_temperature(t_host):
        raise ValueError(f"temperature must be a finite float32 number >= 0, got {temperature!r}")
    per_row = any(isinstance(v, (jax.Array, np.ndarray)) for v in (top_k, top_p, min_p))
    if not per_row:
        top_k, top_p, min_p = check_truncation(top_k, top_p, min_p)
        if not truncates(top_k, top_p, min_p):
            return logits
    vocab = logits.shape[-1]
    x = logits.astype(jnp.float32)
    keys = _order_keys(x)
    keep = jnp.ones(x.shape, bool)
    if per_row:
        # Each cut's bisection (32 passes over the logits) runs only when some row asks for it.
        k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32)[..., None], x.shape[:-1] + (1,))
        on = (k > 0) & (k < vocab)
        keep = jax.lax.cond(jnp.any(on), lambda: jnp.where(on, keys >= _largest_cut(
            keys, jnp.ones_like(x), jnp.clip(k, 1, vocab).astype(jnp.float32)), keep), lambda: keep)
    elif 0 < top_k < vocab:
        keep = keys >= _largest_cut(keys, jnp.ones_like(x), jnp.float32(top_k))
    inv_t = inverse_temperature(temperature)
    top = jnp.max(x, axis=-1, keepdims=True)
    scaled = (x - jnp.where(jnp.isfinite(top), top, 0.0)) * inv_t  # log p + log Z, <= 0
    def top_p_cut(p):
        mass = jnp.where(keep, jnp.exp(scaled), 0.0)
        return keys >= _largest_cut(keys, mass, p * jnp.sum(mass, axis=-1, keepdims=True))

    if per_row:
        p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32)[..., None], x.shape[:-1] + (1,))
        keep = jax.lax.cond(jnp.any(p < 1), lambda: keep & (top_p_cut(p) | (p >= 1)), lambda: keep)
    elif top_p < 1:
        keep = keep & top_p_cut(top_p)
    if per_row:
        m = jnp.asarray(min_p, jnp.float32)[..., None]
        keep = keep & ((m <= 0) | (scaled >= jnp.log(jnp.where(m > 0, m, 1.0))))
    elif min_p > 0:
        keep = keep & (scaled >= math.log(min_p))
    return jnp.where(keep, logits, jnp.asarray(-jnp.inf, logits.dtype))
