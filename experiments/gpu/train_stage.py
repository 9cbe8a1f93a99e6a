"""Stage d: ExitTrain throughput (anchor blocks per second) on Qwen3-4B/8B-shaped bf16 targets.

A few steps of `tevjax.train.step.Trainer` with exit_lambda > 0 (DFlash token loss + the ExitTrain
exit loss: DDTree trees from the drafter's detached marginals, scored by the frozen target in one
pass per sequence), on the same random-weight bf16 targets and 5-layer DFlash drafter as stage c.
The batch is random too (tokens, a loss mask covering the last three quarters of every sequence as
a response would, and tapped-feature vectors): a step's cost depends on the shapes only.

The first step (compile + run) is reported apart; then `--steps` steps are timed one by one.
Anchor blocks per second = the step's valid anchors (metrics["blocks"]) / step seconds. If time is
left, the same step without the exit loss (token-only, exit_lambda = 0) shows what ExitTrain adds.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from common import Deadline, device_init, drafter_config, stage_parser, stamp, targets, write
from tevjax.models.dflash import DFlashDrafter
from tevjax.models.transformer import Transformer
from tevjax.sharding import make_mesh
from tevjax.train.dataset import Batch
from tevjax.train.step import TrainConfig, Trainer


def random_batch(batch: int, seq_len: int, vocab: int, features: int, seed: int) -> Batch:
    """A full batch of random sequences; the last three quarters of each are supervised."""
    k_tok, k_feat = jax.random.split(jax.random.key(seed))
    positions = jnp.arange(seq_len)
    return Batch(
        tokens=jax.random.randint(k_tok, (batch, seq_len), 0, vocab, jnp.int32),
        loss_mask=jnp.broadcast_to(positions >= seq_len // 4, (batch, seq_len)),
        features=jax.random.normal(k_feat, (batch, seq_len, features), jnp.bfloat16),
        length=jnp.full((batch,), seq_len, jnp.int32),
    )


def peak_gib() -> str:
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - memory_stats is optional per backend
        stats = {}
    return f"{stats['peak_bytes_in_use'] / 2**30:.1f}" if "peak_bytes_in_use" in stats else "-"


def run(target, drafter, cfg: TrainConfig, steps: int) -> dict:
    trainer = Trainer(drafter, target, cfg, make_mesh())
    batch = random_batch(cfg.batch_size, cfg.seq_len, target.cfg.vocab_size, drafter.cfg.feature_dim, cfg.seed)
    state = trainer.init_state()
    t0 = time.perf_counter()
    state, metrics = trainer.step(state, batch)
    jax.block_until_ready(metrics)
    first = time.perf_counter() - t0
    times, blocks = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, metrics = trainer.step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
        blocks.append(float(metrics["blocks"]))
    loss = {k: float(metrics[k]) for k in ("loss", "loss_tok", "loss_exit") if k in metrics}
    if not all(np.isfinite(v) for v in loss.values()):
        raise FloatingPointError(f"non-finite training loss {loss}")
    return {"first_s": first, "step_s": np.asarray(times), "blocks": np.asarray(blocks), "loss": loss,
            "peak_gib": peak_gib()}


def report(header, rows, notes) -> list[str]:
    lines = header + [
        "| target | objective | batch x seq | anchors (exit trees) | exit budget | step s, median (min-max) | "
        "anchor blocks / s | compile + first step s | peak device GiB | final loss |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for (name, objective, cfg), r in rows:
        t = r["step_s"]
        bps = np.median(r["blocks"] / t)
        lines.append(
            f"| {name} | {objective} | {cfg.batch_size} x {cfg.seq_len} | {cfg.anchors} ({cfg.exit_anchors if cfg.exit_on else 0}) | "
            f"{cfg.exit_budget if cfg.exit_on else '-'} | {np.median(t):.3f} ({t.min():.3f}-{t.max():.3f}) | {bps:,.0f} | "
            f"{r['first_s']:.1f} | {r['peak_gib']} | " + ", ".join(f"{k} {v:.4g}" for k, v in r["loss"].items()) + " |")
    return lines + [""] + notes


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = stage_parser(__doc__, 100.0)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per configuration")
    args = ap.parse_args(argv)
    deadline = Deadline(args.budget_s)
    if args.tiny:
        models, steps = targets(True)[:1], args.steps or 2
        shape = dict(batch_size=2, seq_len=64, anchors=4, exit_anchors=2, exit_budget=4)
    else:
        models, steps = targets(False), args.steps or 3
        shape = dict(batch_size=4, seq_len=512, anchors=32, exit_anchors=8, exit_budget=64)
    exit_cfg = TrainConfig(steps=1000, exit_lambda=0.1, exit_weight="w", **shape)
    header = stamp("GPU stage d: ExitTrain training throughput", argv, [
        f"- Trainer steps (optax AdamW, clip 1.0; bf16 drafter and target, random weights and batch), "
        f"exit loss lambda {exit_cfg.exit_lambda}, weights {exit_cfg.exit_weight!r}; {steps} timed steps after "
        "the first. Anchor blocks per second: valid anchors of the global batch per step second.", ""])

    plan = [(name, cfg, "ExitTrain", exit_cfg) for name, cfg in models]
    if not args.tiny:  # the comparison costs one more compile; the dry run skips it
        plan += [(name, cfg, "token only", TrainConfig(steps=1000, exit_lambda=0.0, **shape)) for name, cfg in models[:1]]
    rows, notes, slowest = [], [], 0.0
    for name, cfg, objective, tcfg in plan:
        if rows and not deadline.fits(1.5 * slowest + 5):
            notes.append(f"Not run (time budget): {name}, {objective}.")
            continue
        t0 = time.perf_counter()
        target = device_init(Transformer, cfg, seed=0)
        drafter = device_init(DFlashDrafter, drafter_config(cfg, args.tiny), seed=1)
        rows.append(((name, objective, tcfg), run(target, drafter, tcfg, steps)))
        del target, drafter
        slowest = max(slowest, time.perf_counter() - t0)
        print(f"{name} {objective}: {np.median(rows[-1][1]['step_s']):.3f} s/step", flush=True)
        write(args.out, report(header, rows, notes))
    lines = report(header, rows, notes)
    write(args.out, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
