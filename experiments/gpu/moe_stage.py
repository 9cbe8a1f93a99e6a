"""Stage e: the two dispatches of a routed mixture of experts on the accelerator.

`tevjax.models.SparseMoE` runs "dense" (every expert on every token, E / k times the FLOPs, plain
batched matmuls) on CPU, where it measured faster (`experiments/results/moe_dispatch.md`), and
"ragged" (tokens grouped by expert, `jax.lax.ragged_dot`) everywhere else. This stage measures that
choice where it matters: one layer's MLP of Qwen3-30B-A3B (128 experts of width 768, 8 per token,
model width 2048), of Mixtral-8x7B (8 of width 14336, 2 per token, width 4096) and of gpt-oss-20b
(32 of width 2880, 4 per token, width 2880; last, so the stage's budget may skip it), bf16, for a
decoding round's tree (16 tokens), a batch of trees (64, 512) and a prefill chunk (4096), both
dispatches interleaved (`moe_dispatch.measure`, which first checks that their outputs agree).
"""

from __future__ import annotations

import sys

from common import Deadline, finish, stage_parser, stamp, write
from moe_dispatch import TABLE_HEAD, measure, table_row

# (name, experts, per token, model width, expert width, token counts)
SHAPES = [("Qwen3-30B-A3B", 128, 8, 2048, 768, (16, 64, 512, 4096)),
          ("Mixtral-8x7B", 8, 2, 4096, 14336, (16, 512)),
          ("gpt-oss-20b", 32, 4, 2880, 2880, (16, 512))]  # (its biases and clipped gate left out: per-row adds)
TINY_SHAPES = [("tiny", 4, 2, 64, 32, (8, 32))]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = stage_parser(__doc__, 45.0)
    args = ap.parse_args(argv)
    deadline = Deadline(args.budget_s)
    dtype = "float32" if args.tiny else "bfloat16"
    iters, repeats = (3, 2) if args.tiny else (20, 5)
    header = stamp("GPU stage e: mixture-of-experts dispatch, dense vs grouped (ragged_dot)", argv, [
        f"- One layer's routed MLP, {dtype}; per token count the median call of each of {repeats} interleaved "
        f"rounds of {iters} calls, the median over rounds, and the same-round ratio ragged / dense (its range in "
        f"brackets). Below 1: grouping by expert is faster, as `SparseMoE`'s \"auto\" assumes off CPU."])
    rows, skipped = [], []
    for name, experts, k, hidden, width, tokens in TINY_SHAPES if args.tiny else SHAPES:
        if rows and not deadline.fits(15):
            skipped.append(name)
            continue
        label = f"{name} (E {experts}, k {k}, D {hidden}, I {width}): "

        def on_row(r, label=label):
            rows.append(table_row(r, prefix=label))
            write(args.out, header + ["| shape: tokens" + TABLE_HEAD[0][len("| tokens"):], TABLE_HEAD[1], *rows])

        measure(experts, k, hidden, width, dtype, [n for n in tokens], iters, repeats, on_row=on_row)
    return finish(args.out, header + ["| shape: tokens" + TABLE_HEAD[0][len("| tokens"):], TABLE_HEAD[1], *rows],
                  skipped)


if __name__ == "__main__":
    sys.exit(main())
