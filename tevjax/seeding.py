"""User seeds -> PRNG keys over the full unsigned 64-bit range.

`jax.random.key(seed)` with 64-bit types disabled (JAX's default) keeps only the low 32 bits of a
Python int seed, so seeds 0 and 2**32 give the same stream, and it overflows above 2**63 - 1.
`seed_key` instead writes the two 32-bit halves of the seed into the key: for the default
threefry2x32 implementation a key is the pair of words (k0, k1), and `jax.random.key(seed)`
itself builds (seed >> 32, seed & 0xFFFFFFFF) when 64-bit types are enabled. So the map from
seed to key is one-to-one (no two seeds share a stream), and every seed below 2**32 keeps
exactly the key `jax.random.key(seed)` gives it today. Worked example::

    seed = 2**32 + 5   ->  key words [1, 5]
    seed = 5           ->  key words [0, 5]   (== jax.random.key(5))

Under another default PRNG implementation (`jax_default_prng_impl`), whose key layout differs,
the high word is folded into the key of the low word instead.
"""

from __future__ import annotations

import operator

__all__ = ["SEED_LIMIT", "check_seed", "seed_key"]

SEED_LIMIT = 2**64  # seeds are integers in [0, SEED_LIMIT)
_LOW_MASK = 0xFFFFFFFF


def check_seed(seed) -> int:
    """`seed` as a Python int; ValueError (one line) unless it is an integer in [0, 2**64)."""
    try:
        value = None if isinstance(seed, bool) else operator.index(seed)  # ints, numpy ints
    except TypeError:
        value = None
    if value is None:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    if not 0 <= value < SEED_LIMIT:
        raise ValueError(f"seed must be in [0, 2**64) = [0, {SEED_LIMIT - 1}], got {value}")
    return value


def seed_key(seed: int):
    """A typed PRNG key (a `jax.Array`) for `seed` in [0, 2**64), distinct for every seed (see the
    module docstring). ValueError for anything else."""
    # jax is imported here so that `check_seed` (argument parsing in the CLI) stays jax-free.
    import jax
    import jax.numpy as jnp

    seed = check_seed(seed)
    low, high = seed & _LOW_MASK, seed >> 32
    key = jax.random.key(low)
    if high == 0:
        return key  # exactly jax.random.key(seed): existing seeds keep their streams
    impl = jax.random.key_impl(key)
    if str(impl) == "threefry2x32":
        return jax.random.wrap_key_data(jnp.array([high, low], jnp.uint32), impl=impl)
    return jax.random.fold_in(key, high)
