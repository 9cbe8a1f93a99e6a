"""bfloat16 numerics: bf16 weights and activations, float32 logits, softmax and exit-law arithmetic.

The decisive check: greedy decoding of a bf16 model agrees with the float32 model wherever the
float32 decision is clear. Both models hold the same random weights (the bf16 ones are the float32
ones rounded) and are stepped through the engine's own decode step along the float32 greedy
trajectory (teacher forcing, so one early disagreement cannot derail every later comparison).

The stated bound: every bf16 logit is within LOGIT_ERROR = 0.125 of its float32 value (32 bf16
roundoff units, u = 2^-8, on logits of standard deviation ~1; measured maximum 0.08 on CPU). If
that holds, a float32 top-2 margin above MARGIN = 2 * LOGIT_ERROR cannot be flipped, so at those
positions the bf16 argmax must equal the float32 one. The test checks the error bound itself too,
so the margin argument is never vacuous.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tevjax.decode import engine
from tevjax.models.dflash import DFlashConfig, DFlashDrafter
from tevjax.models.transformer import Transformer
from tevjax.testing import random_model, tiny_config
from test_prefill import all_eqns

LOGIT_ERROR = 0.125
MARGIN = 2 * LOGIT_ERROR
STEPS, PROMPT, ROWS = 48, 12, 4

CFG32 = tiny_config("qwen3", num_layers=4, vocab_size=512)
CFG16 = dataclasses.replace(CFG32, dtype="bfloat16", param_dtype="bfloat16")
# A hybrid target too (Qwen3.5's dense layers: routing would flip on rounding, a change no bound covers):
# three Gated DeltaNet layers, their recurrent state float32, their keys and values recorded and committed
# in bf16, and one gated attention layer. Its bf16 roundings are more (conv, the delta rule's output, the
# gated norm), and the delta rule's reads compound them: its bound is wider (measured maximum 0.21 on
# CPU); a vocabulary of 16 widens the top-2 margins, so that enough positions clear twice it.
HYBRID32 = tiny_config("qwen3_5_text", num_layers=4, vocab_size=16, linear_layers=(0, 1, 2), linear_key_dim=64,
                       linear_value_dim=64)
HYBRID_LOGIT_ERROR = 0.3


@functools.partial(jax.jit, static_argnums=0)
def _decode_step(graphdef, state, root, cache_len, cache):
    """The engine's autoregressive step: a root-only tree pass and its commit -> (logits [B, V], cache)
    (a commit moves nothing here; a hybrid target's linear layers run the root into their state)."""
    out = engine.tree_pass(nnx.merge(graphdef, state), engine.root_trees(root), cache_len, cache)
    b = root.shape[0]
    return out.logits[:, 0], out.cache.advance(jnp.zeros((b, 1), jnp.int32), jnp.ones((b,), jnp.int32))


@pytest.mark.parametrize("cfg32, bound, min_clear", [
    pytest.param(CFG32, LOGIT_ERROR, 0.25, id="qwen3"),
    pytest.param(HYBRID32, HYBRID_LOGIT_ERROR, 0.25, id="qwen3_5_text", marks=pytest.mark.slow)])
def test_bf16_greedy_matches_float32_where_the_margin_exceeds_the_bound(cfg32, bound, min_clear):
    cfg16 = dataclasses.replace(cfg32, dtype="bfloat16", param_dtype="bfloat16")
    decoders = {name: engine.Decoder(random_model(cfg, seed=0), None, engine.DecodeConfig(max_new_tokens=STEPS))
                for name, cfg in (("f32", cfg32), ("bf16", cfg16))}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg32.vocab_size, PROMPT).tolist() for _ in range(ROWS)]
    states = {name: d.prefill(prompts) for name, d in decoders.items()}
    caches = {name: s.target_cache for name, s in states.items()}
    assert states["bf16"].target_cache.k.dtype == jnp.bfloat16
    root, cache_len = states["f32"].root, states["f32"].cache_len

    errors, margins, agree, trajectory = [], [], [], []
    for _ in range(STEPS):
        logits = {}
        for name, d in decoders.items():
            logits[name], caches[name] = _decode_step(d.tgd, d.tstate, root, cache_len, caches[name])
        assert logits["bf16"].dtype == jnp.float32  # bf16 activations, float32 logits
        l32, l16 = np.asarray(logits["f32"]), np.asarray(logits["bf16"])
        top2 = np.sort(l32, axis=-1)[:, -2:]
        margins.append(top2[:, 1] - top2[:, 0])
        errors.append(np.max(np.abs(l16 - l32), axis=-1))
        agree.append(np.argmax(l16, axis=-1) == np.argmax(l32, axis=-1))
        root = jnp.asarray(np.argmax(l32, axis=-1), jnp.int32)  # follow the float32 trajectory
        trajectory.append(np.asarray(root))
        cache_len = cache_len + 1
    errors, margins, agree = map(np.concatenate, (errors, margins, agree))

    assert errors.max() < bound, f"bf16 logit error {errors.max():.3f} exceeds the stated bound {bound}"
    clear = margins > 2 * bound
    assert clear.sum() >= min_clear * clear.size, (f"only {clear.sum()} of {clear.size} positions have margin > "
                                                   f"{2 * bound}")
    bad = np.flatnonzero(clear & ~agree)
    assert bad.size == 0, f"bf16 argmax differs at positions {bad.tolist()} with float32 margins {margins[bad]}"

    # The trajectory followed is float32 greedy decoding itself (the engine's while loop).
    gens = decoders["f32"].generate(prompts)
    np.testing.assert_array_equal(np.array([g.tokens for g in gens]), np.stack(trajectory, axis=1))


def _dot_precisions(jaxpr) -> list:
    """(operand dtype, precision, result dtype) of every dot_general in a jaxpr, sub-jaxprs included."""
    return [(e.invars[0].aval.dtype, e.params["precision"], e.outvars[0].aval.dtype)
            for e in all_eqns(jaxpr) if e.primitive.name == "dot_general"]


def _engine_jaxprs(cfg):
    """The jaxprs of one speculative round (drafter, builder, target tree pass, verifier, commit) and
    of one prefill chunk (the causal path), traced on abstract models and state (nothing is
    initialised or compiled)."""
    dcfg = DFlashConfig.for_target(cfg, num_layers=2, block_size=4, mask_token_id=cfg.vocab_size - 1,
                                   target_layer_ids=(0, 2))
    target = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    drafter = nnx.eval_shape(lambda: DFlashDrafter(dcfg, rngs=nnx.Rngs(0)))
    decoder = engine.Decoder(target, drafter, engine.DecodeConfig(budget=4, temperature=1.0, max_new_tokens=8))
    _, capacity = decoder.shapes([3])
    state = decoder._abstract_state(1, capacity)
    statics = dict(tgd=decoder.tgd, dgd=decoder.dgd, cfg=decoder.cfg)
    tokens = jax.ShapeDtypeStruct((1, decoder.chunk_size([3])), jnp.int32)
    return (jax.make_jaxpr(functools.partial(engine._round, **statics))(decoder.tstate, decoder.dstate, state).jaxpr,
            jax.make_jaxpr(functools.partial(engine._prefill_chunk, **statics))(
                decoder.tstate, decoder.dstate, state, tokens, jnp.int32(0)).jaxpr)


def test_float32_matmuls_are_true_float32_and_bf16_ones_accumulate_logits_in_float32():
    # float32: every product HIGHEST (GPUs would otherwise run TF32 and miss the parity tolerances),
    # in the rounds and in the causal path of prefill alike.
    for jaxpr in _engine_jaxprs(CFG32):
        dots = _dot_precisions(jaxpr)
        assert dots and all(p is not None and all(x == jax.lax.Precision.HIGHEST for x in p) for _, p, _ in dots), dots
    # bf16: tensor-core products; attention scores and the logits (V-wide outputs) come out float32.
    for jaxpr in _engine_jaxprs(CFG16):
        dots = _dot_precisions(jaxpr)
        assert dots and all(dt == jnp.bfloat16 for dt, _, _ in dots), dots
        assert any(out == jnp.float32 for _, _, out in dots)
