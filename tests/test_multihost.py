"""Multi-host: two processes joined by `jax.distributed` on this machine, against one process.

Each process of the job sees 2 forced CPU devices, and they talk through JAX's CPU collectives
(gloo); the reference is one process with 4 forced devices. Both run the same script on the same
(2, 2) mesh, so its `data` axis spans the two processes and its `model` axis stays within each.
The script makes a data directory with `generate_data` on the mesh, trains a tiny drafter on it
with `train` (stopping part-way, then `resume=True`) and decodes with it, greedy and at T = 1. The
processes join through `initialize_distributed`, the function the CLI calls, reading the
coordinator from the environment as it does.

Equal means bit-for-bit. On this mesh the cross-process reductions each add two partial results,
and a sum of two floats does not depend on their order. So anything lost or counted twice
(another host's slice of a batch, a checkpoint written from one host only, a sampling key that
differs between hosts) shows as a difference, not as rounding.

Each host's clock is its own, and the script makes them disagree: process 0 wants a checkpoint
and an evaluation after every step, and process 1's clock, as the decoder reads it, runs ten times
as fast. Before the hosts agreed on such decisions, the first crashed the job in gloo ("collective
mismatch"), and decoding's round counts per call, sized from each host's own timing, did the same
when load made the hosts' timings differ.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from test_interrupt import python_sigint_handler  # noqa: F401  (a fixture)
from tevjax.testing import forced_devices_env

TESTS = Path(__file__).parent

SCRIPT = textwrap.dedent("""
    import dataclasses, json, sys
    sys.path.insert(0, {tests!r})
    import jax
    import numpy as np
    from tevjax.decode import DecodeConfig, Decoder
    from tevjax.multihost import initialize_distributed
    from tevjax.sharding import host_array, make_mesh, shard_model
    from tevjax.train.rollout import generate_data, sequence_hidden
    from tevjax.train.run import train
    from tevjax.train.step import Trainer
    from test_train import CFG, PROMPTS, ROLLOUT, TAPS, _drafter, _loaded, _target

    processes, data, run, out = {processes}, {data!r}, {run!r}, {out!r}
    assert initialize_distributed() == (processes > 1)
    pid = jax.process_index()
    assert (jax.process_count(), jax.device_count()) == (processes, 4), (jax.process_count(), jax.devices())
    if pid == 1:  # this host's clock runs 10 times as fast, so it would size the decoder's calls otherwise
        import time, types
        import tevjax.decode.engine as engine
        engine.time = types.SimpleNamespace(perf_counter=lambda: 10 * time.perf_counter())
    target, mesh = _target(), make_mesh(2, 2)
    shard_model(target, mesh)  # as `load_target(mesh=)` loads it for `tevjax data --mesh`
    generate_data(_loaded(target), ROLLOUT, data, prompts=PROMPTS, mesh=mesh, progress=False, log=lambda _: None)
    # 5 sequences: the chunk's rows are padded to a multiple of the data axis.
    seqs = [p + [7] * k for k, p in enumerate(PROMPTS[1][:5])]
    np.savez(f"{{out}}/hidden_p{{processes}}_{{pid}}.npz",
             *[h.view(np.uint16) for h in sequence_hidden(target, seqs, TAPS, mesh=mesh)])
    cfg = dataclasses.replace(CFG, steps=16)
    quiet = dict(target_name="tiny", heldout_records=4, progress=False, log=lambda _: None)
    # The hosts' clocks disagree: process 0 wants a checkpoint and an evaluation after every step,
    # the others never. They agree at steps 10 and 12 (every AGREE_EVERY steps and at the end of
    # the leg), so all of them write and evaluate there together instead of one waiting in a
    # collective the others never join.
    often = 0.0 if pid == 0 else 1e9
    train(target, _drafter(target), data, run, cfg, until=12, mesh=mesh, checkpoint_every_s=often,
          eval_every_s=often, **quiet)
    state = train(target, _drafter(target), data, run, cfg, resume=True, mesh=mesh, **quiet)
    result = {{"params": {{"/".join(map(str, p)): host_array(v).tolist()
                         for p, v in jax.tree_util.tree_flatten_with_path(state.params)[0]}},
              "step": int(state.step)}}
    trained = Trainer(_drafter(target), target, cfg, mesh).drafter(state)
    prompts = [[1, 5, 7, 9, 11], [1, 3], [1, 4, 4, 4, 8, 9], [6]]
    for temperature in (0.0, 1.0):
        dc = DecodeConfig(budget=4, max_new_tokens=10, temperature=temperature, prompt_bucket=8, capacity=48)
        gens = Decoder(target, trained, dc, mesh=mesh).generate(prompts, seed=3)
        result[f"tokens_t{{temperature:g}}"] = [g.tokens for g in gens]
    with open(f"{{out}}/p{{processes}}_{{pid}}.json", "w") as f:
        json.dump(result, f)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _launch(argvs: list[list[str]], envs: list[dict], what: str, timeout: float = 300,
            codes: list[int | tuple[int, ...]] | None = None, cwds: list[Path] | None = None) -> list[str]:
    """Runs one process per argv (with its environment, in its directory) and returns their
    outputs; fails on an exit status other than `codes` (default: all 0; a tuple allows any of
    its statuses) or on a hang (a process waiting in a collective that another never joins)."""
    procs = [subprocess.Popen(argv, env=env, cwd=cwd, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for argv, env, cwd in zip(argvs, envs, cwds or [None] * len(argvs))]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"{what} did not finish in {timeout:.0f} s (a host left waiting?)")
    want = [c if isinstance(c, tuple) else (c,) for c in ([0] * len(procs) if codes is None else codes)]
    assert all(p.returncode in w for p, w in zip(procs, want)), "\n".join(
        f"{what}, process {pid} (exit {p.returncode}):\n{log[-3000:]}" for pid, (p, log) in enumerate(zip(procs, logs)))
    return logs


def _joined_envs(env: dict, processes: int = 2) -> list[dict]:
    port = _free_port()
    return [{**env, "JAX_COORDINATOR_ADDRESS": f"localhost:{port}", "JAX_NUM_PROCESSES": str(processes),
             "JAX_PROCESS_ID": str(pid)} for pid in range(processes)]


def _job(processes: int, data: Path, run: Path, out: Path) -> None:
    """SCRIPT as one job of `processes` processes with 4 devices in all, joined through the
    environment."""
    code = SCRIPT.format(tests=str(TESTS), processes=processes, data=str(data), run=str(run), out=str(out))
    env = forced_devices_env(4 // processes)
    envs = [env] if processes == 1 else _joined_envs(env, processes)
    _launch([[sys.executable, "-c", code]] * processes, envs, f"the {processes}-process job")


def _shard_files(data: Path) -> dict[str, bytes]:
    return {str(f.relative_to(data)): f.read_bytes() for f in sorted((data / "shards").rglob("*")) if f.is_file()}


def _bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def test_two_processes_generate_train_resume_and_decode_as_one(tmp_path):
    from test_train import CFG, PROMPTS, ROLLOUT, TAPS, _drafter, _loaded, _params, _target

    from tevjax.train.rollout import generate_data, sequence_hidden
    from tevjax.train.run import train

    _job(1, tmp_path / "data_one", tmp_path / "one", tmp_path)
    _job(2, tmp_path / "data_two", tmp_path / "two", tmp_path)

    # The data: the two-process job wrote every file of the one-process job, byte for byte, and
    # both hold the unsharded run's responses, with its features to bfloat16 rounding (split sums
    # round differently before the cast).
    one, two = _shard_files(tmp_path / "data_one"), _shard_files(tmp_path / "data_two")
    assert one.keys() == two.keys() and len(one) == 4 * 5, sorted(one)
    for name in one:
        assert one[name] == two[name], name
    target = _target()
    plain = tmp_path / "data_plain"
    generate_data(_loaded(target), ROLLOUT, plain, prompts=PROMPTS, progress=False, log=lambda _: None)
    ref = _shard_files(plain)
    assert ref.keys() == one.keys()
    for name in ref:
        if name.endswith("features.npy"):
            got, want = (_bf16(np.load(tmp_path / d / name)) for d in ("data_one", "data_plain"))
            np.testing.assert_allclose(got, want, rtol=2 ** -7, atol=1e-3, err_msg=name)
        else:
            assert one[name] == ref[name], name
    manifests = [json.loads((tmp_path / d / "manifest.json").read_text())
                 for d in ("data_one", "data_two", "data_plain")]
    for m in manifests:
        m.pop("timings")
    assert manifests[0] == manifests[1] == manifests[2] and manifests[0]["complete"]

    # Teacher-forced features (`sequence_hidden`, the ShareGPT-replies path) on the mesh.
    seqs = [p + [7] * k for k, p in enumerate(PROMPTS[1][:5])]
    want = sequence_hidden(target, seqs, TAPS)
    for name in ("hidden_p1_0", "hidden_p2_0", "hidden_p2_1"):
        got = np.load(tmp_path / f"{name}.npz")
        assert len(got.files) == len(want)
        for k, w in enumerate(want):
            np.testing.assert_allclose(_bf16(got[f"arr_{k}"]), w.astype(np.float32), rtol=2 ** -7, atol=1e-3,
                                       err_msg=f"{name} sequence {k}")

    # Training and decoding: bit for bit, on every process.
    one = json.loads((tmp_path / "p1_0.json").read_text())
    for pid in (0, 1):
        two = json.loads((tmp_path / f"p2_{pid}.json").read_text())
        assert two["step"] == one["step"] == 16
        assert two["params"].keys() == one["params"].keys()
        for name, want in one["params"].items():
            np.testing.assert_array_equal(np.asarray(two["params"][name]), np.asarray(want),
                                          err_msg=f"process {pid}: {name}")
        assert two["tokens_t0"] == one["tokens_t0"], pid
        assert two["tokens_t1"] == one["tokens_t1"], pid
    # Process 0's every-step clock was heard at the agreed steps only; the resumed leg's clocks
    # (5 and 10 minutes) never fired, so its only checkpoint is the final one.
    run = tmp_path / "two"
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir()) == [10, 12, 16]
    log = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log if "heldout" in e] == [10, 12, 16]
    assert json.loads((run / "run.json").read_text())["train"]["steps"] == 16
    # The run the two hosts wrote exports, and resumes, in this one process as they trained it.
    exported = _params(run, target)
    assert exported.keys() == one["params"].keys()
    for name, want in one["params"].items():
        np.testing.assert_array_equal(exported[name], np.asarray(want, np.float32), err_msg=name)
    state = train(target, _drafter(target), tmp_path / "data_two", run, dataclasses.replace(CFG, steps=16),
                  resume=True, target_name="tiny", heldout_records=4, progress=False, log=lambda _: None)
    got = {"/".join(map(str, p)): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(state.params)[0]}
    for name, want in one["params"].items():
        np.testing.assert_array_equal(got[name], np.asarray(want, np.float32), err_msg=name)


# Slow (three processes, ~20 s): the default suite joins jobs by the environment
# (test_two_processes_generate_train_resume_and_decode_as_one) and parses the flags in
# test_a_job_that_never_assembles_stops_at_the_join_timeout.
@pytest.mark.slow
def test_cli_generate_joins_two_processes_by_its_flags(tiny_llama_dir):
    """`tevjax generate` on two processes joined by --coordinator / --num-processes / --process-id
    on a (2, 2) mesh prints, on each of them, the tokens one process prints on one device."""
    base = [sys.executable, "-m", "tevjax", "generate", "--target", str(tiny_llama_dir), "--prompt-ids", "1,2,3",
            "--max-new-tokens", "12", "--budget", "4", "--json"]
    port = _free_port()
    joined = [base + ["--mesh", "data=2,model=2", "--coordinator", f"localhost:{port}", "--num-processes", "2",
                      "--process-id", str(pid)] for pid in (0, 1)]
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    logs = _launch([base] + joined, [env] + [{**env, **forced_devices_env(2)}] * 2, "tevjax generate")
    records = [[json.loads(line) for line in log.splitlines() if line.startswith("{")] for log in logs]
    assert [len(r) for r in records] == [1, 1, 1], logs
    one = records[0][0]
    assert len(one["tokens"]) == 12 or one["tokens"][-1] == 2
    for pid in (0, 1):
        assert records[pid + 1][0]["tokens"] == one["tokens"], (pid, records)
        # Each host says which job it joins before jax.distributed's wait, and what it joined.
        joining = f"tevjax: joining the job at localhost:{port} as process {pid} of 2, waiting up to 300 s"
        assert joining in logs[pid + 1], logs[pid + 1]
        assert f"tevjax: joined: process {pid} of 2, 4 devices in all" in logs[pid + 1], logs[pid + 1]
    assert "joining" not in logs[0]


@pytest.mark.parametrize("env, message", [
    ({"JAX_NUM_PROCESSES": "0", "JAX_PROCESS_ID": "0"}, "a job of 0 processes (--num-processes / JAX_NUM_PROCESSES)"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "-1"},
     "process id -1 (--process-id / JAX_PROCESS_ID) is not in 0..1"),
    ({"JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"}, "JAX_NUM_PROCESSES='two' is not an integer"),
])
def test_bad_job_environment_is_refused_before_joining(monkeypatch, env, message):
    from tevjax.multihost import initialize_distributed

    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "localhost:1")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as e:
        initialize_distributed()
    assert message in str(e.value)


def test_a_job_environment_without_a_coordinator_is_refused(monkeypatch):
    """JAX_NUM_PROCESSES and JAX_PROCESS_ID of a multi-host job, with no coordinator to join and no
    cluster to detect: each host ran the whole command alone, in silence. A job of one process, as
    some launchers set it, still runs alone."""
    from tevjax.multihost import initialize_distributed

    for name in ("JAX_COORDINATOR_ADDRESS", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for env, given in (({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}, "JAX_NUM_PROCESSES=2, JAX_PROCESS_ID=1"),
                       ({"JAX_PROCESS_ID": "3"}, "JAX_PROCESS_ID=3")):
        monkeypatch.delenv("JAX_NUM_PROCESSES", raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(ValueError) as e:
            initialize_distributed()
        assert str(e.value).startswith(f"{given} ask for a process of a multi-host job, but no coordinator is given: "
                                       "set JAX_COORDINATOR_ADDRESS (or --coordinator)"), str(e.value)
    monkeypatch.setenv("JAX_NUM_PROCESSES", "1")
    monkeypatch.setenv("JAX_PROCESS_ID", "0")
    assert initialize_distributed() is False


# No hang when one host fails. The limit is well under jax.distributed's own: without
# `abort_job`, the failing process waits 300 s in the shutdown barrier while the other waits in
# a collective, then both abort with a coordination-service message that names no cause.
FAIL_LIMIT_S = 90

FAILING = textwrap.dedent("""
    import jax
    import numpy as np
    from tevjax.multihost import every_process, initialize_distributed

    assert initialize_distributed()
    for step in range(1000):  # a collective per step, as a training or decoding loop has
        every_process([step])
        if jax.process_index() == 1 and step == 3:
            raise RuntimeError("host 1 fails at step 3")
    print("finished")
""")


def test_an_uncaught_exception_on_one_host_ends_the_job():
    """Process 1 raises after a few collectives; process 0, waiting in the next one, is told why
    and exits too, instead of waiting out jax.distributed's timeouts."""
    logs = _launch([[sys.executable, "-c", FAILING]] * 2, _joined_envs(forced_devices_env(1)), "the failing job",
                   timeout=FAIL_LIMIT_S, codes=[1, 1])
    assert "RuntimeError: host 1 fails at step 3" in logs[1] and "Traceback" in logs[1], logs[1]
    assert "tevjax: stopping process 0 of 2: process 1 failed: RuntimeError: host 1 fails at step 3" in logs[0], logs[0]
    assert "finished" not in logs[0], logs[0]


FAILING_LATE = textwrap.dedent("""
    import time
    import jax
    from tevjax.multihost import every_process, initialize_distributed

    assert initialize_distributed()
    every_process([1])
    if jax.process_index() == {failing}:
        time.sleep(1.0)  # the other process has finished and waits in jax.distributed's shutdown
        raise RuntimeError("host {failing} fails after the other finished")
    print("finished")
""")


@pytest.mark.parametrize("failing", [0, 1])
def test_a_host_that_fails_after_another_finished_ends_it_too(failing):
    """One process finishes its work and waits, at exit, for the other in jax.distributed's
    shutdown barrier; the other then raises. The finished one is told why and exits with status
    1 at once, where before it waited out jax's heartbeat timeout (100 s, more than this test
    allows) and was aborted (SIGABRT) with a message that named no cause. Process 0 hosts the
    job's store, so both directions are checked."""
    code = FAILING_LATE.format(failing=failing)
    logs = _launch([[sys.executable, "-c", code]] * 2, _joined_envs(forced_devices_env(1)), "the failing job",
                   timeout=FAIL_LIMIT_S, codes=[1, 1])
    other = 1 - failing
    assert f"RuntimeError: host {failing} fails after the other finished" in logs[failing], logs[failing]
    assert "finished" in logs[other].splitlines(), logs[other]
    assert (f"tevjax: stopping process {other} of 2: process {failing} failed: RuntimeError: host {failing} fails "
            f"after the other finished") in logs[other], logs[other]
    assert "Check failure" not in logs[other], logs[other]


KILLED = textwrap.dedent("""
    import os, signal, sys, time
    from tevjax.multihost import every_process, initialize_distributed

    assert initialize_distributed(heartbeat_timeout_s={heartbeat})
    every_process([1])
    if {killed} == int(os.environ["JAX_PROCESS_ID"]):
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)  # no exit handler, no word to the store: only heartbeats stop
    print("waiting", flush=True)
    time.sleep({wait})  # host-side work (a long compile, a file read): no collective to fail in
    print("woke", flush=True)
""")


@pytest.mark.parametrize("killed", [0, 1])
def test_a_killed_host_is_found_by_heartbeats_within_the_heartbeat_timeout(killed):
    """One process is SIGKILLed while the other is busy on the host, outside any collective (where
    gloo on CPUs, unlike NCCL, would fail at once). Process 1's death is told only by its missing
    heartbeats: with a heartbeat timeout of 3 s the survivor is aborted by jax, naming the dead
    task, long before its 60 s of work ends (at jax's default 100 s it would finish that work and
    then wait at exit, past this test's limit). Process 0 hosts the coordination service: its
    death closes process 1's connection, which jax notices at once."""
    code = KILLED.format(heartbeat=3, killed=killed, wait=60)
    start = time.monotonic()
    logs = _launch([[sys.executable, "-c", code]] * 2, _joined_envs(forced_devices_env(1)), "the killed job",
                   timeout=FAIL_LIMIT_S, codes=[-signal.SIGKILL if pid == killed else -signal.SIGABRT for pid in (0, 1)])
    elapsed = time.monotonic() - start
    other = 1 - killed
    assert "waiting" in logs[other] and "woke" not in logs[other], logs[other]
    assert elapsed < 45, elapsed  # joining ~2-5 s, then at most a few heartbeat periods
    if killed == 1:  # the service (in process 0) names the task that stopped sending heartbeats
        assert "The following tasks are unhealthy (stopped sending heartbeats):\n1\n" in logs[other], logs[other][-3000:]
    else:  # the service's own host: its socket closes, and process 1 hears at once
        assert "Failed to send RPC to coordination service" in logs[other], logs[other][-3000:]


def test_a_heartbeat_timeout_must_be_whole_seconds_of_at_least_one():
    from tevjax.multihost import initialize_distributed

    for bad in (0, -5, 2.5, True, "10"):
        with pytest.raises(ValueError, match="heartbeat timeout of .* whole number of seconds, at least 1"):
            initialize_distributed("localhost:1", 2, 0, heartbeat_timeout_s=bad)


class _Joining(Exception):
    pass


def test_join_arguments_come_from_flags_then_the_environment(monkeypatch):
    """What `initialize_distributed` hands to jax.distributed, checked in this process: the join
    itself (`_join_within`) records its arguments and raises instead."""
    from tevjax import multihost

    calls = []

    def join(timeout_s, job, **kwargs):
        calls.append((timeout_s, job, kwargs))
        raise _Joining

    monkeypatch.setattr(multihost, "_join_within", join)
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_JOB_ID",
                 "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert multihost.initialize_distributed() is False and calls == []  # a single-host run joins nothing
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="join timeout of .* it must be positive and finite"):
            multihost.initialize_distributed("localhost:1", 2, 0, timeout_s=bad)
    assert calls == []
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "env:1")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "8")
    monkeypatch.setenv("JAX_PROCESS_ID", "7")
    logs = []
    with pytest.raises(_Joining):  # flags win over the environment
        multihost.initialize_distributed("flags:2", 2, 1, log=logs.append, timeout_s=12.5,
                                         heartbeat_timeout_s=np.int64(7))
    assert calls[-1] == (12.5, "process 1 of 2: the job at flags:2", dict(
        coordinator_address="flags:2", num_processes=2, process_id=1, heartbeat_timeout_seconds=7))
    assert type(calls[-1][2]["heartbeat_timeout_seconds"]) is int  # as jax takes it
    assert logs == ["joining the job at flags:2 as process 1 of 2, waiting up to 12.5 s for every process"]
    with pytest.raises(_Joining):  # what the flags leave out, the environment gives
        multihost.initialize_distributed(process_id=3)
    assert calls[-1][2] == dict(coordinator_address="env:1", num_processes=8, process_id=3,
                                heartbeat_timeout_seconds=multihost.HEARTBEAT_TIMEOUT_S)
    # Under a cluster manager, with no coordinator anywhere, JAX's own detection finds the job.
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    with pytest.raises(_Joining):
        multihost.initialize_distributed(timeout_s=5)
    assert calls[-1] == (5, "this process: the job that JAX's cluster detection finds",
                         dict(heartbeat_timeout_seconds=multihost.HEARTBEAT_TIMEOUT_S))


def test_our_join_deadline_comes_before_jaxs(monkeypatch):
    # jax's own deadline must be the later one, so that the timeout's message is tevjax's.
    from tevjax import multihost

    seen = {}
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kwargs: seen.update(kwargs))
    multihost._join_within(600.0, "the job", coordinator_address="x:1")
    assert seen["coordinator_address"] == "x:1" and seen["initialization_timeout"] > 600


def _digest(value) -> bytes:
    import hashlib

    from tevjax.multihost import _feed

    h = hashlib.sha256()
    _feed(h, value)
    return h.digest()


def test_check_same_compares_values_by_content():
    """What `check_same` hashes: dicts whatever their order, nesting, and arrays by dtype, shape
    and bytes (so equal bytes in another shape or dtype differ)."""
    assert _digest({"a": 1, "b": [2, 3]}) == _digest({"b": [2, 3], "a": 1})
    assert _digest([[1, 2], [3]]) != _digest([[1], [2, 3]])
    assert _digest("1") != _digest(1)
    zeros = np.zeros(4, np.int32)
    assert _digest(zeros) == _digest(np.zeros(4, np.int32))
    assert _digest(zeros) != _digest(zeros.reshape(2, 2))
    assert _digest(zeros) != _digest(np.zeros(2, np.int64))
    assert _digest(zeros) != _digest(np.array([0, 0, 0, 1], np.int32))
    assert _digest(jax.numpy.ones(3, jax.numpy.bfloat16)) != _digest(jax.numpy.full(3, 2, jax.numpy.bfloat16))
    assert _digest(jax.random.key(0)) == _digest(jax.random.key(0)) != _digest(jax.random.key(1))  # typed keys


def test_the_keys_and_processes_that_differ_are_named(monkeypatch):
    """`check_same` and `_check_each` on a stand-in job of 3 processes: `every_process` returns
    this process's row for every process, with the columns listed in `bumped` changed."""
    from tevjax import multihost

    bumped: dict[int, list[int]] = {}

    def every_process(values):
        table = np.stack([np.asarray(values, np.int32).reshape(-1)] * 3)
        for process, columns in bumped.items():
            table[process, columns] += 1
        return table

    monkeypatch.setattr(multihost, "every_process", every_process)
    monkeypatch.setattr(jax, "process_count", lambda: 3)
    digests = {"a.bin": bytes(16), "b.bin": bytes(range(16)), "c.bin": bytes(16)}  # 4 int32 columns each
    multihost._check_each("the model", digests)
    multihost.check_same("the prompts", ["x"])
    bumped[2] = [5]  # a word of b.bin's digest, on process 2
    with pytest.raises(ValueError) as e:
        multihost._check_each("the model", digests)
    assert str(e.value) == "the model: b.bin differs between the job's processes: process 2 against process 0"
    with pytest.raises(ValueError) as e:
        multihost._check_each("the software", digests, {"a.bin": "1", "b.bin": "2", "c.bin": "3"})
    assert str(e.value) == ("the software: b.bin (2 on process 0) differs between the job's processes: "
                            "process 2 against process 0")
    bumped[1] = [0, 11]
    with pytest.raises(ValueError) as e:
        multihost._check_each("the model", digests)
    assert str(e.value) == ("the model: a.bin, b.bin, c.bin differ between the job's processes: "
                            "processes 1, 2 against process 0")
    bumped.clear()
    bumped[1] = [3]
    with pytest.raises(ValueError) as e:
        multihost.check_same("the prompts", ["x"])
    assert str(e.value) == "the prompts differs between the job's processes: process 1 against process 0"


@pytest.mark.parametrize("lacking", ["model", "prompts.txt"])
def test_cli_error_on_one_host_ends_the_job(tiny_llama_dir, tmp_path, lacking):
    """`tevjax generate` with a file that one host lacks: that host prints the error and exits with
    the CLI's usage status, and the other stops with the same reason instead of waiting for it.
    The hosts run the same command line in directories of their own, and one lacks the model
    directory (found missing after the job is joined, while the other loads and shards the model)
    or the prompt file (found missing before any model is loaded)."""
    hosts = [tmp_path / "host0", tmp_path / "host1"]
    for host in hosts:
        host.mkdir()
        (host / "model").symlink_to(tiny_llama_dir)
        (host / "prompts.txt").write_text("hello\nworld\n")
    (hosts[1] / lacking).unlink()
    argv = [sys.executable, "-m", "tevjax", "generate", "--target", "model", "--batch-file", "prompts.txt",
            "--no-chat", "--max-new-tokens", "12", "--budget", "4", "--mesh", "data=2", "--json"]
    env = {**forced_devices_env(1), "PYTHONPATH": str(TESTS.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    logs = _launch([argv] * 2, _joined_envs(env), "tevjax generate", timeout=FAIL_LIMIT_S, codes=[1, 2], cwds=hosts)
    error = next(line for line in logs[1].splitlines() if line.startswith("tevjax: error:"))
    assert lacking in error and "Traceback" not in logs[1], logs[1]
    why = error.removeprefix("tevjax: error: ")
    assert f"tevjax: stopping process 0 of 2: process 1 failed: {why}" in logs[0], logs[0]
    assert '"tokens"' not in logs[0], logs[0]


@pytest.mark.parametrize("pid", [0, 1])
def test_a_job_that_never_assembles_stops_at_the_join_timeout(tiny_llama_dir, pid):
    """One process of a 2-process job starts, the other never does. The one that started (the
    coordinator's host, or a process that connects to it) waits --join-timeout seconds, then
    exits with status 1 and says what happened; jax.distributed alone aborts it (SIGABRT) with a
    stack trace that blames another task that "died"."""
    argv = [sys.executable, "-m", "tevjax", "generate", "--target", str(tiny_llama_dir), "--prompt-ids", "1,2,3",
            "--max-new-tokens", "8", "--mesh", "data=2", "--coordinator", f"localhost:{_free_port()}",
            "--num-processes", "2", "--process-id", str(pid), "--join-timeout", "2"]
    env = {**forced_devices_env(1), "PYTHONPATH": str(TESTS.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = time.monotonic()
    log, = _launch([argv], [env], "the lone process", timeout=FAIL_LIMIT_S, codes=[1])
    assert f"process {pid} of 2: the job at localhost:" in log and "was not joined by every process within 2 s" in log, log
    assert "Check failure" not in log and "Traceback" not in log, log
    assert time.monotonic() - start < FAIL_LIMIT_S


@pytest.mark.parametrize("change", ["weights", "files"])
def test_hosts_with_different_copies_of_the_model_are_refused(tiny_llama_dir, tmp_path, change):
    """Each host loads its own copy of the target under the same path, and a jit over the mesh
    trusts them to be the same: a copy whose weights differ (one number of one tensor), or that
    lacks a file the loader reads, is refused on every host, naming what differs, before any
    weight is placed on the mesh."""
    from safetensors.numpy import load_file, save_file

    hosts = [tmp_path / "host0", tmp_path / "host1"]
    for host in hosts:
        shutil.copytree(tiny_llama_dir, host / "model")
    if change == "weights":
        tensors = load_file(hosts[1] / "model" / "model.safetensors")
        tensors["model.norm.weight"][3] += 1e-3
        save_file(tensors, hosts[1] / "model" / "model.safetensors", metadata={"format": "pt"})
        why = "the target 'model': model.safetensors differs between the job's processes: process 1 against process 0"
    else:
        (hosts[1] / "model" / "generation_config.json").unlink()
        why = "which files the target 'model' has"
    argv = [sys.executable, "-m", "tevjax", "generate", "--target", "model", "--prompt-ids", "1,2,3",
            "--max-new-tokens", "8", "--budget", "4", "--mesh", "data=2", "--json"]
    env = {**forced_devices_env(1), "PYTHONPATH": str(TESTS.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # Both fail at once: each exits with its own error (2) or the other's (1), for the same reason.
    logs = _launch([argv] * 2, _joined_envs(env), "tevjax generate", timeout=FAIL_LIMIT_S, codes=[(1, 2), (1, 2)],
                   cwds=hosts)
    for log in logs:
        assert why in log and "differs between the job's processes: process 1 against process 0" in log, log
        assert '"tokens"' not in log and "Traceback" not in log, log


CHECKED = textwrap.dedent("""
    import jax
    import numpy as np
    from tevjax.multihost import check_same, initialize_distributed

    assert initialize_distributed()
    check_same("the settings", {"budget": 8, "prompts": [[1, 2], [3]]})  # the same everywhere: passes
    try:
        check_same("the prompts", [[1, 2], [3 + jax.process_index()]])
    except ValueError as e:
        print("refused:", e)
    # Arrays by content: numpy abridges the repr of this one to its ends, which are the same.
    weights = np.zeros(10_000, np.float32)
    weights[5_000] = jax.process_index()
    try:
        check_same("the weights", {"w": weights, "key": jax.random.key(0)})
    except ValueError as e:
        print("refused:", e)
""")


def test_check_same_names_the_process_that_differs():
    """Every process raises the same error (so none is left in a collective), naming the process
    whose value is not process 0's."""
    logs = _launch([[sys.executable, "-c", CHECKED]] * 2, _joined_envs(forced_devices_env(1)), "the checked job",
                   timeout=FAIL_LIMIT_S)
    for log in logs:
        assert "refused: the prompts differs between the job's processes: process 1 against process 0" in log, log
        assert "refused: the weights differs between the job's processes: process 1 against process 0" in log, log


ROWS = textwrap.dedent("""
    import numpy as np, jax
    from tevjax.multihost import initialize_distributed
    from tevjax.sharding import host_array, make_mesh
    from tevjax.train.run import _global_batch
    from tevjax.train.step import TrainConfig

    class Data:  # what a batch reads of TrainData: record i is the row [i, i, ...]
        def order(self, seed, step, batch_size):
            return np.random.default_rng([seed, step]).permutation(100)[:batch_size]

        def batch(self, records, columns, seq_len):
            r = np.asarray(records)
            return {"tokens": np.repeat(r[:, None], seq_len, 1).astype(np.int32),
                    "loss_mask": np.ones((len(r), seq_len), bool),
                    "features": np.repeat(r[:, None, None], seq_len, 1).astype(np.float32),
                    "length": r.astype(np.int32)}

    assert initialize_distributed()
    d = jax.devices()
    cfg = TrainConfig(steps=3, batch_size=4, anchors=2, exit_anchors=1, seq_len=3)
    want = Data().order(cfg.seed, 1, cfg.batch_size)
    for name, mesh in (("data=2,model=2", make_mesh(2, 2)), ("model=4", make_mesh(1, 4)),
                       ("interleaved", make_mesh(4, 1, [d[0], d[2], d[1], d[3]]))):
        b = _global_batch(Data(), [0], cfg, 1, mesh)
        for x in (b.length, b.tokens[:, 0], b.features[:, 0, 0]):
            # the whole batch, in order, and each device's part of it where the sharding says
            assert host_array(x).tolist() == want.tolist(), (name, host_array(x).tolist(), want.tolist())
            for s in x.addressable_shards:
                assert np.asarray(s.data).tolist() == want[s.index[0]].tolist(), (name, s.device, s.index)
        print("rows ok:", name, flush=True)
""")


def test_each_host_reads_the_training_rows_its_devices_hold():
    """Training's global batch on 2 processes of 2 devices each, on meshes whose `data` axis splits
    the batch between them (2 x 2), does not split it (model=4 across both hosts: each reads the
    whole batch), and alternates between them (4 x 1 over interleaved devices): every device holds
    the rows of the batch its sharding says. Each host had fed rows [pid * B/2, (pid + 1) * B/2) as
    its "own slice": on model=4 that made a replicated batch of B/2 rows that held other rows on
    each host (trained on in silence), and on the interleaved mesh a batch of shuffled rows."""
    logs = _launch([[sys.executable, "-c", ROWS]] * 2, _joined_envs(forced_devices_env(2)), "the rows job",
                   timeout=FAIL_LIMIT_S)
    for log in logs:
        for name in ("data=2,model=2", "model=4", "interleaved"):
            assert f"rows ok: {name}" in log, log


def test_cli_flags_that_differ_between_hosts_are_refused(tiny_llama_dir):
    """A flag that differs between hosts (a launcher's mistake) would send them into different
    collectives, or decode different prompts; the CLI refuses it before loading anything."""
    argvs = [[sys.executable, "-m", "tevjax", "generate", "--target", str(tiny_llama_dir), "--prompt-ids", "1,2,3",
              "--max-new-tokens", str(n), "--budget", "4", "--mesh", "data=2", "--json"] for n in (12, 16)]
    env = {**forced_devices_env(1), "PYTHONPATH": str(TESTS.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # Both processes fail at once, so either may hear of the other's failure before its own: each
    # exits with the CLI's usage status (its own error) or 1 (the other's), with the same reason.
    logs = _launch(argvs, _joined_envs(env), "tevjax generate", timeout=FAIL_LIMIT_S, codes=[(1, 2), (1, 2)])
    why = ("the command line (other than --process-id, --coordinator and --debug) differs between the job's processes: "
           "process 1 against process 0")
    for log in logs:
        assert why in log and '"tokens"' not in log, log


def test_ctrl_c_on_one_host_stops_the_job_in_order(tmp_path, python_sigint_handler):
    """`tevjax generate` on two processes, batches of two prompts: [a, a] finish and print; in
    [a, z] the "a" row finishes within a few rounds and "z" would decode 30000 tokens. SIGINT to
    process 0 only: both processes stop after the same round (they agree on it), print the finished
    "a" row, and exit 130, in order rather than through `abort_job`."""
    from test_cli import write_scripted_target
    from test_interrupt import CHAIN, LOOP

    target = tmp_path / "scripted"
    write_scripted_target(target, [*zip(CHAIN, CHAIN[1:]), (LOOP, LOOP)], max_positions=32768)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a\na\na\nz\n")
    argv = [sys.executable, "-m", "tevjax", "generate", "--target", str(target), "--batch-file", str(prompts),
            "--batch-size", "2", "--no-chat", "--verifier", "ar", "--max-new-tokens", "30000", "--json",
            "--mesh", "data=2"]
    env = {**forced_devices_env(1), "PYTHONPATH": str(TESTS.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = [subprocess.Popen(argv, env=e, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for e in _joined_envs(env)]
    try:
        first = []  # the first batch, printed on every host (gloo prints to stdout too)
        while len([line for line in first if line.startswith("{")]) < 2:
            first.append(procs[0].stdout.readline())
            assert first[-1], ("process 0 ended early", first, procs[0].stderr.read())
        time.sleep(3.0)  # the "a" row of the second batch finishes within a few rounds
        assert all(p.poll() is None for p in procs), "the 'z' row finished: the test needs a longer generation"
        procs[0].send_signal(signal.SIGINT)
        outs = [p.communicate(timeout=FAIL_LIMIT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    outs[0] = ("".join(first) + outs[0][0], outs[0][1])
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 130 and "tevjax: interrupted" in err and "stopping process" not in err, err
        records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert [r["text"] for r in records] == ["ok", "ok", "ok"], out
        assert records[2]["prompt"] == "a" and records[2]["tokens"] == CHAIN[1:]


DIFFERENT_INIT = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import jax
    from tevjax.multihost import initialize_distributed
    from tevjax.sharding import make_mesh
    from tevjax.train.run import train
    from test_train import CFG, _drafter, _target

    assert initialize_distributed()
    target = _target()
    try:  # process 1 starts from another drafter (a host's own copy of --init, say)
        train(target, _drafter(target, seed=jax.process_index()), {data!r}, {run!r}, CFG, mesh=make_mesh(2, 1),
              target_name="tiny", heldout_records=4, progress=False, log=lambda _: None)
    except ValueError as e:
        print("refused:", e)
""")


def test_training_refuses_hosts_that_start_from_different_drafters(tmp_path):
    """Every process feeds the mesh its own copy of the initial parameters, and nothing else would
    notice that they differ: `train` compares them (and the settings and the data manifest) first,
    and every process refuses before anything is written into the run directory."""
    from test_train import PROMPTS, ROLLOUT, _loaded, _target

    from tevjax.train.rollout import generate_data

    data, run = tmp_path / "data", tmp_path / "run"
    generate_data(_loaded(_target()), ROLLOUT, data, prompts=PROMPTS, progress=False, log=lambda _: None)
    code = DIFFERENT_INIT.format(tests=str(TESTS), data=str(data), run=str(run))
    logs = _launch([[sys.executable, "-c", code]] * 2, _joined_envs(forced_devices_env(1)), "the training job",
                   timeout=FAIL_LIMIT_S)
    for log in logs:
        assert ("refused: the initial drafter's parameters differs between the job's processes: "
                "process 1 against process 0") in log, log
    assert list(run.iterdir()) == []  # made by process 0 to check that the hosts share it; nothing written


NOT_SHARED = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    import jax
    import tevjax.multihost
    from tevjax.multihost import initialize_distributed
    from tevjax.sharding import make_mesh
    from tevjax.train.rollout import generate_data
    from tevjax.train.run import train
    from test_train import CFG, PROMPTS, ROLLOUT, _drafter, _loaded, _target

    # Each host's directory is a local one, where a file shows at once or never: a second is
    # enough, and the default 10 s would be spent waiting for a file that never shows.
    tevjax.multihost.SHARED_DIR_WAIT_S = 1.0
    assert initialize_distributed()
    target = _target()
    try:  # "data" and "run" are relative paths, and each host runs in a directory of its own
        if {what!r} == "data":
            generate_data(_loaded(target), ROLLOUT, "data", prompts=PROMPTS, mesh=make_mesh(2, 1), progress=False,
                          log=lambda _: None)
        else:
            train(target, _drafter(target), {data!r}, "run", CFG, mesh=make_mesh(2, 1), target_name="tiny",
                  heldout_records=4, progress=False, log=lambda _: None)
    except ValueError as e:
        print("refused:", e)
""")


# The run directory's case stays in the default suite; the data directory's goes through the same
# check (`check_shared_dir`) and costs another ~15 s of two processes, so it runs with the slow tests.
@pytest.mark.parametrize("what", [pytest.param("data", marks=pytest.mark.slow), "run"])
def test_directories_the_hosts_do_not_share_are_refused(tmp_path, what):
    """Process 0 writes the data and run directories and every host reads them, and orbax writes
    each checkpoint from every host: a path that is each host's own directory (a local disk, or
    here a relative path) made a training job wait forever, with no message, for the parts of
    its first checkpoint. Every host now refuses it first, naming the hosts that cannot see it."""
    from test_train import PROMPTS, ROLLOUT, _loaded, _target

    from tevjax.train.rollout import generate_data

    data = tmp_path / "shared_data"
    if what == "run":
        generate_data(_loaded(_target()), ROLLOUT, data, prompts=PROMPTS, progress=False, log=lambda _: None)
    hosts = [tmp_path / "host0", tmp_path / "host1"]
    for host in hosts:
        host.mkdir()
    code = NOT_SHARED.format(tests=str(TESTS), what=what, data=str(data))
    logs = _launch([[sys.executable, "-c", code]] * 2, _joined_envs(forced_devices_env(1)), f"the {what} job",
                   timeout=FAIL_LIMIT_S, cwds=hosts)
    for log in logs:
        assert (f"refused: the {what} directory (--out) '{what}' is not a directory that the job's processes share: "
                f"process 1 cannot see a file that process 0 wrote there") in log, log
    assert [list((host / what).iterdir()) for host in hosts if (host / what).exists()] == [[]]


def test_a_lingering_probe_does_not_make_a_directory_hold_files(tmp_path):
    """A network filesystem may list check_shared_dir's probe on another host for a moment after
    process 0 removed it; that host must still take a new run's directory for empty."""
    from tevjax.multihost import holds_files

    assert not holds_files(tmp_path / "absent")
    (tmp_path / ".tevjax-shared-12345").write_text("")
    assert not holds_files(tmp_path)
    (tmp_path / "run.json").write_text("{}")
    assert holds_files(tmp_path)


def test_a_jax_without_the_private_key_value_client_degrades_to_a_note(monkeypatch, capsys):
    """tevjax reads the job's key-value client from a private jax attribute (as orbax does). A jax
    release that moves it must not break a job: no failure watch, and a note that says so."""
    import jax._src.distributed as distributed

    from tevjax import multihost

    monkeypatch.delattr(distributed, "global_state")
    assert multihost._kv_client() is None
    assert "a failing host will not end the others early" in capsys.readouterr().err


OTHER_SOFTWARE = textwrap.dedent("""
    import jax
    from tevjax import multihost

    if {other!r} == "jax":  # process 1 has another jax installed (as its metadata says)
        real = multihost._software
        multihost._software = lambda: {{**real(), "jax": "0.0.1"}} if jax.process_index() == 1 else real()
    try:
        multihost.initialize_distributed()
        print("joined")
    except ValueError as e:
        print("refused:", e)
""")


def test_hosts_with_other_software_are_refused_as_they_join():
    """A host with another version of jax (or of tevjax's source, or of another package it
    computes with) would run other programs: collectives out of step, or other values in silence.
    Joining compares them, in one collective, and every host refuses, naming the package and its
    own version of it."""
    logs = _launch([[sys.executable, "-c", OTHER_SOFTWARE.format(other="jax")]] * 2,
                   _joined_envs(forced_devices_env(1)), "the job", timeout=FAIL_LIMIT_S)
    version = jax.__version__
    assert (f"refused: the installed software: jax ({version} on process 0) differs between the job's processes: "
            f"process 1 against process 0") in logs[0], logs[0]
    assert "refused: the installed software: jax (0.0.1 on process 1) differs" in logs[1], logs[1]
    logs = _launch([[sys.executable, "-c", OTHER_SOFTWARE.format(other="none")]] * 2,
                   _joined_envs(forced_devices_env(1)), "the job", timeout=FAIL_LIMIT_S)
    assert all("joined" in log.splitlines() for log in logs), logs


# ~23 s of two processes: the slow suite's. The default suite's two-process decoding check is
# `test_two_processes_generate_train_resume_and_decode_as_one`, which decodes as one process does.
@pytest.mark.slow
def test_cli_eval_on_two_processes_measures_what_one_does(text_target_dir, tmp_path):
    """`tevjax eval` on two processes (batches of 2 prompts over a data=2 mesh) reports on both
    the per-prompt rounds and block lengths of a one-process run, with every greedy output equal
    to AR's; only the timings differ."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\nworld\nabc\nxyz\n")
    base = [sys.executable, "-m", "tevjax", "eval", "--target", str(text_target_dir), "--prompts", str(prompts),
            "--num-prompts", "4", "--budgets", "2,4", "--max-new-tokens", "8", "--batch-size", "2", "--json"]
    env = {**forced_devices_env(1), "PYTHONPATH": str(TESTS.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    logs = _launch([base] + [base + ["--mesh", "data=2"]] * 2, [env] + _joined_envs(env), "tevjax eval")
    results = [json.loads([line for line in log.splitlines() if line.startswith('{"verifier"')][-1]) for log in logs]

    def measured(result):
        return [(r["budget"], r["tau"], r["prompt_emitted"], r["prompt_rounds"], r["tokens"], r["mismatches"])
                for r in result["budgets"]], result["ar"]["tokens"]

    assert results[0]["mismatches"] == 0 and len(results[0]["budgets"]) == 2
    assert measured(results[1]) == measured(results[2]) == measured(results[0])
