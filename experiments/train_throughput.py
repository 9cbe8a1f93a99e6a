"""Training throughput on the embedded SmolLM2 target: anchor blocks per hour, token vs exit objective,
1 and 2 drafter layers, plus the cost of recomputing the target features instead of reading them.

Each configuration is compiled first (excluded), then the configurations take turns, one step each,
for --rounds rounds on the same batches (round-robin, so the shared machine's load hits every
configuration alike). A block is one valid anchor (its G = 15 draft rows). The feature row times the
target forward that `tevjax data` runs once per sequence and caches (`sequence_hidden`), on one
training batch: what a step would cost extra if features were recomputed during training.

    python experiments/train_throughput.py --data ~/.cache/tevjax/data/smollm2-sharegpt
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tevjax.loading import load_target, mask_token_for
from tevjax.models.dflash import DFlashConfig, DFlashDrafter
from tevjax.sharding import make_mesh
from tevjax.train.dataset import Batch, TrainData
from tevjax.train.rollout import SHARDS, sequence_hidden
from tevjax.train.step import TrainConfig, Trainer
from report import emit  # experiments/report.py (scripts run from this folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=os.path.expanduser("~/.cache/tevjax/data/smollm2-sharegpt"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--anchors", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--exit-budget", type=int, default=8)
    ap.add_argument("--exit-anchors", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    default_out = pathlib.Path(__file__).parent / "results" / "train_throughput.md"
    ap.add_argument("--out", default=str(default_out))
    args = ap.parse_args()

    t_start = time.perf_counter()
    loaded = load_target("smollm2", dtype="float32")
    split = "train" if any((pathlib.Path(args.data) / SHARDS).glob("train-*")) else "heldout"
    data = TrainData(args.data, split)
    taps = data.taps
    mask = mask_token_for(loaded.target_cfg, loaded.tokenizer)
    columns = data.tap_columns(taps)
    batches = []
    for r in range(args.rounds):
        host = data.batch(data.order(0, r, args.batch), columns, args.seq_len)
        batches.append(Batch(**{k: jnp.asarray(v) for k, v in host.items()}))

    configs = {}
    for layers in (1, 2):
        for objective, lam in (("token", 0.0), ("exit", 0.1)):
            dcfg = DFlashConfig.for_target(loaded.target_cfg, num_layers=layers, block_size=16, mask_token_id=mask,
                                           target_layer_ids=taps)
            cfg = TrainConfig(steps=1000, batch_size=args.batch, anchors=args.anchors, seq_len=args.seq_len,
                              exit_lambda=lam, exit_budget=args.exit_budget, exit_anchors=args.exit_anchors)
            tr = Trainer(DFlashDrafter(dcfg, rngs=nnx.Rngs(0)), loaded.target, cfg, make_mesh())
            state = tr.init_state()
            t0 = time.perf_counter()
            state, m = tr.step(state, batches[0])
            jax.block_until_ready(m)
            configs[(layers, objective)] = {"trainer": tr, "state": state, "compile_s": time.perf_counter() - t0,
                                            "times": [], "blocks": []}
            print(f"compiled {layers} layer(s) {objective}: {configs[(layers, objective)]['compile_s']:.1f} s", flush=True)

    feat_times = []
    seqs = [data.record(int(i), columns)[0][: args.seq_len].tolist() for i in data.order(0, 0, args.batch)]
    sequence_hidden(loaded.target, seqs, taps)  # compile
    for r in range(args.rounds):
        for key, c in configs.items():
            t0 = time.perf_counter()
            c["state"], m = c["trainer"].step(c["state"], batches[r])
            jax.block_until_ready(m)
            c["times"].append(time.perf_counter() - t0)
            c["blocks"].append(float(m["blocks"]))
        t0 = time.perf_counter()
        sequence_hidden(loaded.target, seqs, taps)
        feat_times.append(time.perf_counter() - t0)
        print(f"round {r + 1}/{args.rounds}", flush=True)

    rows, raw = [], []
    token1 = np.median(configs[(1, "token")]["times"])
    for (layers, objective), c in configs.items():
        t = np.asarray(c["times"])
        per_hour = np.asarray(c["blocks"]) / t * 3600
        rows.append(f"| {layers} | {objective} | {np.median(t):.2f} (p10 {np.percentile(t, 10):.2f}, p90 "
                    f"{np.percentile(t, 90):.2f}) | {np.median(per_hour) / 1000:.0f}k | "
                    f"{np.median(t) / token1:.2f}x | {c['compile_s']:.0f} |")
        raw.append({"layers": layers, "objective": objective, "step_s": t.tolist(), "blocks": c["blocks"],
                    "compile_s": c["compile_s"]})
    ft = np.asarray(feat_times)
    lines = [
        "# Training throughput (SmolLM2-135M target, CPU float32)",
        "",
        f"Command: `python experiments/train_throughput.py --data {args.data}` "
        f"(batch {args.batch} sequences, {args.anchors} anchors each, sequence length {args.seq_len}, "
        f"block 16; exit objective: {args.exit_anchors} trees per sequence at budget {args.exit_budget}, lambda 0.1). "
        f"{args.rounds} round-robin rounds after compilation, on the {split} split. "
        f"Machine: {platform.platform()}, {os.cpu_count()} cores"
        f" (shared with the background `tevjax data` job while measured). Took {time.perf_counter() - t_start:.0f} s.",
        "",
        "| drafter layers | objective | step seconds, median | anchor blocks / hour | step vs 1-layer token | compile s |",
        "|---:|---|---|---:|---:|---:|",
        *rows,
        "",
        f"Recomputing the features (one target forward over the batch's {args.batch} sequences, as `tevjax data` "
        f"does once): median {np.median(ft):.2f} s per batch = {np.median(ft) / token1:.2f}x a 1-layer token step. "
        "Features are therefore cached on disk (bfloat16) rather than recomputed in every step.",
    ]
    emit(lines, args.out)
    pathlib.Path(args.out).with_suffix(".json").write_text(json.dumps(
        {"args": vars(args), "configs": raw, "feature_forward_s": ft.tolist(), "jax": jax.__version__,
         "platform": platform.platform()}, indent=1))


if __name__ == "__main__":
    main()
