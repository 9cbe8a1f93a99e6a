"""The canonical exit law of a fixed draft tree (paper Sec. 3, Lemma 1).

For target next-token distributions p_v at every node v (after temperature):

    P(root) = 1,  P(v) = P(pa(v)) * p_pa(v)(x_v)          target prefix probability
    rho(v)  = max(0, 1 - sum_{children u} p_v(x_u))        local exit probability (1 at a leaf)
    w(v)    = P(v) * rho(v)                                exit probability, sum_v w(v) = 1
    C_p     = sum_{v != root} P(v)                         target coverage; E[block] <= 1 + C_p

Everything is level-parallel: per-edge probabilities come from one log-sum-exp pass over the
[N, V] logits plus a gather, and the products along root paths are a masked product over the
tree's ancestor-or-self matrix, so there is no loop over nodes or depths. Reductions over nodes use
`where` + `sum`/`prod` rather than matmuls, because float32 matmuls may run in TF32 on GPUs.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from tevjax.tree import DraftTree

__all__ = ["ExitLaw", "exit_law", "is_greedy"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExitLaw:
    """Per-node quantities of the canonical exit law (0 at padding)."""

    prefix_prob: jax.Array  # [N] float32  P(v)
    local_exit: jax.Array  # [N] float32  rho(v)
    exit_prob: jax.Array  # [N] float32  w(v)
    coverage: jax.Array  # []  float32  C_p(T) = expected number of accepted draft tokens


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EdgeStats:
    """What the exit law and every verifier share: scaled logits and per-edge target probabilities."""

    scaled_logits: jax.Array  # [N, V] float32 logits / T (padding rows zeroed); raw logits if greedy
    log_norm: jax.Array  # [N] float32 log-sum-exp of each scaled row (0 when greedy)
    edge_prob: jax.Array  # [N] float32 p_pa(u)(x_u) for real non-root u, else 0


def is_greedy(temperature: Any) -> bool | None:
    """True/False for a concrete temperature, None when it is traced (decided at run time)."""
    try:
        return float(temperature) == 0.0
    except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError, TypeError):
        return None


def _sample_stats(tree: DraftTree, logits: jax.Array, temperature: jax.Array) -> EdgeStats:
    # Padding rows may hold anything, NaN included: zero them before any reduction.
    safe_t = jnp.where(temperature > 0, temperature, 1.0).astype(jnp.float32)
    z = jnp.where(tree.valid[:, None], logits.astype(jnp.float32), 0.0) / safe_t
    log_norm = jax.nn.logsumexp(z, axis=-1)
    parent = jnp.maximum(tree.parents, 0)
    edge_logit = z[parent, tree.tokens]
    is_edge = tree.valid & (tree.parents >= 0)
    edge_prob = jnp.where(is_edge, jnp.exp(edge_logit - log_norm[parent]), 0.0)
    return EdgeStats(z, log_norm, edge_prob)


def _greedy_stats(tree: DraftTree, logits: jax.Array) -> EdgeStats:
    # T = 0: p_v is the point mass on argmax (first index on ties, as jnp.argmax).
    z = jnp.where(tree.valid[:, None], logits.astype(jnp.float32), 0.0)
    top = jnp.argmax(z, axis=-1)
    parent = jnp.maximum(tree.parents, 0)
    is_edge = tree.valid & (tree.parents >= 0)
    edge_prob = jnp.where(is_edge & (tree.tokens == top[parent]), 1.0, 0.0)
    return EdgeStats(z, jnp.zeros(z.shape[:1], jnp.float32), edge_prob)


def edge_stats(tree: DraftTree, logits: jax.Array, temperature: Any) -> EdgeStats:
    """Per-edge target probabilities; greedy (point masses) when temperature == 0."""
    greedy = is_greedy(temperature)
    if greedy is True:
        return _greedy_stats(tree, logits)
    if greedy is False:
        return _sample_stats(tree, logits, jnp.asarray(temperature, jnp.float32))
    t = jnp.asarray(temperature, jnp.float32)
    return jax.lax.cond(t > 0, lambda: _sample_stats(tree, logits, t), lambda: _greedy_stats(tree, logits))


def law_from_edges(tree: DraftTree, edge_prob: jax.Array) -> ExitLaw:
    """The exit law from per-edge probabilities (shared by `exit_law` and the verifiers)."""
    is_edge = tree.valid & (tree.parents >= 0)
    # P(v) = product of the edge probabilities on v's root path (root factor 1).
    factor = jnp.where(is_edge, edge_prob, 1.0)
    prefix = jnp.prod(jnp.where(tree.ancestors, factor[None, :], 1.0), axis=-1)
    prefix = jnp.where(tree.valid, prefix, 0.0)
    child_mass = jnp.sum(jnp.where(tree.children, edge_prob[None, :], 0.0), axis=-1)
    # Children can cover all mass; 1 - sum then rounds slightly below 0: clamp, never negative.
    rho = jnp.where(tree.valid, jnp.clip(1.0 - child_mass, 0.0, 1.0), 0.0)
    coverage = jnp.sum(jnp.where(is_edge, prefix, 0.0))
    return ExitLaw(prefix_prob=prefix, local_exit=rho, exit_prob=prefix * rho, coverage=coverage)


def exit_law(tree: DraftTree, logits: jax.Array, temperature: Any = 1.0) -> ExitLaw:
    """The canonical exit law (P, rho, w) and coverage C_p of `tree` under target `logits` [N, V].

    Row i of `logits` is the target's next-token logits after the prefix ending at node i.
    Logits may contain -inf (zero-probability tokens); padding rows are ignored. Temperature 0
    gives the greedy law: w is the point mass on the deepest node of the argmax path.
    Jittable and `vmap`-composable (over trees, logits and temperatures).
    """
    return law_from_edges(tree, edge_stats(tree, logits, temperature).edge_prob)
