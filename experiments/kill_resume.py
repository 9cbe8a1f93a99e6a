"""SIGKILL and resume: does a killed `tevjax train` or `tevjax data`, rerun until it finishes, end
bit for bit where an uninterrupted run does?

It builds a tiny random llama target (the tests' helpers), makes a reference data directory and a
reference training run through the CLI, uninterrupted, then runs trials of the same commands as
subprocesses that it SIGKILLs 1 or 2 times each, and reruns (with `--resume` once the directory
holds a run or a plan: run.json, manifest.json; without it when it is empty or holds only what a
killed start leaves) until a run finishes. Kills come after a delay drawn over the reference's whole
wall time (start-up included) or, for half of the training kills, just after a checkpoint of step
>= k appears (+ 0-0.3 s), so that some land inside saves. Each trial's schedule is drawn from
(--seed, command, trial); where a timed kill lands still depends on the machine's speed.

A training trial passes when every rerun exits 0, the final checkpoint's state leaves are
bit-identical (dtype and values) to the reference's, the checkpoints kept are the reference's and
log.jsonl parses. A data trial passes when every rerun exits 0, the shard files are byte-identical,
manifest.json equals the reference's apart from timings, the prompt files are equal and the
directory holds no other files. The script exits 1 if any trial fails.

    python experiments/kill_resume.py                     # experiments/results/kill_resume.md (+ .json)
    python experiments/kill_resume.py --train-trials 2 --data-trials 1 --out /tmp/kill_resume.md
    python experiments/kill_resume.py --draft-vocab 64 --train-trials 8 --data-trials 0 \
        --out experiments/results/kill_resume_draft_vocab.md    # a reduced draft vocabulary
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import save  # noqa: E402  experiments/report.py

REPO = Path(__file__).resolve().parents[1]
STEPS = 30
# A few seconds of training on 2 CPU cores; a checkpoint after every step (--checkpoint-every 0.01 s).
TRAIN_ARGS = ["--steps", str(STEPS), "--batch", "4", "--anchors", "4", "--seq-len", "112", "--block-size", "4",
              "--exit-budget", "4", "--exit-anchors", "2", "--mask-token", "5", "--checkpoint-every", "0.01",
              "--eval-every", "2", "--no-progress"]
DATA_ARGS = ["--num-prompts", "16", "--heldout", "4", "--heldout-records", "4", "--batch-size", "2",
             "--max-new-tokens", "12", "--max-prompt-tokens", "96", "--no-progress"]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def make_target(path: Path) -> None:
    """A 4-layer random llama with the tests' tiny tokenizer, saved as an HF directory."""
    sys.path.insert(0, str(REPO / "tests"))
    from test_gguf import tiny_vocab
    from test_tokenizer import tiny_meta, write_tok_dir

    from tevjax.convert.hf import save_hf_target
    from tevjax.testing import random_model, tiny_config

    cfg = tiny_config("llama", num_layers=4, max_position_embeddings=128, vocab_size=len(tiny_vocab()))
    path.mkdir(parents=True)
    save_hf_target(random_model(cfg, seed=5), path)
    write_tok_dir(tiny_meta(), path)


def step_of(name: str) -> int | None:
    """A checkpoint entry's step: '12', or orbax's temporary '12.orbax-checkpoint-tmp-...' (a save in progress)."""
    head = name.split(".")[0]
    return int(head) if head.isdigit() else None


def attempt(cmd: list[str], out: Path, kill: tuple | None, log: Path) -> dict:
    """Runs cmd to its end, or SIGKILLs it at `kill`: ("after", seconds) or ("ckpt", k, extra seconds)."""
    seen = set(os.listdir(out / "checkpoints")) if (out / "checkpoints").is_dir() else set()
    with open(log, "ab") as f:
        f.write(f"\n=== {' '.join(cmd[3:])} kill={kill}\n".encode())
        f.flush()
        t0 = time.monotonic()
        # Its own process group, so that the kill reaches anything it started.
        p = subprocess.Popen(cmd, stdout=f, stderr=f, env=ENV, cwd=out.parent, start_new_session=True)
        killed = None
        while p.poll() is None and killed is None:
            now = time.monotonic() - t0
            if now > 900:  # a hung run is a failure, not a wait forever
                killed = "hung"
            elif kill and kill[0] == "after" and now >= kill[1]:
                killed = f"{now:.1f} s"
            elif kill and kill[0] == "ckpt" and (out / "checkpoints").is_dir():
                new = [s for s in map(step_of, set(os.listdir(out / "checkpoints")) - seen) if s is not None]
                if any(s >= kill[1] for s in new):
                    time.sleep(kill[2])
                    if p.poll() is not None:
                        break  # it finished meanwhile: no kill
                    killed = f"ckpt {max(new)} + {kill[2]:.2f} s"
            time.sleep(0.005)
        if killed:
            os.killpg(p.pid, signal.SIGKILL)
        rc = p.wait()
    return {"killed": killed, "rc": rc, "seconds": round(time.monotonic() - t0, 2)}


def run_trial(kind: str, base: list[str], out: Path, kills: list[tuple], log: Path) -> dict:
    """Kills per `kills`, then reruns without a kill until a run finishes (or one fails)."""
    marker = "run.json" if kind == "train" else "manifest.json"
    events = []
    for kill in kills + [None]:
        resume = (out / marker).exists()
        events.append({**attempt(base + (["--resume"] if resume else []), out, kill, log), "resume": resume})
        if not events[-1]["killed"]:
            break  # finished (a kill's trigger may come after the run's end), or failed
    return {"kills": [e["killed"] for e in events if e["killed"]], "reruns": len(events) - 1,
            "resumed": sum(e["resume"] for e in events), "rc": events[-1]["rc"], "events": events}


def restore_state(run: Path, step: int) -> list:
    import jax
    import orbax.checkpoint as ocp

    where = (run / "checkpoints" / str(step) / "state").absolute()
    tree = ocp.PyTreeCheckpointHandler().metadata(where).tree
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    state = ocp.PyTreeCheckpointer().restore(where, args=ocp.args.PyTreeRestore(restore_args=args))
    return [(jax.tree_util.keystr(k), np.asarray(v)) for k, v in jax.tree_util.tree_flatten_with_path(state)[0]]


def check_train(run: Path, ref: Path, ref_state: list) -> list[str]:
    bad = []
    if sorted(os.listdir(run / "checkpoints")) != sorted(os.listdir(ref / "checkpoints")):
        bad.append(f"checkpoints {sorted(os.listdir(run / 'checkpoints'))}")
    vocab = "draft_vocab.npy"  # a reduced draft vocabulary's ids
    if (ref / vocab).exists() and not (
            (run / vocab).exists() and (run / vocab).read_bytes() == (ref / vocab).read_bytes()):
        bad.append(f"{vocab} differs")
    state = restore_state(run, STEPS)
    differ = [k for (k, x), (k2, y) in zip(state, ref_state) if k != k2 or x.dtype != y.dtype
              or not np.array_equal(x, y)]
    if differ or len(state) != len(ref_state):
        bad.append(f"{len(differ)} of {len(ref_state)} state leaves differ, e.g. {differ[:2]}")
    try:
        [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines() if line.strip()]
    except ValueError as e:
        bad.append(f"log.jsonl: {e}")
    return bad


def check_data(out: Path, ref: Path) -> list[str]:
    def files(d):
        return {str(f.relative_to(d)) for f in d.rglob("*") if f.is_file()}

    def manifest(d):
        return {k: v for k, v in json.loads((d / "manifest.json").read_text()).items() if k != "timings"}

    bad = [f"{name} differs" for name in ("prompts.jsonl", "heldout.jsonl")
           if (out / name).read_bytes() != (ref / name).read_bytes()]
    have, want = files(out), files(ref)
    if have != want:
        bad.append(f"files: extra {sorted(have - want)[:3]}, missing {sorted(want - have)[:3]}")
    shards = sorted(f for f in have & want if f.startswith("shards/"))
    bad += [f"{f} differs" for f in shards if (out / f).read_bytes() != (ref / f).read_bytes()][:3]
    if manifest(out) != manifest(ref):
        bad.append("manifest.json differs beyond timings")
    return bad


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train-trials", type=int, default=12)
    ap.add_argument("--data-trials", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, default=None,
                    help="a new or empty directory for the target and runs (default: a temporary one, removed)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "kill_resume.md")
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="train drafters that score only this many token ids (`tevjax train --draft-vocab`; "
                         "the run then also keeps draft_vocab.npy, chosen from the data before its first step)")
    args = ap.parse_args(argv)
    if args.draft_vocab < 0:
        ap.error("--draft-vocab must be >= 0 (0: the whole vocabulary)")
    if min(args.train_trials, args.data_trials) < 0 or max(args.train_trials, args.data_trials) < 1:
        ap.error("--train-trials and --data-trials must be >= 0, and one of them >= 1")
    if args.work is not None and args.work.exists() and (not args.work.is_dir() or any(args.work.iterdir())):
        ap.error(f"--work {str(args.work)!r} must be a new or empty directory")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    t_start = time.time()
    work = args.work or Path(tempfile.mkdtemp(prefix="kill_resume-"))
    work.mkdir(parents=True, exist_ok=True)
    make_target(work / "target")
    cli = [sys.executable, "-m", "tevjax"]
    data = [*cli, "data", "--target", str(work / "target"), *DATA_ARGS, "--out"]
    train_args = TRAIN_ARGS + (["--draft-vocab", str(args.draft_vocab)] if args.draft_vocab else [])
    train = [*cli, "train", "--target", str(work / "target"), "--data", str(work / "dref"), *train_args, "--out"]
    refs = {}
    for kind, base in (("data", data), ("train", train)):  # training reads the reference data
        ref = work / f"{kind[0]}ref"
        r = attempt(base + [str(ref)], ref, None, work / f"{kind}-ref.log")
        if r["rc"] != 0:
            sys.exit(f"the reference {kind} run failed (rc {r['rc']}): see {work / f'{kind}-ref.log'}")
        refs[kind] = r["seconds"]
        print(f"reference {kind} run: {r['seconds']} s", flush=True)
    ref_state = restore_state(work / "tref", STEPS) if args.train_trials else None
    trials = []
    for kind, n in (("train", args.train_trials), ("data", args.data_trials)):
        for t in range(n):
            rng = np.random.default_rng([args.seed, ("train", "data").index(kind), t])
            kills = [("ckpt", int(rng.integers(1, STEPS + 1)), round(float(rng.uniform(0, 0.3)), 2))
                     if kind == "train" and rng.random() < 0.5
                     else ("after", round(float(rng.uniform(0.5, refs[kind])), 2))
                     for _ in range(int(rng.integers(1, 3)))]
            out = work / f"{kind}-{t}"
            base = (train if kind == "train" else data) + [str(out)]
            rec = {"kind": kind, "trial": t, "schedule": kills,
                   **run_trial(kind, base, out, kills, work / f"{out.name}.log")}
            if rec["rc"] != 0:
                lines = (work / f"{out.name}.log").read_text().strip().splitlines()
                rec["problems"] = [f"rerun exit {rec['rc']}: {lines[-1] if lines else ''}"]
            else:
                rec["problems"] = (check_train(out, work / "tref", ref_state) if kind == "train"
                                   else check_data(out, work / "dref"))
            print(json.dumps(rec), flush=True)
            trials.append(rec)
            if not rec["problems"]:
                shutil.rmtree(out)  # failures stay for a look
    ok = sum(not r["problems"] for r in trials)

    def passed(kind):
        return sum(r["kind"] == kind and not r["problems"] for r in trials)
    from real_trees import machine_facts, versions

    commit = versions().get("git", "unknown")

    lines = ["# SIGKILL and resume: killed runs, rerun to the end, against uninterrupted ones", "",
             f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; wall time "
             f"{(time.time() - t_start) / 60:.1f} min; tevjax commit {commit}.",
             f"- Command: `python experiments/kill_resume.py --train-trials {args.train_trials} "
             f"--data-trials {args.data_trials} --seed {args.seed}"
             f"{f' --draft-vocab {args.draft_vocab}' if args.draft_vocab else ''}`",
             f"- Machine: {machine_facts()}.",
             f"- A 4-layer random llama target. `tevjax train {' '.join(train_args)}` (reference "
             f"{refs['train']:.0f} s) and `tevjax data {' '.join(DATA_ARGS)}` (reference {refs['data']:.0f} s). "
             "Kills: seconds after the start, or `ckpt s + d`: d seconds after checkpoint s appeared (the first "
             "new one at or past a drawn step); a trial's later kills hit its reruns. Reruns: runs after the "
             "first (with --resume: those that found run.json / manifest.json). Identical: train: final state "
             "leaves bit-identical, same checkpoints kept, log.jsonl parses"
             f"{', draft_vocab.npy byte-identical' if args.draft_vocab else ''}; data: shards byte-identical, "
             "manifest equal but for timings, prompt files equal, no other files.", "",
             f"**{ok} of {len(trials)} identical** ({passed('train')} of {args.train_trials} train, "
             f"{passed('data')} of {args.data_trials} data).", "",
             "| command | trial | kills | reruns (resumed) | outcome |", "|---|---:|---|---:|---|"]
    for r in trials:
        lines.append(f"| {r['kind']} | {r['trial']} | {'; '.join(r['kills']) or '- (finished first)'} "
                     f"| {r['reruns']} ({r['resumed']}) | {'; '.join(r['problems']) or 'identical'} |")
    save(lines, args.out, {"argv": sys.argv, "commit": commit, "reference_seconds": refs, "trials": trials})
    if args.work is None and ok == len(trials):
        shutil.rmtree(work)
    elif ok < len(trials):
        print(f"failed trials' directories and logs are in {work}")
    sys.exit(0 if ok == len(trials) else 1)


if __name__ == "__main__":
    main()
