"""How long a multi-host job takes to end when one of its processes fails, and what it says.

Two processes on this machine (one forced CPU device each, gloo collectives), joined by
`jax.distributed`, run a loop with one collective per step (`tevjax.multihost.every_process`, as
training and decoding take their decisions); at step 3 one of them raises. Two cases:

* `running`: the other process is in the next collective when it does;
* `finished`: the other process has finished (it stops at step 3) and waits at exit, in
  jax.distributed's shutdown barrier, for the failing one, which raises a second later.

Two ways of joining:

* `jax`: `jax.distributed.initialize` alone, what tevjax did before `tevjax.multihost.abort_job`;
* `tevjax`: `tevjax.multihost.initialize_distributed`, whose processes tell each other of a failure.

For each case and way, with process 0 (the coordination service's host) or process 1 failing, it
reports the seconds from the exception to the last process's exit, each process's exit status,
and whether the other process's output names the exception. `jax` waits out jax.distributed's
own timeouts in the `running` case, minutes per run, so `--repeats` applies to `tevjax` only
(about 11 minutes in all).

    python experiments/multihost_failure.py [--repeats 5] [--out results/multihost_failure.md]

It writes the table to `--out` and every run (exit statuses, seconds, whether the cause was named)
beside it as .json.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np

from real_trees import machine_facts  # noqa: E402  experiments/ (scripts run from this folder)
from report import emit  # noqa: E402

from tevjax.testing import forced_devices_env

RESULTS = Path(__file__).resolve().parent / "results" / "multihost_failure.md"
CASES = ("running", "finished")

JOB = textwrap.dedent("""
    import os, sys, time
    import jax
    from tevjax.multihost import every_process, initialize_distributed

    if {mode!r} == "tevjax":
        assert initialize_distributed()
    else:
        jax.distributed.initialize(os.environ["JAX_COORDINATOR_ADDRESS"], int(os.environ["JAX_NUM_PROCESSES"]),
                                   int(os.environ["JAX_PROCESS_ID"]))
    for step in range(100_000):
        every_process([step])
        if step == 3:
            if jax.process_index() == {failing}:
                if {case!r} == "finished":
                    time.sleep(1.0)  # the other has finished by now, and waits at exit for this one
                print(f"FAILING AT {{time.time():.3f}}", flush=True)
                raise RuntimeError("process {failing} fails at step 3")
            if {case!r} == "finished":
                break
        time.sleep(0.01)
""")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_once(case: str, mode: str, failing: int, timeout: float) -> dict:
    code = JOB.format(case=case, mode=mode, failing=failing)
    env, port = forced_devices_env(1), _port()
    procs = [subprocess.Popen([sys.executable, "-c", code], text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**env, "JAX_COORDINATOR_ADDRESS": f"localhost:{port}", "JAX_NUM_PROCESSES": "2",
                                   "JAX_PROCESS_ID": str(pid)}) for pid in range(2)]
    outs, ends = [None, None], [None, None]
    start = time.time()
    while any(o is None for o in outs) and time.time() - start < timeout:
        for pid, p in enumerate(procs):
            if outs[pid] is None and p.poll() is not None:
                ends[pid], outs[pid] = time.time(), p.stdout.read()
        time.sleep(0.05)
    for pid, p in enumerate(procs):
        if outs[pid] is None:
            p.kill()
            outs[pid] = p.communicate()[0] + "\n[killed: still running at the time limit]"
    failed_at = next(float(line.split()[-1]) for line in outs[failing].splitlines() if line.startswith("FAILING AT"))
    survivor = outs[1 - failing]
    return {"case": case, "mode": mode, "failing": failing, "codes": [p.returncode for p in procs],
            "seconds": max(e for e in ends if e is not None) - failed_at if all(ends) else None,
            "names_cause": f"process {failing} fails at step 3" in survivor}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="runs per failing process with tevjax's joining")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds before a run's processes are killed")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    t0 = time.time()
    runs = []
    for case in CASES:
        for failing in (0, 1):
            runs.append(run_once(case, "jax", failing, args.timeout))
            print(runs[-1], flush=True)
            for _ in range(args.repeats):
                runs.append(run_once(case, "tevjax", failing, args.timeout))
                print(runs[-1], flush=True)
    lines = ["# One failing process in a two-process job: time to the job's end", "",
             f"- Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; wall time "
             f"{(time.time() - t0) / 60:.1f} min.",
             f"- Command: `python experiments/multihost_failure.py --repeats {args.repeats}`",
             f"- Machine: {machine_facts()}.",
             "- Two processes, one forced CPU device each, gloo collectives; one collective per step; the failing "
             "process raises at step 3, while the other is in the next collective (`running`) or after the other "
             "has finished and waits at exit (`finished`). Seconds: from the exception to the last process's exit "
             "(median and range over runs). Exit statuses: process 0, process 1; -6 is SIGABRT (jax's client "
             "ending a process).", "",
             "| the other process | joined by | failing process | runs | seconds to the end: median [range] | "
             "exit statuses | survivor names the cause |", "|---|---|---:|---:|---|---|:---:|"]
    for case, mode, failing in itertools.product(CASES, ("jax", "tevjax"), (0, 1)):
        rs = [r for r in runs if r["case"] == case and r["mode"] == mode and r["failing"] == failing]
        secs = [r["seconds"] for r in rs if r["seconds"] is not None]
        when = (f"{np.median(secs):.1f} [{min(secs):.1f}-{max(secs):.1f}]" if secs else "-") + \
            ("" if len(secs) == len(rs) else f"; {len(rs) - len(secs)} killed at {args.timeout:.0f} s")
        codes = sorted({tuple(r["codes"]) for r in rs})
        names = sum(r["names_cause"] for r in rs)
        joined = "`jax.distributed.initialize`" if mode == "jax" else "`initialize_distributed`"
        lines.append(f"| {case} | {joined} | "
                     f"{failing} | {len(rs)} | {when} | {', '.join(map(str, codes))} | {names} of {len(rs)} |")
    emit(lines, args.out)
    args.out.with_suffix(".json").write_text(json.dumps({"argv": sys.argv, "machine": machine_facts(),
                                                         "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
