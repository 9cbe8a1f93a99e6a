"""Training-time evaluation on held-out data: per-position top-1 accuracy and simulated greedy tau.

The held-out responses are the target's own greedy continuations, so a drafter's greedy block
length at an anchor can be read off the data without running the target: build the drafter's
DDTree tree at the anchor (the decoder's `draft_trees`), follow the data tokens a+1, a+2, ... down
the tree while a child carries the next token and that token is still inside the response; tau
is 1 (the bonus) + the depth reached. Averaged over fixed anchors of fixed records, this is the
greedy tau of decoding those responses from those positions (up to ties in the target's argmax).

Decoding does not start its rounds at uniform positions: each round's root is the previous round's
bonus token, the token its tree missed, so decoding visits the harder positions (on SmolLM2's
64 held-out records, v14's simulated tau at budget 8 is 2.07 along decoding's rounds and 2.26 over
every position: `experiments/results/heldout_screen_traj_g1.md`). With
`trajectory=True` the drafter is scored at every position and the rounds are walked as decoding
takes them (`trajectory_blocks`): the same quantity as decoding the recorded responses.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tevjax.decode.engine import draft_trees
from tevjax.train.dataset import Batch, TrainData
from tevjax.train.objectives import batch_anchors

__all__ = ["HeldoutEval", "block_truth", "greedy_accepted_depth", "trajectory_blocks"]


def greedy_accepted_depth(tokens, parents, valid, truth, truth_ok) -> jax.Array:
    """Depth reached by following `truth` [G] (usable while `truth_ok` [G]) down one tree [N]."""
    g = truth.shape[0]

    def step(node, d):
        # The child of `node` whose token is truth[d] (nodes have distinct sibling tokens).
        hit = valid & (parents == node) & (tokens == truth[d]) & truth_ok[d]
        child = jnp.where(jnp.any(hit), jnp.argmax(hit), -1)
        nxt = jnp.where(node >= 0, child, -1)
        return nxt, nxt >= 0

    _, reached = jax.lax.scan(step, jnp.int32(0), jnp.arange(g))
    return jnp.sum(jnp.cumprod(reached.astype(jnp.int32)))


def block_truth(tokens, loss_mask, anchors, valid, g: int) -> tuple[jax.Array, jax.Array]:
    """The data's tokens at depths 1..g after each anchor, [B, M, g], and where they count: inside
    the sequence, supervised, and after a valid anchor. tokens / loss_mask [B, T]; anchors / valid
    [B, M] (`sample_anchors`)."""
    t = tokens.shape[1]
    pos = anchors[..., None] + jnp.arange(1, g + 1)
    pos_c = jnp.minimum(pos, t - 1)
    rows = jnp.arange(tokens.shape[0])[:, None, None]
    return tokens[rows, pos_c], (pos < t) & loss_mask[rows, pos_c] & valid[..., None]


def trajectory_blocks(anchors: np.ndarray, valid: np.ndarray, depth: np.ndarray) -> tuple[int, int]:
    """(tokens emitted, rounds) of greedy decoding along one record: the first valid anchor is round
    0's root (the last prompt token); a round at anchor a with accepted depth k emits k + 1 tokens
    and the next round's root is a + k + 1, while that is a valid anchor. The answer ends one past
    the last anchor, and a round that reaches it emits only what is left (as decoding stops at its
    last new token). anchors / valid / depth [M]: every eligible position of the record, sorted
    (`sample_anchors` with M >= its length)."""
    depth_at = {int(a): int(k) for a, v, k in zip(anchors, valid, depth) if v}
    if not depth_at:
        return 0, 0
    a, end, tokens, rounds = min(depth_at), max(depth_at) + 1, 0, 0
    while a in depth_at:
        tokens, rounds = tokens + min(depth_at[a] + 1, end - a), rounds + 1
        a += depth_at[a] + 1
    return tokens, rounds


@functools.partial(jax.jit, static_argnames=("dgd", "tgd", "budgets", "anchors", "per_anchor"))
def _evaluate(dstate, tstate, batch: Batch, key, *, dgd, tgd, budgets, anchors, per_anchor=False):
    drafter = nnx.merge(dgd, dstate)
    target = nnx.merge(tgd, tstate)
    b = batch.tokens.shape[0]
    anc, valid = batch_anchors(key, batch.loss_mask, anchors)
    z = drafter.logits(target, drafter.train_hidden(target, batch.features, batch.tokens, anc))  # [B, M, G, Vd]
    g = z.shape[2]
    truth, truth_ok = block_truth(batch.tokens, batch.loss_mask, anc, valid, g)
    hit = (drafter.token_ids(jnp.argmax(z, axis=-1)) == truth) & truth_ok
    # Per record ([B] or [B, G]): records are the independent units of a paired comparison.
    out = {"acc_hits": jnp.sum(hit, axis=1), "acc_count": jnp.sum(truth_ok, axis=1),
           "anchors": jnp.sum(valid, axis=1)}
    roots = jnp.take_along_axis(batch.tokens, anc, axis=1).reshape(-1)
    for budget in budgets:
        trees = draft_trees(z.reshape(b * anchors, g, -1), roots, budget, drafter.vocab_ids())
        depth = jax.vmap(greedy_accepted_depth)(trees.tokens, trees.parents, trees.valid,
                                                truth.reshape(b * anchors, g), truth_ok.reshape(b * anchors, g))
        out[f"tau_{budget}"] = jnp.sum(jnp.where(valid, 1 + depth.reshape(b, anchors), 0), axis=1)
        if per_anchor:
            out[f"depth_{budget}"] = depth.reshape(b, anchors)
    if per_anchor:
        out.update(anchor=anc, valid=valid)
    return out


class HeldoutEval:
    """Fixed held-out records and anchors; `__call__(drafter, target)` -> metrics dict."""

    def __init__(self, data: TrainData, columns: list[int], *, records: int = 32, anchors: int = 32,
                 seq_len: int = 512, budgets: tuple[int, ...] = (4, 8, 16), batch: int = 8, seed: int = 1234,
                 trajectory: bool = False):
        n = min(records, len(data))
        self.batches = [data.batch(range(s, min(n, s + batch)), columns, seq_len) for s in range(0, n, batch)]
        # The trajectory needs the drafter at every position: anchors = seq_len takes them all. The
        # draft logits of a batch are then [batch, seq_len, G, Vd] (1.9 GB in float32 for SmolLM2's
        # drafter at 8 x 512), so a longer seq_len wants a smaller batch.
        self.anchors = seq_len if trajectory else anchors
        self.budgets, self.seed, self.trajectory = tuple(budgets), seed, trajectory

    def per_record(self, drafter, target) -> dict[str, np.ndarray]:
        """Sums per held-out record, in record order: "anchors" [R] (valid anchors), "tau_<b>" [R]
        (simulated block lengths at budget b, summed over the record's anchors) and "acc_hits" /
        "acc_count" [R, G]. The anchors depend only on the data and the seed, so two drafters are
        scored at the same anchors: sum(tau_b) / sum(anchors) is each one's tau_sim@b, and records
        pair them (`experiments/heldout_screen.py`). With `trajectory`, also "traj_tokens_<b>" and
        "traj_rounds_<b>" [R] (`trajectory_blocks`): their ratio is tau along decoding's rounds."""
        dgd, dstate = nnx.split(drafter)
        tgd, tstate = nnx.split(target)
        parts: dict[str, list[np.ndarray]] = {}
        for i, host in enumerate(self.batches):
            batch = Batch(**{k: jnp.asarray(v) for k, v in host.items()})
            out = _evaluate(dstate, tstate, batch, jax.random.fold_in(jax.random.key(self.seed), i),
                            dgd=dgd, tgd=tgd, budgets=self.budgets, anchors=self.anchors, per_anchor=self.trajectory)
            if self.trajectory:
                anc, valid = np.asarray(out.pop("anchor")), np.asarray(out.pop("valid"))
                for b in self.budgets:
                    depth = np.asarray(out.pop(f"depth_{b}"))
                    walks = [trajectory_blocks(anc[r], valid[r], depth[r]) for r in range(len(anc))]
                    out[f"traj_tokens_{b}"], out[f"traj_rounds_{b}"] = (np.asarray(x) for x in zip(*walks))
            for k, v in out.items():
                parts.setdefault(k, []).append(np.asarray(v))
        return {k: np.concatenate(v) for k, v in parts.items()}

    def __call__(self, drafter, target) -> dict[str, float]:
        totals = {k: v.sum(axis=0) for k, v in self.per_record(drafter, target).items()}
        n = max(float(totals["anchors"]), 1.0)
        acc = totals["acc_hits"] / np.maximum(totals["acc_count"], 1)
        metrics = {f"acc@{k + 1}": float(acc[k]) for k in range(min(4, len(acc)))}
        metrics.update({f"tau_sim@{b}": float(totals[f"tau_{b}"]) / n for b in self.budgets})
        if self.trajectory:
            metrics.update({f"tau_traj@{b}": float(totals[f"traj_tokens_{b}"])
                            / max(float(totals[f"traj_rounds_{b}"]), 1.0) for b in self.budgets})
        return metrics
