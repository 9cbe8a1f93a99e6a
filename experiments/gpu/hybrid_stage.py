"""Stage f: a tree pass on a hybrid target (Gated DeltaNet linear layers) against an all-attention
target of the same width, on the accelerator.

Two random bf16 models of Qwen3-Next-80B-A3B's width and heads (D 2048; attention 16 query and 2
key/value heads of 256; linear layers 16 key and 32 value heads of 128), 8 layers each, with a dense
MLP of Qwen3-Next's `intermediate_size` (5120) in place of its 512 experts: `qwen3_5_text` (6 Gated
DeltaNet layers, 2 gated attention layers) and `qwen3` (8 attention layers). After the engine's
prefill of a 1024-token prompt, per round in a fresh random order: the tree pass plus the commit of a
3-node path at N = 1 (the step), 17, 33 and 65 (`experiments/hybrid_latency.py`, whose CPU figures
this repeats where a tree pass is cheap next to the weights' reads). The question it answers: what a
tree costs in units of a step when most layers keep a recurrent state instead of a KV cache.
"""

from __future__ import annotations

import sys

from common import Deadline, device_init, finish, stage_parser, stamp, write
from hybrid_latency import TABLE, measure, prepare, rows


def configs(tiny: bool) -> dict:
    from tevjax.testing import tiny_config

    if tiny:
        width = dict(vocab_size=4096, max_position_embeddings=4096, dtype="bfloat16", param_dtype="bfloat16")
        hybrid = dict(linear_layers=(0, 1, 2), linear_key_heads=2, linear_value_heads=4, linear_key_dim=8,
                      linear_value_dim=6, linear_conv=4, rotary_dim=4)
        return {"attention": tiny_config("qwen3", num_layers=4, **width),
                "hybrid": tiny_config("qwen3_5_text", num_layers=4, **width, **hybrid)}
    width = dict(vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_layers=8, num_heads=16,
                 num_kv_heads=2, head_dim=256, rope_theta=10_000_000.0, tie_word_embeddings=False,
                 max_position_embeddings=8192, dtype="bfloat16", param_dtype="bfloat16")
    hybrid = dict(linear_layers=(0, 1, 2, 4, 5, 6), linear_key_heads=16, linear_value_heads=32, linear_key_dim=128,
                  linear_value_dim=128, linear_conv=4, rotary_dim=64)
    return {"attention": tiny_config("qwen3", **width), "hybrid": tiny_config("qwen3_5_text", **width, **hybrid)}


def main(argv=None) -> int:
    import numpy as np

    from tevjax.models.transformer import Transformer

    argv = sys.argv[1:] if argv is None else argv
    ap = stage_parser(__doc__, 40.0)
    args = ap.parse_args(argv)
    deadline = Deadline(args.budget_s)
    prefix, nodes, iters = (64, [1, 9], 5) if args.tiny else (1024, [1, 17, 33, 65], 20)
    cfgs = configs(args.tiny)
    header = stamp("GPU stage f: tree passes on a hybrid (Gated DeltaNet) target vs an all-attention one", argv, [
        f"- Two random bf16 models of {cfgs['hybrid'].num_layers} layers, D {cfgs['hybrid'].hidden_size}: "
        f"`qwen3_5_text` ({len(cfgs['hybrid'].linear_layers)} Gated DeltaNet layers) and `qwen3`; batch 1, a "
        f"{prefix}-token prompt prefilled by the engine; tree pass + commit of a 3-node path, median ms over "
        f"{iters} rounds in a fresh random order each, and ratios of medians [10-90% of per-round ratios]."])
    models = {name: device_init(Transformer, cfg, seed=0) for name, cfg in cfgs.items()}
    prompt = np.random.default_rng(0).integers(3, cfgs["hybrid"].vocab_size, prefix).tolist()
    runs = prepare(models, prompt, nodes, seed=0)
    skipped = []
    if not deadline.fits(5):
        skipped.append("the timed rounds")
        return finish(args.out, header, skipped)
    times = measure(runs, nodes, iters, 1, seed=0)
    lines = header + ["", *TABLE, *rows(times, nodes)]
    write(args.out, lines)
    return finish(args.out, lines, skipped)


if __name__ == "__main__":
    sys.exit(main())
