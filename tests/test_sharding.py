"""Sharding: the logical-axes tables, their errors, and decoding and training over device meshes.

The mesh tests run in one subprocess per test with 4 forced CPU devices
(`XLA_FLAGS=--xla_force_host_platform_device_count=4`, set before jax is imported there), each
running several named checks (`CHECKS` below) so that jax is imported once. Their models are
tiny: 8 query heads and 4 key/value heads of width 8, so that every (data, model) mesh of 4
devices divides them, a vocabulary of 96 and a drafter with a reduced vocabulary of 48 ids.
"""

from __future__ import annotations

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
from tevjax.testing import forced_devices_env, random_model, tiny_config


def _mesh(data, model):
    """An abstract mesh of any size: shardings and their errors need no real devices."""
    return AbstractMesh((data, model), ("data", "model"))


def _specs(tree) -> dict[str, P]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {".".join(str(getattr(k, "key", getattr(k, "idx", ""))) for k in path[:-1]): s.spec for path, s in flat}


@pytest.mark.parametrize("arch, overrides", [("llama", {}), ("qwen3", {}), ("llama", {"attention_bias": True}),
                                             ("qwen2", {}), ("gemma2", {}), ("gemma3_text", {}), ("phi3", {}),
                                             ("mixtral", {}), ("qwen3_moe", {}), ("qwen2_moe", {}), ("smollm3", {}),
                                             ("granite", {}), ("olmo2", {}), ("olmo3", {}), ("olmoe", {}),
                                             ("granitemoe", {}), ("gpt_oss", {})])
def test_every_target_array_has_axes_and_heads_split_over_model(arch, overrides):
    target = nnx.eval_shape(lambda: random_model(tiny_config(arch, num_heads=8, num_kv_heads=4, head_dim=8,
                                                             **overrides)))
    specs = _specs(param_shardings(target, _mesh(2, 4)))
    assert specs["embed_tokens.embedding"] == P("model", None)  # vocabulary over `model`
    assert specs["layers.self_attn.q_proj.kernel"] == P(None, None, "model")
    assert specs["layers.self_attn.k_proj.kernel"] == P(None, None, "model")
    assert specs["layers.self_attn.o_proj.kernel"] == P(None, "model", None)
    cfg = target.cfg
    if cfg.moe:  # each expert's width over `model`, every expert on every device; the router whole
        assert specs["layers.mlp.gate_proj"] == specs["layers.mlp.up_proj"] == P(None, None, None, "model")
        assert specs["layers.mlp.down_proj"] == P(None, None, "model", None)
        assert specs["layers.mlp.router.kernel"] == P(None, None, None)
        if cfg.shared_expert_size:  # Qwen2-MoE's shared expert: split as a dense MLP, its gate whole
            assert specs["layers.mlp.shared_expert.gate_proj.kernel"] == P(None, None, "model")
            assert specs["layers.mlp.shared_expert.down_proj.kernel"] == P(None, "model", None)
            assert specs["layers.mlp.shared_expert_gate.kernel"] == P(None, None, None)
    else:
        assert specs["layers.mlp.gate_proj.kernel"] == P(None, None, "model")
        assert specs["layers.mlp.down_proj.kernel"] == P(None, "model", None)
    assert specs["norm.scale"] == P(None)
    if cfg.tie_word_embeddings:
        assert "lm_head.kernel" not in specs
    else:
        assert specs["lm_head.kernel"] == P(None, "model")
    assert ("layers.input_layernorm.scale" in specs) == cfg.input_norms  # OLMo norms outputs only
    if cfg.qk_norm_whole:  # OLMo's and OLMoE's q/k norms over each projection: split as the projection is
        assert specs["layers.self_attn.q_proj_norm.scale"] == specs["layers.self_attn.k_proj_norm.scale"] == P(
            None, "model")
    elif cfg.qk_norm:  # per-head q/k norms
        assert specs["layers.self_attn.q_norm.scale"] == P(None, None)
    if cfg.output_norms:  # Gemma 2's norms on the attention and MLP outputs
        assert specs["layers.attn_output_norm.scale"] == specs["layers.mlp_output_norm.scale"] == P(None, None)
    if cfg.qkv_biased:  # Llama's attention_bias, Qwen2's
        assert specs["layers.self_attn.q_proj.bias"] == P(None, "model")
        assert specs["layers.self_attn.v_proj.bias"] == P(None, "model")
    assert ("layers.self_attn.o_proj.bias" in specs) == cfg.attention_bias  # Qwen2 has none
    assert ("layers.self_attn.q_proj.bias" in specs) == cfg.qkv_biased  # Qwen2's, attention_bias (GPT-OSS)
    if arch == "gpt_oss":  # its attention sinks, one per query head, split with the heads
        assert specs["layers.self_attn.sinks"] == P(None, "model")


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


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss", "llama"])
def test_an_expert_axis_splits_experts_whole_and_the_rest_over_expert_and_model(arch):
    """Expert parallelism: on a (data, expert, model) mesh a routed MLP's experts are split over
    `expert` (each device holds E / n of them, each expert's width split over `model`); attention,
    dense MLPs, the vocabulary and the cache over `expert` x `model` together; the router whole."""
    target = nnx.eval_shape(lambda: random_model(tiny_config(arch, num_heads=8, num_kv_heads=4, head_dim=8)))
    mesh = AbstractMesh((1, 2, 2), ("data", "expert", "model"))
    specs = _specs(param_shardings(target, mesh))
    both = ("expert", "model")
    assert specs["embed_tokens.embedding"] == P(both, None)
    assert specs["layers.self_attn.q_proj.kernel"] == specs["layers.self_attn.k_proj.kernel"] == P(None, None, both)
    assert specs["layers.self_attn.o_proj.kernel"] == P(None, both, None)
    assert logical_sharding(mesh, CACHE_AXES, (2, 4, 4, 16, 8)).spec == P(None, "data", both, None, None)
    if target.cfg.moe:
        assert specs["layers.mlp.gate_proj"] == specs["layers.mlp.up_proj"] == P(None, "expert", None, "model")
        assert specs["layers.mlp.down_proj"] == P(None, "expert", "model", None)
        assert specs["layers.mlp.router.kernel"] == P(None, None, None)
        if target.cfg.shared_expert_size:  # every token runs it: split as a dense MLP
            assert specs["layers.mlp.shared_expert.gate_proj.kernel"] == P(None, None, both)
        if arch == "gpt_oss":  # the gate/up biases go with their experts; the down biases stay whole, as the router
            assert specs["layers.mlp.gate_bias"] == P(None, "expert", "model")
            assert specs["layers.mlp.down_bias"] == P(None, None, None)
    else:
        assert specs["layers.mlp.gate_proj.kernel"] == P(None, None, both)
        assert specs["layers.mlp.down_proj.kernel"] == P(None, both, None)
    # Whole experts per device with the width unsplit: (data, expert=4, model=1).
    if target.cfg.moe:
        specs = _specs(param_shardings(target, AbstractMesh((1, 4, 1), ("data", "expert", "model"))))
        assert specs["layers.mlp.gate_proj"] == P(None, "expert", None, "model")  # `model` of size 1
    # An expert axis that does not divide the experts, or the vocabulary split over both, is named.
    if arch == "qwen3_moe":
        wide = nnx.eval_shape(lambda: random_model(tiny_config(arch, vocab_size=96, num_heads=8, num_kv_heads=8,
                                                               head_dim=8)))
        with pytest.raises(ValueError, match=r"mesh axis 'expert' of size 8 does not divide the 4 experts"):
            param_shardings(wide, AbstractMesh((1, 8, 1), ("data", "expert", "model")))
        odd = nnx.eval_shape(lambda: random_model(tiny_config(arch, vocab_size=302, num_heads=8, num_kv_heads=4,
                                                              head_dim=8)))
        with pytest.raises(ValueError, match=r"mesh axes expert x model of size 4 does not divide the 302 vocabulary"):
            param_shardings(odd, mesh)


def test_draft_logits_selected_after_equal_columns_first():
    """The mesh path of a reduced draft vocabulary (score every token, then take the draft ids'
    columns) gives the same draft logits as reading those columns of the head first."""
    tcfg = tiny_config()
    target = random_model(tcfg)
    ids = np.sort(np.random.default_rng(0).choice(299, 40, replace=False))
    drafter = DFlashDrafter(DFlashConfig.for_target(tcfg, num_layers=1, block_size=4, mask_token_id=299,
                                                    draft_vocab_size=40), rngs=nnx.Rngs(0), draft_vocab=ids)
    hidden = jax.numpy.asarray(np.random.default_rng(1).standard_normal((2, 3, tcfg.hidden_size)), np.float32)
    np.testing.assert_allclose(np.asarray(drafter.logits(target, hidden, select_after=True)),
                               np.asarray(drafter.logits(target, hidden)), rtol=1e-6, atol=1e-6)


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
    assert logical_sharding(_mesh(2, 2), CACHE_AXES, (2, 4, 2, 16, 8)).spec == P(None, "data", "model", None, None)
    # A mesh without a `model` axis splits nothing over it.
    assert logical_sharding(AbstractMesh((2,), ("data",)), ("batch", "heads"), (4, 6)).spec == P("data", None)
    target = nnx.eval_shape(lambda: random_model(tiny_config()))
    state = nnx.state(target)
    state["norm"]["scale"] = nnx.Param(jax.ShapeDtypeStruct((65,), np.float32))
    with pytest.raises(AssertionError, match=r"'norm.scale' has shape \(65,\)"):
        param_shardings(target, _mesh(1, 1), state)


def test_mesh_parsing_and_device_count_errors():
    assert parse_mesh("data=2, model=1") == {"data": 2, "model": 1}
    assert parse_mesh("data=1,expert=4") == {"data": 1, "expert": 4}
    assert parse_mesh(" data = 2 ,model= 4") == {"data": 2, "model": 4}  # spaces around a name or size
    for text in ("data=1 6", "mo del=2"):  # but not inside one: not data=16, not model=2
        with pytest.raises(ValueError, match="expected entries like data=2,model=1"):
            parse_mesh(text)
    one = jax.devices()[:1]
    assert make_mesh(1, 1, one).axis_names == ("data", "model")  # no `expert` axis unless asked
    assert dict(make_mesh(1, 1, one, expert=1).shape) == {"data": 1, "model": 1}
    with pytest.raises(ValueError, match="expected entries like data=2,model=1"):
        parse_mesh("data=two")
    for bad in (dict(model=0), dict(expert=0), dict(data=0), dict(model=-1), dict(model=1.5)):
        with pytest.raises(ValueError, match=f"make_mesh: {next(iter(bad))} must be a positive int"):
            make_mesh(**bad)
    with pytest.raises(ValueError, match="data is given twice"):
        parse_mesh("data=2,data=1")
    with pytest.raises(ValueError, match="expected entries like data=2,model=1"):
        parse_mesh(" , ")
    with pytest.raises(ValueError, match="make_mesh: device .* is given twice"):  # not XLA's error at the first put
        make_mesh(2, 1, one * 2)
    n = len(jax.devices())
    with pytest.raises(ValueError, match=f"needs {4 * n} devices, {n} are present"):
        make_mesh(4 * n, 1)
    with pytest.raises(ValueError, match=f"model={2 * n} needs at least {2 * n} devices"):
        make_mesh(None, 2 * n)
    with pytest.raises(ValueError, match=f"mesh expert={2 * n} x model=1 needs at least {2 * n} devices"):
        make_mesh(None, 1, expert=2 * n)


def test_mesh_entries_must_be_positive_and_make_mesh_takes_no_bools():
    # A size of 0 is refused by --mesh itself, not later by make_mesh; an empty entry (a trailing
    # comma) is skipped; True is an int to Python but not a mesh size.
    for text in ("model=0", "data=2,expert=0"):
        with pytest.raises(ValueError, match="with positive sizes"):
            parse_mesh(text)
    assert parse_mesh("data=2,model=1,") == {"data": 2, "model": 1}
    for bad in (dict(model=True), dict(data=True), dict(expert=True)):
        with pytest.raises(ValueError, match=f"make_mesh: {next(iter(bad))} must be a positive int"):
            make_mesh(**bad, devices=jax.devices()[:1])


def test_make_mesh_lays_out_the_devices(monkeypatch):
    """Which axis gets how many devices, and in which order: checked on stand-in devices (ints), with
    `Mesh` recording its arguments, since a real mesh of 8 needs 8 forced devices."""
    import tevjax.sharding as sharding

    monkeypatch.setattr(sharding, "Mesh", lambda devices, names: (devices.tolist(), names))
    devices = list(range(8))
    # `data` left out takes every device the others do not use: 8 / (expert 2 x model 2) = 2 rows
    assert make_mesh(None, 2, devices, expert=2) == ([[[0, 1], [2, 3]], [[4, 5], [6, 7]]],
                                                     ("data", "expert", "model"))
    # expert 4 x model 1: each device of a row holds its own experts (the expert axis has size 4)
    assert make_mesh(None, 1, devices, expert=4) == ([[[0], [1], [2], [3]], [[4], [5], [6], [7]]],
                                                     ("data", "expert", "model"))
    assert make_mesh(2, 1, devices[:6], expert=3) == ([[[0], [1], [2]], [[3], [4], [5]]],
                                                      ("data", "expert", "model"))
    assert make_mesh(None, 4, devices) == ([[0, 1, 2, 3], [4, 5, 6, 7]], ("data", "model"))
    # A group of exactly every device is one row, not too many; numpy sizes (from shapes) are ints.
    assert make_mesh(None, 8, devices) == ([devices], ("data", "model"))
    assert make_mesh(np.int64(2), np.int64(4), devices) == make_mesh(2, 4, devices)
    with pytest.raises(ValueError, match="model=4 does not divide the 6 devices"):
        make_mesh(None, 4, devices[:6])
    with pytest.raises(ValueError, match="expert=2 x model=2 does not divide the 6 devices"):
        make_mesh(None, 2, devices[:6], expert=2)
    # The default devices are every process's (`jax.devices()`), not this process's alone.
    monkeypatch.setattr(jax, "devices", lambda *a: devices[:4])
    assert make_mesh(None, 2) == ([[0, 1], [2, 3]], ("data", "model"))


def test_logical_sharding_argument_checks_and_placed_dtypes():
    from tevjax.sharding import place, replicated

    # As many logical axes as dimensions: a shape that is one short is an error, not a shorter spec.
    with pytest.raises(ValueError, match=r"x: 2 logical axes \('batch', 'heads'\) for an array of shape \(4,\)"):
        logical_sharding(_mesh(2, 2), ("batch", "heads"), (4,), what="x")
    with pytest.raises(ValueError, match="unknown logical axis 'hidden'; known: "):
        logical_sharding(_mesh(2, 2), ("batch", "hidden"), (4, 8))
    # Optimizer mode replicates only unnamed scalars (step counts); an unnamed moment array raises.
    target = nnx.eval_shape(lambda: random_model(tiny_config()))
    state = nnx.state(target)
    state["extra"] = nnx.Param(jax.ShapeDtypeStruct((3,), np.float32))
    with pytest.raises(ValueError, match="'extra' has no row"):
        param_shardings(target, _mesh(1, 1), state, optimizer=True)
    # `place` converts to the dtype asked for, with a sharding as without one.
    mesh = make_mesh(1, 1, jax.devices()[:1])
    for sharding in (None, replicated(mesh)):
        assert place(np.arange(4.0), jax.numpy.bfloat16, sharding).dtype == jax.numpy.bfloat16


def test_specs_keep_the_order_of_their_names_and_every_dimension_is_named():
    from tevjax.sharding import batch_sharding, logical_spec

    assert logical_spec("batch", None, "heads") == P("data", None, ("expert", "model"))
    assert batch_sharding(_mesh(2, 2), 3).spec == P("data", None, None)  # rows over `data`, the rest whole
    with pytest.raises(ValueError, match="unknown logical axis 'hidden'"):  # the first unknown name
        logical_spec("batch", "hidden", "width")
    # A shape longer than its names is an error too, not a spec of its leading dimensions.
    with pytest.raises(ValueError, match=r"x: 1 logical axes \('batch',\) for an array of shape \(4, 2\)"):
        logical_sharding(_mesh(2, 2), ("batch",), (4, 2), what="x")


def test_table_paths_match_whole_and_only_optimizer_scalars_are_replicated():
    from jax.tree_util import DictKey, GetAttrKey, SequenceKey

    from tevjax.sharding import _matches, _path_parts, _table, shardings_by_path

    # A list index is a path part as a dict key is; a Variable's `.value` is not one.
    assert _path_parts((DictKey("layers"), SequenceKey(1), GetAttrKey("fc"), DictKey("kernel"),
                        GetAttrKey("value"))) == ("layers", "1", "fc", "kernel")
    # A row matches a whole path, and its `*` a list index only.
    assert _matches(("layers", "*", "fc"), ("layers", "0", "fc"))
    assert not _matches(("layers", "*", "fc"), ("layers", "fc", "fc"))
    assert not _matches(("norm", "scale"), ("norm", "scale", "extra"))
    with pytest.raises(TypeError, match="no sharding table for int"):
        _table(3)
    target = nnx.eval_shape(lambda: random_model(tiny_config()))
    state = nnx.state(target)
    state["step"] = nnx.Param(jax.ShapeDtypeStruct((), np.int32))
    # Outside an optimizer's state a scalar is a model array like any other: without a row, an error.
    with pytest.raises(ValueError, match="the target array 'step' has no row"):
        param_shardings(target, _mesh(1, 1), state)
    # What a checkpoint loader looks up: every array, by its attribute path.
    by_path = shardings_by_path(target, _mesh(2, 2))
    assert len(by_path) == len(jax.tree.leaves(nnx.state(target)))
    assert by_path[("layers", "self_attn", "q_proj", "kernel")].spec == P(None, None, "model")


def test_a_hybrid_target_keeps_key_head_groups_whole_in_its_weights_and_caches():
    """Qwen3-Next's q|k|v channels run key-head group by group: a split must not cut a group, in
    the conv weights as in the caches' per-key-head arrays, and the K/V and linear caches split
    rows over `data` and heads over `model`."""
    from tevjax.models.cache import KVCache
    from tevjax.sharding import cache_shardings

    target = nnx.eval_shape(lambda: random_model(tiny_config("qwen3_next", num_heads=8, num_kv_heads=4,
                                                             head_dim=8)))
    # 2 key heads and 4 value heads: model=4 divides the 56 channels and the value heads, not the key heads.
    with pytest.raises(ValueError, match=r"size 4 does not divide the 2 linear layers' key heads"):
        param_shardings(target, _mesh(1, 4))
    # An optimizer moment of the gated norm ends in `norm.scale` as the final norm's does: the longer
    # (more specific) row gives it its shape, [Ll, Dv], and its sharding.
    moment = {"mu": {"linear_layers": {"linear_attn": {"norm": {"scale": jax.ShapeDtypeStruct((1, 6), np.float32)}}}}}
    assert jax.tree.leaves(param_shardings(target, _mesh(1, 2), moment, optimizer=True))[0].spec == P(None, None)
    cache = jax.eval_shape(lambda: KVCache.init(target.cfg, 2, 16, tree_slots=3))
    s = cache_shardings(_mesh(2, 2), cache)
    assert s.k.spec == s.v.spec == P(None, "data", "model", None, None)
    assert s.linear.state.spec == P(None, "data", "model", None, None)
    assert s.linear.tree_k.spec == P(None, "data", None, "model", None)
    with pytest.raises(ValueError, match="does not divide the 2 batch rows of the KV cache"):
        cache_shardings(_mesh(4, 1), cache)
    with pytest.raises(ValueError, match="does not divide the 2 linear layers' key heads .* linear state's tree_k"):
        cache_shardings(_mesh(1, 4), cache)


def test_traced_on_frozen_keys_and_host_arrays():
    from tevjax.sharding import (batch_sharding, frozen, global_batch_array, host_array, replicated, thawed,
                                 traced_on)

    mesh = make_mesh(1, 1, jax.devices()[:1])
    fn = jax.sharding.get_abstract_mesh
    assert traced_on(fn, None) is fn  # no mesh: the function itself
    assert traced_on(fn, mesh)() == mesh.abstract_mesh  # the mesh in context while it runs
    # A tree of shardings as a key of shared programs: hashable, equal for equal trees, and thawed back.
    tree = {"k": replicated(mesh), "linear": None, "rows": batch_sharding(mesh, 2)}
    assert hash(frozen(tree)) == hash(frozen(dict(tree))) and frozen(tree) == frozen(dict(tree))
    assert thawed(frozen(tree)) == tree
    local = np.arange(6).reshape(2, 3)
    x = global_batch_array(mesh, local)
    assert x.sharding.spec == P("data", None)
    np.testing.assert_array_equal(host_array(x), local)
    np.testing.assert_array_equal(host_array(local), local)  # a host array as it is


@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt-ids", "1,2", "--mesh", "data=64,model=2"], "needs 128 devices"),
    (["generate", "--prompt-ids", "1,2", "--mesh", "data=x"], "expected entries like data=2,model=1"),
    (["eval", "--mesh", "model=64"], "model=64 needs at least 64 devices"),
    (["eval", "--mesh", "expert=32,model=2"], "expert=32 x model=2 needs at least 64 devices"),
    (["eval", "--mesh", "experts=2"], "expected entries like data=2,model=1 (or expert=2)"),
    (["data", "--num-prompts", "8", "--out", "/nonexistent/d", "--mesh", "data=64"], "needs 64 devices"),
    (["data", "--num-prompts", "8", "--out", "/nonexistent/d", "--coordinator", "localhost:1"],
     "--coordinator needs --num-processes"),
    (["generate", "--prompt-ids", "1,2", "--coordinator", "localhost:1", "--num-processes", "2", "--process-id", "2"],
     "process id 2 (--process-id / JAX_PROCESS_ID) is not in 0..1, the ids of a job of 2 processes"),
])
def test_cli_mesh_errors_are_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and err.count("--mesh") <= 1, err


# ------------------------------------------------------------------------- forced devices

def _run(*checks: str, timeout: int = 1500) -> str:
    """Runs the named checks of `CHECKS` in one subprocess with 4 forced CPU devices."""
    env = forced_devices_env(4)
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import jax
        assert len(jax.devices()) == 4, jax.devices()
    """) + textwrap.dedent(COMMON) + "".join(
        "\n_t0 = time.perf_counter()\n" + textwrap.dedent(CHECKS[c])
        + f"\nprint(f'OK {c} ({{time.perf_counter() - _t0:.0f}} s)', flush=True)\n" for c in checks)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)
    assert res.returncode == 0 and f"OK {checks[-1]}" in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]
    print(res.stdout)
    return res.stdout


# Shared by the checks: tiny models, prompts, decoding, and the HLO check.
COMMON = """
import re
import time
import numpy as np
from flax import nnx
from tevjax.decode import DecodeConfig, Decoder
from tevjax.models.dflash import DFlashConfig, DFlashDrafter
from tevjax.sharding import make_mesh
from tevjax.testing import random_model, tiny_config

PROMPTS = [[1, 5, 7, 9, 11], [1, 3], [1, 4, 4, 4, 8, 9], [6]]
V = 96

_MEMO = {}

def memo(key, make):
    # Models and decoders are built once per process: a Decoder compiles once per batch shape,
    # and compilation is what these checks spend their time on.
    if key not in _MEMO:
        _MEMO[key] = make()
    return _MEMO[key]

def models(arch="llama"):
    return memo(arch, lambda: _models(arch))

def _models(arch):
    tcfg = tiny_config(arch, vocab_size=V, num_heads=8, num_kv_heads=4, head_dim=8)
    target = random_model(tcfg, seed=0)
    # A reduced draft vocabulary: 48 of the 95 non-mask ids (their columns of the LM head).
    ids = np.sort(np.random.default_rng(0).choice(V - 1, 48, replace=False))
    dcfg = DFlashConfig.for_target(tcfg, num_layers=1, block_size=4, mask_token_id=V - 1, draft_vocab_size=48)
    return target, DFlashDrafter(dcfg, rngs=nnx.Rngs(1), draft_vocab=ids)

def config(verifier="tev", temperature=0.0, **kw):
    return DecodeConfig(**{"verifier": verifier, "budget": 4, "max_new_tokens": 8, "temperature": temperature,
                           "prompt_bucket": 8, "capacity": 32, **kw})

def decoder(target, drafter, verifier, temperature=0.0, mesh=None):
    # verifier "ar": no drafter (autoregressive decoding).
    key = (id(target), id(drafter), verifier, temperature, None if mesh is None else tuple(mesh.shape.items()))
    if verifier == "ar":
        return memo(key, lambda: Decoder(target, None, config(temperature=temperature), mesh=mesh))
    return memo(key, lambda: Decoder(target, drafter, config(verifier, temperature), mesh=mesh))

def tokens(dec, seed=0):
    return [g.tokens for g in dec.generate(PROMPTS, seed=seed)]

COLLECTIVE = re.compile(r"= (.*?) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(-start)?\\(")

def check_loop_hlo(dec, mesh):
    # Every weight stays split as its table says, and no collective of the compiled loop moves
    # as much as one layer's slice of a split weight (gathering or summing it) or the [B, N, V]
    # logits of a tree pass. What may move: [B, N, D] activations (after o_proj, down_proj and
    # the vocabulary-split embedding lookup), per-device partial results of reductions over V,
    # and the [B, G, Vd] draft logits.
    leaves = jax.tree_util.tree_flatten_with_path((dec.tstate, dec.dstate))[0]
    named = [(jax.tree_util.keystr(p), x) for p, x in leaves if any(x.sharding.spec)]
    split = [x for _, x in named]
    assert split, "no weight is split"
    group = mesh.size // mesh.shape["data"]  # model, or expert x model: every split matrix spans it
    for name, x in named:
        shard = x.addressable_shards[0].data.shape
        axes = [a for entry in x.sharding.spec if entry for a in ((entry,) if isinstance(entry, str) else entry)]
        factor = int(np.prod([mesh.shape[a] for a in axes]))
        assert np.prod(shard) * factor == np.prod(x.shape), (name, x.shape, shard, x.sharding)
        assert factor == group, (name, x.sharding)
    state = dec.prefill(PROMPTS)
    hlo = dec.compiled_loop(state).as_text()
    layers = dec.target_cfg.num_layers
    # One layer's slice of each split matrix ([L, ...] stacks, or the [V, D] embedding and head);
    # biases, GPT-OSS's sinks and a linear layer's per-head decays, decay and beta projections ([D, Hv])
    # and conv taps are too small to bound anything.
    small = ("bias", "sinks", "A_log", "'conv'", "'in_proj_a'", "'in_proj_b'")
    weight = min(int(np.prod(x.shape)) // (layers if x.ndim >= 3 else 1) for name, x in named
                 if any(x.sharding.spec) and not any(word in name for word in small))
    logits = state.root.shape[0] * dec.tree_slots * V
    sizes = []
    for m in COLLECTIVE.finditer(hlo):
        sizes += [int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                  for dims in re.findall(r"\\[([0-9,]*)\\]", m.group(1))]
    assert sizes, "no collective at all: is the loop split?"
    assert max(sizes) < min(weight, logits), (sorted(sizes)[-5:], weight, logits)
    print(f"loop collectives: {len(sizes)}, largest {max(sizes)} elements < weight slice {weight}, "
          f"logits {logits}")
    return len(sizes)

def moe_decoding(*meshes, arch="qwen3_moe"):
    # The MoE target on each ((data, model), expert) mesh, with either dispatch: greedy TEV
    # equals unsharded; each device holds 1 / expert of the experts; the loop moves no weight slice
    # or expert-output rows, and the two dispatches as many collectives.
    from tevjax.models import set_moe_dispatch
    target, drafter = models(arch)
    want = tokens(decoder(target, drafter, "tev"))
    for shape, expert in meshes:
        mesh = make_mesh(*shape, expert=expert)
        counts = {}
        for dispatch in ("dense", "ragged"):
            assert set_moe_dispatch(target, dispatch) == 1  # one module: the layers are stacked
            dec = Decoder(target, drafter, config("tev"), mesh=mesh)
            assert tokens(dec) == want, (dict(mesh.shape), dispatch)
            gate = dec.tstate["layers"]["mlp"]["gate_proj"][...]
            assert gate.addressable_shards[0].data.shape[1] * expert == gate.shape[1], gate.sharding
            counts[dispatch] = check_loop_hlo(dec, mesh)
        assert counts["ragged"] == counts["dense"], (dict(mesh.shape), counts)
    set_moe_dispatch(target, "auto")
"""

CHECKS = {
    # Checkpoints load straight into their shardings; (2, 2) greedy TEV equals unsharded; a batch
    # of 3 on a data axis of 2 is padded and the pad dropped.
    "load_2x2": """
        import tempfile
        from tevjax.convert.dflash_ckpt import load_dflash, save_dflash
        from tevjax.convert.hf import load_hf_target, save_hf_target
        from tevjax.sharding import param_shardings

        target, drafter = models()
        reference = tokens(decoder(target, drafter, "tev"))
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
        sharded = decoder(loaded_target, loaded_drafter, "tev", mesh=mesh)
        assert tokens(sharded) == reference, (tokens(sharded), reference)
        three = [g.tokens for g in sharded.generate(PROMPTS[:3])]
        assert three == reference[:3], (three, reference)
    """,
    # (1, 4) tensor parallel, Llama-style target (separate LM head): greedy TEV equals unsharded
    # and the compiled loop keeps every weight split (HLO).
    "hlo_1x4": """
        target, drafter = models()
        mesh = make_mesh(1, 4)
        dec = decoder(target, drafter, "tev", mesh=mesh)
        assert tokens(dec) == tokens(decoder(target, drafter, "tev"))
        check_loop_hlo(dec, mesh)
    """,
    # Lookup chains on a (2, 2) mesh (the builder's scores come out of its shard_map; the token
    # history is split by rows): greedy TEV equals unsharded decoding without lookup; so do
    # fallback rounds and a prefill that reuses a state.
    "lookup_2x2": """
        target, drafter = models()
        mesh = make_mesh(2, 2)
        dec = Decoder(target, drafter, config(lookup=4), mesh=mesh)
        assert tokens(dec) == tokens(decoder(target, drafter, "tev"))
        assert dec.prefill(PROMPTS).history.sharding.spec[0] == "data"
        # Fallback rounds (one cond for the whole batch; the per-row counters split by rows),
        # alternating with drafted ones: the same tokens.
        fb = Decoder(target, drafter, config(lookup=4, fallback_below=100.0, fallback_rounds=1), mesh=mesh)
        assert tokens(fb) == tokens(decoder(target, drafter, "tev"))
        state = fb.run(fb.prefill(PROMPTS))
        assert state.skip.sharding.spec[0] == "data" and int(np.asarray(state.plain_rounds).sum()) > 0
        # A second turn from that state (`prefill(reuse=...)`, the sharded rebase): the rows keep
        # their prompt and output and decode what a fresh prefill decodes.
        second = [p + g.tokens + [2, 3] for p, g in zip(PROMPTS, fb.results(state))]
        again = fb.prefill(second, seed=1, reuse=(state, PROMPTS))
        assert again.history.sharding.spec[0] == "data"
        assert [g.tokens for g in fb.results(fb.run(again))] == [g.tokens for g in fb.generate(second, seed=1)]
        # And a corpus chain after it, from a table of the answers themselves (so that it matches):
        # the table is copied to every device, and the chain takes rounds off.
        from tevjax.builder import ngram_table
        plain = decoder(target, drafter, "tev")
        answers = [p + g.tokens for p, g in zip(PROMPTS, plain.generate(PROMPTS))]
        table = ngram_table(np.concatenate(answers), np.cumsum([0] + [len(a) for a in answers]),
                            np.array([len(p) for p in PROMPTS]), min_count=1)
        both = Decoder(target, drafter, config(lookup=4, corpus=4), mesh=mesh, ngrams=table)
        assert tokens(both) == tokens(plain)
        assert both.ngrams.keys.sharding.is_fully_replicated
        rounds = lambda d: sum(g.rounds for g in d.generate(PROMPTS))
        assert rounds(both) < rounds(plain)
        # Stop strings and log-probabilities: each row's automaton state and log-probabilities
        # split by rows, the table copied to every device; the rows stop where unsharded
        # decoding's stop, some before their length, with the same log-probabilities (their
        # log-sum-exp runs over the vocabulary split over `model`).
        spell = [bytes([97 + i % 6]) * (1 + i % 3) for i in range(V)]
        stop_cfg = config(lookup=4, stop=("ca", "fe", "ddd"), logprobs=True)
        stopping = Decoder(target, drafter, stop_cfg, mesh=mesh, spellings=spell)
        want = Decoder(target, drafter, stop_cfg, spellings=spell).generate(PROMPTS)
        got = stopping.generate(PROMPTS)
        assert [g.tokens for g in got] == [g.tokens for g in want] and any(len(g.tokens) < 8 for g in want)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
        state = stopping.prefill(PROMPTS)
        assert state.stop_at.sharding.spec[0] == "data" and state.logprobs.sharding.spec[0] == "data"
        assert state.stop_mask.sharding.spec[0] == "data"
        # Each row's own subset of the stop strings, split by rows: as unsharded.
        subsets = [["ddd"], ["ca", "fe"], [], ["ca", "fe", "ddd"]]
        assert [g.tokens for g in stopping.generate(PROMPTS, stop=subsets)] == [
            g.tokens for g in Decoder(target, drafter, stop_cfg, spellings=spell).generate(PROMPTS, stop=subsets)]
        assert stopping.stops.next.sharding.is_fully_replicated
        # Per-row limits, split by rows like the rest.
        short = [g.tokens for g in stopping.generate(PROMPTS, max_new_tokens=[3, 8, 1, 5])]
        assert short == [w.tokens[:n] for w, n in zip(want, [3, 8, 1, 5])]
        # Per-row temperatures, split by rows: the greedy rows decode unsharded greedy's tokens
        # next to sampled ones (whose draws see the vocabulary split over `model`).
        mixed = Decoder(target, drafter, config(lookup=4, sampling_per_row=True), mesh=mesh)
        got = [g.tokens for g in mixed.generate(PROMPTS, seed=3, temperature=[0.0, 1.0, 0.0, 1.0])]
        assert [got[0], got[2]] == [tokens(plain)[0], tokens(plain)[2]]
        assert mixed.prefill(PROMPTS, temperature=[0.0, 1.0, 0.0, 1.0]).sampling.sharding.spec[0] == "data"
    """,
    # Continuous batching on (2, 2): 5 prompts through 2 rows (one per `data` device), refilled in
    # place, with caches that grow (sharded) when a later prompt needs more slots than the first.
    "continuous_2x2": """
        target, drafter = models()
        mesh = make_mesh(2, 2)
        roomy = Decoder(target, drafter, config(lookup=4, capacity=None, capacity_bucket=16), mesh=mesh)
        longer = PROMPTS + [list(range(1, 40))]
        assert [g.tokens for g in roomy.generate_continuous(longer, 2)] == [g.tokens for g in roomy.generate(longer)]
        assert list(roomy._grow_fns) == [64]
    """,
    # Truncated sampling with the vocabulary split over `model` (1, 4): the cuts' bisection sums over
    # devices. Each setting leaves only the most probable token of these rows (top-p 0.01: the top
    # token alone holds >= 1/V > 0.01; min-p 0.999: no runner-up within 0.1% of it), so sampling at
    # temperature 1 must give the unsharded greedy tokens.
    "truncation_1x4": """
        greedy = tokens(decoder(*models(), "tev"))
        target, drafter = models()
        for cut in ({"top_k": 1}, {"top_p": 0.01}, {"min_p": 0.999}):
            dec = Decoder(target, drafter, config("tev", 1.0, **cut), mesh=make_mesh(1, 4))
            assert tokens(dec, seed=9) == greedy, cut
    """,
    # Temperature 1, data parallel (4, 1): the unsharded tokens for the same seed (each row samples
    # with fold_in(seed key, row), whatever the split, and computes its own arithmetic).
    "dp_sampling_tev": """
        target, drafter = models()
        for seed in (3, 4):
            want = tokens(decoder(target, drafter, "tev", 1.0), seed)
            assert tokens(decoder(target, drafter, "tev", 1.0, make_mesh(4, 1)), seed) == want, seed
    """,
    # A mesh that does not divide the batch or the heads: one ValueError naming the dimension.
    "errors": """
        import pytest
        from tevjax.train.step import Trainer, TrainConfig

        target, drafter = models()
        with pytest.raises(ValueError, match=r"size 2 does not divide the 3 batch rows of a batch of 3 prompts"):
            decoder(target, drafter, "tev", mesh=make_mesh(2, 2)).prefill(PROMPTS[:3])
        with pytest.raises(ValueError, match=r"size 2 does not divide the 3 batch rows of the training batch"):
            Trainer(drafter, target, TrainConfig(steps=1, batch_size=3), make_mesh(2, 1, devices=jax.devices()[:2]))
        narrow = random_model(tiny_config(vocab_size=V), seed=0)  # 2 key/value heads
        with pytest.raises(ValueError, match=r"size 4 does not divide the 2 key/value heads \\(num_kv_heads\\)"):
            Decoder(narrow, None, config(), mesh=make_mesh(1, 4))
    """,
    # Greedy: every verifier, and autoregressive decoding, on meshes (4, 1), (2, 2) and (1, 4)
    # equals unsharded decoding token for token; at temperature 1 data-parallel (4, 1) decoding
    # gives the unsharded tokens for the same seed. Then a Qwen3-style target (tied embeddings:
    # the LM head is the vocabulary-split embedding; q/k norms) on (2, 2).
    "every_verifier": """
        target, drafter = models()
        for verifier in ("tev", "predraw", "sequential", "ar"):
            t0 = time.perf_counter()
            reference = tokens(decoder(target, drafter, verifier))
            for shape in ((4, 1), (2, 2), (1, 4)):
                assert tokens(decoder(target, drafter, verifier, mesh=make_mesh(*shape))) == reference, (verifier, shape)
            if verifier != "tev":  # tev: check dp_sampling_tev
                want = tokens(decoder(target, drafter, verifier, 1.0), 3)
                assert tokens(decoder(target, drafter, verifier, 1.0, make_mesh(4, 1)), 3) == want, verifier
            print(f"{verifier}: {time.perf_counter() - t0:.0f} s", flush=True)
        target, drafter = models("qwen3")
        want = tokens(decoder(target, drafter, "tev"))
        assert tokens(decoder(target, drafter, "tev", mesh=make_mesh(2, 2))) == want
    """,
    # A mixture-of-experts target (Qwen3-MoE: 4 experts of width 32, 2 per token) tensor parallel
    # (1, 4), each expert's width split, and expert parallel (1, expert=2, 2), half the experts per
    # pair of devices with their widths split: greedy TEV equals unsharded with either dispatch
    # (every expert on every token; grouped by `ragged_dot`, the accelerators'), and the compiled
    # loop moves no weight slice and no [N * k, D] rows of expert outputs (each layer's experts
    # meet in one all-reduce of [N, D] partial sums, so the grouped dispatch needs as many
    # collectives as the dense one).
    # A hybrid target (Qwen3-Next: a Gated DeltaNet layer, then gated attention with experts) on
    # (2, 2): greedy AR and TEV equal unsharded; the linear mixer and its state split by heads over
    # `model` (whole key-head groups on each device) and the state's rows over `data`; the loop moves
    # no weight slice.
    "hybrid_2x2": """
        target, drafter = models("qwen3_next")
        mesh = make_mesh(2, 2)
        for verifier in ("ar", "tev"):
            want = tokens(decoder(target, drafter, verifier))
            dec = decoder(target, drafter, verifier, mesh=mesh)
            assert tokens(dec) == want, (verifier, tokens(dec), want)
        qkv = dec.tstate["linear_layers"]["linear_attn"]["in_proj_qkv"]["kernel"][...]
        assert qkv.addressable_shards[0].data.shape[-1] * 2 == qkv.shape[-1], qkv.sharding
        state = dec.prefill(PROMPTS)
        spec = state.target_cache.linear.state.sharding.spec
        assert spec[1] == "data" and spec[2] in ("model", ("expert", "model")), spec
        check_loop_hlo(dec, mesh)
    """,
    "moe_meshes": """
        import jax.numpy as jnp
        from tevjax.models import set_moe_dispatch
        from tevjax.sharding import traced_on
        moe_decoding(((1, 4), 1), ((1, 2), 2))
        # One routed layer on (1, expert=2, 2), either dispatch: traced on the mesh (as the decoder
        # and the trainer trace), it runs per device and ends in one all-reduce of [N, D]. Left to
        # XLA's partitioner (a jit without the mesh in context) it gives the same output; what that
        # moves is printed, not asserted (on 2026-12-06, grouped: [N * k, I] twice, then
        # [N * k, D]; dense: [N, D] twice, over `expert` and over `model`).
        from tevjax.models.layers import SparseMoE
        from tevjax.sharding import logical_sharding
        moe = SparseMoE(16, 32, 4, 2, norm_topk_prob=True, dtype="float32", param_dtype="float32",
                        rngs=nnx.Rngs(3))
        mesh = make_mesh(1, 2, expert=2)
        axes = {"router": ("embed", "router"), "gate_proj": ("experts", "embed", "mlp"),
                "up_proj": ("experts", "embed", "mlp"), "down_proj": ("experts", "mlp", "embed")}
        x = jnp.asarray(np.random.default_rng(0).standard_normal((12, 16)), jnp.float32)
        for dispatch in ("dense", "ragged"):
            set_moe_dispatch(moe, dispatch)
            graphdef, state = nnx.split(moe)
            placed = jax.tree_util.tree_map_with_path(
                lambda path, v: jax.device_put(v, logical_sharding(mesh, axes[str(path[0].key)], v.shape)), state)
            call = lambda st, x: nnx.merge(graphdef, st)(x)
            ref = np.asarray(call(state, x))
            for name, fn in (("on the mesh", traced_on(call, mesh)), ("partitioner", call)):
                compiled = jax.jit(fn).lower(placed, x).compile()
                np.testing.assert_allclose(np.asarray(compiled(placed, x)), ref, rtol=1e-5, atol=1e-5)
                moved = [m.group(1) for m in COLLECTIVE.finditer(compiled.as_text()) if m.group(2) == "all-reduce"]
                print(f"one routed layer, {dispatch}, {name}: all-reduces of {moved}")
                if name == "on the mesh":
                    assert moved == ["f32[12,16]{1,0}"], (dispatch, moved)
    """,
    # GPT-OSS (attention sinks split with the heads, biased experts: gate and up biases split as the
    # experts and their widths, down's added once after the devices' sums) on (1, 4) and
    # (1, expert=2, 2), as "moe_meshes".
    "gpt_oss_meshes": """
        moe_decoding(((1, 4), 1), ((1, 2), 2), arch="gpt_oss")
    """,
    # More expert-parallel meshes, as "moe_meshes": (1, expert=4, 1), one whole expert per device,
    # and (2, expert=2, 1) with rows split too; and `tevjax data`'s features (one forward of each
    # sequence) traced on (2, expert=2, 1) equal one device's.
    "moe_ep_meshes": """
        from tevjax.models import set_moe_dispatch
        from tevjax.train.rollout import sequence_hidden
        moe_decoding(((1, 1), 4), ((2, 1), 2))
        target, _ = models("qwen3_moe")
        set_moe_dispatch(target, "ragged")
        seqs = [[1, 5, 7, 9, 11, 3], [4, 4, 2], [8, 1, 6, 6, 6, 2, 9], [3]]
        one = sequence_hidden(target, seqs, (0, 1), bucket=8)
        split = sequence_hidden(target, seqs, (0, 1), bucket=8, mesh=make_mesh(2, 1, expert=2))
        for a, b in zip(one, split, strict=True):  # bfloat16 features: equal to their rounding
            np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2)
        set_moe_dispatch(target, "auto")
    """,
    # Temperature 1, tensor parallel (1, 4): o_proj, down_proj and the log-sum-exps sum over
    # devices, which rounds differently from one device (~1e-7 relative), so bitwise equality of
    # sampled tokens is not guaranteed; the law is. 2,000 rows of one prompt, first token (drawn by
    # TEV from the tree pass): chi-square against softmax(target logits) with cells of expected
    # count < 5 pooled; rejecting at p < 1e-4 makes the false-alarm rate 1e-4 per run if the law
    # holds. How many rows equal unsharded decoding with the same seed is printed, not asserted.
    "tp_sampling_law": """
        import jax.numpy as jnp
        import scipy.stats as sps
        from tevjax.models import KVCache, causal_mask

        target, drafter = models()
        prompt, rows = [1, 5, 7, 9], 2000
        t = len(prompt)
        out = target(jnp.asarray([prompt]), jnp.arange(t)[None], KVCache.init(target.cfg, 1, t),
                     jnp.zeros(1, jnp.int32), causal_mask(t)[None])
        z = np.asarray(out.logits, np.float64)[0, -1]
        p = np.exp(z - z.max())
        p /= p.sum()
        cfg = config("tev", 1.0, max_new_tokens=1)
        first = {}
        for name, mesh in (("tp", make_mesh(1, 4)), ("one", None)):
            dec = Decoder(target, drafter, cfg, mesh=mesh)
            first[name] = np.asarray(jax.device_get(dec.run(dec.prefill([prompt] * rows, seed=7)).out))[:, 0]
        counts = np.bincount(first["tp"], minlength=V)
        e = p * rows
        keep = e >= 5
        o, e = np.append(counts[keep], counts[~keep].sum()), np.append(e[keep], e[~keep].sum())
        pvalue = sps.chi2.sf(np.sum((o - e) ** 2 / e), len(e) - 1)
        print(f"first-token chi-square p = {pvalue:.3g} over {len(e)} cells; tensor-parallel rows equal to "
              f"unsharded: {np.sum(first['tp'] == first['one'])}/{rows}")
        assert pvalue > 1e-4, pvalue
    """,
    # Two steps (token + exit loss) on meshes (2, 1) and (1, 2) equal the single-device steps. Split
    # sums round differently (~1e-7 relative), and Adam divides each update by the gradient's own
    # size. Where an element's gradient is a small sum of larger terms of both signs, its rounding
    # error becomes a visible share of the update. Measured on 2026-12-04: 1-2 of the 45,344
    # parameters differ by more than 2e-6 after two steps, and the median by ~1e-9. The largest is
    # gate_proj[22, 60] (|g| ~ 1e-3): 1.2e-5 to 2.5e-5 on (2, 1) and 3.4e-5 on (1, 2), depending on
    # the compiled code. A sharding fault (a missing or doubled reduction) moves the loss and most
    # parameters by ~lr. Stated tolerances: metrics within 1e-5 relative; at most 1 parameter in
    # 10,000 beyond 2e-5 absolute + 1e-5 relative (lr 3e-3); none beyond lr / 30. On (1, 2) the
    # parameters and Adam's moments stay split over `model`.
    "train": """
        import jax.numpy as jnp
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
            diff = max(jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), out[(1, 1)][0],
                                                    out[shape][0])))
            one, split = (np.concatenate([x.ravel() for x in jax.tree.leaves(out[s][0])]) for s in ((1, 1), shape))
            loose = int(np.sum(np.abs(one - split) > 2e-5 + 1e-5 * np.abs(one)))
            print(f"train {shape}: largest parameter difference after 2 steps {diff:.2e}; "
                  f"{loose} of {one.size} beyond 2e-5 + 1e-5 relative")
            assert loose <= max(1, one.size // 10_000) and diff < CFG.lr / 30, (shape, loose, diff)
            for k, v in out[(1, 1)][1].items():
                np.testing.assert_allclose(v, out[shape][1][k], rtol=1e-5, atol=1e-6, err_msg=f"{shape} {k}")
        # Trees on 2 of the 4 sequences (rows 0 and 2, one per data shard): the same step on
        # (2, 1) as on one device; a data axis of 4 cannot split 2 tree-bearing sequences.
        import dataclasses
        import pytest
        few = dataclasses.replace(CFG, exit_sequences=2)
        got = {}
        for shape in ((1, 1), (2, 1)):
            trainer = Trainer(_drafter(target), target, few, make_mesh(*shape, devices=jax.devices()[:shape[0]]))
            state, metrics = trainer.step(trainer.init_state(), batch)
            got[shape] = (jax.tree.map(np.asarray, state.params), float(metrics["loss_exit"]))
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5), got[(1, 1)][0], got[(2, 1)][0])
        np.testing.assert_allclose(got[(1, 1)][1], got[(2, 1)][1], rtol=1e-5)
        with pytest.raises(ValueError, match=r"size 4 does not divide the 2 batch rows of the exit loss's sequences"):
            Trainer(_drafter(target), target, few, make_mesh(4, 1))
    """,
    # Expert parallel training: a Qwen3-MoE target (4 experts, grouped dispatch, so each device
    # runs its own experts under shard_map inside the step's exit loss) on (1, expert=2, 1) and
    # (2, expert=2, 1): two steps equal the single-device steps within the "train" check's stated
    # tolerances, for the same reasons.
    "train_ep": """
        import jax.numpy as jnp
        from tevjax.models import set_moe_dispatch
        from tevjax.train.dataset import Batch
        from tevjax.train.step import Trainer
        from test_train import CFG, _drafter

        target = random_model(tiny_config("qwen3_moe", num_layers=4), seed=0)
        assert set_moe_dispatch(target, "ragged") == 1
        rng = np.random.default_rng(0)
        b, t = CFG.batch_size, CFG.seq_len
        batch = Batch(tokens=jnp.asarray(rng.integers(3, 300, (b, t)), jnp.int32),
                      loss_mask=jnp.asarray(np.arange(t)[None, :] >= 8).repeat(b, 0),
                      features=jnp.asarray(rng.standard_normal((b, t, 2 * target.cfg.hidden_size)), jnp.float32),
                      length=jnp.full((b,), t, jnp.int32))
        out = {}
        for data, expert in ((1, 1), (1, 2), (2, 2)):
            mesh = make_mesh(data, 1, devices=jax.devices()[: data * expert], expert=expert)
            trainer = Trainer(_drafter(target), target, CFG, mesh)
            state = trainer.init_state()
            for _ in range(2):
                state, metrics = trainer.step(state, batch)
            out[data, expert] = (np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(state.params)]),
                                 {k: float(v) for k, v in metrics.items()})
        one, metrics = out[1, 1]
        for shape in ((1, 2), (2, 2)):
            split, got = out[shape]
            loose = int(np.sum(np.abs(one - split) > 2e-5 + 1e-5 * np.abs(one)))
            diff = float(np.max(np.abs(one - split)))
            print(f"train_ep {shape}: largest parameter difference after 2 steps {diff:.2e}; {loose} of {one.size} "
                  f"beyond 2e-5 + 1e-5 relative; exit loss {got['loss_exit']:.6f} vs {metrics['loss_exit']:.6f}")
            assert loose <= max(1, one.size // 10_000) and diff < CFG.lr / 30, (shape, loose, diff)
            for k, v in metrics.items():
                np.testing.assert_allclose(v, got[k], rtol=1e-5, atol=1e-6, err_msg=f"{shape} {k}")
    """,
    # The SmolLM2-135M target (embedded weights) with its shipped drafter (16k-id draft
    # vocabulary), float32. Its 3 key/value heads do not divide by 2, so a (2, 2) mesh is refused
    # with the dimension named; greedy decoding on (4, 1) (data parallel) and on 3 devices as
    # (1, 3) (tensor parallel: 9 / 3 heads, 1536 MLP, 49152 vocabulary) equals unsharded.
    "smollm2": """
        import pytest
        from tevjax.convert.tokenizer import chat_prompt_ids
        from tevjax.loading import load_models

        with pytest.raises(ValueError, match=r"size 2 does not divide the (3 key/value|9 query) heads"):
            load_models("smollm2", dtype="float32", mesh=make_mesh(2, 2))
        plain = load_models("smollm2", dtype="float32")
        assert plain.drafter_trained and plain.drafter.cfg.draft_vocab_size is not None
        ids = [chat_prompt_ids(plain.tokenizer, "What is the capital of France?")] * 4
        cfg = DecodeConfig(budget=8, max_new_tokens=12, temperature=0.0, eos_ids=plain.eos_ids)
        want = [g.tokens for g in Decoder(plain.target, plain.drafter, cfg).generate(ids)]
        for shape, devices in (((4, 1), jax.devices()), ((1, 3), jax.devices()[:3])):
            mesh = make_mesh(*shape, devices=devices)
            loaded = load_models("smollm2", dtype="float32", mesh=mesh)
            t0 = time.perf_counter()
            got = [g.tokens for g in Decoder(loaded.target, loaded.drafter, cfg, mesh=mesh).generate(ids)]
            assert got == want, (shape, got, want)
            print(f"smollm2 {shape}: {len(got[0])} tokens equal, {time.perf_counter() - t0:.0f} s", flush=True)
    """,
}


def test_sharded_decoding_on_forced_devices():
    """The fast subset: loading into (2, 2) shardings and greedy decoding there, (1, 4) greedy
    decoding and its compiled HLO, context and corpus lookup chains, fallback rounds, stop
    strings and log-probabilities on (2, 2), routed experts on (1, 4) and on expert-parallel
    meshes, and the errors of undivided meshes."""
    _run("errors", "load_2x2", "hlo_1x4", "lookup_2x2", "moe_meshes")


@pytest.mark.slow
def test_hybrid_target_on_a_mesh():
    """A Qwen3-Next target on (2, 2): its linear layers split by heads, decoding equal to unsharded."""
    _run("hybrid_2x2")


@pytest.mark.slow
def test_every_verifier_on_every_mesh():
    _run("dp_sampling_tev", "every_verifier")


@pytest.mark.slow
def test_continuous_batching_on_a_mesh():
    _run("continuous_2x2")


@pytest.mark.slow
def test_tensor_parallel_sampling_keeps_the_law():
    _run("tp_sampling_law", "truncation_1x4")


@pytest.mark.slow
def test_training_step_on_meshes_equals_one_device():
    _run("train", "train_ep")


@pytest.mark.slow
def test_more_expert_parallel_meshes():
    _run("moe_ep_meshes", "gpt_oss_meshes")


@pytest.mark.slow
def test_smollm2_on_meshes_equals_unsharded():
    _run("smollm2", timeout=2400)
