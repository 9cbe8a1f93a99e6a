"""DDTree best-first tree builder, on device (REFERENCE section 2).

Given the drafter's per-position log-marginals q_1..q_L (one drafter pass), the builder returns the
B prefixes with the highest score(a_1..a_d) = sum_i log q_i(a_i) as a `DraftTree`. DDTree's
reference pops a host-side heap B times; here the same set comes out of static-shape array ops:

1. top-K tokens per depth, K = min(B, V): a prefix that uses a token outside the top K of its depth
   is beaten by >= B prefixes that swap that token for a better one, so it is never in the top B;
2. a beam of the best B prefixes of each depth, by `lax.scan` over depths: every depth-d prefix in
   the top B of its depth extends a depth-(d-1) prefix in the top B of *its* depth (replace the
   parent by any of B better ones and keep the last token), so depth d only looks at
   (beam of depth d-1) x (top-K tokens of depth d);
3. one global top B over the L x B beam entries (a sort), with ties going to the shallower depth.

Why the result is prefix-closed: log-probabilities are <= 0, so in float32 a child's score is <= its
parent's (round(a + b) <= a for b <= 0). The global order is (score descending, then depth, then
beam rank); a parent's key is strictly smaller than its child's, so whenever a child is among the
first B its parent is too, and earlier. That order is also the node numbering (DDTree's pop order).

Worked example of step 2's candidate pruning (B = 4, K = 4). Both the beam (rows i) and the top-K
values (columns j) are sorted descending, so cell (i, j) is beaten by every cell above-left of it:
(i + 1)(j + 1) - 1 cells. Cells with (i + 1)(j + 1) > B can be skipped::

         j=0 j=1 j=2 j=3
    i=0   x   x   x   x        x: candidate, (i + 1)(j + 1) <= 4
    i=1   x   x   .   .        8 candidates instead of 16; for B = 128 it is 645 instead of 16384
    i=2   x   .   .   .
    i=3   x   .   .   .

Letters: L depth (drafter positions), V vocabulary, B budget, K = min(B, V) tokens kept per depth,
N = B + 1 tree slots, P pruned candidates per depth.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tevjax.tree import DraftTree

__all__ = ["build_ddtree"]


@functools.lru_cache(maxsize=None)
def _candidate_pairs(budget: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Static (beam row, token rank) pairs with (row + 1)(rank + 1) <= budget; see module docstring.

    Row 0 keeps all K ranks (depth 1 grows from the root alone) and rank 0 keeps all B rows (every
    beam entry may continue with its depth's best token), so >= B candidates always remain.
    """
    rows, ranks = [], []
    for i in range(budget):
        width = min(k, budget // (i + 1))
        rows.append(np.full(width, i, np.int32))
        ranks.append(np.arange(width, dtype=np.int32))
    return np.concatenate(rows), np.concatenate(ranks)


def build_ddtree(
    log_marginals: jax.Array, root_token: jax.Array, budget: int
) -> tuple[DraftTree, jax.Array]:
    """Builds the DDTree draft tree holding the `budget` highest-scoring prefixes.

    Args:
      log_marginals: [L, V] float drafter log-probabilities for depths 1..L (row d-1 is depth d).
        Entries must be <= 0 (log-probabilities, not raw logits) and NaN-free; -inf marks a token
        the drafter rules out. Any float dtype; scores are accumulated in float32.
      root_token: [] int, the last committed token (the root's token).
      budget: static int B >= 0, number of non-root nodes; the tree has N = B + 1 slots.

    Returns:
      `(tree, scores_N)`. Node 0 is the root; nodes 1..B are the B highest-scoring prefixes of depth
      1..L in descending score order (ties: shallower first), so parents precede children. Slots
      beyond the number of finite-score prefixes (tiny V**L, or -inf entries) are padding (parent
      -1). `scores_N` is float32: 0 for the root, the prefix score for real nodes, -inf for padding.

    Jit with `budget` static (`jax.jit(build_ddtree, static_argnums=2)`); vmap over leading batch
    axes of `log_marginals` and `root_token`. No host sync, heap, or loop over nodes.
    """
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < 0:
        raise ValueError(f"budget must be a static int >= 0, got {budget!r}")
    budget = int(budget)
    log_marginals = jnp.asarray(log_marginals)
    if log_marginals.ndim != 2:
        raise ValueError(
            f"log_marginals must be [L, V], got shape {log_marginals.shape}; "
            "use jax.vmap for batches"
        )
    if not jnp.issubdtype(log_marginals.dtype, jnp.floating):
        raise ValueError(f"log_marginals must be floating point, got {log_marginals.dtype}")
    root_token = jnp.asarray(root_token, jnp.int32)
    if root_token.ndim != 0:
        raise ValueError(f"root_token must be a scalar, got shape {root_token.shape}")
    depth_cap, vocab = log_marginals.shape
    n = budget + 1

    if budget == 0 or depth_cap == 0 or vocab == 0:
        # Nothing can be drafted: a root-only tree with every other slot padding.
        tokens_N = jnp.zeros(n, jnp.int32).at[0].set(root_token)
        scores_N = jnp.full(n, -jnp.inf, jnp.float32).at[0].set(0.0)
        return DraftTree.from_parents(tokens_N, jnp.full(n, -1, jnp.int32)), scores_N

    k = min(budget, vocab)
    # float32 before top_k: exact for bf16/f16 (the cast is monotone and lossless), and XLA:CPU has
    # a fast top-k only for float32 (bf16 falls back to a full sort, ~100x slower at V = 151936).
    top_vals_LxK, top_ids_LxK = jax.lax.top_k(log_marginals.astype(jnp.float32), k)
    pair_row_P, pair_rank_P = _candidate_pairs(budget, k)

    def grow_one_depth(beam_B, row):
        vals_K, ids_K = row
        cand_P = beam_B[pair_row_P] + vals_K[pair_rank_P]
        # top_k returns values sorted descending, which keeps the next depth's pruning valid.
        new_beam_B, pick_B = jax.lax.top_k(cand_P, budget)
        parent_row_B = jnp.asarray(pair_row_P)[pick_B]
        token_B = ids_K[jnp.asarray(pair_rank_P)[pick_B]]
        return new_beam_B, (new_beam_B, parent_row_B, token_B)

    # Depth 0 holds the root alone (score 0); the other rows are empty (-inf) and stay so.
    beam0_B = jnp.full(budget, -jnp.inf, jnp.float32).at[0].set(0.0)
    _, (score_LxB, parent_row_LxB, token_LxB) = jax.lax.scan(
        grow_one_depth, beam0_B, (top_vals_LxK, top_ids_LxK)
    )

    # Global order: score descending, then depth-major flat index ascending, so equal scores go to
    # the shallower depth and a parent is always numbered before its child. A two-key sort makes
    # that order explicit instead of relying on how a backend's top_k breaks ties; exact ties are
    # common (a bf16 drafter often gives a token log-probability exactly 0).
    score_F = score_LxB.reshape(-1)
    neg_score_F, flat_F = jax.lax.sort(
        (-score_F, jnp.arange(score_F.shape[0], dtype=jnp.int32)), num_keys=2
    )
    node_score_B, flat_B = -neg_score_F[:budget], flat_F[:budget]
    depth_idx_B = flat_B // budget  # depth - 1
    parent_flat_B = (depth_idx_B - 1) * budget + parent_row_LxB.reshape(-1)[flat_B]
    # Inverse permutation restricted to chosen entries: flat index -> node number (1..B), -1 if
    # not chosen. Prefix-closure guarantees every real node's parent entry was chosen.
    node_of_flat_F = (
        jnp.full(score_F.shape, -1, jnp.int32)
        .at[flat_B]
        .set(jnp.arange(1, n, dtype=jnp.int32), unique_indices=True)
    )
    parent_B = jnp.where(depth_idx_B == 0, 0, node_of_flat_F[jnp.maximum(parent_flat_B, 0)])
    real_B = node_score_B > -jnp.inf
    parent_B = jnp.where(real_B, parent_B, -1)
    token_B = jnp.where(real_B, token_LxB.reshape(-1)[flat_B], 0)

    tokens_N = jnp.concatenate([root_token[None], token_B])
    parents_N = jnp.concatenate([jnp.full(1, -1, jnp.int32), parent_B])
    node_score_B = jnp.where(real_B, node_score_B, -jnp.inf)
    scores_N = jnp.concatenate([jnp.zeros(1, jnp.float32), node_score_B])
    return DraftTree.from_parents(tokens_N, parents_N), scores_N
