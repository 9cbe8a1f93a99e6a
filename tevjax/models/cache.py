"""Per-layer key/value cache of the target model.

The cache is only storage: it holds no lengths. Callers (the decode engine) track each row's
committed length and pass write positions to `Transformer.__call__`, which writes the K/V of new
tokens at `write_pos[b] + t` and lets queries see every slot below `write_pos[b]`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from tevjax.models.config import ModelConfig
from tevjax.models.linear_attention import commit_path

__all__ = ["KVCache", "LinearState", "read_slots", "scatter_rows", "write_layer", "write_slots"]


def scatter_rows(buf: jax.Array, idx: jax.Array, values: jax.Array, *, axis: int = 0) -> jax.Array:
    """`buf` with `values[.., b, t, ..]` written at slot `idx[b, t]` of row b (a slot index past
    the end is dropped).

    buf has its rows at `axis` and its slots right after; values has the same layout with T in
    place of the slots; idx is [B, T]. Written as a vmap over rows, not with an arange row index:
    XLA then partitions the write by rows, so a batch split over devices writes its own rows and
    gathers nothing (an explicit row index makes it all-gather the indices and the values). The
    axes before `axis` are vmapped too, so every batching dimension of the scatter leads: XLA:CPU
    moves batching dimensions to the front before it scatters, and a row axis behind another one
    made it transpose (copy) the whole buffer on every call. For the KV cache (then laid out
    [L, B, S, K, Dh]) that was the whole cache per commit: 63 ms against 3 ms at S = 1024 on 2
    CPU cores.
    """
    f = jax.vmap(lambda row, i, v: row.at[i].set(v.astype(row.dtype), mode="drop"))
    for _ in range(axis):
        f = jax.vmap(f, in_axes=(0, None, 0))
    return f(buf, idx, values)


def write_layer(buf: jax.Array, layer: jax.Array, idx: jax.Array, values: jax.Array) -> jax.Array:
    """`buf` [L, B, K, S, Dh] with `values` [B, T, K, Dh] written at layer `layer` (traced), slots
    `idx` [B, T] of each row (S = dropped): one layer's K or V for the new tokens.

    Explicit (layer, row, slot) indices rather than a vmap over rows: the rows sit behind the
    layer axis, and a vmapped scatter there made XLA:CPU copy the whole cache stack in every
    layer of every forward pass (an AR step at a 2,048-token context cost 10x one at 64). The
    index arrays broadcast to [B, T] and the kv-head slice sits between them, so the written
    window is [B, T, K, Dh], the layout of `values`. On a batch-split mesh this write gathers the
    new tokens' indices and values (small next to the cache); the cache stays split by rows.
    """
    rows = jnp.arange(buf.shape[1], dtype=jnp.int32)[:, None]
    return buf.at[layer, rows, :, idx].set(values.astype(buf.dtype), mode="drop")


def read_slots(buf: jax.Array, idx: jax.Array) -> jax.Array:
    """[L, B, K, T, Dh]: the slots `idx` [B, T] (in range) of each row of `buf` [L, B, K, S, Dh], in
    every layer; layers and rows vmapped, as in `write_slots`."""
    return jax.vmap(jax.vmap(lambda x, i: x[:, i]), in_axes=(0, None))(buf, idx)


def write_slots(buf: jax.Array, idx: jax.Array, values: jax.Array) -> jax.Array:
    """`buf` [L, B, K, S, Dh] with `values` [L, B, K, T, Dh] written at slots `idx` [B, T] of each
    row (a slot past the end is dropped), in every layer. Layers and rows are vmapped, so they
    lead as batching dimensions (see `scatter_rows`); the kv heads are part of each write."""
    write = jax.vmap(jax.vmap(lambda x, i, v: x.at[:, i].set(v.astype(x.dtype), mode="drop")),
                     in_axes=(0, None, 0))
    return write(buf, idx, values)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LinearState:
    """What a model's linear-attention layers carry (Qwen3-Next; `tevjax.models.linear_attention`).

    A recurrent state cannot be cut back to a prefix the way slots above a length are ignored, so
    a tree pass leaves `state` and `conv` as they were (emptied for a row whose pass starts at slot
    0) and records what each tree node fed its layers (`tree_*`, N node entries); `advance` then
    runs the accepted path into them. A causal run (prefill) updates them itself. The q|k|v channels
    (C) run key-head group by group, as `GatedDeltaNet`'s. Shape letters: the legend in
    `tevjax/__init__.py`.
    """

    state: jax.Array  # [Ll, B, Hv, Dk, Dv] float32 the recurrent state after the committed tokens
    conv: jax.Array  # [Ll, B, W - 1, C] the last W - 1 conv inputs of the committed tokens
    tree_x: jax.Array  # [Ll, B, N, C] the last tree pass's conv inputs, by tree node
    tree_k: jax.Array  # [Ll, B, N, Hk, Dk] its convolved keys, before the norm
    tree_v: jax.Array  # [Ll, B, N, Hv, Dv] its values
    tree_gb: jax.Array  # [Ll, B, N, 2, Hv] float32 its decays g and betas

    @classmethod
    def init(cls, cfg, batch: int, tree_slots: int) -> "LinearState":
        nl, w, c = len(cfg.linear_layers), cfg.linear_conv, cfg.linear_conv_channels
        kh, hv, dk, dv = cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim
        z = functools.partial(jnp.zeros, dtype=cfg.dtype)
        return cls(state=jnp.zeros((nl, batch, hv, dk, dv), jnp.float32), conv=z((nl, batch, w - 1, c)),
                   tree_x=z((nl, batch, tree_slots, c)), tree_k=z((nl, batch, tree_slots, kh, dk)),
                   tree_v=z((nl, batch, tree_slots, hv, dv)),
                   tree_gb=jnp.zeros((nl, batch, tree_slots, 2, hv), jnp.float32))

    @property
    def tree_slots(self) -> int:
        """Static node count N a tree pass may record."""
        return self.tree_x.shape[2]

    def advance(self, nodes: jax.Array, count: jax.Array) -> "LinearState":
        """The state after the first `count` [B] nodes of `nodes` [B, M] (root first: the accepted
        path) of the last tree pass, in every linear layer (`linear_attention.commit_path`)."""
        state, conv = jax.vmap(commit_path, in_axes=(0, 0, 0, 0, 0, 0, None, None))(
            self.state, self.conv, self.tree_x, self.tree_k, self.tree_v, self.tree_gb, nodes, count)
        return dataclasses.replace(self, state=state, conv=conv.astype(self.conv.dtype))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Stacked K/V for all layers (shape letters: the legend in `tevjax/__init__.py`)."""

    # Heads before slots: attention reads one kv head's [S, Dh] keys as one contiguous matrix.
    # With the slots first, XLA:CPU transposed each layer's keys and values on every pass: a
    # budget-8 tree pass's attention over 2,048 slots took 33.6 ms instead of 19.7 (30 SmolLM2
    # layers, 2 CPU cores).
    k: jax.Array  # [L, B, K, S, Dh] keys after RoPE, compute dtype (L: the attention layers)
    v: jax.Array  # [L, B, K, S, Dh] values, compute dtype
    linear: LinearState | None = None  # a model with linear-attention layers: their state

    @classmethod
    def init(cls, cfg: ModelConfig, batch: int, capacity: int, *, tree_slots: int = 1) -> "KVCache":
        """Zero cache with `capacity` slots per row, in the config's compute dtype.

        `cfg` is any config with `num_layers`, `num_kv_heads`, `head_dim` and `dtype` (the target's
        `ModelConfig`, or a `DFlashConfig` for the drafter's context cache). A model with linear
        layers also gets their `LinearState`, recording up to `tree_slots` (N) tree nodes a pass.
        """
        if batch <= 0 or capacity <= 0 or tree_slots <= 0:
            raise ValueError(f"cache init: batch={batch}, capacity={capacity} and tree_slots={tree_slots} must be "
                             f"positive")
        linear = getattr(cfg, "linear_layers", ())
        shape = (cfg.num_layers - len(linear), batch, cfg.num_kv_heads, capacity, cfg.head_dim)
        return cls(k=jnp.zeros(shape, cfg.dtype), v=jnp.zeros(shape, cfg.dtype),
                   linear=LinearState.init(cfg, batch, tree_slots) if linear else None)

    @property
    def capacity(self) -> int:
        """Static slot count S per row."""
        return self.k.shape[3]

    @property
    def batch(self) -> int:
        """Static row count B."""
        return self.k.shape[1]

    def move_slots(self, src: jax.Array, dst_start: jax.Array) -> "KVCache":
        """Copies slot `src[b, m]` to slot `dst_start[b] + m` in every layer (jittable).

        This is the commit step after tree verification: `src[b]` lists the cache slots of the
        accepted path (e.g. `prefix_len + accepted_node_index`), `dst_start[b]` the row's
        committed length. Entries with `src[b, m] < 0` (unused, for paths shorter than src's
        second axis) are skipped. Reads happen before writes, so overlapping source and
        destination ranges are safe. src: [B, path slots] int32 (the decoder passes an accepted
        path: N - 1 slots); dst_start: [B] int32.
        """
        if src.ndim != 2 or src.shape[0] != self.batch or jnp.shape(dst_start) != (self.batch,):
            raise ValueError(f"KVCache.move_slots: src has shape {tuple(src.shape)} and dst_start "
                             f"{tuple(jnp.shape(dst_start))}, expected ({self.batch}, M) and ({self.batch},) for a "
                             f"cache of {self.batch} rows")
        b, m = src.shape
        take = jnp.clip(src, 0, self.capacity - 1)
        dst = dst_start[:, None] + jnp.arange(m)[None, :]
        # Skipped or out-of-range destinations get index S, which `mode="drop"` ignores.
        dst = jnp.where((src >= 0) & (dst >= 0) & (dst < self.capacity), dst, self.capacity)

        def move(x):  # the read happens before the write
            return write_slots(x, dst, read_slots(x, take))

        return dataclasses.replace(self, k=move(self.k), v=move(self.v))

    def advance(self, nodes: jax.Array, count: jax.Array) -> "KVCache":
        """After a tree pass: the linear layers' state run over the first `count` [B] of `nodes`
        [B, M] (root first), the accepted path (`LinearState.advance`); a cache without linear
        layers as it is. The decoder's commit calls it beside `move_slots`."""
        if self.linear is None:
            return self
        return dataclasses.replace(self, linear=self.linear.advance(nodes, count))
