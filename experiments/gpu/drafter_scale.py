"""Regenerate the drafter's training data and fine-tune it on one GPU, in one time-boxed process.

On this project's 2-core CPU, `tevjax data` makes ~1,300 records an hour and `tevjax train` runs
~175 anchor blocks a second, so each drafter stage had a few thousand new records (model card,
stages 11-13). On a GPU both are cheap, but the usual path does not carry over: `tevjax data`
stores the tapped target features (6 taps x 576 x bf16 = 6.9 KB a token, ~2 GB per thousand
records) and `tevjax train` streams them from disk through host memory. Here the features are
never stored: each training batch's features come from one causal forward of the frozen target
on the device (the same states `sequence_hidden` computes), cast to bfloat16 and zeroed past each
record's last-but-one token exactly as stored shards are.

    python experiments/gpu/drafter_scale.py --prompts P.npz --init DRAFTER --out DIR \\
        [--gen-seconds S] [--train-seconds S] [--probe CONFIG.json] [--tiny]

Phases, under one deadline each (measured from the start of the process):
  1. generate: the target's greedy (or, with `--temperature`, sampled) responses (256 new tokens
     at most, as `tevjax data --turns later`) to the prompts in `--prompts` (an .npz of uint16
     `ids`, `offsets` and the prompts' `index` in the data directory's prompts.jsonl), in
     fixed-shape batches (one compile).
     The records are written to DIR/records-*.npz (token ids; prompt lengths): 3.3 MB for 19k
     records, so they travel to a later GPU call, where `--records` trains on them again along
     with that call's new records (the data grows across sessions without storing features).
  2. train: `tevjax.train.step.Trainer` (the same step as `tevjax train`: DFlash token loss,
     gamma decay, AdamW with warmup + cosine) from `--init`, over the generated records. The
     number of steps is set from a measured step time so that the schedule ends inside the budget.
  3. export: DIR/drafter/{config.json, model.safetensors} (bf16), also written once mid-run.

`--probe CONFIG.json` runs phases 1 and 2 briefly on a random-weight target of that HF config
(real shapes, no weights needed) and writes the measured batch and step times to
`$TMPDIR/tevjax_probe.json`, where a later run on the same machine reads them; it also fills
JAX's persistent compilation cache (`--compile-cache`). `--tiny` shrinks every size for a CPU
dry run on the embedded target.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

T0 = time.monotonic()
PROBE_FILE = Path(tempfile.gettempdir()) / "tevjax_probe.json"


def log(msg, **kw) -> None:
    print(json.dumps({"t": round(time.monotonic() - T0, 1), "msg": msg, **kw}), flush=True)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--init", type=Path, required=True, help="DFlash drafter directory to start from")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--probe", type=Path, default=None, help="HF config.json: random-weight timing run")
    p.add_argument("--records", type=Path, nargs="*", default=[],
                   help="records-*.npz of earlier runs: trained on along with the new records (3.3 MB per 19k)")
    p.add_argument("--drop-index", type=Path, default=None,
                   help="JSON whose drop_index lists plan indices of --records to leave out "
                        "(experiments/heldout_sources.py: records that share a held-out prompt's conversation)")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--gen-seconds", type=float, default=240.0, help="generation ends by this time")
    p.add_argument("--train-seconds", type=float, default=520.0, help="training ends by this time")
    p.add_argument("--gen-batch", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: the target's greedy responses (the recipe); > 0: sampled ones (more text per prompt)")
    p.add_argument("--batch", type=int, default=64, help="training sequences per step")
    p.add_argument("--anchors", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--layers", type=int, default=None,
                   help="grow the --init drafter to this many layers first (new layers start as the identity)")
    p.add_argument("--lr", type=float, default=4e-4)
    p.add_argument("--gamma", type=float, default=2.0)
    p.add_argument("--max-epochs", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile-cache", default=str(Path(tempfile.gettempdir()) / "tevjax_jax_cache"))
    args = p.parse_args(argv)
    if args.tiny:
        args.gen_batch, args.max_new_tokens, args.batch, args.anchors, args.seq_len = 4, 16, 2, 4, 256
    return args


def load(args):
    """(target Transformer, target config, eos ids, drafter) on the default device, float32."""
    from flax import nnx

    from tevjax.convert.dflash_ckpt import load_dflash

    if args.probe is not None:
        from tevjax.models.config import ModelConfig
        from tevjax.models.transformer import Transformer

        tcfg = ModelConfig.from_hf_config(args.probe, dtype="float32", param_dtype="float32")
        target = Transformer(tcfg, rngs=nnx.Rngs(0))
        eos = tuple(tcfg.eos_token_ids)
    else:
        from tevjax.loading import load_target

        loaded = load_target("smollm2", dtype="float32")
        target, tcfg, eos = loaded.target, loaded.target_cfg, loaded.eos_ids
    _, drafter = load_dflash(args.init, tcfg, dtype="float32", param_dtype="float32")
    if args.layers is not None and args.layers != drafter.cfg.num_layers:
        from tevjax.models.dflash import grow_drafter

        drafter = grow_drafter(drafter, args.layers, rngs=nnx.Rngs(args.seed))  # refuses to remove layers
    return target, tcfg, eos, drafter


def read_prompts(path: Path, tiny: bool) -> tuple[list[list[int]], np.ndarray]:
    z = np.load(path)
    ids, off = z["ids"].astype(np.int64), z["offsets"]
    prompts = [ids[off[i]:off[i + 1]].tolist() for i in range(len(off) - 1)]
    index = z["index"]
    if tiny:
        prompts, index = prompts[:8], index[:8]
    return prompts, index


def load_records(path: Path) -> list[tuple[list[int], list[int], str]]:
    """The (prompt, response, stop) records of a `save_records` file."""
    z = np.load(path)
    tokens, off, plen, eos = z["tokens"].astype(np.int64), z["offsets"], z["prompt_len"], z["eos"]
    if len(off) != len(plen) + 1 or len(eos) != len(plen) or (len(off) and off[-1] != len(tokens)):
        raise ValueError(f"{path}: inconsistent records file")
    out = []
    for r in range(len(plen)):
        seq = tokens[off[r]:off[r + 1]].tolist()
        out.append((seq[:plen[r]], seq[plen[r]:], "eos" if eos[r] else "length"))
    return out


def generate(args, target, eos, prompts, deadline: float):
    """Responses in batches of args.gen_batch (the last one padded with its own first prompt);
    stops before a batch that would end past `deadline` (seconds since start)."""
    from tevjax.decode.engine import DecodeConfig, Decoder

    bucket = 256  # every prompt fits one bucket: one compile for every batch
    if max(map(len, prompts)) > bucket + 1:
        raise ValueError(f"a prompt is longer than {bucket + 1} tokens")
    cfg = DecodeConfig(temperature=args.temperature, max_new_tokens=args.max_new_tokens, eos_ids=tuple(eos),
                       prompt_bucket=bucket, capacity=-(-(bucket + 2 + args.max_new_tokens) // 128) * 128)
    # float32 models run true float32 matmuls on GPUs too (`layers.matmul_precision`), so these are
    # the float32 target's greedy responses, as on the CPU.
    dec = Decoder(target, None, cfg)
    records, batch_s = [], []
    for start in range(0, len(prompts), args.gen_batch):
        # The first batch's time includes the compile; later batches are timed alone.
        expect = (batch_s[-1] if len(batch_s) == 1 else max(batch_s[1:])) if batch_s else 0.0
        if time.monotonic() - T0 + expect * 1.1 > deadline:
            log("generation deadline", records=len(records))
            break
        chunk = prompts[start:start + args.gen_batch]
        padded = chunk + [chunk[0]] * (args.gen_batch - len(chunk))
        t = time.monotonic()
        gens = dec.generate(padded, seed=args.seed * 1_000_003 + start)  # the seed matters only when sampling
        batch_s.append(time.monotonic() - t)
        for p, g in zip(chunk, gens[:len(chunk)]):
            records.append((p, list(g.tokens), g.stop))
        log("generated", records=len(records), batch_s=round(batch_s[-1], 2),
            new_tokens=int(sum(len(g.tokens) for g in gens[:len(chunk)])))
    return records, batch_s


def save_records(out: Path, records, index, parts: int = 2) -> None:
    """records-<k>.npz: uint16 tokens (prompt + response) concatenated, offsets, prompt lengths,
    the prompts' indices in prompts.jsonl, stop reasons (1 = eos)."""
    bounds = np.linspace(0, len(records), parts + 1).astype(int)
    for k in range(parts):
        rs = records[bounds[k]:bounds[k + 1]]
        seqs = [np.asarray(p + r, np.uint16) for p, r, _ in rs]
        off = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
        np.savez_compressed(out / f"records-{k}.npz", tokens=np.concatenate(seqs) if seqs else np.zeros(0, np.uint16),
                            offsets=off, prompt_len=np.asarray([len(p) for p, _, _ in rs], np.int32),
                            index=np.asarray(index[bounds[k]:bounds[k + 1]], np.int32),
                            eos=np.asarray([s == "eos" for _, _, s in rs], np.uint8))


def host_batch(records, rows, seq_len: int):
    b = len(rows)
    tokens = np.zeros((b, seq_len), np.int32)
    mask = np.zeros((b, seq_len), bool)
    length = np.zeros((b,), np.int32)
    for j, i in enumerate(rows):
        p, r, _ = records[i]
        seq = (p + r)[:seq_len]
        q = len(seq)
        tokens[j, :q], length[j] = seq, q
        mask[j, len(p):q] = True
    return tokens, mask, length


def export(trainer, state, dcfg, where: Path) -> None:
    from tevjax.convert.dflash_ckpt import save_dflash

    save_dflash(trainer.drafter(state), dcfg, where, dtype="bfloat16")


def train(args, target, drafter, records, deadline: float, probe: dict | None):
    import jax

    from tevjax.sharding import batch_sharding, global_batch_array, make_mesh
    from tevjax.train.dataset import Batch
    from tevjax.train.rollout import batch_features
    from tevjax.train.step import TrainConfig, Trainer

    mesh = make_mesh()
    n = len(records)
    taps = tuple(drafter.cfg.target_layer_ids)
    step_s = (probe or {}).get("step_s")
    compile_s = (probe or {}).get("train_compile_s", 60.0)
    left = deadline - (time.monotonic() - T0) - compile_s - 15.0
    if args.probe is not None:
        steps = 8
    elif step_s:
        steps = int(left / (step_s * 1.08))
    else:
        steps = int(left / 0.5)  # no measurement: a conservative guess; the loop also stops at the deadline
    steps = max(4, min(steps, int(args.max_epochs * n / args.batch)))
    cfg = TrainConfig(steps=steps, batch_size=args.batch, anchors=args.anchors, seq_len=args.seq_len, lr=args.lr,
                      warmup=0.04, weight_decay=0.0, gamma=args.gamma, exit_lambda=0.0,
                      exit_anchors=min(8, args.anchors), seed=args.seed)
    log("train plan", steps=steps, records=n, epochs=round(steps * args.batch / n, 2), step_s=step_s)
    trainer = Trainer(drafter, target, cfg, mesh)
    state = trainer.init_state()
    rng = np.random.default_rng([args.seed, 7])
    perm, pos = rng.permutation(n), 0
    losses, t_compile = [], None
    mid_done = False
    done = 0
    for s in range(steps):
        if pos + args.batch > n:
            perm, pos = rng.permutation(n), 0
        rows = perm[pos:pos + args.batch]
        pos += args.batch
        tok, mask, length = host_batch(records, rows, args.seq_len)
        tok_d, len_d = global_batch_array(mesh, tok), global_batch_array(mesh, length)
        feats = batch_features(trainer.tstate, tok_d, len_d, graphdef=trainer.tgd, taps=taps)  # split once
        feats = jax.device_put(feats, batch_sharding(mesh, 3))  # a no-op where it already is
        batch = Batch(tokens=tok_d, loss_mask=global_batch_array(mesh, mask), features=feats, length=len_d)
        t = time.monotonic()
        state, metrics = trainer.step(state, batch)
        if s == 0 or (s + 1) % 25 == 0 or s + 1 == steps:
            m = {k: float(v) for k, v in jax.device_get(metrics).items()}
            if s == 0:
                t_compile = time.monotonic() - t
                t_steady = time.monotonic()
            per_step = (time.monotonic() - t_steady) / s if s else None  # mean since the compiled first step
            if not np.isfinite(m["loss_tok"]):
                raise FloatingPointError(f"step {s + 1}: non-finite loss {m}")
            losses.append((s + 1, round(m["loss_tok"], 4), round(m["acc1"], 4)))
            log("step", step=s + 1, loss_tok=round(m["loss_tok"], 4), acc1=round(m["acc1"], 4),
                s_per_step=round(per_step, 4) if per_step else None)
        done = s + 1
        now = time.monotonic() - T0
        if not mid_done and s + 1 >= steps * 0.6 and args.probe is None:
            export(trainer, state, drafter.cfg, args.out / "drafter")
            mid_done = True
            log("mid export", step=s + 1)
        if now > deadline:
            log("training deadline: stopped before the schedule ended", step=s + 1, of=steps)
            break
    jax.block_until_ready(state)
    total = time.monotonic() - t_steady if t_compile is not None and done > 1 else None
    step_time = total / (done - 1) if total else None
    return trainer, state, {"steps": steps, "done": done, "compile_s": t_compile, "step_s": step_time,
                            "losses": losses}


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    if args.compile_cache:
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    args.out.mkdir(parents=True, exist_ok=True)
    log("start", jax=jax.__version__, devices=str(jax.devices()))
    target, tcfg, eos, drafter = load(args)
    log("loaded", layers=tcfg.num_layers, drafter_layers=drafter.cfg.num_layers)
    prompts, index = read_prompts(args.prompts, args.tiny)
    probe = None
    if args.probe is None and PROBE_FILE.is_file():
        probe = json.loads(PROBE_FILE.read_text())
        log("probe", **probe)
    if args.probe is not None:
        prompts = prompts[:args.gen_batch]  # one batch: the compile and one batch's time
    records, batch_s = generate(args, target, eos, prompts, args.gen_seconds)
    if args.probe is None:
        save_records(args.out, records, index[:len(records)])
        log("records saved", records=len(records))
    drop = set(json.loads(args.drop_index.read_text())["drop_index"]) if args.drop_index else set()
    carried = [r for path in args.records for r, i in zip(load_records(path), np.load(path)["index"].tolist())
               if i not in drop]
    if carried:
        log("carried records", records=len(carried), files=[str(p) for p in args.records])
    trainer, state, stats = train(args, target, drafter, records + carried, args.train_seconds, probe)
    summary = {"records": len(records), "carried_records": len(carried),
               "gen_batch_s": [round(x, 2) for x in batch_s], **stats,
               "response_tokens": int(sum(len(r) for _, r, _ in records)),
               "eos_fraction": round(float(np.mean([s == "eos" for _, _, s in records])), 4) if records else None,
               "wall_s": round(time.monotonic() - T0, 1), "args": {k: str(v) for k, v in vars(args).items()}}
    if args.probe is not None:
        PROBE_FILE.write_text(json.dumps({"gen_batch_s": batch_s[0] if batch_s else None, "step_s": stats["step_s"],
                                          "train_compile_s": stats["compile_s"]}))
    else:
        export(trainer, state, drafter.cfg, args.out / "drafter")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    log("done", **{k: v for k, v in summary.items() if k not in ("losses", "args", "gen_batch_s")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
