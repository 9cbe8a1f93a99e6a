"""One optax training step for the drafter: token loss + lambda * exit loss, jitted over a device mesh.

Shape letters follow the legend in `tevjax/__init__.py`: B sequences (global batch), T sequence
length, M anchors per sequence, E exit anchors per sequence (a subset of the M), G = block_size - 1
draft rows, N = exit budget + 1 tree slots, V vocabulary.

A step, for every sequence of the batch:

1. M anchors sampled where the next token is supervised (`sample_anchors`,
   keyed by fold_in(seed key, step): the step is a pure function of (state, batch));
2. the drafter's block forward at every anchor against the sequence's context features
   (`DFlashDrafter.train_hidden`), the target's LM head -> draft logits z [B, M, G, Vd] over the
   drafter's vocabulary (Vd = V, or a reduced draft vocabulary: labels outside it are not counted);
3. token loss on all M anchors (with `distill` > 0, mixed with the distillation loss against the
   target's own distribution of each label, read from the stored final-normed state: no target
   forward);
4. (lambda > 0) on E evenly spread anchors of Bx evenly spread sequences: DDTree trees built
   from the DETACHED draft logits with the decoder's own stage function (`draft_trees`), scored
   by the frozen target in ONE pass per sequence (`score_trees`: the sequence and all E trees in
   one forward, each tree seeing the full prefix before its anchor and its own ancestors), the
   exit law (P, rho, w) and the weights omega, all detached; exit loss on the E anchors' rows.

Gradients reach the drafter's parameters only: the target (whose embedding and LM head the
drafter shares) is a constant of the differentiated function, and the optimizer is an
`nnx.Optimizer` over `nnx.Param` of the drafter alone.

On a (`data`, `model`) mesh the batch is split over `data` and every array of the target, the
drafter, the optimizer's moments and the state takes its sharding from the tables of
`tevjax.sharding` (heads, MLP width and vocabulary over `model`; a `model` axis of 1 replicates).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from tevjax.checks import is_int, is_real
from tevjax.decode.engine import draft_trees
from tevjax.law import edge_stats, law_from_edges
from tevjax.models.cache import KVCache
from tevjax.models.dflash import DFlashDrafter
from tevjax.models.transformer import Transformer
from tevjax.sampling import check_truncation, truncate_logits
from tevjax.seeding import check_seed, seed_key
from tevjax.sharding import (batch_sharding, check_batch, frozen, host_array, param_shardings, replicated, thawed,
                             traced_on)
from tevjax.train.dataset import Batch
from tevjax.train.objectives import (EXIT_WEIGHTS, batch_anchors, distill_loss_terms, exit_loss_terms, exit_weights,
                                     ratio, token_loss_terms)
from tevjax.tree import DraftTree, valid_temperature

__all__ = ["TrainConfig", "TrainState", "Trainer", "final_tap", "make_optimizer", "score_trees", "loss_terms",
           "teacher_logits"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Static training settings (a jit static argument: hashable)."""

    steps: int
    batch_size: int = 8  # B: sequences per global batch
    anchors: int = 32  # M: anchor blocks per sequence
    seq_len: int = 512  # T: sequences are padded or cropped to this
    lr: float = 6e-4
    warmup: float = 0.04  # fraction of steps with linear warmup, then cosine to 0
    weight_decay: float = 0.0  # optax.adamw's default is 1e-4: the recipe uses 0, set explicitly
    b1: float = 0.9
    b2: float = 0.999
    clip_norm: float = 1.0
    gamma: float | None = 7.0  # token-loss position decay exp(-(k-1)/gamma); None = off
    # Weight a in [0, 1] of the distillation loss: loss_tok = (1 - a) * hard + a * soft labels.
    distill: float = 0.0
    exit_lambda: float = 0.0  # 0 = token-only
    exit_weight: str = "w"
    exit_budget: int = 8  # tree budget of the exit loss's trees
    exit_anchors: int = 8  # E: anchors per sequence that get a tree
    # Bx: sequences of the batch that get trees (None: all B), spread evenly over the batch. Each
    # tree-bearing sequence costs one target forward over T + E*N tokens, so at a fixed number of
    # trees per step fewer sequences with more trees each are cheaper: B=8, E=8 and B=2, E=32 give
    # 64 trees each, from 8 * 776 or 2 * 1568 target tokens (T = 512, N = 33).
    exit_sequences: int | None = None
    exit_temperature: float = 1.0  # target temperature of the exit law
    # Truncation of the exit law's target (`tevjax.sampling.truncate_logits`): set them to the
    # top-k / top-p / min-p that decoding will sample with, so that the exit weights follow the law
    # the verifier accepts under. 0 / 1.0 / 0.0: off.
    exit_top_k: int = 0
    exit_top_p: float = 1.0
    exit_min_p: float = 0.0
    seed: int = 0

    def __post_init__(self):
        try:
            check_seed(self.seed)
        except ValueError as e:
            raise ValueError(f"TrainConfig.{e}") from None
        object.__setattr__(self, "seed", int(self.seed))
        for name in ("steps", "batch_size", "anchors", "seq_len", "exit_budget", "exit_anchors"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"TrainConfig.{name} must be a positive int, got {value!r}")
            object.__setattr__(self, name, int(value))  # NumPy ints work as ints do; stored as Python's
        for name in ("lr", "warmup", "weight_decay", "b1", "b2", "clip_norm", "gamma", "distill", "exit_lambda",
                     "exit_temperature"):
            value = getattr(self, name)
            if value is None and name == "gamma":
                continue
            # float() would read True as 1.0 and "0.1" as 0.1, or fail without naming the field.
            if not is_real(value):
                raise TypeError(f"TrainConfig.{name} must be a number, got {value!r} ({type(value).__name__})")
            object.__setattr__(self, name, float(value))
        for name in ("lr", "clip_norm", "exit_temperature"):
            value = float(getattr(self, name))
            if not (valid_temperature(value) and value > 0):  # finite in float32, as the step computes
                raise ValueError(f"TrainConfig.{name} must be a finite float32 number > 0, got {getattr(self, name)!r}")
        for name in ("b1", "b2"):  # Adam's moment decays
            if not 0 <= float(getattr(self, name)) < 1:
                raise ValueError(f"TrainConfig.{name} must be in [0, 1), got {getattr(self, name)!r}")
        for name in ("weight_decay", "exit_lambda"):
            value = float(getattr(self, name))
            if not valid_temperature(value):  # >= 0 and finite in float32, as the step computes
                raise ValueError(f"TrainConfig.{name} must be a finite float32 number >= 0, got {getattr(self, name)!r}")
        if not 0 <= float(self.distill) <= 1:
            raise ValueError(f"TrainConfig.distill must be a weight in [0, 1], got {self.distill!r}")
        if not 0 <= self.warmup < 1:
            raise ValueError(f"TrainConfig.warmup must be a fraction in [0, 1), got {self.warmup!r}")
        if self.gamma is not None and not self.gamma > 0:
            raise ValueError(f"TrainConfig.gamma must be > 0 or None, got {self.gamma!r}")
        if self.gamma is not None and not np.float32(self.gamma) >= np.finfo(np.float32).tiny:
            # The step divides by gamma in float32: a smaller one is 0 there (or flushed to 0), and the
            # first row's weight exp(-0 / 0) is NaN: the loss reads 0 and every gradient NaN.
            raise ValueError(f"TrainConfig.gamma must be at least float32's smallest normal number "
                             f"({float(np.finfo(np.float32).tiny):.4g}), got {self.gamma!r}")
        try:
            check_truncation(self.exit_top_k, self.exit_top_p, self.exit_min_p)
        except (TypeError, ValueError) as e:
            raise type(e)(f"TrainConfig.exit_{e}") from None
        if self.exit_weight not in EXIT_WEIGHTS:
            raise ValueError(f"TrainConfig.exit_weight {self.exit_weight!r} is not one of {', '.join(EXIT_WEIGHTS)}")
        if self.exit_anchors > self.anchors:
            raise ValueError(f"TrainConfig.exit_anchors ({self.exit_anchors}) exceeds anchors ({self.anchors})")
        if self.exit_sequences is not None:
            n = self.exit_sequences
            if not is_int(n) or n < 1 or self.batch_size % n:
                raise ValueError(f"TrainConfig.exit_sequences must be a positive divisor of batch_size "
                                 f"({self.batch_size}) or None, got {n!r}")
            object.__setattr__(self, "exit_sequences", int(n))

    @property
    def exit_on(self) -> bool:
        return self.exit_lambda > 0


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW on a warmup + cosine-to-zero schedule."""
    warmup = int(round(cfg.warmup * cfg.steps))
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup, decay_steps=max(cfg.steps, warmup + 1),
        end_value=0.0)
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                       optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a step reads and writes, and everything a checkpoint holds (with the data
    position, which is `step`: see `tevjax.train.dataset`)."""

    params: Any  # nnx.State of the drafter's nnx.Param
    opt: Any  # nnx.State of the nnx.Optimizer (optax state + its step count)
    step: jax.Array  # [] int32 steps taken
    key: jax.Array  # [2] uint32 key data of the run's base PRNG key


# ------------------------------------------------------------------------------------ exit trees


def score_trees(target: Transformer, tokens: jax.Array, anchors: jax.Array, trees: DraftTree) -> jax.Array:
    """Target logits [B, E, N, V] of every node of every anchor's tree, each under its true context.

    tokens [B, T]; anchors [B, E]; trees with leading dims [B, E] and N slots (node 0 = the anchor
    token). One forward per sequence over [sequence | tree 1 | ... | tree E]: the sequence part is
    causal; a node of tree e sits at position anchor_e + depth and sees the sequence before its
    anchor (positions < anchor_e) and its own ancestors in tree e. This equals E separate passes
    that each prefill tokens[:anchor_e] and run the tree (the decoder's tree pass), without
    repeating the prefix.

    The mask is the ancestor-or-self relation of one big tree (the sequence a chain, each anchor's
    tree hanging off the token before its anchor), so a hybrid target's linear layers, which run a
    tree pass as the gated delta rule over that relation (`linear_attention.gated_delta`), give each
    node the output of its own sequence too: no recurrent state per anchor is needed.
    """
    b, t = tokens.shape
    e, n = trees.tokens.shape[1:]
    total = t + e * n
    seq_pos = jnp.arange(t, dtype=jnp.int32)
    all_tokens = jnp.concatenate([tokens, jnp.maximum(trees.tokens, 0).reshape(b, e * n)], axis=1)
    node_pos = anchors[..., None] + trees.depth  # [B, E, N]
    positions = jnp.concatenate([jnp.broadcast_to(seq_pos, (b, t)), node_pos.reshape(b, e * n)], axis=1)

    causal = seq_pos[:, None] >= seq_pos[None, :]  # [T, T]
    to_seq = seq_pos[None, None, None, :] < anchors[..., None, None]  # [B, E, 1, T] -> per node row
    to_seq = jnp.broadcast_to(to_seq, (b, e, n, t)).reshape(b, e * n, t)
    same_tree = jnp.eye(e, dtype=bool)[None, :, None, :, None]  # [1, E, 1, E, 1]
    in_tree = same_tree & trees.ancestors[:, :, :, None, :]  # [B, E, N, E, N]
    in_tree = in_tree.reshape(b, e * n, e * n)
    top = jnp.concatenate([jnp.broadcast_to(causal, (b, t, t)), jnp.zeros((b, t, e * n), bool)], axis=2)
    bottom = jnp.concatenate([to_seq, in_tree], axis=2)
    mask = jnp.concatenate([top, bottom], axis=1)  # [B, T + E*N, T + E*N]

    # (A hybrid target's cache records the pass's nodes for a commit; nothing reads them here.)
    out = target(all_tokens, positions, KVCache.init(target.cfg, b, total, tree_slots=total),
                 jnp.zeros((b,), jnp.int32), mask, compute_logits=False)
    return target.logits(out.final_hidden[:, t:]).reshape(b, e, n, -1)


# ------------------------------------------------------------------------------------ the loss


def final_tap(drafter: DFlashDrafter, target: Transformer) -> int:
    """Index among the drafter's taps of the target's last layer, whose stored state is the
    final-normed hidden state the LM head reads (`tapped_hidden`): the distillation loss's teacher."""
    last = target.cfg.num_layers - 1
    taps = tuple(drafter.cfg.target_layer_ids)
    if last not in taps:
        raise ValueError(f"the distillation loss reads the target's distribution from its last layer ({last}), "
                         f"which the drafter does not tap (taps {list(taps)})")
    return taps.index(last)


def teacher_logits(drafter: DFlashDrafter, target: Transformer, features: jax.Array, anchors: jax.Array,
                   g: int) -> jax.Array:
    """The target's logits [B, M, G, Vd] over the draft vocabulary for every draft row: row g-1 of
    anchor a drafts the token at a + g, whose distribution the target gave at a + g - 1. Read from
    the stored features (the final-normed state of the last tap) through the LM head; constants."""
    d = target.cfg.hidden_size
    r = final_tap(drafter, target)
    t = features.shape[1]
    pos = jnp.minimum(anchors[..., None] + jnp.arange(g, dtype=jnp.int32), t - 1)  # [B, M, G]
    h = jnp.take_along_axis(features[..., r * d:(r + 1) * d], pos.reshape(pos.shape[0], -1)[..., None], axis=1)
    h = h.reshape(pos.shape + (d,))
    return jax.lax.stop_gradient(target.logits(h, drafter.vocab_ids()).astype(jnp.float32))


def loss_terms(drafter: DFlashDrafter, target: Transformer, batch: Batch, key: jax.Array,
               cfg: TrainConfig, mesh=None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss, metrics) of one global batch; differentiable in the drafter only. With a `mesh`, the
    exit loss builds its trees per device (`draft_trees(..., mesh)`), not from gathered logits."""
    b, t = batch.tokens.shape
    anchors, valid = batch_anchors(key, batch.loss_mask, cfg.anchors)
    hidden = drafter.train_hidden(target, batch.features, batch.tokens, anchors)  # [B, M, G, D]
    z = drafter.logits(target, hidden)  # [B, M, G, Vd] float32
    lse = jax.nn.logsumexp(z, axis=-1)  # [B, M, G]
    labels, in_vocab = drafter.draft_index(batch.tokens)  # [B, T] draft-vocabulary indices
    tok = token_loss_terms(lse, z, labels, batch.loss_mask & in_vocab, anchors, valid, cfg.gamma)
    loss = ratio(tok)
    metrics = {"loss_tok": ratio(tok), "blocks": jnp.sum(valid.astype(jnp.float32))}
    if cfg.distill > 0:
        soft = teacher_logits(drafter, target, batch.features, anchors, z.shape[2])
        kd = distill_loss_terms(lse, z, soft, batch.loss_mask, anchors, valid, cfg.gamma)
        loss = (1.0 - cfg.distill) * loss + cfg.distill * ratio(kd)
        metrics["loss_kd"] = ratio(kd)

    # Top-1 agreement with the data token at block position 1 (a cheap running diagnostic; a
    # label outside the draft vocabulary counts as a miss).
    pos1 = jnp.minimum(anchors + 1, t - 1)
    rows = jnp.arange(b)[:, None]
    hit1 = (jnp.argmax(z[:, :, 0], axis=-1) == labels[rows, pos1]) & in_vocab[rows, pos1] & valid
    metrics["acc1"] = jnp.sum(hit1) / jnp.maximum(jnp.sum(valid), 1)

    if cfg.exit_on:
        bx = cfg.exit_sequences or b
        stride = b // bx

        def rows_of(x):
            # Rows 0, stride, 2 * stride, ...: as [Bx, stride, ...][:, 0], so a batch split over
            # the mesh's `data` axis stays split (Bx divides over it), each device its own rows.
            return x.reshape((bx, stride) + x.shape[1:])[:, 0]

        sel = np.linspace(0, cfg.anchors - 1, cfg.exit_anchors).round().astype(np.int32)  # static, spread
        ze, lse_e, ae, ve = (rows_of(x[:, sel]) for x in (z, lse, anchors, valid))
        seq = rows_of(batch.tokens)
        e, g, v = ze.shape[1:]
        roots = jnp.take_along_axis(seq, ae, axis=1)
        flat = draft_trees(jax.lax.stop_gradient(ze).reshape(bx * e, g, v), roots.reshape(bx * e), cfg.exit_budget,
                           drafter.vocab_ids(), mesh)
        trees = jax.tree.map(lambda x: x.reshape((bx, e) + x.shape[1:]), flat)
        tlogits = jax.lax.stop_gradient(score_trees(target, seq, ae, trees))

        def weights(tree, logits):
            logits = truncate_logits(logits, cfg.exit_temperature, top_k=cfg.exit_top_k, top_p=cfg.exit_top_p,
                                     min_p=cfg.exit_min_p)  # as it is when every cut is off
            edge = edge_stats(tree, logits, cfg.exit_temperature).edge_prob
            law = law_from_edges(tree, edge)
            return exit_weights(law, tree, edge, cfg.exit_weight), law.coverage

        omega, coverage = jax.vmap(jax.vmap(weights))(trees, tlogits)
        # Drafted nodes are in the draft vocabulary by construction; the gather reads their index.
        node_index = drafter.draft_index(trees.tokens)[0]
        ex = exit_loss_terms(lse_e, ze, dataclasses.replace(trees, tokens=node_index), omega, ve)
        loss = loss + cfg.exit_lambda * ratio(ex)
        metrics["loss_exit"] = ratio(ex)
        metrics["coverage"] = jnp.sum(jnp.where(ve, coverage, 0.0)) / jnp.maximum(jnp.sum(ve), 1)
    metrics["loss"] = loss
    return loss, metrics


# ------------------------------------------------------------------------------------ the step


def _train_step(state: TrainState, tstate, dconst, batch: Batch, *, dgd, ogd, tgd, cfg: TrainConfig, mesh=None):
    drafter = nnx.merge(dgd, state.params, dconst)
    optimizer = nnx.merge(ogd, state.opt)
    target = nnx.merge(tgd, tstate)
    key = jax.random.fold_in(jax.random.wrap_key_data(state.key), state.step)
    grad_fn = nnx.value_and_grad(lambda d: loss_terms(d, target, batch, key, cfg, mesh), has_aux=True)
    (_, metrics), grads = grad_fn(drafter)
    metrics["grad_norm"] = optax.global_norm(grads)
    optimizer.update(drafter, grads)
    new = TrainState(params=nnx.state(drafter, nnx.Param), opt=nnx.state(optimizer), step=state.step + 1,
                     key=state.key)
    return new, metrics


@functools.lru_cache(maxsize=16)
def _jitted_step(dgd, ogd, tgd, cfg: TrainConfig, mesh, shardings: tuple):
    """The jitted, sharded step for one (model structure, config, mesh, shardings): cached, so
    Trainers of the same run (a resume in the same process, tests, sweeps) share one compilation.
    `shardings` holds the `frozen` (state, target, drafter constants) shardings."""
    state_s, tstate_s, dconst_s = (thawed(key) for key in shardings)
    batch_shard = Batch(tokens=batch_sharding(mesh, 2), loss_mask=batch_sharding(mesh, 2),
                        features=batch_sharding(mesh, 3), length=batch_sharding(mesh, 1))
    step = traced_on(functools.partial(_train_step, dgd=dgd, ogd=ogd, tgd=tgd, cfg=cfg, mesh=mesh), mesh)
    return jax.jit(step, in_shardings=(state_s, tstate_s, dconst_s, batch_shard),
                   out_shardings=(state_s, replicated(mesh)), donate_argnums=(0,))


class Trainer:
    """Holds the graph definitions, the frozen target and the jitted, mesh-sharded step.

    The batch is split over the mesh's `data` axis; the target, the parameters and the optimizer
    state take the shardings of `tevjax.sharding`'s tables (split over `model` where it is > 1,
    replicated otherwise); the loss's sums run over the global batch, so XLA all-reduces the
    gradients and the step equals the single-device step on the same global batch (to float32
    rounding of the split sums). The state is donated: each step's output replaces its input and
    nothing else holds it.
    """

    def __init__(self, drafter: DFlashDrafter, target: Transformer, cfg: TrainConfig, mesh):
        drafter.cfg.check_target(target.cfg)
        if cfg.distill > 0:
            final_tap(drafter, target)
        check_batch(mesh, cfg.batch_size, f"the training batch (batch_size {cfg.batch_size})")
        if cfg.exit_on and cfg.exit_sequences is not None:
            check_batch(mesh, cfg.exit_sequences, f"the exit loss's sequences (exit_sequences {cfg.exit_sequences})")
        self.cfg, self.mesh = cfg, mesh
        self.tx = make_optimizer(cfg)
        # Parameters are trained; the rest of the drafter (a draft vocabulary) is a constant.
        self.dgd, params, dconst = nnx.split(drafter, nnx.Param, ...)
        optimizer = nnx.Optimizer(drafter, self.tx, wrt=nnx.Param)
        self.ogd, opt = nnx.split(optimizer)
        self.tgd, tstate = nnx.split(target)
        rep = replicated(mesh)
        # One table for everything: the optimizer's moments take their parameter's sharding.
        self.state_shardings = TrainState(params=param_shardings(drafter, mesh, params),
                                          opt=param_shardings(drafter, mesh, opt, optimizer=True), step=rep, key=rep)
        tshard, dshard = param_shardings(target, mesh, tstate), param_shardings(drafter, mesh, dconst)
        self.tstate = jax.device_put(tstate, tshard)
        self.dconst = jax.device_put(dconst, dshard)
        self._init = (params, opt)
        self._step = _jitted_step(self.dgd, self.ogd, self.tgd, cfg, mesh,
                                  tuple(frozen(t) for t in (self.state_shardings, tshard, dshard)))

    def init_state(self) -> TrainState:
        params, opt = self._init
        key = jax.random.key_data(seed_key(self.cfg.seed))  # jax.random.key(seed) below 2**32, one-to-one above
        state = TrainState(params=params, opt=opt, step=jnp.zeros((), jnp.int32), key=key)
        # Copies, never the drafter's own buffers (which device_put passes through where they are
        # already placed so, as on one device): the first step donates the state, and would delete
        # the caller's drafter's parameters and this Trainer's initial state with it.
        return jax.device_put(state, self.state_shardings, may_alias=False)

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the state: the restore target."""
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            jax.eval_shape(self.init_state), self.state_shardings)

    def step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
        return self._step(state, self.tstate, self.dconst, batch)

    def drafter(self, state: TrainState) -> DFlashDrafter:
        # host_array: on a multi-host mesh whose `model` axis spans hosts, no host holds a whole parameter.
        return nnx.merge(self.dgd, *(jax.tree.map(host_array, t) for t in (state.params, self.dconst)))
