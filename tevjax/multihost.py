"""Multi-host jobs: joining one, agreeing across its processes, and ending it when one fails.

A multi-host job runs the same program on every process (one per host), joined by
`jax.distributed`; a jit over a mesh then spans every process's devices (`tevjax.sharding`).
Four things each host would otherwise have or do on its own:
- **Decisions.** Each host's clock and signals are its own, but a decision that starts a
  collective (a checkpoint, an evaluation over the mesh, a stop, a decoder call's round count)
  must be taken by every host at the same point, or one waits in a collective the others never
  join. Such decisions go through `every_process` / `any_process`.
- **Writes.** One process writes a shared file, between `barrier`s, in a directory that every
  process sees (`check_shared_dir`).
- **Inputs.** The software, the command and the files it reads must be the same on every host
  (`check_same`, `check_same_files`; the software when joining).
- **Failures.** A process that fails ends the whole job within seconds (`abort_job`), rather than
  leaving the others waiting in a collective.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from tevjax.checks import is_int

__all__ = ["HEARTBEAT_TIMEOUT_S", "JOIN_TIMEOUT_S", "SHARED_DIR_WAIT_S", "abort_job", "any_process", "barrier",
           "check_same", "check_same_files", "check_shared_dir", "every_process", "holds_files", "initialize_distributed"]

JOIN_TIMEOUT_S = 300.0  # jax.distributed's default: hosts of one job may start minutes apart
# jax.distributed's default. A process that dies without a word (SIGKILL, the kernel's OOM
# killer, a lost host) is noticed only by its missing heartbeats: on GPUs the others wait in their
# next NCCL collective until then, and jax then aborts them with a message naming the dead task.
HEARTBEAT_TIMEOUT_S = 100
# How long a host looks for process 0's probe file in a directory the job must share
# (`check_shared_dir`): a network filesystem may show a new file on other hosts a few seconds late.
SHARED_DIR_WAIT_S = 10.0


def every_process(values: Sequence[int]) -> np.ndarray:
    """[P, n]: the int32 `values` of each of the P processes of a multi-host job, one row each
    ([1, n] in a single process, with no collective). Host-side decisions that lead to collectives
    (the module's docstring) must be the same on every host, so hosts decide from everyone's
    values. A collective itself: every process must call it at the same point."""
    row = np.asarray(values, np.int32).reshape(-1)
    if jax.process_count() == 1:
        return row[None]
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(row)).reshape(jax.process_count(), row.size)


def any_process(*flags: bool) -> tuple[bool, ...]:
    """Each flag OR-ed over the processes of a multi-host job (as given in a single process)."""
    return tuple(bool(f) for f in every_process([bool(f) for f in flags]).any(axis=0))


def barrier(name: str) -> None:
    """Waits until every process of a multi-host job reaches the barrier `name` (no-op in one)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def check_same(what: str, value: Any) -> None:
    """Raises ValueError, on every process of a multi-host job alike, where `value` is not the same
    on every process as on process 0; a collective (nothing at all in a single process). A job's
    processes must run the same command on the same inputs: a flag that differs (--max-new-tokens
    on one host) sends them into different collectives, and a file that differs under the same path
    (a host's own copy of the data or of a checkpoint) gives a result with no error at all.

    `value`: dicts, lists and tuples of scalars, strings and arrays, compared by content (an array
    that spans processes, which no process holds whole, by its shape and dtype only)."""
    if jax.process_count() == 1:
        return
    h = hashlib.sha256()
    _feed(h, value)
    differ, _ = _differing({what: h.digest()})
    if differ:
        raise ValueError(f"{what} differs between the job's processes: {_against_0(differ)}")


def check_same_files(what: str, directory: str | os.PathLike, patterns: Iterable[str]) -> None:
    """Raises ValueError, on every process of a multi-host job alike, where the files of
    `directory` that match `patterns` (glob patterns, top level only) are not the same on every
    process as on process 0, by name and content; the error names the files that differ. A
    collective (nothing at all in a single process).

    Each host loads its own copy of a checkpoint, and a jit over a mesh that spans hosts trusts
    every process to feed it the same weights: a host with another version of the weights (or of
    the tokenizer) gives a result with no error at all."""
    if jax.process_count() == 1:
        return
    directory = Path(directory)
    names = sorted({p.name for pattern in patterns for p in directory.glob(pattern) if p.is_file()})
    check_same(f"which files {what} has ({', '.join(names) or 'none'} on process {jax.process_index()})", names)
    if not names:
        return
    _check_each(what, {name: _file_digest(directory / name) for name in names})


def _check_each(what: str, digests: dict[str, bytes], shown: dict[str, str] | None = None) -> None:
    """Raises ValueError, on every process alike, naming the keys whose digests are not process
    0's on every process (with this process's `shown` value of each, where given)."""
    differ, keys = _differing(digests)
    if differ:
        named = [f"{k} ({shown[k]} on process {jax.process_index()})" if shown else k for k in keys]
        raise ValueError(f"{what}: {', '.join(named)} differ{'s' * (len(keys) == 1)} between the job's processes: "
                         f"{_against_0(differ)}")


def _differing(digests: dict[str, bytes]) -> tuple[list[int], list[str]]:
    """(the processes, the keys) whose digests (their first 16 bytes) are not process 0's; one
    collective for all the keys."""
    rows = np.stack([np.frombuffer(d[:16], np.int32) for d in digests.values()])
    table = every_process(rows.reshape(-1)).reshape(jax.process_count(), *rows.shape)
    return ([p for p in range(len(table)) if (table[p] != table[0]).any()],
            [k for i, k in enumerate(digests) if (table[:, i] != table[0, i]).any()])


def _against_0(processes: list[int]) -> str:
    return f"process{'es' * (len(processes) > 1)} {', '.join(map(str, processes))} against process 0"


def check_shared_dir(what: str, directory: str | os.PathLike, *, wait_s: float | None = None) -> None:
    """Raises ValueError, on every process of a multi-host job alike, unless `directory` is one
    directory that every process sees: a shared filesystem, mounted at the same path on every
    host. Process 0 makes it if it does not exist. A collective (nothing at all in a single
    process). Call it before any process decides anything from what the directory holds.

    Process 0 writes a file under a fresh random name there, and every other process looks for it
    for up to `wait_s` seconds (default SHARED_DIR_WAIT_S; a network filesystem may show a new file
    late). Without this check, a run directory that is each host's own leaves orbax waiting forever
    for the other hosts' parts of a checkpoint, with no message; a data directory, the other hosts
    failing to read files that only process 0's copy has."""
    if jax.process_count() == 1:
        return
    directory, pid = Path(directory), jax.process_index()
    token = int(every_process([secrets.randbits(31) if pid == 0 else 0])[0, 0])
    probe = directory / f"{_PROBE}{token}"
    problem = ""
    if pid == 0:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe.write_text("each process of a multi-host job looks for this file; process 0 removes it\n")
        except OSError as e:
            problem = f"process 0 cannot write there ({e.strerror or e})"
    if any_process(bool(problem))[0]:  # every process raises alike, whichever failed
        raise ValueError(f"{what} {str(directory)!r}: {problem or 'process 0 cannot write there'}")
    deadline = time.monotonic() + (SHARED_DIR_WAIT_S if wait_s is None else wait_s)
    while not (seen := probe.exists()) and time.monotonic() < deadline:
        time.sleep(0.2)
    table = every_process([seen])
    if pid == 0:
        with contextlib.suppress(OSError):
            probe.unlink()
    barrier("tevjax-shared-dir-probed")  # so that no process finds the probe in what it reads next
    blind = [p for p in range(len(table)) if not table[p, 0]]
    if blind:
        raise ValueError(f"{what} {str(directory)!r} is not a directory that the job's processes share: "
                         f"process{'es' * (len(blind) > 1)} {', '.join(map(str, blind))} cannot see a file that "
                         f"process 0 wrote there. It must be on a filesystem that every host mounts at that path.")


_PROBE = ".tevjax-shared-"


def holds_files(directory: str | os.PathLike) -> bool:
    """Whether `directory` exists and holds anything but `check_shared_dir`'s probe, which another
    host's view of a network filesystem may still list for a moment after it is removed."""
    directory = Path(directory)
    return directory.exists() and any(not p.name.startswith(_PROBE) for p in directory.iterdir())


def _file_digest(path: Path) -> bytes:
    """The first 16 bytes of the file's SHA-256 (about 1 GB/s here; read in chunks, so a file of
    any size costs 1 MiB of memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.digest()[:16]


def _feed(h, value: Any) -> None:
    if isinstance(value, dict):
        h.update(b"{")
        for key in sorted(value, key=repr):
            _feed(h, key)
            _feed(h, value[key])
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"[")
        for item in value:
            _feed(h, item)
        h.update(b"]")
    elif isinstance(value, (np.ndarray, jax.Array)):
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):  # typed keys have no numpy form
            value = jax.random.key_data(value)
        h.update(repr((str(value.dtype), tuple(value.shape))).encode())
        if getattr(value, "is_fully_addressable", True):  # bytes as they are: no copy, any dtype (bf16)
            h.update(np.ascontiguousarray(np.asarray(value)).reshape(-1).view(np.uint8))
    else:
        h.update(repr(value).encode())


def initialize_distributed(coordinator: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, log: Callable[[str], None] | None = None,
                           timeout_s: float = JOIN_TIMEOUT_S,
                           heartbeat_timeout_s: int = HEARTBEAT_TIMEOUT_S) -> bool:
    """Runs `jax.distributed.initialize` for a multi-host job; returns whether it did.

    Flags win over the environment: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID
    (the last two are read here; jax itself reads only the first). With a coordinator but no
    process count, or under SLURM / Open MPI, JAX's cluster auto-detection fills in the rest. A
    single-host run without any of them does nothing. A joined process watches for another's
    failure (`abort_job`), and its uncaught exceptions end the job.

    `log` hears, before the wait, which job is being joined. Every process waits up to
    `timeout_s` for the others to join, and then exits with status 1 and a message that says
    so. (jax.distributed alone aborts it with a stack trace that blames "another task" that
    "died", though the one missing may never have started.)

    A joined process that stops sending heartbeats for `heartbeat_timeout_s` (a whole number of
    seconds, as jax takes it) is taken for dead, and jax aborts the others. Shorter finds a killed
    host sooner; too short aborts a healthy job whose host stalls (swapping, a paused VM).
    """
    # Infinite would reach jax as int(inf), a raw OverflowError (and kill the timer thread first).
    if not 0 < timeout_s < float("inf"):
        raise ValueError(f"a join timeout of {timeout_s} s: it must be positive and finite")
    if not is_int(heartbeat_timeout_s) or heartbeat_timeout_s < 1:
        raise ValueError(f"a heartbeat timeout of {heartbeat_timeout_s!r} s: it must be a whole number of "
                         f"seconds, at least 1")
    if jax.distributed.is_initialized():  # already joined (the CLI joins before its checks, then again)
        return True
    env = os.environ

    def env_int(name):
        if name not in env:
            return None
        try:
            return int(env[name])
        except ValueError:
            raise ValueError(f"{name}={env[name]!r} is not an integer") from None

    from_flags = coordinator is not None
    coordinator = coordinator or env.get("JAX_COORDINATOR_ADDRESS")
    # The process count and id that only the environment gives (the CLI refuses such flags itself).
    from_env = [name for name, given in (("JAX_NUM_PROCESSES", num_processes), ("JAX_PROCESS_ID", process_id))
                if given is None and name in env]
    num_processes = num_processes if num_processes is not None else env_int("JAX_NUM_PROCESSES")
    process_id = process_id if process_id is not None else env_int("JAX_PROCESS_ID")
    log = log or (lambda _: None)
    waits = f"waiting up to {timeout_s:g} s for every process"
    if coordinator is not None and num_processes is not None and process_id is not None:
        if num_processes < 1:
            raise ValueError(f"a job of {num_processes} processes (--num-processes / JAX_NUM_PROCESSES): "
                             f"it needs at least 1")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"process id {process_id} (--process-id / JAX_PROCESS_ID) is not in "
                             f"0..{num_processes - 1}, the ids of a job of {num_processes} processes")
        log(f"joining the job at {coordinator} as process {process_id} of {num_processes}, {waits}")
        _join_within(timeout_s, f"process {process_id} of {num_processes}: the job at {coordinator}",
                     coordinator_address=coordinator, num_processes=num_processes, process_id=process_id,
                     heartbeat_timeout_seconds=int(heartbeat_timeout_s))
    elif from_flags:
        raise ValueError("--coordinator needs --num-processes and --process-id")
    elif coordinator is not None or any(v in env for v in ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE")):
        log(f"joining the job that JAX's cluster detection finds, {waits}")
        _join_within(timeout_s, "this process: the job that JAX's cluster detection finds",
                     heartbeat_timeout_seconds=int(heartbeat_timeout_s))
    elif from_env and ((num_processes or 1) > 1 or (process_id or 0) != 0):
        # A launcher that set these but not the coordinator: each host would run the whole job
        # alone, every one of them writing the same run or data directory.
        given = ", ".join(f"{name}={env[name]}" for name in from_env)
        raise ValueError(f"{given} ask for a process of a multi-host job, but no coordinator is given: set "
                         f"JAX_COORDINATOR_ADDRESS (or --coordinator), or unset {' and '.join(from_env)} to run alone")
    else:
        return False
    log(f"joined: process {jax.process_index()} of {jax.process_count()}, {jax.device_count()} devices in all")
    _watch_for_abort()
    if jax.process_count() > 1:
        software = _software()
        _check_each("the installed software", {k: hashlib.sha256(v.encode()).digest() for k, v in software.items()},
                    software)
    return True


_PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "ml_dtypes", "transformers")


def _software() -> dict[str, str]:
    """What each host must have installed alike: tevjax's own source (a host with an older
    checkout runs other programs, and sends its collectives out of step or computes other values
    in silence), the packages it computes with, and Python."""
    from importlib import metadata

    h = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    software = {"tevjax source": f"sha256 {h.hexdigest()[:12]}", "Python": sys.version.split()[0]}
    for package in _PACKAGES:
        try:
            software[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            software[package] = "not installed"
    return software


def _join_within(timeout_s: float, job: str, **kwargs) -> None:
    """jax.distributed.initialize, ended by this process after `timeout_s` with a message that
    says what happened. jax's own deadline is set later, so that this one comes first; its wait
    releases the GIL, so a timer thread runs meanwhile."""
    joined = threading.Event()

    def give_up():
        if joined.is_set():
            return
        print(f"tevjax: error: {job} was not joined by every process within {timeout_s:g} s. Every host must "
              f"start the same command, with the same coordinator and number of processes, within the join "
              f"timeout (--join-timeout) of the first; a host that failed before joining leaves the others "
              f"waiting here.", file=sys.stderr, flush=True)
        os._exit(1)

    timer = threading.Timer(timeout_s, give_up)
    timer.daemon = True
    timer.start()
    try:
        jax.distributed.initialize(initialization_timeout=int(timeout_s) + _JAX_JOIN_MARGIN_S, **kwargs)
    finally:
        joined.set()
        timer.cancel()


_JAX_JOIN_MARGIN_S = 30


# One process's failure ends the whole job. Without this, a host that raises leaves the others
# waiting in their next collective, and itself in jax.distributed's shutdown barrier: 300 s
# (shutdown_timeout) before both abort, or 100 s (heartbeat_timeout) if it exits without that
# barrier, each with a coordination-service message that does not say what failed. Instead, the
# failing process leaves its reason in the job's key-value store under every other process's
# _ABORT key and exits at once; each process's watchdog thread waits on its own key, prints the
# reason and exits too.
#
# The store lives in process 0, and once it is gone jax's client aborts any process still
# running ("detected fatal errors"), with that message rather than the reason. So process 0
# exits last: before it does, it waits until every other process has acknowledged (_ACK), as
# each does just before it exits.
_ABORT, _ACK = "tevjax/abort/{}", "tevjax/abort_ack/{}"
_ACK_WAIT_S = 5.0
_job: tuple[Any, int, int] | None = None  # (key-value client, this process, processes) once joined


def _kv_client():
    """The job's key-value client, or None. jax has no public accessor for it (orbax reads this
    same private attribute): should a jax release move it, jobs run as before, without the
    failure watch, and say so."""
    try:
        from jax._src.distributed import global_state

        return global_state.client
    except (ImportError, AttributeError):
        print("tevjax: note: this jax release does not expose the job's key-value store where tevjax looks for "
              "it; a failing host will not end the others early", file=sys.stderr, flush=True)
        return None


def _exit_job(code: int) -> None:
    """Exits this process of a failing job: process 0 (the store's host) only after the others
    have acknowledged, or _ACK_WAIT_S has passed."""
    client, pid, count = _job
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        client.key_value_set(_ACK.format(pid), "1", allow_overwrite=True)
    except Exception:  # noqa: BLE001 - the store is gone: nobody waits for this process
        pass
    if pid == 0:
        deadline = time.monotonic() + _ACK_WAIT_S
        for other in range(1, count):  # a process that died without a word never acknowledges
            try:
                client.blocking_key_value_get(_ACK.format(other), max(1, int(1000 * (deadline - time.monotonic()))))
            except Exception:  # noqa: BLE001
                pass
        time.sleep(0.2)  # so the acknowledged processes have exited when the store goes
    os._exit(code)


def _watch_for_abort() -> None:
    """Starts this process's abort watchdog and routes uncaught exceptions to `abort_job`."""
    global _job
    client, pid, count = _kv_client(), jax.process_index(), jax.process_count()
    if client is None or count == 1 or _job is not None:
        return
    _job = (client, pid, count)

    stopping = threading.Event()

    def watch():
        while not stopping.is_set():
            try:  # the wait releases the GIL; it is renewed hourly so no RPC deadline is reached
                why = client.blocking_key_value_get(_ABORT.format(pid), 3_600_000)
            except Exception as e:  # noqa: BLE001 - a renewed wait, or the store is gone
                if "DEADLINE_EXCEEDED" in str(e):
                    continue
                return  # the job was shut down, or the store's host exited (jax's error polling ends this one)
            if not why:  # woken by shut_down below
                return
            print(f"tevjax: stopping process {pid} of {count}: {why}", file=sys.stderr, flush=True)
            _exit_job(1)

    watcher = threading.Thread(target=watch, name="tevjax-abort-watch", daemon=True)
    watcher.start()

    def shut_down():
        # At exit, jax.distributed's shutdown waits in a barrier until every process reaches it.
        # It runs here, before jax's own exit handler (registered earlier, so run later), with the
        # watchdog still watching: a process that fails while this one waits (it finished first)
        # ends this one too, at once, rather than after jax's heartbeat timeout and an abort.
        # Then the watchdog is woken and joined: a daemon thread whose wait ends during
        # interpreter shutdown aborts the process.
        try:
            jax.distributed.shutdown()
        except Exception as e:  # noqa: BLE001 - jax's own handler would meet the same
            print(f"tevjax: note: leaving the job: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        stopping.set()
        with contextlib.suppress(Exception):  # the store is gone with the job, and the wait with it
            client.key_value_set(_ABORT.format(pid), "", allow_overwrite=True)
        watcher.join(timeout=_ACK_WAIT_S)

    atexit.register(shut_down)
    previous = sys.excepthook

    def excepthook(kind, value, tb):
        previous(kind, value, tb)
        abort_job(f"{kind.__name__}: {value}", 130 if issubclass(kind, KeyboardInterrupt) else 1)

    sys.excepthook = excepthook


def abort_job(why: str, code: int = 1) -> None:
    """Ends a multi-host job joined by `initialize_distributed`: this process exits now with
    `code`, and every other one within seconds with 1, printing `why` and which process failed.
    Returns without doing anything in a single-process run. Uncaught exceptions call it; so does
    the CLI on any error, after printing it."""
    if _job is None:
        return
    client, pid, count = _job
    for other in range(count):
        if other != pid:
            try:
                client.key_value_set(_ABORT.format(other), f"process {pid} failed: {why}", allow_overwrite=True)
            except Exception:  # noqa: BLE001 - the store is gone: its host's exit already ends the job
                break
    _exit_job(code)
