"""Seeds over the full unsigned 64-bit range: no aliasing, both ends accepted, the rest refused."""

import jax
import numpy as np
import pytest

from tevjax.seeding import SEED_LIMIT, check_seed, seed_key


def _words(key):
    return tuple(int(w) for w in np.asarray(jax.random.key_data(key)))


def test_seeds_below_2_32_keep_their_keys():
    for seed in (0, 1, 12345, 2**31, 2**32 - 1):
        assert _words(seed_key(seed)) == _words(jax.random.key(seed)), seed


def test_high_bits_are_not_dropped():
    # jax.random.key(2**32) == jax.random.key(0) without 64-bit types: the defect this fixes.
    assert _words(seed_key(2**32)) != _words(seed_key(0))
    draws = {s: np.asarray(jax.random.uniform(seed_key(s), (4,)))
             for s in (0, 2**32, 2**33, 2**63, 2**64 - 2**32, 5, 2**32 + 5)}
    values = [tuple(d) for d in draws.values()]
    assert len(set(values)) == len(values)


def test_key_words_are_the_seed_halves():
    # one-to-one by construction: the key holds (seed >> 32, seed & 0xFFFFFFFF)
    for seed in (2**32, 2**32 + 5, 2**63 - 1, 2**64 - 1, 0xDEADBEEF_0BADF00D):
        assert _words(seed_key(seed)) == (seed >> 32, seed & 0xFFFFFFFF), seed


def test_matches_jax_with_64_bit_types():
    # with x64 enabled, jax.random.key itself builds the same key from a 64-bit seed
    with jax.enable_x64(True):
        for seed in (2**32 + 5, 2**63 - 1):
            assert _words(seed_key(seed)) == _words(jax.random.key(seed)), seed


def test_both_ends_and_numpy_integers():
    assert _words(seed_key(0)) == (0, 0)
    assert _words(seed_key(SEED_LIMIT - 1)) == (2**32 - 1, 2**32 - 1)
    assert _words(seed_key(np.uint64(2**64 - 1))) == (2**32 - 1, 2**32 - 1)
    assert check_seed(np.int64(7)) == 7


@pytest.mark.parametrize("seed, message", [
    (-1, r"seed must be in \[0, 2\*\*64\) = \[0, 18446744073709551615\], got -1"),
    (2**64, r"got 18446744073709551616"),
    (1.5, r"seed must be an integer in \[0, 2\*\*64\), got 1.5"),
    ("3", r"got '3'"),
    (True, r"got True"),
])
def test_out_of_range_or_non_integer_seeds(seed, message):
    with pytest.raises(ValueError, match=message):
        seed_key(seed)


def test_another_prng_implementation_folds_the_high_word_in():
    # Under a key layout other than threefry's (here "rbg"), the high word is folded into the low
    # word's key: seeds that share their low word still get distinct keys.
    with jax.default_prng_impl("rbg"):
        seeds = (5, 2**32 + 5, 2**33 + 5, 2**64 - 2**32 + 5)
        words = [tuple(np.asarray(jax.random.key_data(seed_key(s))).ravel()) for s in seeds]
        assert len(set(words)) == len(seeds)
        assert str(jax.random.key_impl(seed_key(2**33 + 5))) == "rbg"
        assert (np.asarray(jax.random.key_data(seed_key(2**33 + 5)))
                == np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.key(5), 2)))).all()
