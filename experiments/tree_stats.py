"""Pure host-side helpers of the fixed-tree experiments (numpy in, numpy or floats out).

Shared by experiments/fixed_tree_equivalence.py and experiments/exit_mass.py and unit-tested in
tests/test_tree_stats.py with hand-computed values. A tree here is the `DraftTree` layout as
numpy arrays: `parents[N]` (-1 for the root and padding), `depth[N]`, `valid[N]` (see
`tevjax/tree.py`); shape letters follow the legend in `tevjax/__init__.py`.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["EXIT_KINDS", "bernstein_halfwidth", "block_follows_tree", "block_length_moments", "exit_kind",
           "mass_by_depth_rank", "sibling_ranks"]


def sibling_ranks(parents: np.ndarray, valid: np.ndarray, score: np.ndarray) -> np.ndarray:
    """[N] rank of every real non-root node among its siblings by `score`, 0 = highest; -1 for the
    root and padding. Equal scores go to the lower node index (the builder's node order).

    Siblings share a parent, hence a draft row and a prefix score, so ranking them by the
    drafter's probability of their token is the same as ranking by their DDTree prefix score.

    Example: parents [-1, 0, 0, 1, 0], score [0, -2, -1, -3, -1] -> ranks [-1, 2, 0, 0, 1]
    (node 2 and node 4 tie at -1; node 2 comes first).
    """
    parents, valid, score = np.asarray(parents), np.asarray(valid, bool), np.asarray(score, np.float64)
    n = parents.shape[0]
    idx = np.arange(n)
    is_edge = valid & (parents >= 0)
    same = (parents[:, None] == parents[None, :]) & is_edge[:, None] & is_edge[None, :]
    before = (score[None, :] > score[:, None]) | ((score[None, :] == score[:, None]) & (idx[None, :] < idx[:, None]))
    ranks = np.sum(same & before, axis=1)
    return np.where(is_edge, ranks, -1)


def mass_by_depth_rank(depth: np.ndarray, rank: np.ndarray, mass: np.ndarray, valid: np.ndarray,
                       max_depth: int, max_rank: int) -> np.ndarray:
    """[max_depth + 1, max_rank + 1] sums of `mass` by (depth, sibling rank) of real nodes.

    The root (rank -1) counts in cell (0, 0); ranks >= max_rank share the last column ("max_rank or
    worse"), depths beyond max_depth the last row. Summing every cell gives the total mass of real
    nodes, so for an exit law w the table sums to 1.
    """
    depth, rank = np.asarray(depth), np.asarray(rank)
    mass, valid = np.asarray(mass, np.float64), np.asarray(valid, bool)
    table = np.zeros((max_depth + 1, max_rank + 1))
    rows = np.minimum(depth, max_depth)
    cols = np.clip(rank, 0, max_rank)
    np.add.at(table, (rows[valid], cols[valid]), mass[valid])
    return table


EXIT_KINDS = ("root", "internal", "leaf below horizon", "leaf at horizon")


def exit_kind(parents: np.ndarray, depth: np.ndarray, valid: np.ndarray, horizon: int) -> np.ndarray:
    """[N] index into `EXIT_KINDS` of where a target continuation that exits at each node leaves
    the tree; -1 for padding:

    0 root: no drafted depth-1 token matched (whatever the tree's shape);
    1 internal: a non-root node with drafted children; the exit takes its residual mass rho < 1;
    2 leaf below the draft horizon: the budget ran out there, all of P(v) leaves;
    3 leaf at the horizon (depth = G): the drafter could not go deeper.

    The law treats both leaf kinds alike (rho = 1); paper Sec. 5 separates them because only
    below the horizon can more budget extend the tree.
    """
    parents, depth, valid = np.asarray(parents), np.asarray(depth), np.asarray(valid, bool)
    n = parents.shape[0]
    has_child = np.zeros(n, bool)
    has_child[parents[valid & (parents >= 0)]] = True
    kind = np.where(has_child, 1, np.where(depth >= horizon, 3, 2))
    kind = np.where(np.arange(n) == 0, 0, kind)
    return np.where(valid, kind, -1)


def block_length_moments(exit_prob: np.ndarray, depth: np.ndarray) -> tuple[float, float, int]:
    """(mean, variance, largest |L - mean| possible) of the output-block length L = depth(V) + 1
    when the exit node V has law `exit_prob` (w). The mean is 1 + C_p (paper Eq. 6).

    Example: w = [0.5, 0.25, 0.25] at depths [0, 1, 2] -> L in {1, 2, 3} with mean 1.75,
    variance 0.6875, range bound 1.25.
    """
    w = np.asarray(exit_prob, np.float64)
    w = w / w.sum()  # float32 laws sum to 1 up to rounding
    length = np.asarray(depth, np.float64) + 1.0
    mean = float(np.sum(w * length))
    var = float(max(np.sum(w * length**2) - mean**2, 0.0))
    support = length[w > 0]
    spread = float(max(abs(support.max() - mean), abs(mean - support.min()))) if support.size else 0.0
    return mean, var, spread


def bernstein_halfwidth(n: int, variance: float, spread: float, delta: float) -> float:
    """t with P(|mean of n iid draws - true mean| >= t) <= delta, by Bernstein's inequality.

    For iid X_i with variance `variance` and |X_i - E X| <= `spread` (both known exactly here,
    from the exit law), P(|mean - E X| >= t) <= 2 exp(-n t^2 / (2 variance + 2 spread t / 3)).
    Unlike a z-score this needs no normal approximation, which fails for the skewed block lengths
    of trees where a rare deep exit carries a tiny probability. Solving the bound = delta for t:
    t = (a + sqrt(a^2 + 8 n variance c)) / (2 n), c = log(2 / delta), a = 2 spread c / 3.
    """
    if n < 1 or not 0 < delta < 1:
        raise ValueError(f"need n >= 1 and 0 < delta < 1, got n={n}, delta={delta}")
    c = math.log(2.0 / delta)
    a = 2.0 * spread * c / 3.0
    return (a + math.sqrt(a * a + 8.0 * n * variance * c)) / (2.0 * n)


def block_follows_tree(tokens: np.ndarray, parents: np.ndarray, valid: np.ndarray, block) -> bool:
    """Whether an emitted block (accepted tokens, then the bonus; possibly cut short at EOS or the
    token limit) can come from verifying this tree: every token but the last must be a drafted
    child of the previous node, starting at the root; the last may be a child or the bonus.

    Used to check that a captured tree is the tree the engine verified in that round.
    """
    tokens, parents, valid = np.asarray(tokens), np.asarray(parents), np.asarray(valid, bool)
    node = 0
    for i, tok in enumerate(block):
        child = np.flatnonzero(valid & (parents == node) & (tokens == tok))
        if child.size == 0:
            return i == len(block) - 1  # only the bonus may leave the tree
        node = int(child[0])
    return True
