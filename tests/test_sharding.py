"""Sharding: the logical-axes tables, their errors, and decoding and training over device meshes.

The mesh tests run in a subprocess with 4 forced CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=4`, set before jax is imported there). Their
models are tiny: 8 query heads and 4 key/value heads of width 8, so that every (data, model) mesh
of 4 devices divides them, and a vocabulary of 64.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, PartitionSpec as P

from tevjax.cli import main
from tevjax.models.dflash import DFlashConfig, DFlashDrafter
from tevjax.sharding import (CACHE_AXES, DRAFTER_AXES, TARGET_AXES, check_batch, logical_sharding, make_mesh,
                             param_shardings, parse_mesh)
from tevjax.testing import random_model, tiny_config


def _mesh(data, model):
    """An abstract mesh of any size: shardings and their errors need no real devices."""
    return AbstractMesh((data, model), ("data", "model"))


def _specs(tree) -> dict[str, P]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {".".join(str(getattr(k, "key", getattr(k, "idx", ""))) for k in path[:-1]): s.spec for path, s in flat}


@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("qwen3", {}), ("llama", {"attention_bias": True})])
def test_every_target_array_has_axes_and_heads_split_over_model(arch, overrides):
    target = nnx.eval_shape(lambda: random_model(tiny_config(arch, num_heads=8, num_kv_heads=4, head_dim=8,
                                                             **overrides)))
    specs = _specs(param_shardings(target, _mesh(2, 4)))
    assert specs["embed_tokens.embedding"] == P("model", None)  # vocabulary over `model`
    assert specs["layers.self_attn.q_proj.kernel"] == P(None, None, "model")
    assert specs["layers.self_attn.k_proj.kernel"] == P(None, None, "model")
    assert specs["layers.self_attn.o_proj.kernel"] == P(None, "model", None)
    assert specs["layers.mlp.gate_proj.kernel"] == P(None, None, "model")
    assert specs["layers.mlp.down_proj.kernel"] == P(None, "model", None)
    assert specs["norm.scale"] == P(None)
    if arch == "llama":
        assert specs["lm_head.kernel"] == P(None, "model")
    else:  # tied embeddings, per-head q/k norms
        assert "lm_head.kernel" not in specs and specs["layers.self_attn.q_norm.scale"] == P(None, None)
    if overrides:
        assert specs["layers.self_attn.q_proj.bias"] == P(None, "model")


def test_drafter_arrays_and_optimizer_moments_share_the_table():
    import optax

    tcfg = tiny_config(num_heads=8, num_kv_heads=4, head_dim=8)
    drafter = DFlashDrafter(DFlashConfig.for_target(tcfg, num_layers=2, block_size=4, mask_token_id=5,
                                                    target_layer_ids=(0, 1), draft_vocab_size=16), rngs=nnx.Rngs(0))
    mesh = _mesh(1, 4)
    specs = _specs(param_shardings(drafter, mesh))
    assert specs["layers.1.self_attn.q_proj.kernel"] == P(None, "model")
    assert specs["layers.0.mlp.down_proj.kernel"] == P("model", None)
    assert specs["fc.kernel"] == P(None, None) and specs["draft_vocab"] == P(None)
    opt = nnx.state(nnx.Optimizer(drafter, optax.adamw(1e-3), wrt=nnx.Param))
    opt_specs = _specs(param_shardings(drafter, mesh, opt, optimizer=True))
    assert opt_specs["opt_state.0.mu.layers.1.self_attn.q_proj.kernel"] == P(None, "model")
    assert opt_specs["opt_state.0.nu.layers.0.mlp.up_proj.kernel"] == P(None, "model")
    assert opt_specs["opt_state.0.count"] == P()


def test_tables_name_only_known_logical_axes():
    from tevjax.sharding import LOGICAL_RULES

    for axes in (*TARGET_AXES.values(), *DRAFTER_AXES.values(), CACHE_AXES):
        assert set(axes) <= set(LOGICAL_RULES), axes
    # A module array missing from its table is an error, not a silent replica.
    target = nnx.eval_shape(lambda: random_model(tiny_config()))
    state = nnx.state(target)
    state["extra"] = nnx.Param(jax.ShapeDtypeStruct((3,), np.float32))
    with pytest.raises(ValueError, match="'extra' has no row"):
        param_shardings(target, _mesh(1, 1), state)


@pytest.mark.parametrize("overrides, mesh, message", [
    # (Key/value heads divide query heads, so a target meets the key/value-heads check first.)
    ({}, (1, 4), "does not divide the 2 key/value heads (num_kv_heads)"),
    ({"num_heads": 3, "num_kv_heads": 3, "intermediate_size": 100}, (1, 3),
     "does not divide the 100 MLP width (intermediate_size)"),
    ({"vocab_size": 301}, (1, 2), "does not divide the 301 vocabulary entries (vocab_size)"),
])
def test_a_mesh_that_does_not_divide_a_dimension_is_named(overrides, mesh, message):
    target = nnx.eval_shape(lambda: random_model(tiny_config(**overrides)))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        param_shardings(target, _mesh(*mesh))


def test_batch_and_shape_checks():
    with pytest.raises(ValueError, match=r"size 4 does not divide the 6 query heads \(num_heads\) of q"):
        logical_sharding(_mesh(1, 4), ("embed", "heads"), (64, 48), units={"heads": 6}, what="q")
    with pytest.raises(ValueError, match="does not divide the 3 batch rows of a batch of 3"):
        check_batch(_mesh(2, 1), 3, "a batch of 3")
    check_batch(_mesh(2, 1), 4)
    assert logical_sharding(_mesh(2, 2), CACHE_AXES, (2, 4, 16, 2, 8)).spec == P(None, "data", None, "model", None)
    # A mesh without a `model` axis splits nothing over it.
    assert logical_sharding(AbstractMesh((2,), ("data",)), ("batch", "heads"), (4, 6)).spec == P("data", None)
    target = nnx.eval_shape(lambda: random_model(tiny_config()))
    state = nnx.state(target)
    state["norm"]["scale"] = nnx.Param(jax.ShapeDtypeStruct((65,), np.float32))
    with pytest.raises(AssertionError, match=r"'norm.scale' has shape \(65,\)"):
        param_shardings(target, _mesh(1, 1), state)


def test_mesh_parsing_and_device_count_errors():
    assert parse_mesh("data=2, model=1") == {"data": 2, "model": 1}
    with pytest.raises(ValueError, match="expected entries like data=2,model=1"):
        parse_mesh("data=two")
    n = len(jax.devices())
    with pytest.raises(ValueError, match=f"needs {4 * n} devices, {n} are present"):
        make_mesh(4 * n, 1)
    with pytest.raises(ValueError, match=f"model={2 * n} needs at least {2 * n} devices"):
        make_mesh(None, 2 * n)


@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt-ids", "1,2", "--mesh", "data=64,model=2"], "needs 128 devices"),
    (["generate", "--prompt-ids", "1,2", "--mesh", "data=x"], "expected entries like data=2,model=1"),
    (["eval", "--mesh", "model=64"], "model=64 needs at least 64 devices"),
])
def test_cli_mesh_errors_are_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


# ------------------------------------------------------------------------- forced devices

def _run(script: str, prelude: str = "", timeout: int = 1500) -> str:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import jax
        assert len(jax.devices()) == 4, jax.devices()
    """) + prelude + textwrap.dedent(script)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)
    assert res.returncode == 0 and "OK" in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]
    return res.stdout


# Shared by the subprocess scripts: tiny models, prompts, and the HLO check.
COMMON = """
import re
import numpy as np
from flax import nnx
from tevjax.decode import DecodeConfig, Decoder
from tevjax.models.dflash import DFlashConfig, DFlashDrafter
from tevjax.sharding import make_mesh
from tevjax.testing import random_model, tiny_config

PROMPTS = [[1, 5, 7, 9, 11], [1, 3], [1, 4, 4, 4, 8, 9], [6]]

def models(arch="llama"):
    tcfg = tiny_config(arch, vocab_size=64, num_heads=8, num_kv_heads=4, head_dim=8)
    target = random_model(tcfg, seed=0)
    dcfg = DFlashConfig.for_target(tcfg, num_layers=1, block_size=4, mask_token_id=63)
    return target, DFlashDrafter(dcfg, rngs=nnx.Rngs(1))

def config(verifier="tev", temperature=0.0):
    return DecodeConfig(verifier=verifier, budget=4, max_new_tokens=8, temperature=temperature,
                        prompt_bucket=8, capacity=32)

def tokens(decoder, seed=0):
    return [g.tokens for g in decoder.generate(PROMPTS, seed=seed)]

def check_loop_hlo(decoder, mesh):
    # Every weight stays split as its table says, and no all-gather in the compiled loop moves
    # as much as one split weight or the [B, N, V] logits of a tree pass.
    split = [x for x in jax.tree.leaves((decoder.tstate, decoder.dstate)) if any(x.sharding.spec)]
    assert split, "no weight is split"
    for x in split:
        shard = x.addressable_shards[0].data.shape
        assert np.prod(shard) * mesh.shape["model"] == np.prod(x.shape), (x.shape, shard, x.sharding)
    state = decoder.prefill(PROMPTS)
    hlo = decoder.compiled_loop(state).as_text()
    logits = state.root.shape[0] * decoder.tree_slots * decoder.target_cfg.vocab_size
    limit = min([logits] + [int(np.prod(x.shape)) for x in split])
    gathers = []
    for line in hlo.splitlines():
        m = re.search(r"= (.*?) all-gather(-start)?\\(", line)
        if m:
            gathers += [int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                        for dims in re.findall(r"\\[([0-9,]*)\\]", m.group(1))]
    assert max(gathers, default=0) < limit, (sorted(gathers)[-5:], limit)
    return len(gathers)
"""


def test_decoding_on_a_2x2_mesh_equals_unsharded_and_keeps_weights_split():
    """Qwen3-style tiny target (tied embeddings: the LM head is the vocabulary-split embedding),
    TEV, greedy: checkpoints load straight into their shardings, data x tensor parallel decoding
    gives the unsharded tokens, and the compiled loop gathers no weight and no [B, N, V] logits."""
    _run(prelude=COMMON, script="""
        import tempfile
        from tevjax.convert.dflash_ckpt import load_dflash, save_dflash
        from tevjax.convert.hf import load_hf_target, save_hf_target
        from tevjax.sharding import param_shardings

        target, drafter = models("qwen3")
        reference = tokens(Decoder(target, drafter, config()))
        mesh = make_mesh(2, 2)
        with tempfile.TemporaryDirectory() as tmp:
            save_hf_target(target, tmp + "/target")
            save_dflash(drafter, drafter.cfg, tmp + "/drafter")
            _, loaded_target = load_hf_target(tmp + "/target", mesh=mesh)
            _, loaded_drafter = load_dflash(tmp + "/drafter", target.cfg, mesh=mesh)
        for original, loaded in ((target, loaded_target), (drafter, loaded_drafter)):
            want = param_shardings(loaded, mesh)
            jax.tree.map(lambda a, b, s: (np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                                          np.testing.assert_equal(b.sharding.spec, s.spec)),
                         nnx.state(original), nnx.state(loaded), want)
        sharded = Decoder(loaded_target, loaded_drafter, config(), mesh=mesh)
        assert tokens(sharded) == reference, (tokens(sharded), reference)
        check_loop_hlo(sharded, mesh)
        # 3 prompts on a data axis of 2: generate pads a row and drops it.
        three = [g.tokens for g in sharded.generate(PROMPTS[:3])]
        assert three == reference[:3], (three, reference)
        print("OK")
    """)


@pytest.mark.slow
def test_every_verifier_on_every_mesh():
    """Greedy: every verifier on meshes (4, 1), (2, 2) and (1, 4), and autoregressive decoding on
    (1, 4), equal unsharded decoding token for token. Temperature 1: data-parallel (4, 1) decoding
    gives the unsharded tokens for the same seeds (each row keeps its own PRNG stream and its own
    arithmetic). Tensor parallelism splits the sums of o_proj, down_proj and the log-sum-exps over
    devices, which rounds differently (~1e-7 relative), so a sampled token may differ in rare
    near-ties: at temperature 1 on (1, 4) only validity is asserted, not bitwise equality."""
    _run(prelude=COMMON, script="""
        target, drafter = models()
        for verifier in ("tev", "predraw", "sequential"):
            reference = tokens(Decoder(target, drafter, config(verifier)))
            for shape in ((4, 1), (2, 2), (1, 4)):
                mesh = make_mesh(*shape)
                dec = Decoder(target, drafter, config(verifier), mesh=mesh)
                assert tokens(dec) == reference, (verifier, shape)
                if verifier == "tev" and shape != (4, 1):
                    check_loop_hlo(dec, mesh)
            sampled = tokens(Decoder(target, drafter, config(verifier, 1.0)), seed=3)
            dp = tokens(Decoder(target, drafter, config(verifier, 1.0), mesh=make_mesh(4, 1)), seed=3)
            assert dp == sampled, (verifier, dp, sampled)
            tp = tokens(Decoder(target, drafter, config(verifier, 1.0), mesh=make_mesh(1, 4)), seed=3)
            assert [len(t) for t in tp] == [8] * 4 and all(0 <= x < 64 for t in tp for x in t)
        ar = tokens(Decoder(target, None, config()))
        assert tokens(Decoder(target, None, config(), mesh=make_mesh(1, 4))) == ar
        print("OK")
    """)


@pytest.mark.slow
def test_training_step_on_meshes_equals_one_device():
    """Two steps (token + exit loss) on meshes (2, 1) and (1, 2) equal the single-device steps.
    Split sums round differently (~1e-7 relative) and Adam divides by sqrt(v), so after two steps a
    parameter may differ by a few 1e-6: the stated tolerance is 2e-5 absolute on parameters
    (lr 3e-3) and 1e-5 relative on metrics, as for the data-parallel test in test_train.py."""
    _run("""
        import jax.numpy as jnp
        import numpy as np
        from tevjax.sharding import make_mesh
        from tevjax.train.dataset import Batch
        from tevjax.train.step import Trainer
        from test_train import CFG, _drafter, _target

        target = _target()
        rng = np.random.default_rng(0)
        b, t = CFG.batch_size, CFG.seq_len
        feats = 2 * target.cfg.hidden_size
        batch = Batch(tokens=jnp.asarray(rng.integers(3, 300, (b, t)), jnp.int32),
                      loss_mask=jnp.asarray(np.arange(t)[None, :] >= 8).repeat(b, 0),
                      features=jnp.asarray(rng.standard_normal((b, t, feats)), jnp.float32),
                      length=jnp.full((b,), t, jnp.int32))
        out = {}
        for shape in ((1, 1), (2, 1), (1, 2)):
            devices = jax.devices()[: shape[0] * shape[1]]
            trainer = Trainer(_drafter(target), target, CFG, make_mesh(*shape, devices=devices))
            state = trainer.init_state()
            for _ in range(2):
                state, metrics = trainer.step(state, batch)
            if shape == (1, 2):
                q = state.params["layers"][0]["self_attn"]["q_proj"]["kernel"].value
                assert q.addressable_shards[0].data.shape[1] * 2 == q.shape[1], q.sharding
                moments = [x for path, x in jax.tree_util.tree_flatten_with_path(state.opt)[0]
                           if "'mu'" in str(path) and "'up_proj'" in str(path)]
                assert moments and all(m.sharding.spec == jax.sharding.PartitionSpec(None, "model")
                                       for m in moments), [m.sharding for m in moments]
            out[shape] = (jax.tree.map(np.asarray, state.params), {k: float(v) for k, v in metrics.items()})
        for shape in ((2, 1), (1, 2)):
            jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5),
                         out[(1, 1)][0], out[shape][0])
            for k, v in out[(1, 1)][1].items():
                np.testing.assert_allclose(v, out[shape][1][k], rtol=1e-5, atol=1e-6, err_msg=f"{shape} {k}")
        print("OK")
    """)
