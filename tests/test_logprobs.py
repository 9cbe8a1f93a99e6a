"""`DecodeConfig.logprobs`: the target's log-probability of every generated token, read from the
tree pass that verified it, equals the log softmax of one causal pass over prompt + output, for
autoregressive and speculative decoding, greedy and sampled, whatever the block cuts."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tevjax.decode import DecodeConfig, Decoder
from tevjax.decode.engine import block_logprobs
from tevjax.models.cache import KVCache
from tevjax.models.layers import causal_mask
from test_decode import PROMPTS, models  # noqa: F401  the tiny target (vocabulary 24) and its fresh drafter

KW = dict(max_new_tokens=24, budget=8, prompt_bucket=16, capacity=64)


@functools.partial(jax.jit, static_argnames="graphdef")
def _log_softmax(graphdef, state, seq):
    t = seq.shape[1]
    target = nnx.merge(graphdef, state)
    out = target(seq, jnp.arange(t, dtype=jnp.int32)[None], KVCache.init(target.cfg, 1, t), jnp.zeros((1,), jnp.int32),
                 causal_mask(t)[None])
    return jax.nn.log_softmax(out.logits[0].astype(jnp.float32), axis=-1)


def teacher_forced(target, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """[len(tokens)] log-probabilities of `tokens` after the prompt and the tokens before each,
    from one causal pass over the whole sequence (none of the engine's code). Padded to 64
    positions, so that every row shares one compile; the causal mask hides the padding."""
    seq = np.zeros((1, 64), np.int32)
    seq[0, : len(prompt) + len(tokens) - 1] = prompt + tokens[:-1]
    logp = np.asarray(_log_softmax(*nnx.split(target), jnp.asarray(seq)))
    return logp[len(prompt) - 1 + np.arange(len(tokens)), tokens]


@pytest.mark.parametrize("verifier, temperature", [(None, 0.0), ("tev", 1.0)])
def test_logprobs_equal_a_causal_pass_over_the_output(models, verifier, temperature):
    target, drafter = models
    cfg = DecodeConfig(logprobs=True, temperature=temperature, lookup=5 if verifier else 0, eos_ids=(7,),
                       **({"verifier": verifier} if verifier else {}), **KW)
    dec = Decoder(target, drafter if verifier else None, cfg)
    gens = dec.generate(PROMPTS, seed=3)
    for p, g in zip(PROMPTS, gens):
        assert len(g.logprobs) == len(g.tokens)
        np.testing.assert_allclose(g.logprobs, teacher_forced(target, p, g.tokens), atol=2e-5)
    if verifier:
        assert max(g.tau for g in gens) > 1.2  # multi-token blocks: accepted nodes predicted tokens
    # Asking for them changes no token.
    plain = Decoder(target, drafter if verifier else None, dataclasses.replace(cfg, logprobs=False))
    assert [g.tokens for g in plain.generate(PROMPTS, seed=3)] == [g.tokens for g in gens]
    assert all(g.logprobs is None for g in plain.generate(PROMPTS[:1], seed=3))


def test_block_logprobs_reads_each_token_at_its_parent():
    """A 4-node tree, root 0 with children 1 and 2, node 3 under 2: the path 2 -> 3 and a bonus.
    Token 0 of the block is read at the root, token 1 at node 2, the bonus at node 3."""
    from types import SimpleNamespace

    logits = jnp.log(jnp.asarray([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8], [0.2, 0.6, 0.2], [0.3, 0.3, 0.4]]]))
    ver = SimpleNamespace(path=jnp.asarray([[2, 3, -1]]), tokens=jnp.asarray([[1, 0, 2, -1]]))
    got = np.asarray(block_logprobs(logits, ver))[0, :3]
    np.testing.assert_allclose(got, np.log([0.25, 0.2, 0.4]), rtol=1e-6)


def test_logprobs_must_be_a_bool():
    with pytest.raises(TypeError, match="DecodeConfig.logprobs must be a bool, got 1"):
        DecodeConfig(logprobs=1)
