"""Hand-computed checks of the pure helpers of the fixed-tree experiments (experiments/tree_stats.py)."""

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
from tree_stats import (bernstein_halfwidth, block_follows_tree, block_length_moments, exit_kind,  # noqa: E402
                        mass_by_depth_rank, sibling_ranks)

# The 6-slot tree used below (slot 5 is padding):
#   root 0 -> 1 (score -2), 2 (score -1), 4 (score -1);  1 -> 3
PARENTS = np.array([-1, 0, 0, 1, 0, -1])
DEPTH = np.array([0, 1, 1, 2, 1, 0])
VALID = np.array([1, 1, 1, 1, 1, 0], bool)
SCORE = np.array([0.0, -2.0, -1.0, -3.0, -1.0, -np.inf])


def test_sibling_ranks_break_ties_by_node_order():
    assert sibling_ranks(PARENTS, VALID, SCORE).tolist() == [-1, 2, 0, 0, 1, -1]


def test_mass_by_depth_rank_sums_cells_and_clips_ranks():
    ranks = sibling_ranks(PARENTS, VALID, SCORE)
    w = np.array([0.1, 0.2, 0.3, 0.15, 0.25, 0.9])  # the padding's 0.9 must be ignored
    table = mass_by_depth_rank(DEPTH, ranks, w, VALID, max_depth=2, max_rank=1)
    # depth 0: root 0.1 at rank 0; depth 1: node 2 (rank 0) 0.3, nodes 4 (rank 1) and 1 (rank 2 -> 1) 0.45;
    # depth 2: node 3 (rank 0) 0.15.
    np.testing.assert_allclose(table, [[0.1, 0.0], [0.3, 0.45], [0.15, 0.0]])
    assert table.sum() == pytest.approx(1.0)
    # Depths beyond max_depth land in the last row.
    np.testing.assert_allclose(mass_by_depth_rank(DEPTH, ranks, w, VALID, 1, 2), [[0.1, 0, 0], [0.45, 0.25, 0.2]])


def test_exit_kind_separates_internal_nodes_and_both_leaf_kinds():
    # root 0; node 1 has a child (internal); nodes 2 and 4 are depth-1 leaves; node 3 a depth-2 leaf.
    assert exit_kind(PARENTS, DEPTH, VALID, horizon=2).tolist() == [0, 1, 2, 3, 2, -1]
    assert exit_kind(PARENTS, DEPTH, VALID, horizon=3).tolist() == [0, 1, 2, 2, 2, -1]
    # A root-only tree exits at the root.
    assert exit_kind(np.array([-1]), np.array([0]), np.array([True]), horizon=1).tolist() == [0]


def test_block_length_moments_by_hand():
    mean, var, spread = block_length_moments(np.array([0.5, 0.25, 0.25, 0.0]), np.array([0, 1, 2, 7]))
    assert mean == pytest.approx(1.75)  # 1 + C_p, C_p = 0.25 + 2 * 0.25
    assert var == pytest.approx(0.5 * 1 + 0.25 * 4 + 0.25 * 9 - 1.75**2)  # 0.6875
    assert spread == pytest.approx(1.25)  # the depth-7 slot has w = 0: not in the support
    assert block_length_moments(np.array([1.0]), np.array([0])) == (1.0, 0.0, 0.0)


def test_bernstein_halfwidth_by_hand():
    # n = 100, variance 1, spread 3, delta = 2 / e^2 (c = 2): a = 4, t = (4 + sqrt(16 + 1600)) / 200.
    assert bernstein_halfwidth(100, 1.0, 3.0, 2 * math.exp(-2)) == pytest.approx((4 + math.sqrt(1616)) / 200)
    assert bernstein_halfwidth(10, 0.0, 0.0, 0.01) == 0.0  # a deterministic length: no slack at all
    with pytest.raises(ValueError):
        bernstein_halfwidth(0, 1.0, 1.0, 0.01)


def test_bernstein_halfwidth_holds_for_a_skewed_law():
    # A rare deep exit (p = 1e-3 at depth 10): the empirical miss rate stays below delta.
    rng = np.random.default_rng(0)
    n, delta = 400, 0.05
    w, depth = np.array([1 - 1e-3, 1e-3]), np.array([0, 10])
    mean, var, spread = block_length_moments(w, depth)
    t = bernstein_halfwidth(n, var, spread, delta)
    means = 1.0 + 10.0 * rng.binomial(n, 1e-3, size=20_000) / n
    assert np.mean(np.abs(means - mean) >= t) <= delta


def test_block_follows_tree():
    tokens = np.array([7, 11, 12, 13, 14, 0])
    assert block_follows_tree(tokens, PARENTS, VALID, [11, 13, 99])  # path 1 -> 3, then a bonus
    assert block_follows_tree(tokens, PARENTS, VALID, [12, 5])  # node 2, then a bonus
    assert block_follows_tree(tokens, PARENTS, VALID, [5])  # nothing accepted
    assert block_follows_tree(tokens, PARENTS, VALID, [11])  # cut short at EOS after one token
    assert not block_follows_tree(tokens, PARENTS, VALID, [13, 5])  # 13 is not a child of the root
    assert not block_follows_tree(tokens, PARENTS, VALID, [11, 12, 5])  # 12 is not below node 1
