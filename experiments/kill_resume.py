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
bit-identical (dtype and values) to the reference's, the run directory holds the reference's files
and checkpoints, and log.jsonl parses. A data trial passes when every rerun exits 0, the shard files are byte-identical,
manifest.json equals the reference's apart from timings, the prompt files are equal and the
directory holds no other files. The script exits 1 if any trial fails.

    python experiments/kill_resume.py                     # experiments/results/kill_resume.md (+ .json)
    python experiments/kill_resume.py --train-trials 2 --data-trials 1 --out /tmp/kill_resume.md
    python experiments/kill_resume.py --draft-vocab 64 --train-trials 8 --data-trials 0 \
        --out experiments/results/kill_resume_draft_vocab.md    # a reduced draft vocabulary
    python experiments/kill_resume.py --init --train-trials 8 --data-trials 0 \
        --out experiments/results/kill_resume_init.md           # runs that start from a drafter
    python experiments/kill_resume.py --hosts 2 --train-trials 8 --data-trials 4 \
        --out experiments/results/kill_resume_hosts2.md         # two-process jobs

`--init`: the training runs start from a drafter (`tevjax train --init PARENT --layers 2`, so a
second layer is grown from --seed): PARENT is the export of an uninterrupted 4-step fresh run.

`--hosts 2`: every run is a job of two processes joined by `jax.distributed` on this machine (one
forced CPU device each, gloo collectives, `--heartbeat-timeout 5 --join-timeout 30`), the reference
too. A kill hits one process, drawn per kill; the other must then end by itself (a job with a dead
host aborts), within SURVIVOR_WAIT_S, before both are rerun.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import save  # noqa: E402  experiments/report.py

from tevjax.testing import forced_devices_env  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STEPS = 30
# A few seconds of training on 2 CPU cores; a checkpoint after every step (--checkpoint-every 0.01 s;
# a multi-host job's hosts agree on checkpoints every tevjax.train.run.AGREE_EVERY steps).
TRAIN_ARGS = ["--steps", str(STEPS), "--batch", "4", "--anchors", "4", "--seq-len", "112",
              "--exit-budget", "4", "--exit-anchors", "2", "--checkpoint-every", "0.01", "--eval-every", "2",
              "--no-progress"]
FRESH_ARGS = ["--block-size", "4", "--mask-token", "5"]  # a fresh drafter's; an --init drafter keeps its own
PARENT_STEPS = 4
# A job whose host was killed: jax.distributed aborts the others within a few heartbeat timeouts, or
# at the join timeout when the kill came before the job assembled.
JOB_ARGS = ["--heartbeat-timeout", "5", "--join-timeout", "30"]
SURVIVOR_WAIT_S = 120
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def attempt(base: list[str], hosts: int, out: Path, kill: tuple | None, log: Path) -> dict:
    """Runs base, as one process or as a job of `hosts` processes, to its end, or SIGKILLs one of its
    processes at `kill`: ("after", seconds, victim) or ("ckpt", k, extra seconds, victim). After a
    kill the other processes must end by themselves within SURVIVOR_WAIT_S."""
    seen = set(os.listdir(out / "checkpoints")) if (out / "checkpoints").is_dir() else set()
    if hosts == 1:
        cmds, envs = [base], [ENV]
    else:
        port = free_port()
        cmds = [base + ["--coordinator", f"localhost:{port}", "--num-processes", str(hosts), "--process-id",
                        str(pid), *JOB_ARGS] for pid in range(hosts)]
        envs = [{**forced_devices_env(1), "PYTHONPATH": ENV["PYTHONPATH"]}] * hosts
    logs = [log] if hosts == 1 else [log.with_suffix(f".p{pid}.log") for pid in range(hosts)]
    files = [open(f, "ab") for f in logs]
    try:
        for f in files:
            f.write(f"\n=== {' '.join(base[3:])} kill={kill}\n".encode())
            f.flush()
        t0 = time.monotonic()
        # Each in its own process group, so that a kill reaches anything it started.
        procs = [subprocess.Popen(c, stdout=f, stderr=f, env=e, cwd=out.parent, start_new_session=True)
                 for c, e, f in zip(cmds, envs, files)]
        killed = None
        while any(p.poll() is None for p in procs) and killed is None:
            now = time.monotonic() - t0
            if now > 900:  # a hung run is a failure, not a wait forever
                killed = "hung"
            elif kill and procs[kill[-1]].poll() is not None:
                break  # the victim finished first: no kill
            elif kill and kill[0] == "after" and now >= kill[1]:
                killed = f"{now:.1f} s"
            elif kill and kill[0] == "ckpt" and (out / "checkpoints").is_dir():
                new = [s for s in map(step_of, set(os.listdir(out / "checkpoints")) - seen) if s is not None]
                if any(s >= kill[1] for s in new):
                    time.sleep(kill[2])
                    if procs[kill[-1]].poll() is not None:
                        break  # it finished meanwhile: no kill
                    killed = f"ckpt {max(new)} + {kill[2]:.2f} s"
            time.sleep(0.005)
        survivors = None
        if killed == "hung":
            for p in procs:
                _kill(p)
        elif killed:
            _kill(procs[kill[-1]])
            if hosts > 1:
                killed = f"process {kill[-1]}: {killed}"
                t_kill = time.monotonic()
                others = [p for pid, p in enumerate(procs) if pid != kill[-1]]
                while any(p.poll() is None for p in others) and time.monotonic() - t_kill < SURVIVOR_WAIT_S:
                    time.sleep(0.05)
                survivors = {"rc": [p.poll() for p in others], "seconds": round(time.monotonic() - t_kill, 1)}
                if all(p.poll() is not None for p in others):
                    killed += f" (the other ended {survivors['seconds']} s later, exit {survivors['rc'][0]})"
                else:
                    killed += f"; the other process was still running {SURVIVOR_WAIT_S} s later"
                    survivors["hung"] = True
                    for p in others:
                        _kill(p)
        rcs = [p.wait() for p in procs]
    finally:
        for f in files:
            f.close()
    rec = {"killed": killed, "rc": next((rc for rc in rcs if rc != 0), 0), "rcs": rcs,
           "seconds": round(time.monotonic() - t0, 2)}
    return {**rec, "survivors": survivors} if survivors else rec


def _kill(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended on its own meanwhile
        pass


def run_trial(kind: str, base: list[str], hosts: int, out: Path, kills: list[tuple], log: Path) -> dict:
    """Kills per `kills`, then reruns without a kill until a run finishes (or one fails, or a
    survivor of a kill did not end by itself)."""
    marker = "run.json" if kind == "train" else "manifest.json"
    events = []
    for kill in kills + [None]:
        resume = (out / marker).exists()
        events.append({**attempt(base + (["--resume"] if resume else []), hosts, out, kill, log), "resume": resume})
        if not events[-1]["killed"] or events[-1].get("survivors", {}).get("hung"):
            break  # finished (a kill's trigger may come after the run's end), or failed
    hung = [e["killed"] for e in events if e.get("survivors", {}).get("hung")]
    return {"kills": [e["killed"] for e in events if e["killed"]], "reruns": len(events) - 1,
            "resumed": sum(e["resume"] for e in events), "rc": events[-1]["rc"], "hung": hung, "events": events}


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
    if sorted(os.listdir(run)) != sorted(os.listdir(ref)):  # a killed write's leftovers (temporary files)
        bad.append(f"files: {sorted(set(os.listdir(run)) ^ set(os.listdir(ref)))[:3]} are in one run only")
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
    ap.add_argument("--init", action="store_true",
                    help="training runs start from a drafter, grown to 2 layers (`tevjax train --init PARENT "
                         "--layers 2`); PARENT is the export of an uninterrupted 4-step fresh run")
    ap.add_argument("--hosts", type=int, choices=(1, 2), default=1,
                    help="processes per run: 2 joins them by jax.distributed, and a kill hits one of them")
    args = ap.parse_args(argv)
    if args.draft_vocab < 0:
        ap.error("--draft-vocab must be >= 0 (0: the whole vocabulary)")
    if min(args.train_trials, args.data_trials) < 0 or max(args.train_trials, args.data_trials) < 1:
        ap.error("--train-trials and --data-trials must be >= 0, and one of them >= 1")
    if args.init and not args.train_trials:
        ap.error("--init starts the training runs from a drafter: give --train-trials >= 1")
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
    fresh_args = FRESH_ARGS + (["--draft-vocab", str(args.draft_vocab)] if args.draft_vocab else [])
    train_base = [*cli, "train", "--target", str(work / "target"), "--data", str(work / "dref")]
    train_args = TRAIN_ARGS + fresh_args
    refs = {}

    def reference(kind: str, base: list[str], out: Path) -> None:
        r = attempt(base + [str(out)], args.hosts, out, None, work / f"{out.name}.log")
        if r["rc"] != 0:
            sys.exit(f"the reference {kind} run failed (rc {r['rc']}): see {work / out.name}*.log")
        refs[kind] = r["seconds"]
        print(f"reference {kind} run: {r['seconds']} s", flush=True)

    reference("data", data, work / "dref")  # training reads the reference data
    if args.init:
        parent_args = ["--steps", str(PARENT_STEPS)] + TRAIN_ARGS[2:] + fresh_args
        reference("parent", train_base + parent_args + ["--out"], work / "parent-run")
        export = subprocess.run([*cli, "train", "export", "--dtype", "float32", str(work / "parent-run"),
                                 str(work / "parent")], env=ENV, capture_output=True, text=True)
        if export.returncode != 0:
            sys.exit(f"exporting the parent run failed: {export.stderr.strip()[-2000:]}")
        train_args = TRAIN_ARGS + ["--init", str(work / "parent"), "--layers", "2"]
    train = train_base + train_args + ["--out"]
    if args.train_trials:
        reference("train", train, work / "tref")
    ref_state = restore_state(work / "tref", STEPS) if args.train_trials else None
    trials = []
    for kind, n in (("train", args.train_trials), ("data", args.data_trials)):
        for t in range(n):
            rng = np.random.default_rng([args.seed, ("train", "data").index(kind), t])
            kills = [(("ckpt", int(rng.integers(1, STEPS + 1)), round(float(rng.uniform(0, 0.3)), 2))
                      if kind == "train" and rng.random() < 0.5
                      else ("after", round(float(rng.uniform(0.5, refs[kind])), 2)))
                     + (int(rng.integers(args.hosts)) if args.hosts > 1 else 0,)  # the process killed
                     for _ in range(int(rng.integers(1, 3)))]
            out = work / f"{kind}-{t}"
            base = (train if kind == "train" else data) + [str(out)]
            rec = {"kind": kind, "trial": t, "schedule": kills,
                   **run_trial(kind, base, args.hosts, out, kills, work / f"{out.name}.log")}
            if rec["hung"]:
                rec["problems"] = rec["hung"]
            elif rec["rc"] != 0:
                logs = [work / f"{out.name}.log"] if args.hosts == 1 else sorted(work.glob(f"{out.name}.p*.log"))
                lines = [line for f in logs for line in f.read_text().strip().splitlines()[-1:]]
                rec["problems"] = [f"rerun exit {rec['rc']}: {' | '.join(lines)}"]
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
             f"{f' --draft-vocab {args.draft_vocab}' if args.draft_vocab else ''}"
             f"{' --init' if args.init else ''}{f' --hosts {args.hosts}' if args.hosts > 1 else ''}`",
             f"- Machine: {machine_facts()}.",
             "- A 4-layer random llama target. "
             + (f"PARENT: the float32 export of an uninterrupted `tevjax train --steps {PARENT_STEPS} "
                f"{' '.join(TRAIN_ARGS[2:] + fresh_args)}` run. " if args.init else "")
             + (f"Every run is a job of {args.hosts} processes joined by jax.distributed on this machine, one "
                f"forced CPU device each (`{' '.join(JOB_ARGS)}`); each kill hits the process it names, and the "
                f"other one must end by itself within {SURVIVOR_WAIT_S} s. " if args.hosts > 1 else "")
             + f"`tevjax train {' '.join(train_args).replace(str(work / 'parent'), 'PARENT')}` (reference "
             f"{refs.get('train', 0):.0f} s) and `tevjax data {' '.join(DATA_ARGS)}` (reference {refs['data']:.0f} s). "
             "Kills: seconds after the start, or `ckpt s + d`: d seconds after checkpoint s appeared (the first "
             "new one at or past a drawn step); a trial's later kills hit its reruns. Reruns: runs after the "
             "first (with --resume: those that found run.json / manifest.json). Identical: train: final state "
             "leaves bit-identical, the same files in the run directory and checkpoints kept, log.jsonl parses"
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
