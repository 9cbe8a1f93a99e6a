"""The canonical exit law of a fixed draft tree (paper Sec. 3, Lemma 1).

For target next-token distributions p_v at every node v (after temperature):

    P(root) = 1,  P(v) = P(pa(v)) * p_pa(v)(x_v)          target prefix probability
    rho(v)  = max(0, 1 - sum_{children u} p_v(x_u))        local exit probability (1 at a leaf)
    w(v)    = P(v) * rho(v)                                exit probability, sum_v w(v) = 1
    C_p     = sum_{v != root} P(v)                         target coverage; mean block <= 1 + C_p

Per-edge probabilities come from one log-sum-exp over the [N, V] logits plus a gather. The
products along root paths (and the children's mass in rho) have two interchangeable propagations:

    "matrix"  a masked product over the tree's ancestor-or-self matrix [N, N]: no loop at all,
              O(N^2) work, every node in one reduction;
    "scan"    `lax.scan` over depth levels h = 1..N-1 (the static bound, a chain's depth): depth-h
              nodes take P(parent) * p_parent(x_v), one [N] gather per level (O(N) work each) and
              no [N, N] array; the children's mass is a scatter-add over parent indices.

Both multiply the same factors; they agree to float32 rounding (tolerances in tests/test_exit_law.py).
Reductions over nodes use `where` + `sum`/`prod` rather than matmuls, because float32 matmuls may
run in TF32 on GPUs. Shape letters follow the legend in `tevjax/__init__.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import jax
import jax.numpy as jnp

from tevjax import sampling
from tevjax.tree import DraftTree, check_tree_logits, concrete_temperature, valid_temperature

__all__ = ["GREEDY_BELOW", "PROPAGATION", "ExitLaw", "exit_law", "is_greedy", "samples"]

Propagation = Literal["matrix", "scan"]

# The default propagation, from experiments/results/exit_law_scan.md (CPU, jitted). At the decoder's
# sizes (N = 9..65) the scan is faster on the propagation alone (scan/matrix 0.65x for one tree,
# 0.93x for a batch of 32; tens of microseconds), but the whole exit law, which is what the verifiers
# run, is no faster with it (1.02x geometric mean; 1.02-1.09x over repeated runs) because the [N, V]
# log-sum-exp dominates. With no measurable gain the loop-free matrix stays the default: the
# verifiers' numbers stay bit for bit as they were, and there is no sequential dependency across
# levels (which should suit accelerators; not measured here). "scan" is the choice for large batched
# trees (0.3x at N = 513, batch 32).
PROPAGATION: Propagation = "matrix"


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ExitLaw:
    """Per-node quantities of the canonical exit law (0 at padding)."""

    prefix_prob: jax.Array  # [N] float32  P(v)
    local_exit: jax.Array  # [N] float32  rho(v)
    exit_prob: jax.Array  # [N] float32  w(v)
    coverage: jax.Array  # []  float32  C_p = expected number of accepted draft tokens


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class EdgeStats:
    """What the exit law and every verifier share: per-edge target probabilities.

    The scaled logits are never materialised as an [N, V] array (that would cost a full extra
    write and read of the largest tensor); `scaled_row` rescales the one row a verifier needs.
    """

    logits: jax.Array  # [N, V] raw target logits as given (padding rows may hold anything)
    inv_temperature: jax.Array  # [] float32 1 / temperature (1 when greedy)
    edge_prob: jax.Array  # [N] float32 p_pa(u)(x_u) for real non-root u, else 0

    def scaled_row(self, node: jax.Array) -> jax.Array:
        """[V] float32 (logits - their max) / temperature of one real node: its log-probabilities up
        to a constant, shifted so that huge logits or small temperatures cannot overflow."""
        row = self.logits[node].astype(jnp.float32)
        top = jnp.max(row)
        return (row - jnp.where(jnp.isfinite(top), top, 0.0)) * self.inv_temperature


# One rule for every entry point (API, CLI, traced temperatures): a temperature below this is
# greedy. Below it, 1 / temperature in float32 either overflows (1e-39 and smaller) or scales
# logit gaps past float32's range of exp, so "sampling" would be argmax with extra steps or
# garbage; the paper's released code uses the same threshold.
GREEDY_BELOW = 1e-5


def is_greedy(temperature: Any) -> bool | None:
    """True (temperature < GREEDY_BELOW) or False for a concrete temperature, None when it is traced
    (decided at run time by `samples`). A concrete negative, NaN or infinite (in float32) temperature raises,
    and so does one that is not a number (`concrete_temperature`)."""
    t = concrete_temperature(temperature)
    if t is None:
        return None
    if not valid_temperature(t):
        raise ValueError(f"temperature must be a finite float32 number >= 0, got {temperature!r}")
    return t < GREEDY_BELOW


def samples(temperature: jax.Array) -> jax.Array:
    """Run-time form of `not is_greedy` for a traced temperature. It cannot raise, so an invalid
    traced value falls on a documented side: NaN and negative temperatures decode greedily;
    +inf samples uniformly over the tokens with a finite logit (`sampling.inverse_temperature`)."""
    return temperature >= GREEDY_BELOW


def _sample_stats(tree: DraftTree, logits: jax.Array, temperature: jax.Array) -> EdgeStats:
    inv_t = sampling.inverse_temperature(temperature)
    # One fused pass pair over the raw [N, V] logits (no scaled or masked copy of them). Padding
    # rows may hold anything, NaN included: their normalisers are discarded here, on [N] values.
    # log p = inv_t * (x - m) - s (`scaled_lse_parts`): no overflow, and no rounding of the law away.
    row_max, log_norm = sampling.scaled_lse_parts(logits, inv_t)
    log_norm = jnp.where(tree.valid, log_norm, 0.0)
    parent = jnp.maximum(tree.parents, 0)
    edge_logit = (logits[parent, tree.tokens].astype(jnp.float32) - row_max[parent]) * inv_t
    # A token outside [0, V) has target probability 0. Under jit nothing checks the ids, and the
    # gather above clamps (V -> V - 1) or wraps (-1 -> V - 1): without this mask TEV and the
    # sequential verifier accepted such a node at the probability of another token and emitted an
    # out-of-vocabulary id, while predraw and greedy (token == a draw in [0, V)) never accept it.
    in_vocab = (tree.tokens >= 0) & (tree.tokens < logits.shape[-1])
    is_edge = tree.valid & (tree.parents >= 0) & in_vocab
    edge_prob = jnp.where(is_edge, jnp.exp(edge_logit - log_norm[parent]), 0.0)
    return EdgeStats(logits, inv_t, edge_prob)


def _greedy_stats(tree: DraftTree, logits: jax.Array) -> EdgeStats:
    # Temperature 0: p_v is the point mass on argmax (first index on ties, as jnp.argmax).
    top = jnp.argmax(jnp.where(tree.valid[:, None], logits, 0), axis=-1)
    parent = jnp.maximum(tree.parents, 0)
    is_edge = tree.valid & (tree.parents >= 0)
    edge_prob = jnp.where(is_edge & (tree.tokens == top[parent]), 1.0, 0.0)
    return EdgeStats(logits, jnp.float32(1.0), edge_prob)


def edge_stats(tree: DraftTree, logits: jax.Array, temperature: Any) -> EdgeStats:
    """Per-edge target probabilities; greedy (point masses) when temperature < GREEDY_BELOW."""
    greedy = is_greedy(temperature)
    if greedy is True:
        return _greedy_stats(tree, logits)
    if greedy is False:
        return _sample_stats(tree, logits, jnp.asarray(temperature, jnp.float32))
    t = jnp.asarray(temperature, jnp.float32)
    return jax.lax.cond(samples(t), lambda: _sample_stats(tree, logits, t), lambda: _greedy_stats(tree, logits))


def _prefix_by_levels(tree: DraftTree, factor: jax.Array, levels: int) -> jax.Array:
    """[N] P(v) for real nodes of depth <= `levels`, one `lax.scan` step per depth level.

    Step h sets every depth-h node to P(parent) * factor; the parent (depth h - 1) was set one
    step earlier. The root starts at 1; padding (depth 0, not valid) starts at 0 and is never set.
    """
    parent = jnp.maximum(tree.parents, 0)

    def level(prefix_N, h):
        return jnp.where(tree.depth == h, prefix_N[parent] * factor, prefix_N), None

    start = (tree.valid & (tree.depth == 0)).astype(jnp.float32)
    prefix, _ = jax.lax.scan(level, start, jnp.arange(1, levels + 1, dtype=jnp.int32))
    return prefix


def law_from_edges(tree: DraftTree, edge_prob: jax.Array, propagation: Propagation = PROPAGATION) -> ExitLaw:
    """The exit law from per-edge probabilities (shared by `exit_law` and the verifiers).

    `propagation` ("matrix" or "scan", see the module docstring) changes the cost, not the law.
    """
    is_edge = tree.valid & (tree.parents >= 0)
    # P(v) = product of the edge probabilities on v's root path (root factor 1).
    factor = jnp.where(is_edge, edge_prob, 1.0)
    if propagation == "matrix":
        prefix = jnp.prod(jnp.where(tree.ancestors, factor[None, :], 1.0), axis=-1)
        child_mass = jnp.sum(jnp.where(tree.children, edge_prob[None, :], 0.0), axis=-1)
    elif propagation == "scan":
        prefix = _prefix_by_levels(tree, factor, tree.max_depth)
        # Non-edges go to slot N and are dropped (a parent index of -1 would wrap to node N - 1).
        slot = jnp.where(is_edge, tree.parents, tree.num_nodes)
        child_mass = jnp.zeros_like(factor).at[slot].add(edge_prob, mode="drop")
    else:
        raise ValueError(f"propagation must be 'matrix' or 'scan', got {propagation!r}")
    prefix = jnp.where(tree.valid, prefix, 0.0)
    # Children can cover all mass; 1 - sum then rounds slightly below 0: clamp, never negative.
    rho = jnp.where(tree.valid, jnp.clip(1.0 - child_mass, 0.0, 1.0), 0.0)
    coverage = jnp.sum(jnp.where(is_edge, prefix, 0.0))
    return ExitLaw(prefix_prob=prefix, local_exit=rho, exit_prob=prefix * rho, coverage=coverage)


def exit_law(
    tree: DraftTree, logits: jax.Array, temperature: Any = 1.0, propagation: Propagation = PROPAGATION
) -> ExitLaw:
    """The canonical exit law (P, rho, w) and coverage C_p of `tree` under target `logits` [N, V].

    Row i of `logits` is the target's next-token logits after the prefix ending at node i.
    Logits may contain -inf (zero-probability tokens); padding rows are ignored. Temperature 0
    gives the greedy law: w is the point mass on the deepest node of the argmax path.
    Jittable and `vmap`-composable (over trees, logits and temperatures). `propagation` picks how
    P and rho are propagated through the tree ("matrix" or "scan"; same law, see `law_from_edges`).
    """
    check_tree_logits(tree, logits, "exit_law")
    return law_from_edges(tree, edge_stats(tree, logits, temperature).edge_prob, propagation)
