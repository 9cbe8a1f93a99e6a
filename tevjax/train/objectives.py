"""The drafter's training objectives as pure functions: the DFlash token loss and ExitTrain's exit loss.

Shape letters follow the legend in `tevjax/__init__.py`: B sequences, T sequence length (tokens of
one training sequence), M anchors per sequence, G = block_size - 1 draft rows per anchor (row g-1
drafts the token at anchor + g), N tree slots (root + exit budget), V vocabulary.

Every loss returns a (numerator, denominator) pair of float32 scalars summed over the batch it is
given, so that a data-parallel step divides global sums by global sums (never a mean of per-device
means); `ratio` does the division.

Token loss (DFlash, REFERENCE section 5): cross entropy of draft row g-1 of anchor a against the
data token at a + g, weighted exp(-(g-1)/gamma) (gamma None: weight 1), counted where the anchor is
real, a + g lies inside the sequence and is a supervised (response) token; normalised by the sum of
the weights that count.

Distillation loss (an option, not in the DFlash recipe; EAGLE's classification loss is of this
kind): the same rows, positions and weights as the token loss, with the one-hot label replaced by
the target's own distribution of the token at a + g (softmax of its logits at a + g - 1, restricted
to the draft vocabulary and renormalised), i.e. cross entropy lse - sum_v p(v) z[v]. With a reduced
draft vocabulary the training step leaves out of the token loss the rows whose data token lies
outside it (no index to score), but keeps them in this one: their soft label is defined all the
same. At T = 0 the data token is that distribution's argmax, so both losses agree on the mode; the
soft one also says how the rest of the mass lies, which one token per row cannot. (On SmolLM2 it
did not raise tau at T = 0 or T = 1: the shipped drafter's model card.)

Exit loss (ExitTrain, paper Eq. 14 and App. C.2): with omega(v) a detached per-node weight of the
drafter's own tree,

    loss_exit = sum_v omega(v) * (logsumexp(z[row(v)]) - z[row(v), x_v]) / #(non-root nodes),
    row(v) = depth(v) - 1 (nodes of one depth share their anchor's draft row),

computed as sum_rows (row weight) * lse(row) - sum_v omega(v) * z[row(v), x_v]: one log-normaliser
per row (shared with the token loss) plus a gather, never a nodes x V tensor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tevjax.law import ExitLaw
from tevjax.tree import DraftTree

__all__ = ["EXIT_WEIGHTS", "batch_anchors", "distill_loss_terms", "exit_loss_terms", "exit_weights", "ratio",
           "sample_anchors", "token_loss_terms", "P_FLOOR"]

# The released recipes floor every factor of P at this value ("P_tgt").
P_FLOOR = 1e-4
EXIT_WEIGHTS = ("w", "w_depth", "P_floored", "P_rescaled")


def ratio(terms: tuple[jax.Array, jax.Array]) -> jax.Array:
    """numerator / denominator, 0 when nothing counted (an all-padding batch)."""
    num, den = terms
    return jnp.where(den > 0, num / jnp.maximum(den, 1e-30), 0.0)


def sample_anchors(key: jax.Array, loss_mask: jax.Array, num_anchors: int) -> tuple[jax.Array, jax.Array]:
    """Anchors [M] and their validity [M] for one sequence, uniformly without replacement among the
    positions a whose next token is supervised (loss_mask[a + 1]).

    The released recipe also asks loss_mask[a], which leaves out the last token before each
    response. But that token is the decoder's first anchor: prefill writes prompt[:-1] and the last
    prompt token is round 0's root. Trained without it, the shipped drafter's round 0 emitted 1.03
    tokens against ~1.8 for later rounds (32 held-out prompts, greedy, budget 8).

    loss_mask [T] bool. Fewer than M eligible positions: the rest are marked invalid (index 0).
    Anchors come back sorted, so a step's blocks read the sequence left to right.
    """
    t = loss_mask.shape[0]
    eligible = jnp.concatenate([loss_mask[1:], jnp.zeros((1,), bool)])
    # Uniform random keys on eligible positions, -1 elsewhere: the top M keys are a uniform
    # sample without replacement of the eligible positions.
    u = jnp.where(eligible, jax.random.uniform(key, (t,)), -1.0)
    vals, idx = jax.lax.top_k(u, min(num_anchors, t))
    valid = vals >= 0
    idx = jnp.where(valid, idx, t)  # invalid ones sort last
    order = jnp.argsort(idx)
    anchors, valid = idx[order], valid[order]
    if num_anchors > t:  # static: pad with invalid anchors
        pad = num_anchors - t
        anchors = jnp.concatenate([anchors, jnp.full((pad,), t, anchors.dtype)])
        valid = jnp.concatenate([valid, jnp.zeros((pad,), bool)])
    return jnp.where(valid, anchors, 0).astype(jnp.int32), valid


def batch_anchors(key: jax.Array, loss_mask: jax.Array, num_anchors: int) -> tuple[jax.Array, jax.Array]:
    """`sample_anchors` for each row of loss_mask [B, T], row b with the b-th of `split(key, B)`:
    anchors [B, M] and validity [B, M], as the training step and the held-out check draw them."""
    keys = jax.random.split(key, loss_mask.shape[0])
    return jax.vmap(sample_anchors, in_axes=(0, 0, None))(keys, loss_mask, num_anchors)


def token_loss_terms(lse: jax.Array, logits: jax.Array, tokens: jax.Array, loss_mask: jax.Array,
                     anchors: jax.Array, anchor_valid: jax.Array, gamma: float | None) -> tuple[jax.Array, jax.Array]:
    """DFlash token loss (numerator, denominator) for one batch.

    lse [B, M, G] = logsumexp of the draft rows; logits [B, M, G, V] draft logits (only gathered);
    tokens, loss_mask [B, T]; anchors, anchor_valid [B, M].
    """
    pos_c, weight = _label_rows(lse.shape, loss_mask, anchors, anchor_valid, gamma)
    labels = tokens[jnp.arange(lse.shape[0])[:, None, None], pos_c]
    z_label = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]
    return jnp.sum(weight * (lse - z_label)), jnp.sum(weight)


def _label_rows(shape, loss_mask, anchors, anchor_valid, gamma):
    """Per-row label positions [B, M, G] (clipped into the sequence) and token-loss weights [B, M, G]
    (0 where the row does not count: invalid anchor, past the end, or an unsupervised token)."""
    b, m, g = shape
    t = loss_mask.shape[1]
    offs = jnp.arange(1, g + 1, dtype=jnp.int32)
    pos = anchors[..., None] + offs  # [B, M, G] positions of the labels
    inside = pos < t
    pos_c = jnp.minimum(pos, t - 1)
    rows = jnp.arange(b)[:, None, None]
    counted = anchor_valid[..., None] & inside & loss_mask[rows, pos_c]
    weight = jnp.ones((g,), jnp.float32) if gamma is None else jnp.exp(-(offs - 1).astype(jnp.float32) / gamma)
    return pos_c, jnp.where(counted, weight, 0.0)


def distill_loss_terms(lse: jax.Array, logits: jax.Array, teacher_logits: jax.Array, loss_mask: jax.Array,
                       anchors: jax.Array, anchor_valid: jax.Array, gamma: float | None) -> tuple[jax.Array, jax.Array]:
    """Distillation loss (numerator, denominator): soft cross entropy of each draft row against the
    target's distribution of that row's token, weighted and counted as the token loss.

    lse [B, M, G] and logits [B, M, G, V] of the draft rows; teacher_logits [B, M, G, V] the
    target's logits over the same vocabulary for the same rows (treated as constants);
    loss_mask [B, T]; anchors, anchor_valid [B, M].
    """
    _, weight = _label_rows(lse.shape, loss_mask, anchors, anchor_valid, gamma)
    p = jax.nn.softmax(jax.lax.stop_gradient(teacher_logits).astype(jnp.float32), axis=-1)
    ce = lse - jnp.sum(p * logits, axis=-1)
    return jnp.sum(weight * ce), jnp.sum(weight)


def exit_weights(law: ExitLaw, tree: DraftTree, edge_prob: jax.Array, kind: str) -> jax.Array:
    """omega [N] for one tree (0 at the root and at padding); see the module docstring.

    * "w": the exit probability w(v) = P(v) rho(v) (the paper's ExitTrain).
    * "w_depth": w(v) * depth(v) (the released code's "exit" option).
    * "P_floored": P(v) with every factor floored at P_FLOOR (the released recipes' "P_tgt").
    * "P_rescaled": P(v) rescaled to the same total as w over the non-root nodes (the paper's
      prefix-weighted control).
    """
    non_root = tree.valid & (tree.parents >= 0)
    if kind == "w":
        omega = law.exit_prob
    elif kind == "w_depth":
        omega = law.exit_prob * tree.depth.astype(jnp.float32)
    elif kind == "P_floored":
        factor = jnp.where(non_root, jnp.maximum(edge_prob, P_FLOOR), 1.0)
        omega = jnp.prod(jnp.where(tree.ancestors, factor[None, :], 1.0), axis=-1)
    elif kind == "P_rescaled":
        p = jnp.where(non_root, law.prefix_prob, 0.0)
        total_w = jnp.sum(jnp.where(non_root, law.exit_prob, 0.0))
        total_p = jnp.sum(p)
        omega = jnp.where(total_p > 0, p * (total_w / jnp.maximum(total_p, 1e-30)), 0.0)
    else:
        raise ValueError(f"unknown exit weight {kind!r}; choose one of {', '.join(EXIT_WEIGHTS)}")
    return jax.lax.stop_gradient(jnp.where(non_root, omega, 0.0))


def exit_loss_terms(lse: jax.Array, logits: jax.Array, trees: DraftTree, omega: jax.Array,
                    tree_valid: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Exit loss (numerator, denominator) from per-row log-normalisers and a gather.

    lse [..., G] and logits [..., G, V] of the anchors that have trees; trees with leading dims
    [...] and N slots; omega [..., N] detached weights; tree_valid [...] (False: anchor ignored).
    The denominator counts the real non-root nodes of the counted trees.
    """
    non_root = trees.valid & (trees.parents >= 0) & tree_valid[..., None]
    om = jnp.where(non_root, omega, 0.0)
    g = lse.shape[-1]
    row = jnp.clip(trees.depth - 1, 0, g - 1)  # [..., N]
    # Per-row weight: sum of omega over the nodes of that depth (one-hot over G, not over V).
    row_w = jnp.sum(jnp.where(row[..., None] == jnp.arange(g), om[..., None], 0.0), axis=-2)  # [..., G]
    z_node = _gather_node_logits(logits, row, jnp.maximum(trees.tokens, 0))
    num = jnp.sum(row_w * lse) - jnp.sum(om * z_node)
    return num, jnp.sum(non_root.astype(jnp.float32))


def _gather_node_logits(logits: jax.Array, row: jax.Array, token: jax.Array) -> jax.Array:
    """z[row(v), x_v] for every node: logits [..., G, V], row/token [..., N] -> [..., N]."""
    g, v = logits.shape[-2:]
    flat = logits.reshape(logits.shape[:-2] + (g * v,))
    return jnp.take_along_axis(flat, row * v + token, axis=-1)
