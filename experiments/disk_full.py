"""A full disk under `tevjax data`, `tevjax train` and `tevjax train export`, on real file systems:
what the user sees, what is kept, and whether the job goes on exactly once there is space.

Each command writes into a small tmpfs (so this needs root, and Linux's `mount`) that holds part of
what it writes. It must stop with exit status 2 and one line on stderr, `tevjax: error: not enough
disk space ...`, and no traceback; the directory must hold only whole shards or checkpoints. The
tmpfs is then grown (`mount -o remount,size=`), the command is rerun (with `--resume` for data and
training), and the result must equal an uninterrupted run's in a normal directory: shards byte for
byte, the final training state bit for bit, the export byte for byte.

The check before each write is tevjax's defence; a write can still fail when something else fills
the disk between the check and the write. The last case defeats the check (its margin set below
zero in the training process) so that orbax's write itself fails, and records what the user then
sees: tevjax's error line, among orbax's and asyncio's own error logs.

    sudo python experiments/disk_full.py      # experiments/results/disk_full.md (+ .json)
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kill_resume import ENV, make_target, restore_state  # noqa: E402
from report import save  # noqa: E402  experiments/report.py

CLI = [sys.executable, "-m", "tevjax"]
DATA_ARGS = ["--num-prompts", "16", "--heldout", "4", "--heldout-records", "4", "--batch-size", "2",
             "--max-new-tokens", "12", "--max-prompt-tokens", "96", "--no-progress"]
STEPS = 6
TRAIN_ARGS = ["--steps", str(STEPS), "--batch", "4", "--anchors", "4", "--seq-len", "112", "--exit-budget", "4",
              "--exit-anchors", "2", "--checkpoint-every", "0.01", "--no-progress", "--block-size", "4",
              "--mask-token", "5"]
# tmpfs sizes (KiB): each holds a part of its command's writes (a tiny run's checkpoint is ~0.6 MiB
# and tevjax asks for 5% + 1 MiB beyond what it writes), then all of them.
SMALL = {"data": 1300, "train": 2500, "export": 1100, "train, check defeated": 1500}
LARGE = 16384
# The training process of the last case: tevjax's check asks for less than the write takes.
DEFEATED = ("import sys, tevjax.storage as s; s.MARGIN_BYTES = 0; s.MARGIN_FRACTION = -0.6; "
            "from tevjax.cli import main; sys.exit(main(sys.argv[1:]))")


def mount(point: Path, kib: int, remount: bool = False) -> None:
    opts = f"{'remount,' if remount else ''}size={kib}k"
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(point)], check=True, capture_output=True)


def run(cmd: list[str]) -> dict:
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=ENV, capture_output=True, text=True)
    return {"rc": p.returncode, "stderr": p.stderr, "seconds": round(time.monotonic() - t0, 1)}


def error_lines(stderr: str) -> list[str]:
    """stderr without the progress lines (JSON) that the commands print as they go."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("{")]


def listing(d: Path) -> list[str]:
    return sorted(os.listdir(d)) if d.is_dir() else []


def state_equal(a: Path, b: Path) -> bool:
    x, y = restore_state(a, STEPS), restore_state(b, STEPS)
    return len(x) == len(y) and all(k == k2 and u.dtype == v.dtype and np.array_equal(u, v)
                                    for (k, u), (k2, v) in zip(x, y))


def files_equal(a: Path, b: Path) -> bool:
    def files(d):
        return {str(f.relative_to(d)): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}
    return files(a) == files(b)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "disk_full.md")
    args = ap.parse_args(argv)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        sys.exit("disk_full.py mounts small tmpfs file systems: run it as root on Linux")
    t_start = time.time()
    work = Path(tempfile.mkdtemp(prefix="disk_full-"))
    make_target(work / "target")
    target = ["--target", str(work / "target")]
    data_ref, train_ref, export_ref = work / "data", work / "run", work / "export"
    for cmd in ([*CLI, "data", *target, *DATA_ARGS, "--out", str(data_ref)],
                [*CLI, "train", *target, "--data", str(data_ref), *TRAIN_ARGS, "--out", str(train_ref)],
                [*CLI, "train", "export", str(train_ref), str(export_ref)]):
        r = run(cmd)
        if r["rc"] != 0:
            sys.exit(f"a reference run failed: {' '.join(cmd[2:4])}: {r['stderr'][-2000:]}")

    cases = []
    for case, size in SMALL.items():
        point = work / f"tmpfs-{len(cases)}"
        point.mkdir()
        mount(point, size)
        try:
            out = point / "out"
            if case == "data":
                cmd = [*CLI, "data", *target, *DATA_ARGS, "--out", str(out)]
            elif case == "export":
                cmd = [*CLI, "train", "export", str(train_ref), str(out)]
            else:
                head = [sys.executable, "-c", DEFEATED] if case.endswith("defeated") else CLI
                cmd = [*head, "train", *target, "--data", str(data_ref), *TRAIN_ARGS, "--out", str(out)]
            first = run(cmd)
            lines = error_lines(first["stderr"])
            kept = listing(out / "shards") if case == "data" else listing(out / "checkpoints")
            rec = {"case": case, "tmpfs_kib": size, "rc": first["rc"], "seconds": first["seconds"],
                   "tevjax_line": next((x for x in lines if x.startswith("tevjax: error:")), None),
                   "other_lines": sum(not x.startswith("tevjax: error:") for x in lines),
                   "tracebacks": first["stderr"].count("Traceback (most recent call last)"),
                   "kept": kept, "export_written": case == "export" and out.exists()}
            mount(point, LARGE, remount=True)
            again = run(cmd + (["--resume"] if case != "export" else []))
            rec["rerun_rc"] = again["rc"]
            if again["rc"] != 0:
                rec["equal"] = False
                rec["rerun_error"] = error_lines(again["stderr"])[-1:]
            elif case == "data":
                rec["equal"] = files_equal(out / "shards", data_ref / "shards")
            elif case == "export":
                rec["equal"] = files_equal(out, export_ref)
            else:
                rec["equal"] = state_equal(out, train_ref) and listing(out / "checkpoints") == listing(
                    train_ref / "checkpoints")
        finally:
            subprocess.run(["umount", str(point)], check=False)
        print(rec, flush=True)
        cases.append(rec)

    def clean(r):
        return r["rc"] == 2 and r["other_lines"] == 0 and r["tracebacks"] == 0 and r["tevjax_line"] is not None
    checked = [r for r in cases if not r["case"].endswith("defeated")]
    ok = all(clean(r) and r["equal"] and not r["export_written"] for r in checked)
    from real_trees import machine_facts, versions

    commit = versions().get("git", "unknown")
    lines = ["# A full disk under tevjax data, train and export (real tmpfs file systems)", "",
             f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; wall time "
             f"{(time.time() - t_start) / 60:.1f} min; tevjax commit {commit}.",
             "- Command: `sudo python experiments/disk_full.py` (as root: it mounts tmpfs file systems).",
             f"- Machine: {machine_facts()}.",
             f"- A 4-layer random llama target. `tevjax data {' '.join(DATA_ARGS)}`, `tevjax train "
             f"{' '.join(TRAIN_ARGS)}` and `tevjax train export RUN DIR`, each writing into a tmpfs of the size "
             f"given, then rerun (with --resume for data and train) after the tmpfs grew to {LARGE // 1024} MiB, "
             "against uninterrupted runs in a normal directory. 'Other lines': lines on stderr besides tevjax's "
             "error and the commands' JSON progress lines.", "",
             f"**{'Every' if ok else 'Not every'} checked case stopped cleanly, kept what was whole and went on "
             "exactly.**", "",
             "| case | tmpfs | exit | tevjax's error | other lines | tracebacks | kept | rerun exit | rerun equal to "
             "an uninterrupted run |", "|---|---:|---:|---|---:|---:|---|---:|:---:|"]
    for r in cases:
        kept = ("nothing" if r["case"] == "export" and not r["export_written"]
                else ", ".join(r["kept"]) or "nothing")
        lines.append(f"| {r['case']} | {r['tmpfs_kib']} KiB | {r['rc']} | {r['tevjax_line'] or '(none)'} "
                     f"| {r['other_lines']} | {r['tracebacks']} | {kept} | {r['rerun_rc']} "
                     f"| {'yes' if r['equal'] else 'NO'} |")
    lines += ["", "The last row is the race the check cannot see (the space taken between the check and the "
              "write): orbax's asynchronous writers log their own errors and asyncio's, tracebacks among them, "
              "around tevjax's line; what is kept and the resume are the same as with the check."]
    save(lines, args.out, {"argv": sys.argv, "commit": commit, "cases": cases})
    shutil.rmtree(work)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
