"""Exact tree verifiers: TEV, DDTree's predraw-and-follow, EAGLE-style sequential residual, greedy.

All verifiers are pure functions of (key, tree, logits, temperature) and realise the same
canonical (exit node, bonus token) law of paper Theorem 1, so each attains a mean output block
length of 1 + C_p:

- ``tev``: one categorical draw of the exit node from w, one residual draw of the bonus token at
  that node (p_v with the drafted child tokens removed; p_v itself at a leaf). Cost: one
  log-sum-exp pass over [N, V], O(N^2) elementwise tree work, one [V] row draw.
  Every categorical draw uses `tevjax.sampling.categorical` (exact two-stage Gumbel-max), so that
  no verifier pays for V random numbers per draw.
- ``predraw``: one target draw r_v ~ p_v at every node, then follow the child
  whose token equals r_v from the root; the bonus is r at the first node without a match. The
  following is done for all nodes at once: a node is reached iff every edge on its root path matched.
- ``sequential``: at every node its children are tested in index order; child j is accepted with
  probability p(x_j) / (1 - rejected_j) (rejected_j = mass of its earlier, rejected siblings); the
  bonus is drawn from the residual of the node where all children were rejected. Vectorised: one
  uniform per edge.
- temperature 0 (any method): greedy; follow the argmax path, bonus = argmax at the exit node.

Outputs are fixed-shape: with N tree slots, N - 1 (a chain) is the static maximum depth. Shape
letters follow the legend in `tevjax/__init__.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from tevjax import sampling
from tevjax.law import EdgeStats, _greedy_stats, _sample_stats, is_greedy, law_from_edges, samples
from tevjax.tree import DraftTree, check_tree_logits

__all__ = ["VerifyOutput", "verify", "VERIFIERS"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyOutput:
    """One verification round's result (for a tree of N slots)."""

    exit_node: jax.Array  # [] int32 deepest accepted node (0 = root: nothing accepted)
    bonus_token: jax.Array  # [] int32 token drawn from the exit node's residual distribution
    num_accepted: jax.Array  # [] int32 accepted draft tokens = depth(exit_node)
    path: jax.Array  # [N - 1] int32 accepted node indices by depth 1..num_accepted, then -1
    tokens: jax.Array  # [N] int32 accepted tokens, then the bonus token, then -1
    num_tokens: jax.Array  # [] int32 output block length = num_accepted + 1 (bonus included)


def _assemble(tree: DraftTree, exit_node: jax.Array, bonus: jax.Array) -> VerifyOutput:
    n = tree.num_nodes
    idx = jnp.arange(n, dtype=jnp.int32)
    on_path = tree.ancestors[exit_node] & (tree.parents >= 0)
    # Scatter node i to slot depth(i) - 1; everything off the path goes to an out-of-range slot.
    slot = jnp.where(on_path, tree.depth - 1, n + 1)
    num_accepted = tree.depth[exit_node]
    path = jnp.full((n - 1,), -1, jnp.int32).at[slot].set(idx, mode="drop")
    tokens = jnp.full((n,), -1, jnp.int32).at[slot].set(tree.tokens, mode="drop")
    tokens = tokens.at[num_accepted].set(bonus.astype(jnp.int32))
    return VerifyOutput(
        exit_node=exit_node.astype(jnp.int32),
        bonus_token=bonus.astype(jnp.int32),
        num_accepted=num_accepted,
        path=path,
        tokens=tokens,
        num_tokens=num_accepted + 1,
    )


def _deepest(tree: DraftTree, reached: jax.Array) -> jax.Array:
    # Reached nodes form one root path (siblings are exclusive), so the deepest is the exit node.
    return jnp.argmax(jnp.where(reached, tree.depth, -1)).astype(jnp.int32)


def _reached(tree: DraftTree, edge_taken: jax.Array) -> jax.Array:
    """Node v is reached iff every edge on its root path was taken."""
    is_edge = tree.valid & (tree.parents >= 0)
    need = tree.ancestors & is_edge[None, :]
    return tree.valid & jnp.all(jnp.where(need, edge_taken[None, :], True), axis=-1)


def _residual_draw(key: jax.Array, tree: DraftTree, stats: EdgeStats, node: jax.Array) -> jax.Array:
    """Bonus token ~ p_node with the node's drafted child tokens removed (p_node at a leaf)."""
    row = stats.scaled_row(node)
    vocab = row.shape[-1]
    # Ids >= V go to slot V and are dropped; a negative one would wrap (-1 -> V - 1) even with
    # mode="drop" and remove a token the node never drafted, so it is sent to slot V as well.
    child_tokens = jnp.where(tree.children[node] & (tree.tokens >= 0), tree.tokens, vocab)
    residual = row.at[child_tokens].set(-jnp.inf, mode="drop")
    # If rounding made rho(node) > 0 although the children hold every token of nonzero mass, the
    # residual is empty; such an exit has probability ~1e-7 and we fall back to p_node itself.
    residual = jnp.where(jnp.any(residual > -jnp.inf), residual, row)
    return sampling.categorical(key, residual)


def _greedy(key: jax.Array, tree: DraftTree, logits: jax.Array) -> VerifyOutput:
    del key  # greedy decoding is deterministic
    stats = _greedy_stats(tree, logits)
    # Edges matching the parent's argmax; the exit node is the deepest node reached through them.
    exit_node = _deepest(tree, _reached(tree, stats.edge_prob > 0))
    bonus = jnp.argmax(stats.logits[exit_node])
    return _assemble(tree, exit_node, bonus)


def _tev(key, tree, logits, temperature) -> VerifyOutput:
    stats = _sample_stats(tree, logits, temperature)
    law = law_from_edges(tree, stats.edge_prob)
    k_exit, k_bonus = jax.random.split(key)
    exit_node = jax.random.categorical(k_exit, jnp.log(law.exit_prob)).astype(jnp.int32)
    return _assemble(tree, exit_node, _residual_draw(k_bonus, tree, stats, exit_node))


def _predraw(key, tree, logits, temperature) -> VerifyOutput:
    inv_t = sampling.inverse_temperature(temperature)
    # r_v ~ p_v at every node, independently. Padding rows may hold garbage: their draws are
    # in-range indices that no real node ever reads (a real node's parent is real).
    draws = sampling.categorical(key, logits, inv_t)
    parent = jnp.maximum(tree.parents, 0)
    matched = tree.valid & (tree.parents >= 0) & (tree.tokens == draws[parent])
    exit_node = _deepest(tree, _reached(tree, matched))
    return _assemble(tree, exit_node, draws[exit_node])


def _sequential(key, tree, logits, temperature) -> VerifyOutput:
    stats = _sample_stats(tree, logits, temperature)
    n = tree.num_nodes
    idx = jnp.arange(n)
    is_edge = tree.valid & (tree.parents >= 0)
    k_test, k_bonus = jax.random.split(key)
    u = jax.random.uniform(k_test, (n,))
    # earlier[u, u'] : u' is a sibling of u tested before it (smaller index).
    earlier = (tree.parents[:, None] == tree.parents[None, :]) & is_edge[None, :] & (idx[None, :] < idx[:, None])
    rejected_mass = jnp.sum(jnp.where(earlier, stats.edge_prob[None, :], 0.0), axis=-1)
    # Accept with probability p / (1 - rejected mass), written as a product so that no division
    # can overflow.
    passes = is_edge & (u * (1.0 - rejected_mass) < stats.edge_prob)
    chosen = passes & ~jnp.any(earlier & passes[None, :], axis=-1)
    exit_node = _deepest(tree, _reached(tree, chosen))
    return _assemble(tree, exit_node, _residual_draw(k_bonus, tree, stats, exit_node))


VERIFIERS: dict[str, Callable[..., VerifyOutput]] = {
    "tev": _tev,
    "predraw": _predraw,
    "sequential": _sequential,
}


def verify(
    key: jax.Array,
    tree: DraftTree,
    logits: jax.Array,
    temperature: Any = 1.0,
    method: str = "tev",
) -> VerifyOutput:
    """Verifies one draft tree exactly; returns the accepted path and the bonus token.

    Args:
      key: PRNG key (unused when greedy).
      tree: the draft tree (N slots).
      logits: [N, V] target logits; row i is the next-token logits after the prefix ending at node i.
        May contain -inf; padding rows are ignored.
      temperature: float >= 0 (Python number or traced scalar); below `law.GREEDY_BELOW` (1e-5)
        greedy. A concrete negative, NaN or infinite value raises; for traced ones see `law.samples`.
      method: "tev" (default), "predraw" or "sequential". All give the same output law.

    Jittable (``method`` static) and `vmap`-composable over keys, trees, logits and temperatures.
    """
    if method not in VERIFIERS:
        raise ValueError(f"unknown verifier method {method!r}; choose one of {sorted(VERIFIERS)}")
    check_tree_logits(tree, logits, "verify")
    sample = VERIFIERS[method]
    greedy = is_greedy(temperature)
    if greedy is True:
        return _greedy(key, tree, logits)
    t = jnp.asarray(temperature, jnp.float32)
    if greedy is False:
        return sample(key, tree, logits, t)
    return jax.lax.cond(samples(t), lambda: sample(key, tree, logits, t), lambda: _greedy(key, tree, logits))
