"""tevjax: lossless tree speculative decoding in JAX/Flax.

Letter legend for shapes used across the package:
  B batch, T sequence (new tokens), S cache slots, N tree nodes (root + budget), H tree depth,
  L model layers, V vocabulary, D model width, K key/value heads, Dh head width.

The core is model-free: `DraftTree` (a padded static-shape tree), `exit_law` (the canonical exit
law P, rho, w and coverage C_p) and `verify` (TEV, predraw-and-follow, sequential residual, greedy).
"""

from tevjax.law import ExitLaw, exit_law
from tevjax.tree import DraftTree, TreeValidationError, validate_tree
from tevjax.verifiers import VerifyOutput, verify

__all__ = [
    "DraftTree",
    "ExitLaw",
    "TreeValidationError",
    "VerifyOutput",
    "exit_law",
    "validate_tree",
    "verify",
]

__version__ = "0.1.0"
