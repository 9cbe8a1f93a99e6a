"""Device meshes, the one table of sharding rules, and the logical axes of every array.

tevjax names the axes of its arrays logically (batch, vocab, embed, heads, ...) and maps those names
to the axes of a (`data`, `model`) device mesh here, and only here:

* `LOGICAL_RULES`: logical axis -> mesh axis, the one table every sharded array reads;
* `TARGET_AXES`, `DRAFTER_AXES`, `CACHE_AXES`: the logical axes of every parameter of the target
  (`Transformer`) and the DFlash drafter, keyed by parameter path, and of the K/V caches;
* `param_shardings` / `shard_model` / `cache_shardings`: NamedShardings derived from those tables,
  with a shape assertion per array and a ValueError naming the dimension when a mesh axis does
  not divide what it shards.

Data parallelism splits the batch over `data`; tensor parallelism (Megatron style) splits the
attention heads, the key/value heads, the MLP width and the vocabulary over `model`, so every
matmul runs on its own slice of the weights and XLA inserts one all-reduce of the [B, T, D]
activations after `o_proj` and `down_proj`. A mesh may add an `expert` axis
(`make_mesh(expert=n)`, `--mesh data=1,expert=4`) for expert parallelism: a routed MLP's experts
are split over it, whole (each device holds E / n experts, and each expert's width is split over
`model` where that is larger than 1), and every other split axis is split over `expert` x `model`
together, so attention and the vocabulary stay tensor parallel over all of those devices. One jit
over a mesh is the modern form of "pmapped across GPUs" (`pmap` is legacy and implemented on
jit + shard_map).

Multi-host: join the job first (`tevjax.multihost.initialize_distributed`); the mesh then spans
every process's devices and each process feeds the rows of the global batch that its devices hold
(`process_rows`, `global_batch_array`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tevjax.checks import is_int

# What tensor parallelism splits: `model`, with `expert` in front where the mesh has it.
_TENSOR = ("expert", "model")

__all__ = ["CACHE_AXES", "DRAFTER_AXES", "LINEAR_CACHE_AXES", "LOGICAL_RULES", "TARGET_AXES", "batch_sharding",
           "cache_shardings", "check_batch", "global_batch_array", "host_array", "linear_shardings",
           "logical_sharding", "logical_spec", "make_mesh", "mesh_axes", "param_shardings", "parse_mesh", "place",
           "process_rows", "put", "replicated", "shard_model", "shardings_by_path", "traced_on"]

# Logical axis name -> mesh axis, or mesh axes split together (None: replicated). The one table
# every sharded array reads. A mesh axis the mesh does not have is left out (a (data, model) mesh
# splits `heads` over `model` alone), and so is one that an earlier axis of the same array took.
#
# The LM head and the embedding are split over the vocabulary, not over the model width. Measured
# on 4 forced CPU devices (experiments/lm_head_sharding.py, results/lm_head_sharding.md): with
# `embed` sharded, each tree pass all-reduces the whole [B, N, V] logits (the contraction over D
# leaves partial sums), and the verifier then reads them replicated; with `vocab` sharded, a
# device computes its own [B, N, V / M] columns and every reduction over V (log-sum-exp, argmax,
# the sampler's Gumbel-max) combines only [B, N] partial results (SmolLM2 shapes, B = 4, N = 17:
# 33 KiB moved per tree pass + verify against 13,056 KiB). The embedding lookup of a vocab-sharded
# table costs one all-reduce of the [B, T, D] embeddings, as much as the width split's all-gather.
LOGICAL_RULES: Mapping[str, str | tuple[str, ...] | None] = {
    "batch": "data",
    "sequence": None,
    "vocab": _TENSOR,
    "embed": None,
    "heads": _TENSOR,  # query heads (H, or the fused H * Dh axis of a projection)
    "q_heads": _TENSOR,  # q_proj's output: H * Dh, or with an output gate (Qwen3-Next) H * 2 * Dh, head by head
    "kv_heads": _TENSOR,  # key/value heads (K, or K * Dh)
    "attn_heads": _TENSOR,  # one value per query head (GPT-OSS's attention sinks, [H]), split as the heads
    "mlp": _TENSOR,  # the MLP width (intermediate_size; with experts, each expert's: over `model` alone)
    # The experts of a routed MLP, over `expert` when the mesh has one (expert parallelism), else
    # whole on every device with their widths split. Either way the activations are the same on
    # every device of the group, so each device runs its own experts (or width slices) on every
    # token and the routed MLP ends in the dense MLP's one all-reduce of [B, T, D] partial sums: no
    # all-to-all token exchange, which pays when tokens are few (decoding) and costs E / n of the
    # experts' memory per device.
    "experts": "expert",
    "router": None,  # the router's E outputs: every device routes every token itself
    "shared_mlp": _TENSOR,  # the width of Qwen2-MoE's shared expert, split as a dense MLP's
    "gate": None,  # the one output of the shared expert's gate
    "head_dim": None,
    "features": None,  # the drafter's concatenated tapped hidden states (F = n * D)
    # The ids of a reduced draft vocabulary: Vd int32s that every device reads whole to pick the
    # draft vocabulary's columns of its logits (and to map tree indices back to token ids); split,
    # each device would need the other devices' ids, so replicating them is both cheaper and simpler.
    "draft_vocab": None,
    "cache_slots": None,
    "layers": None,
    "linear_layers": None,  # a hybrid target's linear-attention layers (stacked apart from `layers`)
    # Their mixer's axes (`_LINEAR_AXES`, `LINEAR_CACHE_AXES`): the q|k|v channels (C, in key-head
    # groups), the values' Hv * Dv, the value heads Hv and the key heads Hk, split as attention's heads;
    # the conv's width and Dv whole.
    "linear_qkv": _TENSOR,
    "linear_values": _TENSOR,
    "linear_heads": _TENSOR,
    "linear_key_heads": _TENSOR,
    "linear_conv": None,
    "linear_value_dim": None,
}

# Logical axes of one decoder layer's parameters, shared by the target (stacked on a leading
# `layers` axis) and the drafter (a list of layers). A projection's fused output H * Dh is named
# `heads`: splitting it into M equal slices keeps whole heads together when M divides H.
_LAYER_AXES: Mapping[str, tuple[str, ...]] = {
    "input_layernorm.scale": ("embed",),
    "post_attention_layernorm.scale": ("embed",),
    "attn_output_norm.scale": ("embed",),
    "mlp_output_norm.scale": ("embed",),
    "self_attn.q_proj.kernel": ("embed", "q_heads"),
    "self_attn.q_proj.bias": ("q_heads",),
    "self_attn.k_proj.kernel": ("embed", "kv_heads"),
    "self_attn.k_proj.bias": ("kv_heads",),
    "self_attn.v_proj.kernel": ("embed", "kv_heads"),
    "self_attn.v_proj.bias": ("kv_heads",),
    "self_attn.o_proj.kernel": ("heads", "embed"),
    "self_attn.o_proj.bias": ("embed",),
    "self_attn.q_norm.scale": ("head_dim",),
    "self_attn.k_norm.scale": ("head_dim",),
    # OLMo's q/k norms over the whole projection: split as the projection's output is (their
    # statistics then sum over devices, which XLA inserts).
    "self_attn.q_proj_norm.scale": ("heads",),
    "self_attn.k_proj_norm.scale": ("kv_heads",),
    "mlp.gate_proj.kernel": ("embed", "mlp"),
    "mlp.up_proj.kernel": ("embed", "mlp"),
    "mlp.down_proj.kernel": ("mlp", "embed"),
    "mlp.router.kernel": ("embed", "router"),
    "mlp.router.bias": ("router",),
    "self_attn.sinks": ("attn_heads",),
    "mlp.gate_bias": ("experts", "mlp"),
    "mlp.up_bias": ("experts", "mlp"),
    # Added once per token after the devices' partial sums, each token's k rows gathered by expert:
    # whole on every device (E x D), as the router is, so the gather moves nothing.
    "mlp.down_bias": ("router", "embed"),
    "mlp.gate_proj": ("experts", "embed", "mlp"),
    "mlp.up_proj": ("experts", "embed", "mlp"),
    "mlp.down_proj": ("experts", "mlp", "embed"),
    "mlp.shared_expert.gate_proj.kernel": ("embed", "shared_mlp"),
    "mlp.shared_expert.up_proj.kernel": ("embed", "shared_mlp"),
    "mlp.shared_expert.down_proj.kernel": ("shared_mlp", "embed"),
    "mlp.shared_expert_gate.kernel": ("embed", "gate"),
}

# A hybrid target's linear-attention mixer (Qwen3-Next's Gated DeltaNet), split by heads as attention
# is: its q|k|v channels run key-head group by group (`GatedDeltaNet`), so a contiguous split of them
# gives each device whole groups, and with them the value heads those groups serve.
_LINEAR_AXES: Mapping[str, tuple[str, ...]] = {
    "linear_attn.in_proj_qkv.kernel": ("embed", "linear_qkv"),
    "linear_attn.in_proj_z.kernel": ("embed", "linear_values"),
    "linear_attn.in_proj_b.kernel": ("embed", "linear_heads"),
    "linear_attn.in_proj_a.kernel": ("embed", "linear_heads"),
    "linear_attn.conv": ("linear_qkv", "linear_conv"),
    "linear_attn.dt_bias": ("linear_heads",),
    "linear_attn.A_log": ("linear_heads",),
    "linear_attn.norm.scale": ("linear_value_dim",),
    "linear_attn.out_proj.kernel": ("linear_values", "embed"),
}

# Parameter path (dots; `*` matches one list index) -> logical axes, for every parameter of
# `tevjax.models.transformer.Transformer`...
TARGET_AXES: Mapping[str, tuple[str, ...]] = {
    "embed_tokens.embedding": ("vocab", "embed"),
    **{f"layers.{name}": ("layers", *axes) for name, axes in _LAYER_AXES.items()},
    # a hybrid target's linear layers: the same norms and MLPs, and their own mixer
    **{f"linear_layers.{name}": ("linear_layers", *axes) for name, axes in _LAYER_AXES.items()
       if not name.startswith("self_attn.")},
    **{f"linear_layers.{name}": ("linear_layers", *axes) for name, axes in _LINEAR_AXES.items()},
    "norm.scale": ("embed",),
    "lm_head.kernel": ("embed", "vocab"),
}
# ... and of `tevjax.models.dflash.DFlashDrafter` (its embedding and LM head are the target's).
DRAFTER_AXES: Mapping[str, tuple[str, ...]] = {
    "fc.kernel": ("features", "embed"),
    "hidden_norm.scale": ("embed",),
    **{f"layers.*.{name}": axes for name, axes in _LAYER_AXES.items()},
    "norm.scale": ("embed",),
    "draft_vocab": ("draft_vocab",),
}
# `KVCache.k` / `.v` [L, B, K, S, Dh] (the target's cache and the drafter's context cache).
CACHE_AXES: tuple[str, ...] = ("layers", "batch", "kv_heads", "cache_slots", "head_dim")
# `KVCache.linear`'s fields (`LinearState`, a hybrid target's linear layers): rows over `data`, heads
# (and the q|k|v channels, by key-head group) over `model`, as the mixer's weights split.
LINEAR_CACHE_AXES: dict[str, tuple[str | None, ...]] = {
    "state": ("linear_layers", "batch", "linear_heads", None, None),
    "conv": ("linear_layers", "batch", None, "linear_qkv"),
    "tree_x": ("linear_layers", "batch", None, "linear_qkv"),
    "tree_k": ("linear_layers", "batch", None, "linear_key_heads", None),
    "tree_v": ("linear_layers", "batch", None, "linear_heads", None),
    "tree_gb": ("linear_layers", "batch", None, None, "linear_heads"),
}

# What a sharded logical axis counts, for error messages: splitting must not cut one of these.
_UNITS = {"heads": "query heads (num_heads)", "attn_heads": "query heads (num_heads)",
          "kv_heads": "key/value heads (num_kv_heads)", "mlp": "MLP width (intermediate_size)",
          "vocab": "vocabulary entries (vocab_size)",
          "batch": "batch rows", "embed": "model width (hidden_size)", "experts": "experts (num_experts)",
          "router": "router outputs (num_experts)",
          "shared_mlp": "shared expert width (shared_expert_size)",
          "linear_qkv": "linear layers' key heads (linear_key_heads)",
          "linear_key_heads": "linear layers' key heads (linear_key_heads)",
          "linear_values": "linear layers' value heads (linear_value_heads)",
          "linear_heads": "linear layers' value heads (linear_value_heads)"}


def logical_spec(*names: str | None) -> PartitionSpec:
    """PartitionSpec for an array whose axes carry these logical names (None: not sharded), with
    the table's entries as they are; `logical_sharding` fits them to a mesh."""
    unknown = [n for n in names if n is not None and n not in LOGICAL_RULES]
    if unknown:
        raise ValueError(f"unknown logical axis {unknown[0]!r}; known: {sorted(LOGICAL_RULES)}")
    return PartitionSpec(*(None if n is None else LOGICAL_RULES[n] for n in names))


def logical_sharding(mesh: Mesh, axes: Sequence[str | None], shape: Sequence[int] | None = None, *,
                     units: Mapping[str, int] | None = None, what: str = "array") -> NamedSharding:
    """The NamedSharding of an array of `shape` whose axes carry the logical names `axes`.

    A logical axis whose mesh axis is absent from `mesh` is not split. `units` counts the
    indivisible pieces of an axis when they are coarser than its elements (a fused H * Dh
    projection axis has H units): a mesh axis that does not divide them raises a ValueError naming
    the dimension, `what` it belongs to, and both sizes. Without a `shape` nothing is checked.
    """
    if shape is None:
        shape = [0] * len(axes)  # 0 is divisible by every size
    if len(axes) != len(shape):
        raise ValueError(f"{what}: {len(axes)} logical axes {tuple(axes)} for an array of shape {tuple(shape)}")
    logical_spec(*axes)  # unknown names raise
    spec, taken = [], set()
    for logical, size in zip(axes, shape):
        # A mesh axis can split only one axis of an array; a second use stays replicated.
        use = tuple(a for a in mesh_axes(mesh, logical) if a not in taken)
        if not use:
            spec.append(None)
            continue
        n = int(np.prod([mesh.shape[a] for a in use]))
        count = (units or {}).get(logical, size)
        if count % n or size % n:
            name = f"axis {use[0]!r}" if len(use) == 1 else "axes " + " x ".join(use)
            raise ValueError(f"mesh {name} of size {n} does not divide the {count} "
                             f"{_UNITS.get(logical, logical)} of {what}")
        spec.append(use[0] if len(use) == 1 else use)
        taken.update(use)
    return NamedSharding(mesh, PartitionSpec(*spec))


def mesh_axes(mesh: Mesh, logical: str | None) -> tuple[str, ...]:
    """The axes of `mesh` that split the logical axis `logical` (its `LOGICAL_RULES` entry, less
    the axes this mesh lacks), major first: () when nothing splits it. Inside `shard_map` the tuple
    is the axis name of a collective over the split (`psum(x, axes)`), in the order of the slices."""
    rule = None if logical is None else LOGICAL_RULES[logical]
    rule = () if rule is None else (rule,) if isinstance(rule, str) else rule
    return tuple(a for a in rule if a in mesh.shape)


def _dims(cfg) -> dict[str, tuple[int, int]]:
    """Logical axis -> (array size, indivisible units) of a target `ModelConfig` or a `DFlashConfig`."""
    h, k, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    same = lambda n: (n, n)  # noqa: E731
    gate = 2 if getattr(cfg, "attn_output_gate", False) else 1
    dims = {"vocab": same(cfg.vocab_size), "embed": same(cfg.hidden_size), "heads": (h * dh, h),
            "q_heads": (h * dh * gate, h),
            "kv_heads": (k * dh, k), "mlp": same(cfg.intermediate_size),
            # a hybrid target stacks its attention layers and its linear ones apart
            "layers": same(getattr(cfg, "num_attention_layers", cfg.num_layers)),
            "linear_layers": same(len(getattr(cfg, "linear_layers", ()))),
            "linear_qkv": (getattr(cfg, "linear_conv_channels", 0), getattr(cfg, "linear_key_heads", 0)),
            "linear_values": (getattr(cfg, "linear_value_heads", 0) * getattr(cfg, "linear_value_dim", 0),
                              getattr(cfg, "linear_value_heads", 0)),
            "linear_heads": same(getattr(cfg, "linear_value_heads", 0)),
            "linear_key_heads": same(getattr(cfg, "linear_key_heads", 0)),
            "linear_conv": same(getattr(cfg, "linear_conv", 0)),
            "linear_value_dim": same(getattr(cfg, "linear_value_dim", 0)),
            "head_dim": same(dh), "experts": same(getattr(cfg, "num_experts", 0)),
            "router": same(getattr(cfg, "num_experts", 0)), "attn_heads": same(h),
            "shared_mlp": same(getattr(cfg, "shared_expert_size", 0)), "gate": same(1)}
    if hasattr(cfg, "feature_dim"):  # a drafter
        dims["features"] = same(cfg.feature_dim)
        dims["draft_vocab"] = same(cfg.draft_vocab_dim)
    return dims


def _path_parts(path) -> tuple[str, ...]:
    """A pytree path of an `nnx.State` leaf as attribute names ("layers", "0", "fc", "kernel")."""
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        elif isinstance(key, jax.tree_util.GetAttrKey) and key.name != "value":  # a Variable's value
            parts.append(key.name)
    return tuple(parts)


def _matches(pattern: tuple[str, ...], parts: tuple[str, ...]) -> bool:
    return len(pattern) == len(parts) and all(p == q or (p == "*" and q.isdigit()) for p, q in zip(pattern, parts))


def _table(model) -> tuple[Mapping[str, tuple[str, ...]], Any, str]:
    from tevjax.models.dflash import DFlashDrafter
    from tevjax.models.transformer import Transformer

    if isinstance(model, Transformer):
        return TARGET_AXES, model.cfg, "the target"
    if isinstance(model, DFlashDrafter):
        return DRAFTER_AXES, model.cfg, "the drafter"
    raise TypeError(f"no sharding table for {type(model).__name__}: expected a Transformer or a DFlashDrafter")


def param_shardings(model, mesh: Mesh, tree: Any = None, *, optimizer: bool = False) -> Any:
    """NamedShardings of a model's arrays, read from its logical-axes table (`TARGET_AXES` for a
    `Transformer`, `DRAFTER_AXES` for a `DFlashDrafter`) through `LOGICAL_RULES`.

    `tree` defaults to `nnx.state(model)`; it may be any part of it (e.g. the `nnx.Param` of
    `nnx.split`), or, with `optimizer=True`, an optimizer's state, whose moment trees end in the
    parameter paths (`opt_state.0.mu.fc.kernel` takes the sharding of `fc.kernel`) and whose
    scalars (step counts) are replicated. Every array's shape is asserted against the config; an
    array the table does not name raises (no parameter is replicated by omission).
    """
    from flax import nnx

    table, cfg, what = _table(model)
    tree = nnx.state(model) if tree is None else tree
    dims = _dims(cfg)
    rows = [(tuple(k.split(".")), axes) for k, axes in table.items()]

    def one(path, leaf):
        parts = _path_parts(path)
        name = ".".join(parts)
        found = [(pat, axes) for pat, axes in rows
                 if _matches(pat, parts) or (optimizer and len(parts) > len(pat) and _matches(pat, parts[-len(pat):]))]
        if not found:
            if optimizer and np.ndim(leaf) == 0:
                return replicated(mesh)
            raise ValueError(f"{what} array {name!r} has no row in its logical-axes table (tevjax/sharding.py)")
        pat, axes = max(found, key=lambda row: len(row[0]))  # the longest (most specific) pattern
        want = tuple(dims[a][0] for a in axes)
        if tuple(np.shape(leaf)) != want:
            raise AssertionError(f"{what} array {name!r} has shape {tuple(np.shape(leaf))}; its logical axes "
                                 f"{axes} and the config say {want}")
        return logical_sharding(mesh, axes, want, units={a: dims[a][1] for a in axes},
                                what=f"{what} array {name!r}")

    return jax.tree_util.tree_map_with_path(one, tree)


def shardings_by_path(model, mesh: Mesh) -> dict[tuple[str, ...], NamedSharding]:
    """`param_shardings` of every array of `model`, keyed by attribute path ("layers", "0", "fc",
    "kernel"): what a checkpoint loader looks up as it converts each tensor."""
    flat = jax.tree_util.tree_flatten_with_path(param_shardings(model, mesh))[0]
    return {_path_parts(path): s for path, s in flat}


def place(x: np.ndarray, dtype, sharding: NamedSharding | None) -> jax.Array:
    """A converted host tensor as a device array of `dtype`: on the default device without a
    sharding, else straight into `sharding` (`put`: each device gets its slice, no full copy)."""
    if sharding is None:
        return jax.numpy.asarray(x, dtype=dtype)
    return put(np.asarray(x, dtype=dtype), sharding)


def shard_model(model, mesh: Mesh):
    """Moves every array of `model` (a `Transformer` or `DFlashDrafter`) to its sharding on
    `mesh`, in place; returns the model. Arrays already placed so are not copied."""
    from flax import nnx

    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, param_shardings(model, mesh, state)))
    return model


def cache_shardings(mesh: Mesh, cache, what: str = "the KV cache"):
    """A `KVCache` of NamedShardings for `cache` (arrays or shapes, [L, B, K, S, Dh]): rows over
    `data`, key/value heads over `model` (see `CACHE_AXES`); a linear state likewise (`LINEAR_CACHE_AXES`)."""
    from tevjax.models.cache import KVCache

    s = logical_sharding(mesh, CACHE_AXES, cache.k.shape, what=what)
    return KVCache(k=s, v=s, linear=None if cache.linear is None else linear_shardings(mesh, cache.linear))


def linear_shardings(mesh: Mesh, linear=None):
    """A `LinearState` of NamedShardings (`LINEAR_CACHE_AXES`), for `linear`'s shapes when given."""
    from tevjax.models.cache import LinearState

    return LinearState(**{name: logical_sharding(mesh, axes, None if linear is None else getattr(linear, name).shape,
                                                 what=f"the linear state's {name}")
                          for name, axes in LINEAR_CACHE_AXES.items()})


def check_batch(mesh: Mesh, batch: int, what: str = "the batch") -> None:
    """ValueError unless the mesh's `data` axis divides `batch` rows."""
    logical_sharding(mesh, ("batch",), (batch,), what=what)


def put(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
    """A host array placed straight into `sharding`: each device receives only its own slice (no
    full copy on one device first), and in a multi-host run each process fills its own devices
    from its copy of `x`."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def host_array(x: jax.Array) -> np.ndarray:
    """The whole of a (possibly multi-host) global array as a numpy array on this host."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    if x.is_fully_replicated:  # every process holds all of it: no collective needed
        return np.asarray(x.addressable_data(0))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def parse_mesh(text: str) -> dict[str, int]:
    """'data=2,model=1' -> {"data": 2, "model": 1} (and `expert`), with one-line errors."""
    out: dict[str, int] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        # Spaces around a name or a size are allowed, inside one an error: "data=1 6" is not 16.
        name, _, size = (x.strip() for x in part.partition("="))
        if name not in ("data", "expert", "model") or not size.isdigit() or int(size) < 1:
            raise ValueError(f"--mesh {text!r}: expected entries like data=2,model=1 (or expert=2) with "
                             "positive sizes")
        if name in out:
            raise ValueError(f"--mesh {text!r}: {name} is given twice")
        out[name] = int(size)
    if not out:
        raise ValueError(f"--mesh {text!r}: expected entries like data=2,model=1 (or expert=2)")
    return out


def make_mesh(data: int | None = None, model: int = 1, devices=None, *, expert: int = 1) -> Mesh:
    """A (data, model) mesh over `devices` (default: all devices of all processes), or with
    `expert` > 1 a (data, expert, model) mesh for expert parallelism (`LOGICAL_RULES`); `data`
    None takes every device not used by the others."""
    for name, size in (("data", data), ("model", model), ("expert", expert)):
        if size is not None and (not is_int(size) or size < 1):
            raise ValueError(f"make_mesh: {name} must be a positive int, got {size!r}")
    devices = list(jax.devices() if devices is None else devices)
    # A device twice would hold two slices of an array at once: jax builds such a mesh, and the
    # first array placed on it fails in XLA ("Number of processed shards does not match").
    seen = set()
    for d in devices:
        if d in seen:
            raise ValueError(f"make_mesh: device {d} is given twice")
        seen.add(d)
    group = model * expert  # the devices that share one row of the batch
    named = f"model={model}" if expert == 1 else f"expert={expert} x model={model}"
    if data is None:
        if group > len(devices):
            raise ValueError(f"mesh {named} needs at least {group} devices, {len(devices)} are present")
        if len(devices) % group:
            raise ValueError(f"{named} does not divide the {len(devices)} devices")
        data = len(devices) // group
    if data * group != len(devices):
        raise ValueError(f"mesh data={data} x {named} needs {data * group} devices, {len(devices)} are present")
    if expert == 1:  # the plain mesh keeps two axes, as every mesh did before `expert`
        return Mesh(np.asarray(devices).reshape(data, model), ("data", "model"))
    return Mesh(np.asarray(devices).reshape(data, expert, model), ("data", "expert", "model"))


def traced_on(fn, mesh: Mesh | None):
    """`fn`, traced with `mesh` as the abstract mesh in context (`jax.sharding.use_abstract_mesh`):
    what tevjax's decoder and trainer jit. A module may then run a part of itself per device under
    `shard_map` (`SparseMoE`: each device's experts on its tokens, then one all-reduce per layer);
    without the context it leaves the split to XLA's partitioner, with the same results."""
    if mesh is None:
        return fn

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return traced


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Leading (batch) axis over `data`, the rest replicated."""
    return NamedSharding(mesh, logical_spec("batch", *([None] * (ndim - 1))))


def process_rows(mesh: Mesh, batch: int) -> np.ndarray:
    """The rows of a global batch of `batch` rows, split over `data`, that this process's devices
    hold, ascending: what this process reads for `global_batch_array`. Every row in a single
    process. Not always `batch / processes` rows of its own: where the `data` axis is shorter than
    the job (a `model` axis that spans hosts), processes that share a slice of the batch must each
    read all of it, alike."""
    check_batch(mesh, batch)
    index = batch_sharding(mesh, 1).addressable_devices_indices_map((batch,))
    return np.asarray(sorted({r for (rows,) in index.values() for r in range(*rows.indices(batch))}), np.int64)


def global_batch_array(mesh: Mesh, local: np.ndarray, batch: int | None = None) -> jax.Array:
    """A global array of `batch` rows (default: `local`'s, the whole batch of a single-process run),
    batch-sharded over `data`, from this process's rows of it: `local` holds the rows that
    `process_rows(mesh, batch)` names, in that order.

    (jax.make_array_from_process_local_data would take a process's rows for a slice of the batch
    of its own: where the `data` axis does not split the batch between the processes, it made a
    smaller "replicated" batch that held other rows on each host, and trained on it in silence.)"""
    local = np.asarray(local)
    batch = len(local) if batch is None else batch
    rows = process_rows(mesh, batch)
    if len(local) != len(rows):
        raise ValueError(f"process {jax.process_index()} holds {len(rows)} rows of the global batch of {batch} on "
                         f"this mesh, and was given {len(local)}")
    at = np.zeros(batch, np.int64)
    at[rows] = np.arange(len(rows))

    def part(index):
        # A device's rows are a contiguous range of the batch, all among `rows`: so of `local` too.
        need = range(*index[0].indices(batch))
        start = int(at[need.start]) if need else 0
        return local[(slice(start, start + len(need)), *index[1:])]

    return jax.make_array_from_callback((batch, *local.shape[1:]), batch_sharding(mesh, local.ndim), part)


def frozen(tree: Any) -> tuple:
    """A hashable form of a pytree of shardings, (structure, leaves): part of the key under which
    jitted programs are shared (`thawed` gives the tree back). `None` entries stay in the structure."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(leaves)


def thawed(key: tuple) -> Any:
    """The pytree `frozen` made `key` from."""
    treedef, leaves = key
    return jax.tree.unflatten(treedef, leaves)
