"""Stage a: the conformance and model tests, run on the device, with pass/fail counts per file.

The verifier and exit-law conformance tests (statistical tests of the three verifiers against the
exact law, brute-force exit laws), the exact sampler, the bf16 numerics test, and the model tests
that need neither torch nor gguf (tree pass == path forwards, KV cache, DFlash drafter, full-size
configs, greedy speculative == autoregressive decoding) run in one pytest process on the default
jax backend (the GPU when there is one). A file whose imports are missing (torch, gguf, hypothesis,
scipy) is reported as not run, with the missing module named, instead of failing collection.

pytest runs as a child process with the `pytest_stream` plugin, which records every outcome as
soon as it is known: if the stage's time budget runs out, the tests reached so far are still
counted and the rest are reported as not reached. This process imports jax only after the child
has exited, so the two never hold the device at the same time.
"""

from __future__ import annotations

import ast
import collections
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT, stage_parser, stamp, write

HERE = Path(__file__).resolve().parent
# (file, what it checks), in priority order: a run out of time loses the last ones.
FILES = [
    ("tests/test_verify.py", "verifier conformance (TEV, predraw, sequential vs the exact law)"),
    ("tests/test_exit_law.py", "exit law vs brute force; scan == matrix propagation"),
    ("tests/test_sampling.py", "exact two-stage sampler"),
    ("tests/test_bf16.py", "bf16 vs float32 greedy; matmul precision"),
    ("tests/test_tree_attention.py", "model: one tree pass == per-path forwards"),
    ("tests/test_kv_cache.py", "model: KV cache, prefill + steps == full forward"),
    ("tests/test_dflash.py", "model: DFlash drafter parity and properties"),
    ("tests/test_presets.py", "model: full-size Qwen3/Llama configs trace"),
    ("tests/test_decode.py", "engine: greedy speculative == autoregressive, sampling law"),
    ("tests/test_model_parity.py", "model: parity with transformers (needs torch)"),
]
# The CPU dry run: one quick test per kind, so every path of this stage runs in seconds.
TINY = [
    "tests/test_exit_law.py::test_padding_is_invisible",
    "tests/test_verify.py::test_greedy_follows_argmax_path_for_every_method[chain]",
    "tests/test_sampling.py::test_vocab_blocks",
    "tests/test_kv_cache.py::test_writes_past_capacity_are_dropped",
    "tests/test_tree_attention.py::test_full_mask_worked_example",
    "tests/test_dflash.py::test_for_target_defaults",
    "tests/test_presets.py::test_presets_listed",
]
OPTIONAL = ("pytest", "torch", "gguf", "hypothesis", "scipy", "transformers", "safetensors")


def missing_modules(path: Path, seen: set | None = None) -> list[str]:
    """Optional third-party modules that `path` (or a helper module of tests/ it imports) imports at
    module level and that are not installed."""
    seen = set() if seen is None else seen
    seen.add(path)
    missing = []
    for node in ast.parse(path.read_text()).body:
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
        for name in names:
            root = name.split(".")[0]
            helper = path.parent / f"{root}.py"
            if helper.is_file() and helper not in seen:
                missing += missing_modules(helper, seen)
            elif root in OPTIONAL and importlib.util.find_spec(root) is None:
                missing.append(root)
    return sorted(set(missing))


def run_pytest(targets: list[str], timeout_s: float, stream: Path) -> tuple[str, float]:
    """Runs pytest on `targets` with the streaming plugin; returns (exit description, seconds)."""
    env = dict(os.environ, TEVJAX_PYTEST_STREAM=str(stream),
               PYTHONPATH=os.pathsep.join([str(ROOT), str(HERE), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "pytest_stream", "--durations=10", *targets]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout_s, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
        output, status = proc.stdout, f"pytest exit status {proc.returncode}"
    except subprocess.TimeoutExpired as e:
        output, status = e.stdout, f"stopped by the stage's time budget after {timeout_s:.0f} s"
    print((output or b"").decode(errors="replace")[-6000:])  # the log run.sh keeps
    return status, time.perf_counter() - t0


def summarise(stream: Path) -> tuple[dict, list[dict], int]:
    """Per-file counts, failure records and the number of collected tests."""
    collected: list[str] = []
    outcomes: dict[str, dict] = {}
    if stream.exists():
        for line in stream.read_text().splitlines():
            rec = json.loads(line)
            if "collected" in rec:
                collected = rec["collected"]
            elif rec["outcome"] != "passed" or rec["nodeid"] not in outcomes:
                outcomes[rec["nodeid"]] = rec  # an error in teardown overrides a passed call
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    seconds: dict[str, float] = collections.defaultdict(float)
    for nodeid in collected:
        counts[nodeid.split("::")[0]]["collected"] += 1
    for nodeid, rec in outcomes.items():
        f = nodeid.split("::")[0]
        counts[f][rec["outcome"]] += 1
        seconds[f] += rec.get("seconds", 0.0)
    failures = [r for r in outcomes.values() if r["outcome"] in ("failed", "error")]
    return {"counts": counts, "seconds": seconds}, failures, len(collected)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = stage_parser(__doc__, 100.0, budget_help="time budget of the pytest run",
                      tiny_help="one quick test per kind (the CPU dry run)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    stream = out.with_suffix(".jsonl")
    stream.unlink(missing_ok=True)

    selected = TINY if args.tiny else [f for f, _ in FILES]
    about = dict(FILES)
    not_run, targets = {}, []
    for target in selected:
        f = target.split("::")[0]
        missing = missing_modules(ROOT / f)
        if missing:
            not_run[f] = "needs " + ", ".join(missing)
        else:
            targets.append(target)
    status, seconds = "nothing to run", 0.0
    if importlib.util.find_spec("pytest") is None:
        status = "pytest is not installed: nothing run"
    elif targets:
        # Leave time for starting this interpreter and writing the report.
        status, seconds = run_pytest(targets, max(args.budget_s - 15, 10), stream)
    summary, failures, n_collected = summarise(stream)

    header = stamp("GPU stage a: correctness on the device", argv, [
        f"- pytest on {len(targets)} target(s) ({'tiny selection' if args.tiny else 'whole files'}): "
        f"{status}, {seconds:.0f} s wall; {n_collected} tests collected."])
    lines = header + ["| file | checks | passed | failed | errors | skipped | not reached | test seconds | note |",
                      "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    totals = collections.Counter()
    for target in selected:
        f = target.split("::")[0]
        c = summary["counts"].get(f, collections.Counter())
        reached = sum(c[k] for k in ("passed", "failed", "error", "skipped", "xfailed"))
        row = {"passed": c["passed"], "failed": c["failed"], "errors": c["error"], "skipped": c["skipped"] + c["xfailed"],
               "not reached": max(c["collected"] - reached, 0)}
        totals.update(row)
        note = not_run.get(f, "")
        lines.append(f"| {target} | {about.get(f, '')} | {row['passed']} | {row['failed']} | {row['errors']} | "
                     f"{row['skipped']} | {row['not reached']} | {summary['seconds'].get(f, 0.0):.1f} | "
                     f"{'not run: ' + note if note else ''} |")
    lines.append(f"| **total** | | {totals['passed']} | {totals['failed']} | {totals['errors']} | {totals['skipped']} | "
                 f"{totals['not reached']} | {sum(summary['seconds'].values()):.1f} | |")
    if failures:
        lines += ["", "## Failures", ""] + [f"- `{r['nodeid']}` ({r['when']}): {r['message']}" for r in failures]
    write(out, lines)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
