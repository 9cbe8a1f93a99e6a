"""Padded, static-shape draft trees.

A draft tree of N static slots is four arrays plus one derived mask (shape letters follow the
legend in `tevjax/__init__.py`). Node 0 is the root: its token is the last committed token and its
logits row is the target's next-token distribution after the committed prefix. Every real node
i > 0 has a parent 0 <= parents[i] < i, so parents always come before children and one
left-to-right pass is a valid topological order. A node i > 0 with parents[i] == -1 is padding:
it takes no part in any law, and a padded tree behaves exactly like the same tree without the
padding.

Worked example (N = 5; node 3 is padding)::

    tokens   = [ 7, 11, 12,  0, 13]      root "7"
    parents  = [-1,  0,  0, -1,  1]      ├── 11 (node 1)
    depth    = [ 0,  1,  1,  0,  2]      │   └── 13 (node 4)
    valid    = [ 1,  1,  1,  0,  1]      └── 12 (node 2)

    ancestors[i, j] = "j is an ancestor of i, or i itself"   (rows: query i, columns: key j)
        j:  0  1  2  3  4
    i=0  [  1  0  0  0  0 ]
    i=1  [  1  1  0  0  0 ]
    i=2  [  1  0  1  0  0 ]
    i=3  [  0  0  0  1  0 ]   padding sees only itself, so attention rows never go empty
    i=4  [  1  1  0  0  1 ]

`ancestors` is the tree-attention mask of the target's one-pass tree forward and also the matrix
that turns per-edge probabilities into prefix probabilities (see `tevjax.law`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["DraftTree", "TreeValidationError", "check_tree_logits", "concrete_temperature", "valid_temperature",
           "validate_tree"]

# Logits are divided by the temperature in float32, so a temperature must be a float32 number: a
# larger one (1e39) becomes inf there, and 1 / inf turns every logit to 0 (or NaN).
_F32_MAX = float(np.finfo(np.float32).max)


def valid_temperature(t: float) -> bool:
    """A concrete temperature is valid when it is >= 0 and finite in float32 (NaN is not)."""
    return 0 <= t <= _F32_MAX


def concrete_temperature(temperature: Any, *, scalar: bool = True) -> float | None:
    """`temperature` as a float when it is a concrete scalar, None when it is traced (checked at run
    time) or, with `scalar=False`, an array (one temperature per row, not checked here either).

    A bool, a string, None or (with `scalar`) an array is a TypeError naming the temperature:
    float() would read True as 1 and "0.5" as 0.5, and None or a [2] array would fail later with an
    error about something else. The value itself is not checked here (`valid_temperature`).
    """
    if isinstance(temperature, (bool, np.bool_, str, bytes)) or temperature is None or (
            scalar and np.ndim(temperature) != 0):
        raise TypeError(f"temperature must be a number (a scalar), got {temperature!r} "
                        f"({type(temperature).__name__})")
    if np.ndim(temperature) != 0:
        return None
    try:
        return float(temperature)
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
        return None
    except TypeError:  # complex numbers, other objects
        raise TypeError(f"temperature must be a real number, got {temperature!r} "
                        f"({type(temperature).__name__})") from None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftTree:
    """A padded draft tree; see the module docstring for the layout and a worked example.

    Build it with `DraftTree.from_parents`, which derives `depth`, `valid` and `ancestors` and
    canonicalises padding (padding tokens become 0, so they are always valid embedding ids).
    All fields may carry leading batch axes (e.g. under `jax.vmap`).
    """

    tokens: jax.Array  # [N] int32 token of each node (root: last committed token; padding: 0)
    parents: jax.Array  # [N] int32 parent index; -1 for the root and for padding
    depth: jax.Array  # [N] int32 number of edges from the root; 0 for the root and padding
    valid: jax.Array  # [N] bool   True for the root and every real node
    ancestors: jax.Array  # [N, N] bool ancestors[i, j]: j is an ancestor-or-self of i

    @property
    def num_nodes(self) -> int:
        """Static slot count N (root + real nodes + padding)."""
        return self.tokens.shape[-1]

    @property
    def max_depth(self) -> int:
        """Static upper bound on the depth of any node: N - 1 (a chain)."""
        return self.tokens.shape[-1] - 1

    @property
    def size(self) -> jax.Array:
        """Traced count of real nodes, root included."""
        return jnp.sum(self.valid, axis=-1)

    @property
    def children(self) -> jax.Array:
        """[N, N] bool: children[v, u] is True when u is a real child of v."""
        idx = jnp.arange(self.num_nodes)
        return (self.parents[..., None, :] == idx[:, None]) & self.valid[..., None, :]

    @classmethod
    def from_parents(cls, tokens: Any, parents: Any) -> "DraftTree":
        """Builds a tree from `tokens[N]` and `parents[N]`; jittable, no branching on values.

        Structure is derived by pointer doubling: after k rounds every node knows its ancestors up
        to distance 2**k, so ceil(log2(N - 1)) static rounds of row gathers give the full
        ancestor-or-self mask in O(N^2 log N) work with no loop over nodes.

        Nodes that cannot reach the root (padding, children of padding, or a parent index that is
        not earlier than the node) come out as padding, and so does a node that repeats an earlier
        sibling's token, with its subtree: the exit law and the verifiers assume distinct siblings
        (two children of one token would double that token's acceptance), and under jit nothing
        else would catch it. `validate_tree` reports all of these as errors before they reach
        jitted code; the builder and `merge_chain` never make them.
        """
        for name, value in (("tokens", tokens), ("parents", parents)):
            # jnp.asarray(x, int32) would truncate a float id (5.7 -> 5) and read True as 1.
            dtype = value.dtype if hasattr(value, "dtype") else np.asarray(value).dtype  # a tracer has one
            if not np.issubdtype(dtype, np.integer) and not (np.size(value) == 0 and dtype == np.float64):
                raise TypeError(f"DraftTree.from_parents: {name} must be integers, got dtype {dtype}")
            # jnp.asarray(x, int32) wraps a wider id silently (2**32 + 1 -> 1): a valid-looking
            # token or parent that no check after this point can tell from the real one.
            if not isinstance(value, jax.core.Tracer) and np.size(value) and not np.can_cast(dtype, np.int32):
                wide = np.asarray(value)
                if wide.min() < np.iinfo(np.int32).min or wide.max() > np.iinfo(np.int32).max:
                    raise ValueError(f"DraftTree.from_parents: {name} must fit in int32, got values in "
                                     f"[{wide.min()}, {wide.max()}]")
        tokens = jnp.asarray(tokens, jnp.int32)
        parents = jnp.asarray(parents, jnp.int32)
        if tokens.ndim != 1 or parents.shape != tokens.shape:
            raise ValueError(
                "DraftTree.from_parents expects 1-D tokens and parents of equal length, got "
                f"tokens {tokens.shape} and parents {parents.shape}; use jax.vmap for batches"
            )
        n = tokens.shape[0]
        if n == 0:
            raise ValueError("DraftTree.from_parents needs at least the root node; got 0 nodes")
        idx = jnp.arange(n, dtype=jnp.int32)
        # Root and padding point at themselves; so does any node whose parent index is not
        # strictly earlier (that would not be a tree, and a self-loop cannot reach the root).
        linked = (parents >= 0) & (parents < idx)
        repeat = jnp.any((idx[None, :] < idx[:, None]) & (parents[None, :] == parents[:, None])
                         & (tokens[None, :] == tokens[:, None]) & linked[None, :], axis=1)
        jump = jnp.where(linked & ~repeat, parents, idx)
        anc = (idx[:, None] == idx[None, :]) | (jump[:, None] == idx[None, :])
        for _ in range(max(1, math.ceil(math.log2(max(n - 1, 1))))):
            anc = anc | anc[jump]
            jump = jump[jump]
        valid = anc[:, 0]
        eye = idx[:, None] == idx[None, :]
        ancestors = jnp.where(valid[:, None], anc & valid[None, :], eye)
        depth = jnp.where(valid, jnp.sum(ancestors, axis=1) - 1, 0).astype(jnp.int32)
        return cls(
            tokens=jnp.where(valid, tokens, 0),
            parents=jnp.where(valid & (idx > 0), parents, -1),
            depth=depth,
            valid=valid,
            ancestors=ancestors,
        )


class TreeValidationError(ValueError):
    """An untrusted tree, logits array or temperature is malformed; the message names the culprit."""


def check_tree_logits(tree: DraftTree, logits: Any, caller: str) -> None:
    """Raises `TreeValidationError` unless `logits` is a floating [N, V] array for `tree`'s N slots.

    Under `jit` and `vmap` (where both the tree and the logits have their batch axes removed) only
    static shapes and dtypes are read: it runs at trace time and costs nothing at run time. A
    call on concrete arrays (eager, outside any transformation) also gets `validate_tree`'s data
    checks, since a token outside the vocabulary, a repeated sibling token or a NaN / +inf
    logit would otherwise give a wrong answer, not an error: the gathers clamp, and the laws
    assume distinct siblings. `caller` names the public function in the message ("exit_law",
    "verify").
    """
    _check_logits_layout(tuple(tree.tokens.shape), logits, f"{caller}: ")
    if isinstance(tree.tokens, jax.core.Tracer) or isinstance(tree.parents, jax.core.Tracer):
        return
    # The root's token (the last committed one) is never scored, so any id is harmless there.
    tokens = np.array(tree.tokens)
    tokens[..., :1] = 0
    try:
        validate_tree(tokens, tree.parents, logits=None if isinstance(logits, jax.core.Tracer) else logits,
                      vocab_size=np.shape(logits)[-1])
    except TreeValidationError as e:
        raise TreeValidationError(f"{caller}: {e}") from None


def _check_logits_layout(node_shape: tuple[int, ...], logits: Any, prefix: str) -> None:
    shape = tuple(np.shape(logits))
    if len(shape) != len(node_shape) + 1 or shape[:-1] != node_shape:
        n = node_shape[-1] if node_shape else 0
        raise TreeValidationError(
            f"{prefix}logits must have shape [N, V] = [{', '.join(map(str, node_shape))}, V] for a "
            f"tree of {n} nodes; got {shape}"
        )
    if shape[-1] < 1:
        raise TreeValidationError(f"{prefix}logits have an empty vocabulary axis (shape {shape})")
    dtype = jnp.result_type(logits)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TreeValidationError(f"{prefix}logits must be floating point, got dtype {dtype}")


def validate_tree(
    tokens: Any,
    parents: Any,
    *,
    logits: Any | None = None,
    vocab_size: int | None = None,
    temperature: float | None = None,
) -> None:
    """Checks an untrusted tree (and optionally its logits and temperature) outside `jit`.

    Raises `TreeValidationError` naming the first offending node, tensor or value. Checks:
    1-D equal-length tokens/parents; node 0 is a root (parent -1); every parent index is -1 or
    earlier than its node; no real node hangs below a padding node; sibling tokens are distinct;
    tokens are >= 0 and, when V is known (from `vocab_size` or the logits), below V; logits are
    [N, V] and every real row is NaN-free with some finite entry; temperature is a finite
    number >= 0.
    """
    tok = np.asarray(tokens)
    par = np.asarray(parents)
    if tok.ndim != 1 or par.ndim != 1 or tok.shape != par.shape:
        raise TreeValidationError(
            f"tokens and parents must be 1-D arrays of equal length; got tokens {tok.shape} and "
            f"parents {par.shape}"
        )
    n = tok.shape[0]
    if n == 0:
        raise TreeValidationError("a tree needs at least the root node; got 0 nodes")
    for name, arr in (("tokens", tok), ("parents", par)):
        if not np.issubdtype(arr.dtype, np.integer):
            raise TreeValidationError(f"{name} must be integers, got dtype {arr.dtype}")
    if par[0] != -1:
        raise TreeValidationError(f"node 0 is the root and must have parent -1, got {par[0]}")
    real = np.zeros(n, bool)
    real[0] = True
    for i in range(1, n):
        p = int(par[i])
        if p == -1:
            continue
        if p < 0 or p >= n:
            raise TreeValidationError(f"node {i}: parent index {p} is out of range [0, {n})")
        if p >= i:
            raise TreeValidationError(
                f"node {i}: parent {p} is not earlier than the node (parents must precede children)"
            )
        if not real[p]:
            raise TreeValidationError(
                f"node {i} has padding node {p} as its parent (a padding node cannot have real children)"
            )
        real[i] = True
    seen: dict[tuple[int, int], int] = {}
    for i in range(1, n):
        if real[i]:
            key = (int(par[i]), int(tok[i]))
            if key in seen:
                raise TreeValidationError(
                    f"nodes {seen[key]} and {i} are siblings (parent {key[0]}) with the same token "
                    f"{key[1]}; sibling tokens must be distinct"
                )
            seen[key] = i

    if logits is not None:
        lg = np.asarray(logits)
        _check_logits_layout(tok.shape, lg, "")
        if vocab_size is not None and lg.shape[1] != vocab_size:
            raise TreeValidationError(
                f"logits have vocabulary {lg.shape[1]} but vocab_size={vocab_size}"
            )
        vocab_size = lg.shape[1]
        rows = lg[real].astype(np.float32)
        bad_nan = np.isnan(rows).any(axis=1)
        if bad_nan.any():
            node = int(np.flatnonzero(real)[np.argmax(bad_nan)])
            raise TreeValidationError(f"logits row of node {node} contains NaN")
        bad_empty = ~(rows > -np.inf).any(axis=1)
        if bad_empty.any():
            node = int(np.flatnonzero(real)[np.argmax(bad_empty)])
            raise TreeValidationError(
                f"logits row of node {node} is entirely -inf: no token has positive probability"
            )
        if np.isposinf(rows).any():
            node = int(np.flatnonzero(real)[np.argmax(np.isposinf(rows).any(axis=1))])
            raise TreeValidationError(f"logits row of node {node} contains +inf")
    for i in np.flatnonzero(real):
        if int(tok[i]) < 0:
            raise TreeValidationError(f"node {i}: token {int(tok[i])} is negative (token ids are >= 0)")
    if vocab_size is not None:
        for i in np.flatnonzero(real):
            if not 0 <= int(tok[i]) < vocab_size:
                raise TreeValidationError(
                    f"node {i}: token {int(tok[i])} is outside the vocabulary [0, {vocab_size})"
                )
    if temperature is not None:
        try:
            t = concrete_temperature(temperature)
        except TypeError as e:
            raise TreeValidationError(str(e)) from None
        if t is None or not valid_temperature(t):
            raise TreeValidationError(f"temperature must be a finite float32 number >= 0, got {temperature!r}")
