"""DDTree best-first tree builder, on device (REFERENCE section 2).

Given the drafter's per-position log-marginals q_1..q_G (one drafter pass), the builder returns the
`budget` prefixes with the highest score(a_1..a_d) = sum_i log q_i(a_i) as a `DraftTree`. DDTree's
reference pops a host-side heap `budget` times; here the same set comes out of static-shape array
ops:

1. the top k tokens per depth, k = min(budget, V): a prefix that uses a token outside the top k of
   its depth is beaten by >= budget prefixes that swap that token for a better one, so it is never
   among the best `budget`;
2. a beam of the best `budget` prefixes of each depth, by `lax.scan` over depths: every depth-d
   prefix among the best `budget` of its depth extends a depth-(d-1) prefix among the best
   `budget` of *its* depth (replace the parent by any of `budget` better ones and keep the last
   token), so depth d only looks at (beam of depth d-1) x (top k tokens of depth d);
3. one global best `budget` over the G x budget beam entries (a sort), with ties going to the
   shallower depth.

Why the result is prefix-closed: log-probabilities are <= 0, so in float32 a child's score is <= its
parent's (round(a + b) <= a for b <= 0). The global order is (score descending, then depth, then
beam rank); a parent's key is strictly smaller than its child's, so whenever a child is among the
first `budget` its parent is too, and earlier. That order is also the node numbering (DDTree's pop
order).

Worked example of step 2's candidate pruning (budget 4, k = 4). Both the beam (rows i) and the
top-k values (columns j) are sorted descending, so cell (i, j) is beaten by every cell above-left of
it: (i + 1)(j + 1) - 1 cells. Cells with (i + 1)(j + 1) > budget can be skipped::

         j=0 j=1 j=2 j=3
    i=0   x   x   x   x        x: candidate, (i + 1)(j + 1) <= 4
    i=1   x   x   .   .        8 candidates instead of 16; for budget 128 it is 645 instead of 16384
    i=2   x   .   .   .
    i=3   x   .   .   .

Shape letters follow the legend in `tevjax/__init__.py`: G depths (drafter rows), V vocabulary,
N = budget + 1 tree slots, P pruned candidates per depth. The budget and k = min(budget, V) are
counts, not letters: arrays along them are named without a shape suffix and noted `[budget]`,
`[k]`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from tevjax.checks import is_int
from tevjax.tree import DraftTree

__all__ = ["LOOKUP_ORDERS", "LOOKUP_SURVIVAL", "NGRAM_CALIBRATION", "NGRAM_ORDERS", "NgramTable", "build_ddtree",
           "build_ddtree_from_top", "chain_log_reach", "check_survival", "context_chain", "corpus_chain", "merge_chain",
           "ngram_table"]


@functools.lru_cache(maxsize=None)
def _candidate_pairs(budget: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Static (beam row, token rank) pairs with (row + 1)(rank + 1) <= budget; see module docstring.

    Row 0 keeps all k ranks (depth 1 grows from the root alone) and rank 0 keeps all `budget` rows
    (every beam entry may continue with its depth's best token), so >= budget candidates always
    remain.
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
      log_marginals: [G, V] float drafter log-probabilities for depths 1..G (row d-1 is depth d).
        Entries must be <= 0 (log-probabilities, not raw logits) and NaN-free (a ValueError on
        concrete arrays; under jit only shapes are read); -inf marks a token the drafter rules out.
        Any float dtype; scores are accumulated in float32.
      root_token: [] int, the last committed token (the root's token).
      budget: static int >= 0, number of non-root nodes; the tree has N = budget + 1 slots.

    Returns:
      `(tree, scores_N)`. Node 0 is the root; nodes 1..budget are the `budget` highest-scoring
      prefixes of depth 1..G in descending score order (ties: shallower first), so parents precede
      children. Slots beyond the number of finite-score prefixes (tiny V**G, or -inf entries) are
      padding (parent -1). `scores_N` is float32: 0 for the root, the prefix score for real nodes,
      -inf for padding.

    Jit with `budget` static (`jax.jit(build_ddtree, static_argnums=2)`); vmap over leading batch
    axes of `log_marginals` and `root_token`. No host sync, heap, or loop over nodes.
    """
    if not is_int(budget) or budget < 0:
        raise ValueError(f"budget must be a static int >= 0, got {budget!r}")
    budget = int(budget)
    log_marginals = jnp.asarray(log_marginals)
    if log_marginals.ndim != 2:
        raise ValueError(
            f"log_marginals must be [G, V], got shape {log_marginals.shape}; "
            "use jax.vmap for batches"
        )
    if not jnp.issubdtype(log_marginals.dtype, jnp.floating):
        raise ValueError(f"log_marginals must be floating point, got {log_marginals.dtype}")
    root_token = jnp.asarray(root_token, jnp.int32)
    if root_token.ndim != 0:
        raise ValueError(f"root_token must be a scalar, got shape {root_token.shape}")
    lm = _concrete(log_marginals)
    if lm is not None and lm.size:
        # Raw logits (> 0), NaN or +inf break the prefix closure the selection rests on (a child
        # outscoring its parent): the tree came out root-only, or with positive padding scores.
        lm = lm.astype(np.float32)
        bad = np.isnan(lm) | (lm > 0)
        if bad.any():
            d, v = (int(x) for x in np.argwhere(bad)[0])
            raise ValueError(f"log_marginals must be log-probabilities (<= 0, no NaN; -inf rules a token out), "
                             f"got {lm[d, v]} at depth {d + 1}, token {v}: pass log_softmax of the drafter's logits")
    depth_cap, vocab = log_marginals.shape
    if budget == 0 or depth_cap == 0 or vocab == 0:
        return _root_only(root_token, budget + 1)
    k = min(budget, vocab)
    # float32 before top_k: exact for bf16/f16 (the cast is monotone and lossless), and XLA:CPU has
    # a fast top-k only for float32 (bf16 falls back to a full sort, ~100x slower at V = 151936).
    top_vals, top_ids = jax.lax.top_k(log_marginals.astype(jnp.float32), k)  # [G, k] each
    return build_ddtree_from_top(top_vals, top_ids, root_token, budget)


def build_ddtree_from_top(top_vals: jax.Array, top_ids: jax.Array, root_token: jax.Array, budget: int
                          ) -> tuple[DraftTree, jax.Array]:
    """`build_ddtree` from each depth's top k = min(budget, V) log-probabilities `top_vals` [G, k]
    (float32, descending, as `jax.lax.top_k` returns them) and their token ids `top_ids` [G, k].

    Only the top k of a depth can enter the tree (see the module docstring), so this is the whole
    builder after its first step; a caller whose vocabulary is split over devices computes the top
    k per device and merges them (the decoder on a mesh) instead of gathering [G, V]. budget >= 0
    (0, G = 0 or k = 0: a root-only tree of budget + 1 slots).
    """
    if not is_int(budget) or budget < 0:
        raise ValueError(f"build_ddtree_from_top: budget must be a static int >= 0, got {budget!r}")
    budget = int(budget)
    if np.ndim(top_vals) != 2 or np.shape(top_ids) != np.shape(top_vals):
        raise ValueError(f"build_ddtree_from_top: top_vals and top_ids must both be [G, k] (vmap over rows), got "
                         f"shapes {np.shape(top_vals)} and {np.shape(top_ids)}")
    root_token = jnp.asarray(root_token, jnp.int32)
    depth_cap, k = np.shape(top_vals)
    n = budget + 1
    if budget == 0 or depth_cap == 0 or k == 0:
        # Nothing to draft, and the steps below need >= 1 candidate (budget 0 has none) and a beam
        # entry per slot (G = 0 has none: the tree would have 1 slot, not budget + 1).
        return _root_only(root_token, n)
    pair_row_P, pair_rank_P = _candidate_pairs(budget, k)

    def grow_one_depth(beam, row):
        vals, ids = row  # [k] each: this depth's top-k log-probabilities and tokens
        cand_P = beam[pair_row_P] + vals[pair_rank_P]
        # top_k returns values sorted descending, which keeps the next depth's pruning valid.
        new_beam, pick = jax.lax.top_k(cand_P, budget)  # [budget] each
        parent_row = jnp.asarray(pair_row_P)[pick]
        token = ids[jnp.asarray(pair_rank_P)[pick]]
        return new_beam, (new_beam, parent_row, token)

    # Depth 0 holds the root alone (score 0); the other rows are empty (-inf) and stay so.
    beam0 = jnp.full(budget, -jnp.inf, jnp.float32).at[0].set(0.0)  # [budget]
    # [G, budget] each: the beam of every depth, each entry's parent row and token.
    _, (beam_score, beam_parent_row, beam_token) = jax.lax.scan(
        grow_one_depth, beam0, (top_vals, top_ids)
    )

    # Global order: score descending, then depth-major flat index ascending, so equal scores go to
    # the shallower depth and a parent is always numbered before its child. A two-key sort makes
    # that order explicit instead of relying on how a backend's top_k breaks ties; exact ties are
    # common (a bf16 drafter often gives a token log-probability exactly 0).
    flat_score = beam_score.reshape(-1)  # [G * budget]
    neg_sorted, flat_order = jax.lax.sort(
        (-flat_score, jnp.arange(flat_score.shape[0], dtype=jnp.int32)), num_keys=2
    )
    # [budget] each from here on: one entry per non-root node, in node order.
    node_score, chosen = -neg_sorted[:budget], flat_order[:budget]
    depth_idx = chosen // budget  # depth - 1
    parent_flat = (depth_idx - 1) * budget + beam_parent_row.reshape(-1)[chosen]
    # Inverse permutation restricted to chosen entries: flat index -> node number (1..budget), -1
    # if not chosen. Prefix-closure guarantees every real node's parent entry was chosen.
    node_of_flat = (  # [G * budget]
        jnp.full(flat_score.shape, -1, jnp.int32)
        .at[chosen]
        .set(jnp.arange(1, n, dtype=jnp.int32), unique_indices=True)
    )
    parent = jnp.where(depth_idx == 0, 0, node_of_flat[jnp.maximum(parent_flat, 0)])
    real = node_score > -jnp.inf
    parent = jnp.where(real, parent, -1)
    token = jnp.where(real, beam_token.reshape(-1)[chosen], 0)

    tokens_N = jnp.concatenate([root_token[None], token])
    parents_N = jnp.concatenate([jnp.full(1, -1, jnp.int32), parent])
    node_score = jnp.where(real, node_score, -jnp.inf)
    scores_N = jnp.concatenate([jnp.zeros(1, jnp.float32), node_score])
    tree = DraftTree.from_parents(tokens_N, parents_N)
    # A no-op for log-probabilities; under jit (no value checks) entries above 0 could leave a node
    # whose parent was not chosen: from_parents pads it, and its score must say padding too.
    return tree, jnp.where(tree.valid, scores_N, -jnp.inf)


def _root_only(root_token: jax.Array, n: int) -> tuple[DraftTree, jax.Array]:
    """Nothing can be drafted: a root-only tree of `n` slots, every other slot padding."""
    tokens_N = jnp.zeros(n, jnp.int32).at[0].set(root_token)
    scores_N = jnp.full(n, -jnp.inf, jnp.float32).at[0].set(0.0)
    return DraftTree.from_parents(tokens_N, jnp.full(n, -1, jnp.int32)), scores_N


# ------------------------------------------------------------------------------- context lookup
# Small targets repeat themselves: their greedy answers reuse phrases, list items and whole loops of
# their own text. A drafter that sees only the last position misses much of that; a lookup into the
# committed text (prompt-lookup decoding) does not. `context_chain` proposes the continuation of the
# latest earlier occurrence of the context's last few tokens, and `merge_chain` adds it to the
# draft tree where its estimated reach probability beats the drafter's nodes. Any fixed tree keeps
# decoding exact (the verifiers read only the tree and the target's logits), so the lookup changes
# speed, never outputs.

# Suffix lengths tried, longest first: the longest suffix that occurred before picks the occurrence.
LOOKUP_ORDERS = (5, 4, 3, 2, 1)

# LOOKUP_SURVIVAL[n - 1][d - 1]: how often a chain matched with a suffix of n tokens holds the
# target's next d tokens, measured on SmolLM2-135M-Instruct's greedy answers to training prompts
# (the GPU records `experiments/results/gpu_drafter_scale_records-1.npz`, 800 answers, their first
# 128 tokens, every position with a match; n = 5 pools longer suffixes). A long match is usually a
# loop of the answer's own text and holds for many tokens; a match of one token is weak.
LOOKUP_SURVIVAL = (
    (0.21, 0.12, 0.08, 0.06, 0.04, 0.03, 0.03, 0.02),
    (0.54, 0.36, 0.26, 0.20, 0.16, 0.14, 0.11, 0.10),
    (0.66, 0.49, 0.37, 0.30, 0.25, 0.21, 0.18, 0.16),
    (0.73, 0.55, 0.45, 0.38, 0.31, 0.27, 0.24, 0.22),
    (0.90, 0.83, 0.77, 0.73, 0.69, 0.66, 0.64, 0.61),
)


def _concrete(x) -> np.ndarray | None:
    """`x` as a host array when it is concrete (eager, outside any transformation); None when traced."""
    return None if isinstance(x, jax.core.Tracer) else np.asarray(x)


def _check_ids_row(ids, name: str, letter: str, caller: str) -> tuple[int]:
    """`ids`'s shape, after checking that it is one non-empty row of integer token ids (a batch is
    vmapped over rows, not passed whole)."""
    if not isinstance(ids, (jax.Array, np.ndarray)):  # a list: what jnp.asarray would make of it
        ids = np.asarray(ids)
    shape = tuple(np.shape(ids))
    if len(shape) != 1 or shape[0] < 1:
        raise ValueError(f"{caller}: {name} must be one row of token ids [{letter}], {letter} >= 1 (vmap over rows), "
                         f"got shape {shape}")
    if not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
        raise TypeError(f"{caller}: {name} must hold integer token ids, got {jnp.result_type(ids)}")
    return shape


def _check_context(seq, length, size, caller: str) -> None:
    """The static checks of a lookup's inputs (`context_chain`, `corpus_chain`), plus the range of a
    concrete `length`: one row of token ids (vmap over rows), a scalar length in [1, S]. Under jit
    only shapes and dtypes are read; a traced length is clamped as the docstrings say."""
    if not is_int(size) or size < 1:
        raise ValueError(f"{caller}: size must be a static int >= 1, got {size!r}")
    shape = _check_ids_row(seq, "seq", "S", caller)
    if np.ndim(length) != 0:
        raise ValueError(f"{caller}: length must be a scalar (one row; vmap over rows), got shape {np.shape(length)}")
    n = _concrete(length)
    if n is not None and not (np.issubdtype(n.dtype, np.integer) and 1 <= int(n) <= shape[0]):
        raise ValueError(f"{caller}: length must be an int in [1, {shape[0]}] (the slots of seq), got {length!r}")


def context_chain(seq: jax.Array, length: jax.Array, size: int, orders: tuple[int, ...] = LOOKUP_ORDERS
                  ) -> tuple[jax.Array, jax.Array]:
    """The continuation of the context's latest earlier match, as a proposed chain of tokens.

    Args:
      seq: [S] int token ids; slots [0, length) hold the context, its last token (the tree root)
        at length - 1. Slots from `length` on are ignored.
      length: [] int context length >= 1.
      size: static chain length >= 1.
      orders: static suffix lengths, longest first.

    Returns:
      `(chain [size] int32, order [] int32)`. For the first n in `orders` such that the last n
      tokens also end at some earlier slot j (the latest such j), chain[i] = seq[j + 1 + i mod p],
      p = length - 1 - j: the tokens that followed the match, repeated with the period p the match
      implies (a loop of period p <= size continues past the end of the context); order = n.
      When no order matched, order is 0 and chain is 0s.

    vmap over rows; every order is a masked comparison over the S slots, so there are no loops.
    """
    _check_context(seq, length, size, "context_chain")
    if (not isinstance(orders, (tuple, list)) or not orders
            or any(not is_int(n) or n < 1 for n in orders)
            or list(orders) != sorted(set(orders), reverse=True)):
        raise ValueError(f"context_chain: orders must be distinct suffix lengths >= 1, longest first; got {orders!r}")
    seq = jnp.asarray(seq, jnp.int32)
    length = jnp.asarray(length, jnp.int32)
    slots = jnp.arange(seq.shape[0], dtype=jnp.int32)
    end, order = jnp.int32(-1), jnp.int32(0)
    for n in orders:
        # A match ends at j (slots j - n + 1 .. j equal the last n tokens) with j <= length - 2, so
        # at least one known token follows it.
        ok = (slots >= n - 1) & (slots <= length - 2) & (length >= n + 1)
        for o in range(n):
            ok = ok & (jnp.take(seq, jnp.maximum(slots - o, 0)) == jnp.take(seq, jnp.maximum(length - 1 - o, 0)))
        latest = jnp.max(jnp.where(ok, slots, -1))
        take = (end < 0) & (latest >= 0)
        end, order = jnp.where(take, latest, end), jnp.where(take, jnp.int32(n), order)
    period = jnp.maximum(length - 1 - end, 1)
    idx = end + 1 + jnp.arange(size, dtype=jnp.int32) % period
    chain = jnp.where(order > 0, jnp.take(seq, jnp.clip(idx, 0, seq.shape[0] - 1)), 0)
    return chain, order


def check_survival(survival) -> tuple[tuple[float, ...], ...]:
    """`survival` as a tuple of tuples of floats (hashable, so it can sit in a static config), after
    checking that it has LOOKUP_SURVIVAL's layout: one row per match order 1..max(LOOKUP_ORDERS),
    at least 2 depths, probabilities in (0, 1] that do not grow with depth."""
    try:
        table = np.asarray(survival, np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"survival must be a table of numbers, got {survival!r}") from e
    rows = max(LOOKUP_ORDERS)
    if table.ndim != 2 or table.shape[0] != rows or table.shape[1] < 2:
        raise ValueError(f"survival must be a {rows} x D table (one row per match order 1..{rows}, D >= 2 depths), "
                         f"got shape {table.shape}")
    if not np.all((table > 0) & (table <= 1)):
        raise ValueError(f"survival must hold probabilities in (0, 1], got {table.min()} .. {table.max()}")
    if np.any(np.diff(table, axis=1) > 0):
        raise ValueError("survival must not grow with depth: a chain that holds d + 1 tokens holds d")
    return tuple(tuple(float(x) for x in row) for row in table)


def chain_log_reach(order: jax.Array, size: int, survival=LOOKUP_SURVIVAL) -> jax.Array:
    """[size] float32 log-probability that a chain of match order `order` holds depth 1..size
    (`survival[order - 1]`, continued past its end at its last step's ratio); -inf for order 0."""
    table = np.asarray(check_survival(survival), np.float64)
    if size > table.shape[1]:  # geometric continuation at the last step's ratio
        ratio = np.minimum(table[:, -1] / table[:, -2], 1.0)[:, None]
        extra = table[:, -1:] * ratio ** np.arange(1, size - table.shape[1] + 1)
        table = np.concatenate([table, extra], axis=1)
    logs = jnp.asarray(np.log(table[:, :size]), jnp.float32)
    return jnp.where(order > 0, logs[jnp.clip(order, 1, table.shape[0]) - 1], -jnp.inf)


def _check_merge(tree, scores, chain, chain_scores) -> None:
    """`merge_chain`'s input layout (one row: vmap over rows), and on concrete arrays the score laws
    its prefix-closed selection rests on: a chain score that grows with depth, or a NaN, would pick
    a node without its parent and give a malformed tree, not an error."""
    if not isinstance(tree, DraftTree):
        raise TypeError(f"merge_chain: tree must be a DraftTree, got {type(tree).__name__}")
    if tree.tokens.ndim != 1:
        raise ValueError(f"merge_chain: one tree of [N] slots (vmap over rows), got tokens of shape {tree.tokens.shape}")
    n = tree.num_nodes
    if tuple(np.shape(scores)) != (n,):
        raise ValueError(f"merge_chain: scores must have shape [N] = [{n}], got {tuple(np.shape(scores))}")
    shape = _check_ids_row(chain, "chain", "M", "merge_chain")
    if tuple(np.shape(chain_scores)) != shape:
        raise ValueError(f"merge_chain: chain_scores must have the chain's shape {shape}, got "
                         f"{tuple(np.shape(chain_scores))}")
    for name, values in (("scores", scores), ("chain_scores", chain_scores)):
        v = _concrete(values)
        if v is None:
            continue
        v = v.astype(np.float64)
        if np.isnan(v).any() or (v == np.inf).any():
            raise ValueError(f"merge_chain: {name} must be log estimates (finite or -inf), got {v.tolist()}")
    cs = _concrete(chain_scores)
    if cs is not None and np.any(np.diff(cs.astype(np.float64)) > 0):
        raise ValueError("merge_chain: chain_scores must not grow along the chain (a token is reached only "
                         f"through the ones before it), got {cs.tolist()}")


def merge_chain(tree: DraftTree, scores: jax.Array, chain: jax.Array, chain_scores: jax.Array, *,
                with_scores: bool = False) -> DraftTree | tuple[DraftTree, jax.Array]:
    """The best N - 1 nodes of the union of a best-first draft tree and a chain from its root.

    Args:
      tree: [N] draft tree; scores: [N] its nodes' log reach estimates (`build_ddtree_from_top`'s:
        0 at the root, non-increasing from parent to child, -inf for padding).
      chain: [M] int token ids proposed as a path from the root; chain_scores: [M] float their
        log reach estimates, non-increasing (-inf: not proposed).

    Returns the tree (with `with_scores`, `(tree, [N] scores)`: 0 at the root, each node's merged
    estimate, -inf for padding, so that another chain can be merged in) of N slots holding the
    N - 1 highest-scoring non-root nodes among the
    tree's nodes and the chain's (ties to the shallower), numbered in that order. A chain token the
    tree already holds on the chain's path is one node, scored by the larger estimate. Both
    sources score a child no higher than its parent, and a merged node takes the larger of two
    such scores, so the selection is prefix-closed (as in `build_ddtree`). Sibling tokens stay
    distinct: the chain's first new token hangs below the deepest node of the tree that spells a
    chain prefix, so it is not a child there.

    vmap over rows; O((N + M)^2) elementwise work, nothing next to a tree pass.
    """
    _check_merge(tree, scores, chain, chain_scores)
    n, m = tree.num_nodes, chain.shape[0]
    chain = jnp.asarray(chain, jnp.int32)
    chain_scores = jnp.asarray(chain_scores, jnp.float32)
    scores = jnp.where(tree.valid, jnp.asarray(scores, jnp.float32), -jnp.inf)
    node = jnp.arange(n, dtype=jnp.int32)
    # on_chain[v]: node v's path from the root spells chain[:depth(v)] (the root: the empty prefix).
    at_depth = jnp.clip(tree.depth - 1, 0, m - 1)  # [N] each node's chain index
    edge_ok = (tree.depth >= 1) & (tree.depth <= m) & (tree.tokens == jnp.take(chain, at_depth))
    on_chain = tree.valid & jnp.all((edge_ok | (node == 0))[None, :] | ~tree.ancestors, axis=1)  # [N]
    covered = jnp.max(jnp.where(on_chain, tree.depth, 0))
    attach = jnp.argmax(jnp.where(on_chain, tree.depth, -1)).astype(jnp.int32)  # one node per depth
    # A merged node keeps the larger score (chain_scores[d - 1] for depth d).
    merged = on_chain & (node > 0)
    scores = jnp.where(merged, jnp.maximum(scores, jnp.take(chain_scores, at_depth)), scores)
    # Chain candidates i >= covered are new (depth i + 1); candidate index in the union: n + i.
    i = jnp.arange(m, dtype=jnp.int32)
    new = i >= covered
    c_parent = jnp.where(i == covered, attach, n + i - 1)
    c_score = jnp.where(new, chain_scores, -jnp.inf)
    # The union: slots 0..N-1 the tree, N..N+M-1 the chain.
    u_tokens = jnp.concatenate([tree.tokens, chain])
    u_parent = jnp.concatenate([tree.parents, c_parent])
    u_score = jnp.concatenate([scores, c_score]).at[0].set(jnp.inf)  # the root first, always
    u_depth = jnp.concatenate([tree.depth, i + 1])
    u_index = jnp.arange(n + m, dtype=jnp.int32)
    _, _, order = jax.lax.sort((-u_score, u_depth, u_index), num_keys=3)
    chosen = order[:n]  # [N] union index of node 0..N-1; chosen[0] = 0 (the root)
    node_of = jnp.full(n + m, -1, jnp.int32).at[chosen].set(node, unique_indices=True)
    real = jnp.take(u_score, chosen) > -jnp.inf
    parents = jnp.where(real & (node > 0), jnp.take(node_of, jnp.maximum(jnp.take(u_parent, chosen), 0)), -1)
    tokens = jnp.where(real, jnp.take(u_tokens, chosen), 0)
    merged_tree = DraftTree.from_parents(tokens, parents)
    if not with_scores:
        return merged_tree
    return merged_tree, jnp.where(real, jnp.take(u_score, chosen), -jnp.inf).at[0].set(0.0)


# -------------------------------------------------------------------------------- corpus lookup
# A small target's answers to different prompts share phrases ("I'm sorry for any confusion",
# "Here is an example of"), templates and code idioms. `NgramTable` holds, for every n-gram a
# corpus of the target's own answers continues at least `min_count` times, its most frequent next
# token; `corpus_chain` follows it greedily from the committed text's last tokens (the longest
# order that matches at each step), and `merge_chain` offers the chain to the tree like the
# context chain. The context chain copies this answer's own text; the corpus chain covers what
# other answers wrote. Exact, as any fixed tree is.

# Suffix lengths the table holds, longest first.
NGRAM_ORDERS = (6, 5, 4, 3, 2)
# Reach estimate of one chain step whose n-gram continued with its token in a fraction p of the
# corpus: alpha * p ** beta. The corpus fraction overstates how often a *new* answer continues the
# same way. `experiments/corpus_calibration.py` (a table of one half of SmolLM2's GPU records,
# chains on 300 answers of the other half): the first step held 0.73 / 0.54 / 0.34 / 0.22 / 0.13
# of the time with p in [0.9, 1] / [0.7, 0.9) / [0.5, 0.7) / [0.3, 0.5) / below 0.3, where this
# estimate gives 0.74 / 0.53 / 0.33 / 0.18 / 0.06. Scaling its log by 0.75 or 1.5 decoded no better
# (`experiments/results/corpus_tune.md`).
NGRAM_CALIBRATION = (0.75, 1.5)
_NGRAM_MUL = 1000003  # polynomial hash multiplier (uint32 arithmetic wraps, in numpy and jax alike)
_NGRAM_PAD = np.uint32(0xFFFFFFFF)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NgramTable:
    """For each order n (row i: `orders[i]`), the n-grams of a corpus sorted by their 32-bit hash,
    with their most frequent next token and its log reach estimate. Rows are padded to one number
    of entries with key 0xFFFFFFFF, token 0 and log reach -inf. Build it with `ngram_table`.

    A hash collision can only make the chain propose a wrong token, which verification rejects."""

    keys: jax.Array  # [orders, entries] uint32, ascending per row
    tokens: jax.Array  # [orders, entries] int32
    log_reach: jax.Array  # [orders, entries] float32, <= 0; -inf for padding
    orders: tuple[int, ...] = dataclasses.field(metadata=dict(static=True), default=NGRAM_ORDERS)

    @property
    def num_entries(self) -> int:
        return int(np.sum(np.isfinite(np.asarray(self.log_reach))))


def _hash_np(tokens: np.ndarray, n: int) -> np.ndarray:
    """[T - n + 1] uint32 hashes of tokens[i - n + 1 .. i] for i = n - 1 .. T - 1."""
    h = np.zeros(len(tokens) - n + 1, np.uint32)
    for k in range(n):
        h = h * np.uint32(_NGRAM_MUL) + (tokens[k:len(tokens) - n + 1 + k].astype(np.uint32) + np.uint32(1))
    return h


def ngram_table(tokens: np.ndarray, offsets: np.ndarray, starts: np.ndarray, *, orders: tuple[int, ...] = NGRAM_ORDERS,
                min_count: int = 2, calibration: tuple[float, float] = NGRAM_CALIBRATION) -> NgramTable:
    """The n-gram table of a corpus of records (host-side numpy; seconds for millions of tokens).

    Args:
      tokens: [T] int token ids of the records, concatenated; offsets: [records + 1] record r is
        tokens[offsets[r]:offsets[r + 1]]; starts: [records] the first position of each record whose
        token is counted as a continuation (a prompt's length: answers are counted, prompts only
        serve as context).
      orders: suffix lengths, longest first; min_count: an n-gram enters when it occurs at least this
        often with a continuation; calibration: (alpha, beta) of the reach estimate alpha * p ** beta.
    """
    for name, a in (("tokens", tokens), ("offsets", offsets), ("starts", starts)):
        # np.asarray(a, np.int64) would truncate float ids (1.5 -> 1) into a table of wrong n-grams.
        if np.asarray(a).size and not np.issubdtype(np.asarray(a).dtype, np.integer):
            raise ValueError(f"{name} must be integers, got dtype {np.asarray(a).dtype}")
    tokens, offsets, starts = (np.asarray(a, np.int64) for a in (tokens, offsets, starts))
    if tokens.ndim != 1 or offsets.ndim != 1 or starts.shape != (len(offsets) - 1,):
        raise ValueError(f"tokens [T], offsets [records + 1] and starts [records] expected, got shapes "
                         f"{tokens.shape}, {offsets.shape}, {starts.shape}")
    if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != len(tokens) or np.any(np.diff(offsets) < 0):
        raise ValueError("offsets must rise from 0 to len(tokens)")
    if np.any(tokens < 0) or np.any(tokens >= 2 ** 31):
        raise ValueError("token ids must be in [0, 2**31)")
    if not orders or any(int(n) < 1 for n in orders) or list(orders) != sorted(set(orders), reverse=True):
        raise ValueError(f"orders must be distinct suffix lengths >= 1, longest first; got {orders!r}")
    if int(min_count) < 1:
        raise ValueError(f"min_count must be >= 1, got {min_count}")
    alpha, beta = (float(x) for x in calibration)
    if not (0 < alpha <= 1 and beta > 0):
        raise ValueError(f"calibration (alpha, beta) needs 0 < alpha <= 1 and beta > 0, got {calibration!r}")
    record = np.repeat(np.arange(len(starts)), np.diff(offsets))  # [T] record of each position
    first_next = offsets[:-1] + np.maximum(starts, 1)  # [records] first counted continuation position
    rows = []
    for n in orders:
        if len(tokens) <= n:
            rows.append((np.zeros(0, np.uint32), np.zeros(0, np.int64), np.zeros(0)))
            continue
        h = _hash_np(tokens, n)[:-1]  # n-gram ending at i = n - 1 .. T - 2
        end = np.arange(n - 1, len(tokens) - 1)
        r = record[end]
        ok = (end - n + 1 >= offsets[r]) & (end + 1 < offsets[r + 1]) & (end + 1 >= first_next[r])
        key, nxt = h[ok].astype(np.uint64), tokens[end[ok] + 1].astype(np.uint64)
        if key.size == 0:
            rows.append((np.zeros(0, np.uint32), np.zeros(0, np.int64), np.zeros(0)))
            continue
        pairs, counts = np.unique((key << np.uint64(32)) | nxt, return_counts=True)  # sorted by key, then token
        pkey = (pairs >> np.uint64(32)).astype(np.uint32)
        group = np.flatnonzero(np.r_[True, pkey[1:] != pkey[:-1]])  # first pair of each key
        total = np.add.reduceat(counts, group)
        # The most frequent continuation of each key (ties: the smallest token id).
        best = np.lexsort((-counts, np.repeat(np.arange(len(group)), np.diff(np.r_[group, len(pkey)]))))[group]
        keep = total >= min_count
        p = counts[best][keep] / total[keep]
        rows.append((pkey[group][keep], (pairs[best][keep] & np.uint64(0xFFFFFFFF)).astype(np.int64),
                     np.log(alpha * p ** beta)))
    k = max(1, max(len(row[0]) for row in rows))
    keys = np.full((len(orders), k), _NGRAM_PAD, np.uint32)
    toks = np.zeros((len(orders), k), np.int32)
    reach = np.full((len(orders), k), -np.inf, np.float32)
    for i, (kk, tt, rr) in enumerate(rows):
        keys[i, :len(kk)], toks[i, :len(kk)], reach[i, :len(kk)] = kk, tt, rr
    return NgramTable(keys=jnp.asarray(keys), tokens=jnp.asarray(toks), log_reach=jnp.asarray(reach),
                      orders=tuple(int(n) for n in orders))


def corpus_chain(seq: jax.Array, length: jax.Array, size: int, table: NgramTable) -> tuple[jax.Array, jax.Array]:
    """A chain of `size` tokens that follows the table greedily from the context's last tokens.

    Args:
      seq: [S] int token ids; slots [0, length) hold the context (its last token is the tree root).
      length: [] int context length >= 1.
      size: static chain length >= 1.
      table: the corpus n-grams.

    Returns `(chain [size] int32, scores [size] float32)`: step i appends the next token of the
    longest n-gram (of the context and chain[:i]) the table holds; scores are the cumulative log
    reach estimates (non-increasing), -inf from the first step with no match on (chain token 0).

    vmap over rows; each step is one binary search per order.
    """
    _check_context(seq, length, size, "corpus_chain")
    if not isinstance(table, NgramTable):
        raise TypeError(f"corpus_chain: table must be an NgramTable (`ngram_table`), got {type(table).__name__}")
    longest = max(table.orders)
    seq = jnp.asarray(seq, jnp.int32)
    length = jnp.asarray(length, jnp.int32)
    pos = length - longest + jnp.arange(longest, dtype=jnp.int32)
    window = jnp.where(pos >= 0, jnp.take(seq, jnp.clip(pos, 0, seq.shape[0] - 1)), -1)  # [longest], -1: none

    def step(carry, _):
        window, score = carry
        token, reach, hit = jnp.int32(0), jnp.float32(-jnp.inf), jnp.bool_(False)
        for row, n in enumerate(table.orders):  # longest first: the first match wins
            grams = window[longest - n:]
            h = jnp.uint32(0)
            for k in range(n):
                h = h * jnp.uint32(_NGRAM_MUL) + (grams[k].astype(jnp.uint32) + jnp.uint32(1))
            keys = table.keys[row]
            i = jnp.clip(jnp.searchsorted(keys, h), 0, keys.shape[0] - 1)
            found = ~hit & jnp.all(grams >= 0) & (keys[i] == h) & (table.log_reach[row, i] > -jnp.inf)
            token = jnp.where(found, table.tokens[row, i], token)
            reach = jnp.where(found, table.log_reach[row, i], reach)
            hit = hit | found
        score = score + reach  # -inf stays -inf: a chain that stopped does not resume
        window = jnp.concatenate([window[1:], jnp.where(score > -jnp.inf, token, -1)[None]])
        return (window, score), (jnp.where(score > -jnp.inf, token, 0), score)

    _, (chain, scores) = jax.lax.scan(step, (window, jnp.float32(0.0)), None, length=size)
    return chain, scores
