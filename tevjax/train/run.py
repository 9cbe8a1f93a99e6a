"""A training run on disk: configuration, orbax checkpoints with exact resume, logs, export.

    RUN_DIR/
      run.json          the training config, the drafter config, the data directory and target
      log.jsonl         one JSON line per logged step and per held-out evaluation
      checkpoints/<s>/  orbax checkpoints (drafter params, optimizer state, step, PRNG key; the data
                        position is the step) -- the last `keep` are kept

Exact resume: a step is a pure function of (state, batch), the batch of step s is a pure function
of (seed, s), and the checkpoint holds the whole state bit for bit, so a run of all its steps
straight and one of half of them, a stop, then `--resume` for the rest end with identical
parameters. Orbax writes every checkpoint to a temporary directory and renames it into place when
complete, so a crash during a save leaves the previous checkpoint intact (an unfinished one is
never listed); a run that crashed before its first checkpoint resumes from step 0.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np
from flax import nnx

from tevjax.convert.dflash_ckpt import INDEX_FILE, SAFETENSORS_FILE
from tevjax.models.dflash import DFlashConfig, DFlashDrafter, check_draft_vocab
from tevjax.multihost import any_process, barrier, check_same, check_shared_dir, holds_files
from tevjax.sharding import global_batch_array, make_mesh, process_rows
from tevjax.storage import DISK_FULL, WriteError, check_space, failure, free_bytes, short_of_space, space_message
from tevjax.train.dataset import Batch, TrainData
from tevjax.train.rollout import settings_diff, write_json_atomic
from tevjax.train.step import TrainConfig, Trainer, TrainState

__all__ = ["RunError", "WriteError", "export_run", "load_run", "train"]

RUN_FILE = "run.json"
CKPT_DIR = "checkpoints"
LOG_FILE = "log.jsonl"
DRAFT_VOCAB_FILE = "draft_vocab.npy"  # the run's draft vocabulary (a reduced one only)
# In a multi-host run the processes agree every this many steps whether to checkpoint, evaluate or
# stop: agreeing is a collective, and a host sync per step would stall the step pipeline.
AGREE_EVERY = 10


class RunError(ValueError):
    """A run directory that cannot be used as asked (exists, mismatched, corrupt)."""


def _check_seq_len(data: TrainData, seq_len: int, log: Callable[[str], None]) -> None:
    """Refuses a sequence length that crops every record before its response (the run would
    train on nothing: zero blocks, a loss of 0), and notes how many records it crops so."""
    cropped = data.cropped(seq_len)
    lost = int(cropped.sum())
    if lost == len(cropped):
        first = data.first_supervised()
        prompts = first[first >= 1]
        shortest = f"; the shortest prompt is {int(prompts.min())} tokens" if prompts.size else ""
        raise RunError(f"--seq-len {seq_len} crops all {len(cropped)} training records before their responses, "
                       f"so there is nothing to train on{shortest}")
    if lost:
        log(json.dumps({"event": "note", "note": f"--seq-len {seq_len} crops {lost} of {len(cropped)} training "
                                                 f"records before their responses; they add nothing"}))


def _checkpoint_manager(run_dir: Path, keep: int = 3, *, cleanup: bool = False):
    """`cleanup`: remove the temporary directories of saves that a kill cut short. Only the run's
    own trainer asks: an export beside a live run would remove the save in progress."""
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True,
                                           cleanup_tmp_directories=cleanup)
    return ocp.CheckpointManager((run_dir / CKPT_DIR).absolute(), options=options)


@jax.jit
def _finite(state) -> jax.Array:
    """One scalar, the same on every process: every float of the state (weights and optimizer
    moments) is finite. A diverged step turns them to NaN, and such a state is never saved."""
    leaves = [x for x in jax.tree.leaves(state) if jax.numpy.issubdtype(x.dtype, jax.numpy.inexact)]
    return jax.numpy.all(jax.numpy.stack([jax.numpy.isfinite(x).all() for x in leaves]))


class DivergedError(RunError):
    """The training state stopped being finite; nothing of it was saved."""


def _settle(mgr) -> None:
    """Waits for `mgr`'s saves in flight, whatever their outcome: a stopped run's message then says
    which checkpoints it keeps (orbax lists a save in flight until it is known to have failed, then
    drops it)."""
    try:
        mgr.wait_until_finished()
    except Exception:  # noqa: BLE001 - the failed save is left out of what the message lists
        pass


def _kept(mgr) -> str:
    """What a diverged run leaves: its last checkpoint (finite: no other kind is saved)."""
    _settle(mgr)
    last = mgr.latest_step()
    return f"the last checkpoint, step {last}, is finite and kept" if last is not None else "no checkpoint was written"


def _complete_steps(where: Path) -> list[int]:
    """The steps of the complete checkpoints under `where`, read from disk: orbax lists a save it
    has begun as the latest step until `wait_until_finished` reports its failure, and drops the
    steps that save would remove from its list before the save is complete."""
    return sorted(int(p.name) for p in where.iterdir() if p.name.isdigit()) if where.is_dir() else []


def _write_failed(where: Path, what: str, e: BaseException) -> WriteError:
    """A checkpoint write that failed (orbax raises many types, tensorstore's text in them)."""
    why = failure(e)
    return WriteError(f"writing {what} under {where} failed ({why}); {_resumable(where, full=why == DISK_FULL)}")


def _resumable(where: Path, mgr=None, *, full: bool = True) -> str:
    """What a stopped run keeps under `where`, once `mgr`'s saves in flight are done, and how to go
    on (`full`: the write stopped for want of space, not for another failure)."""
    if mgr is not None:
        _settle(mgr)
    steps = _complete_steps(where)
    kept = f"the last complete checkpoint, step {steps[-1]}, is kept" if steps else "no checkpoint was written yet"
    return f"{kept}: {'free some space, then ' if full else 'once that is fixed, '}rerun the same command with --resume"


def _save(mgr, state: TrainState, meta: dict, where: Path) -> None:
    """Saves a checkpoint (written in the background while training goes on) under `where`, the
    run's checkpoint directory, once the state is known to be finite and to fit on the disk."""
    import orbax.checkpoint as ocp

    if not bool(_finite(state)):
        raise DivergedError(f"step {meta['step']}: training diverged (non-finite weights or optimizer state; lower "
                            f"--lr?): not saved; {_kept(mgr)}")
    failed = None
    try:  # the previous save: its space is then counted, and its failure named, before this one
        mgr.wait_until_finished()
    except Exception as e:  # noqa: BLE001 - whatever orbax raised, the run stops here
        failed = e
    step = int(state.step)
    need = sum(x.nbytes for x in jax.tree.leaves(state))  # global arrays: every host's part
    free = short_of_space(where, need)
    # Agreed: every process writes its part of each checkpoint, so all of them save or none does,
    # and a save that failed on one host stops them all.
    any_failed, any_short = any_process(failed is not None, free is not None)
    if failed is not None:
        raise _write_failed(where, "a checkpoint", failed)
    if any_failed:
        raise WriteError(f"writing a checkpoint under {where} failed on another process of the job; "
                         f"{_resumable(where, full=False)}")
    if any_short:
        free = free_bytes(where) if free is None else free
        raise WriteError(f"{space_message(f'checkpoint {step}', where, need, free)}; {_resumable(where)}")
    try:
        mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
    except Exception as e:  # noqa: BLE001
        raise _write_failed(where, f"checkpoint {step}", e) from None


def _restore(mgr, abstract: TrainState, run_dir: Path) -> tuple[TrainState, dict]:
    import orbax.checkpoint as ocp

    step = mgr.latest_step()
    if step is None:
        raise RunError(f"{run_dir}: no complete checkpoint to resume from")
    try:
        out = mgr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                        meta=ocp.args.JsonRestore()))
    except Exception as e:  # orbax raises many types for damaged files; name the checkpoint
        raise RunError(f"{run_dir / CKPT_DIR / str(step)}: checkpoint is corrupt or does not match this "
                       f"drafter ({type(e).__name__}: {str(e).splitlines()[0][:300]})") from None
    got = jax.tree.map(lambda x: (x.shape, x.dtype), out.state)
    want = jax.tree.map(lambda x: (x.shape, x.dtype), abstract)
    if got != want:
        raise RunError(f"{run_dir / CKPT_DIR / str(step)}: checkpoint shapes do not match this drafter")
    if not bool(_finite(out.state)):  # written by a run that diverged before tevjax refused to save it
        raise RunError(f"{run_dir / CKPT_DIR / str(step)}: checkpoint holds non-finite values (the run diverged); "
                       "remove that step's directory to resume from the one before it")
    return out.state, out.meta


def _global_batch(data: TrainData, columns: list[int], cfg: TrainConfig, step: int, mesh) -> Batch:
    """Global batch `step`, of which this process reads only the rows its devices hold: a disjoint
    slice each where the mesh's `data` axis splits the batch between the processes, the same rows
    on each process that shares a slice (a `model` axis across hosts)."""
    rows = data.order(cfg.seed, step, cfg.batch_size)[process_rows(mesh, cfg.batch_size)]
    host = data.batch(rows, columns, cfg.seq_len)
    return Batch(**{k: global_batch_array(mesh, v, cfg.batch_size) for k, v in host.items()})


def _run_record(cfg: TrainConfig, dcfg: DFlashConfig, data_dir: Path, target: str, shards: list[str]) -> dict:
    return {"train": dataclasses.asdict(cfg), "drafter": dcfg.to_hf_config(),
            "drafter_dtype": {"dtype": dcfg.dtype, "param_dtype": dcfg.param_dtype},
            "data": str(Path(data_dir).absolute()), "target": target, "train_shards": shards}


def _read_draft_vocab(run: Path, dcfg: DFlashConfig):
    try:
        return check_draft_vocab(np.load(run / DRAFT_VOCAB_FILE), dcfg)
    except (OSError, ValueError) as e:
        raise RunError(f"{run / DRAFT_VOCAB_FILE}: unreadable draft vocabulary ({e})") from None


def load_run(run_dir: str | os.PathLike) -> dict:
    path = Path(run_dir) / RUN_FILE
    if not path.is_file():
        raise RunError(f"{run_dir}: no {RUN_FILE} (not a tevjax training run)")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunError(f"{path}: unreadable ({e})") from None


def check_run_out(run_dir: str | os.PathLike, resume: bool) -> None:
    """Raises unless `run_dir` suits the mode: a new or empty directory to start a run, or (`resume`)
    one that holds a run. `tevjax train` calls it before the target loads, `train` again."""
    run = Path(run_dir)
    if run.exists() and not run.is_dir():
        raise RunError(f"--out {str(run)!r} is a file, not a directory")
    if (run / RUN_FILE).exists():
        if not resume:
            raise RunError(f"{run} already holds a training run: pass --resume to continue it, or choose a new --out")
    elif resume:
        raise RunError(f"--resume: {run} holds no training run to resume")
    # A start killed before run.json was in place leaves its draft vocabulary (written first, since
    # a resume reads it) and perhaps run.json's temporary file: no run, and a new start rewrites them.
    elif holds_files(run) and {p.name for p in run.iterdir()} - {DRAFT_VOCAB_FILE, RUN_FILE + ".tmp"}:
        raise RunError(f"{run} exists and is not empty: choose a new --out")


def train(target, drafter: DFlashDrafter, data_dir: str | os.PathLike, run_dir: str | os.PathLike,
          cfg: TrainConfig, *, target_name: str, resume: bool = False, until: int | None = None,
          mesh=None, checkpoint_every_s: float = 300.0, eval_every_s: float = 600.0, keep: int = 3,
          heldout_records: int = 32, progress: bool = True, log: Callable[[str], None] = print) -> TrainState:
    """Trains `drafter` (fresh or from --init) on a data directory, or resumes the run in `run_dir`.

    `until` stops early after that step, with a checkpoint (for staged runs and the resume test).
    SIGTERM and Ctrl-C also stop with a checkpoint of the last completed step: the returned state's
    step then falls short of `until` or `cfg.steps` (and `tevjax train` exits 130).
    """
    from tevjax.train.heldout import HeldoutEval

    run = Path(run_dir)
    # Multi-host: orbax writes each checkpoint from every host into this one directory (a host's
    # own would leave it waiting forever), and every host must find the same run in it.
    check_shared_dir("the run directory (--out)", run)
    check_run_out(run, resume)
    saved = None
    if resume:
        saved = load_run(run)
        # Runs started before the distillation and exit-truncation options trained without them.
        for name, off in (("distill", 0.0), ("exit_top_k", 0), ("exit_top_p", 1.0), ("exit_min_p", 0.0)):
            saved.get("train", {}).setdefault(name, off)
    # A resume reads the shards the run started with, even if `tevjax data` has added more since.
    data = TrainData(data_dir, "train", shards=saved.get("train_shards") if saved else None)
    columns = data.tap_columns(drafter.cfg.target_layer_ids)
    _check_seq_len(data, cfg.seq_len, log)
    record = _run_record(cfg, drafter.cfg, Path(data_dir), target_name, data.shard_names)
    record = json.loads(json.dumps(record))
    vocab_file = run / DRAFT_VOCAB_FILE
    if saved is not None:
        diffs = settings_diff(saved, record)
        if diffs:
            raise RunError(f"--resume: {run} was started with other settings: " + "; ".join(diffs[:6]))
        if drafter.draft_vocab is not None:  # the run's own draft vocabulary, not one recounted now
            drafter.draft_vocab.set_value(_read_draft_vocab(run, drafter.cfg))

    mesh = mesh or make_mesh()
    # Before anything is written: a drafter, config or mesh the Trainer refuses leaves no run behind.
    trainer = Trainer(drafter, target, cfg, mesh)
    nproc, pid = jax.process_count(), jax.process_index()
    # Multi-host: every process trains the same drafter on the same data with the same settings
    # (a host's own copy of DATA or of the initial drafter would otherwise differ in silence).
    check_same("the run's settings", record)
    check_same(f"the data manifest of {data_dir}", data.manifest)
    check_same("the initial drafter's parameters", jax.tree_util.tree_leaves(nnx.state(drafter)))
    # RUN_DIR is shared, so every process checks it (above) before process 0 writes it; otherwise
    # a slower host would find the new run.json and refuse the run as existing.
    barrier("tevjax-train-checked")
    if saved is None and pid == 0:
        run.mkdir(parents=True, exist_ok=True)
        if drafter.draft_vocab is not None:  # on disk before run.json, which a resume takes as the run's
            with open(vocab_file, "wb") as f:
                np.save(f, np.asarray(jax.device_get(drafter.vocab_ids()), np.int32))
                f.flush()
                os.fsync(f.fileno())
        else:  # a killed earlier start's (check_run_out lets it stand), which this run has none of
            vocab_file.unlink(missing_ok=True)
        write_json_atomic(run / RUN_FILE, record)
    barrier("tevjax-train-written")
    mgr = _checkpoint_manager(run, keep, cleanup=True)
    if resume and mgr.latest_step() is not None:
        state, meta = _restore(mgr, trainer.abstract_state(), run)
        log(json.dumps({"event": "resume", "step": int(state.step), "checkpoint_meta": meta}))
    else:
        # A run killed after writing run.json but before its first checkpoint finished has nothing
        # to restore: it starts over from step 0 (the settings matched above), as it first did.
        if resume:
            log(json.dumps({"event": "resume", "step": 0, "note": "no checkpoint yet: starting from step 0"}))
        state = trainer.init_state()
    try:
        held = TrainData(data_dir, "heldout")
    except FileNotFoundError:
        heldout = None
    else:
        heldout = HeldoutEval(held, columns, records=heldout_records, seq_len=cfg.seq_len)
        cropped = held.cropped(cfg.seq_len)[:heldout_records]  # HeldoutEval's records
        if cropped.all():  # it would report zeros
            log(json.dumps({"event": "note", "note": f"no held-out evaluation: --seq-len {cfg.seq_len} crops all "
                                                     f"{len(cropped)} held-out records before their responses"}))
            heldout = None

    # SIGTERM and a first Ctrl-C stop after the current step (with a checkpoint; multi-host, at the
    # next agreed step); a second Ctrl-C interrupts at once. Raising inside a step could lose the
    # donated state, so the first only asks.
    stop = {"signal": None}

    def on_signal(signum, _frame):
        if stop["signal"] is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stop["signal"] = signum

    old_handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    last_step = min(cfg.steps, until) if until is not None else cfg.steps
    start = int(state.step)
    bar = None
    if progress and pid == 0:
        from tqdm import tqdm

        bar = tqdm(total=last_step, initial=start, unit="step", desc="tevjax train", dynamic_ncols=True)
    log_path = run / LOG_FILE
    if resume and pid == 0 and log_path.exists():
        # A kill (or power loss) mid-append can leave a torn last line; the next entry would be
        # glued to it. Cut it back to the last complete line.
        with open(log_path, "rb+") as f:
            text = f.read()
            if text and not text.endswith(b"\n"):
                f.truncate(text.rfind(b"\n") + 1)
    t_ckpt = t_eval = time.monotonic()
    # Blocks of every step are summed on the device (no host sync per step) and read when logged.
    t0, blocks = time.monotonic(), jax.numpy.zeros((), jax.numpy.float32)

    def meta_now(step):
        return {"step": step, "data_position": step * cfg.batch_size, "seed": cfg.seed, "records": len(data)}

    def write_log(entry):
        entry = {**entry, "time": round(time.time(), 1)}  # wall clock, for the run's time line
        if pid == 0:
            try:
                with open(log_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(entry) + "\n")
            except OSError as e:  # a torn last line is cut on --resume (above)
                why = failure(e)
                raise WriteError(f"writing {log_path} failed ({why}); "
                                 f"{_resumable(run / CKPT_DIR, mgr, full=why == DISK_FULL)}") from None

    unwinding = None  # the error or interrupt on its way out of the loop, if any
    try:
        for step in range(start, last_step):
            state, metrics = trainer.step(state, _global_batch(data, columns, cfg, step, mesh))
            blocks = blocks + metrics["blocks"]
            if bar is not None or (step + 1) % 10 == 0 or step + 1 == last_step:
                m = {k: float(v) for k, v in jax.device_get(metrics).items()}
                if any(not math.isfinite(v) for v in m.values()):
                    raise DivergedError(f"step {step + 1}: training diverged (lower --lr?): non-finite training "
                                        f"metrics {m}; {_kept(mgr)}")
                rate = float(blocks) / max(time.monotonic() - t0, 1e-9)
                entry = {"step": step + 1, **{k: round(v, 5) for k, v in m.items()}, "blocks_per_s": round(rate, 2)}
                write_log(entry)
                if bar is not None:
                    bar.update(1)
                    extra = f" exit {m['loss_exit']:.4f}" if "loss_exit" in m else ""
                    bar.set_postfix_str(f"tok {m['loss_tok']:.3f}{extra} acc1 {m['acc1']:.2f} {rate:.1f} blocks/s")
            if nproc > 1 and (step + 1) % AGREE_EVERY and step + 1 != last_step:
                continue
            now = time.monotonic()
            want_eval, want_ckpt, want_stop = any_process(
                heldout is not None and now - t_eval >= eval_every_s, now - t_ckpt >= checkpoint_every_s,
                stop["signal"] is not None)
            if want_eval:
                ev = heldout(trainer.drafter(state), target)
                write_log({"step": step + 1, "heldout": ev})
                log(json.dumps({"step": step + 1, "heldout": {k: round(v, 4) for k, v in ev.items()}}))
                t_eval = time.monotonic()
            if want_ckpt:
                _save(mgr, state, meta_now(step + 1), run / CKPT_DIR)
                t_ckpt = now
            if want_stop:
                log(json.dumps({"event": "stopped by signal", "step": step + 1}))
                break
    except BaseException as e:
        # Recorded here, not read from sys.exc_info() in `finally`: that also returns an exception
        # that a caller of train() is handling (train called in an `except` block, a retry).
        unwinding = e
        if isinstance(e, KeyboardInterrupt):
            log(json.dumps({"event": "interrupted", "last_checkpoint": mgr.latest_step()}))
        raise
    finally:
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
        if bar is not None:
            bar.close()
        # In a multi-host job an error on its way out may be this host's alone: the final save's
        # collectives (and orbax's barriers in waiting for a save) would wait for hosts that never
        # join. The CLI's abort_job ends the job; the errors the hosts agree on (a checkpoint that
        # does not fit, a diverged state) have waited for the saves in flight already.
        if nproc == 1 or unwinding is None:
            try:
                try:
                    final = int(state.step)
                    # After a write that failed or would not fit, another save would fail too.
                    if not isinstance(unwinding, WriteError) and mgr.latest_step() != final:
                        _save(mgr, state, meta_now(final), run / CKPT_DIR)
                except (DivergedError, WriteError):  # not saved; the error on its way out (if any) says so
                    if unwinding is None:
                        raise
                except RuntimeError:  # the state was donated to a step that never finished
                    pass
                try:
                    mgr.wait_until_finished()
                except Exception as e:  # noqa: BLE001
                    if unwinding is None:
                        raise _write_failed(run / CKPT_DIR, "the last checkpoint", e) from None
            finally:  # also where the final save raised
                mgr.close()
    if heldout is not None and int(state.step) == cfg.steps:
        ev = heldout(trainer.drafter(state), target)
        write_log({"step": int(state.step), "heldout": ev, "final": True})
        log(json.dumps({"step": int(state.step), "heldout": {k: round(v, 4) for k, v in ev.items()}, "final": True}))
    return state


def _check_export_dir(out: Path, run: Path) -> None:
    """Refuses an export that would replace another model's files or write into a run or data
    directory (`save_dflash` replaces config.json and model.safetensors in an existing one)."""
    from tevjax.train.rollout import MANIFEST

    out = out.absolute()
    if out == run or run in out.parents:
        raise RunError(f"{out}: that is inside the training run {run}; export into a directory of its own")
    if out.exists() and not out.is_dir():
        raise RunError(f"{out} exists and is not a directory")
    for name, what in ((RUN_FILE, "a training run"), (MANIFEST, "a data directory")):
        if (out / name).exists():
            raise RunError(f"{out} holds {what} ({name}); export into a new directory")
    config = out / "config.json"
    weights = [n for n in (SAFETENSORS_FILE, INDEX_FILE) if (out / n).exists()]
    if not config.exists() and weights:
        # Not an earlier export (which has both files): weights of some other model, which the
        # export would replace (a sharded index it would delete).
        raise RunError(f"{out} holds a {weights[0]} but no DFlash drafter's config.json; export into a new "
                       "or empty directory")
    if config.exists():
        try:
            held = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            held = None
        if not isinstance(held, dict) or "dflash_config" not in held:
            kind = held.get("architectures") if isinstance(held, dict) else None
            raise RunError(f"{out} holds another model's config.json{f' ({kind})' if kind else ''}, not a DFlash "
                           "drafter's; export into a new or empty directory")


def export_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike, target_cfg=None, *,
               dtype: str = "bfloat16") -> DFlashConfig:
    """Writes the latest checkpoint's drafter in the public DFlash format (bf16 by default).

    `out_dir` may be new, empty, or an earlier export (its config.json and weights are replaced,
    other files kept); a directory with another model's config.json, a training run or a data
    directory is refused before anything is read."""
    import orbax.checkpoint as ocp

    from tevjax.convert.dflash_ckpt import save_dflash

    run = Path(run_dir).absolute()  # orbax reads absolute paths only
    record = load_run(run)
    _check_export_dir(Path(out_dir), run)
    dcfg = DFlashConfig.from_hf_config(record["drafter"], **record["drafter_dtype"])
    if target_cfg is not None:
        dcfg.check_target(target_cfg)
    drafter = nnx.eval_shape(lambda: DFlashDrafter(dcfg, rngs=nnx.Rngs(0)))
    if drafter.draft_vocab is not None:
        drafter.draft_vocab.set_value(_read_draft_vocab(run, dcfg))
    mgr = _checkpoint_manager(run)
    step = mgr.latest_step()
    if step is None:
        raise RunError(f"{run}: no complete checkpoint to export")
    mgr.close()
    where = run / CKPT_DIR / str(step)
    try:
        # Nested dicts of host (numpy) arrays, from which only the drafter parameters are taken (an
        # export needs no optimizer state). Host arrays, not the saved shardings: the run may have
        # been trained on devices and hosts this process does not have.
        reader = ocp.PyTreeCheckpointer()
        tree = ocp.PyTreeCheckpointHandler().metadata(where / "state").tree
        as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        raw = reader.restore(where / "state", args=ocp.args.PyTreeRestore(restore_args=as_numpy))["params"]
    except Exception as e:  # noqa: BLE001 - orbax raises many types for damaged files; name the checkpoint
        raise RunError(f"{where}: cannot read the drafter parameters ({type(e).__name__}: "
                       f"{str(e).splitlines()[0][:300]})") from None
    for path, var in nnx.iter_graph(drafter):
        if not isinstance(var, nnx.Param):
            continue
        node = raw
        for key in (*map(str, path), "value"):
            if not isinstance(node, dict) or key not in node:
                raise RunError(f"{where}: parameter {'.'.join(map(str, path))} is missing")
            node = node[key]
        value = np.asarray(node)
        if value.shape != var.get_value().shape:
            raise RunError(f"{where}: parameter {'.'.join(map(str, path))} has shape {value.shape}, "
                           f"the run's drafter expects {var.get_value().shape}")
        if not np.isfinite(value).all():  # a checkpoint of a diverged run, written before tevjax refused them
            raise RunError(f"{where}: parameter {'.'.join(map(str, path))} holds non-finite values (the run "
                           "diverged); nothing was exported")
        var.set_value(jax.numpy.asarray(value, var.get_value().dtype))
    out = Path(out_dir)
    then = f"nothing was exported{' (' + str(out) + ' is as it was)' if out.exists() else ''}"
    params = [v.get_value() for _, v in nnx.iter_graph(drafter) if isinstance(v, nnx.Param)]
    need = sum(x.size for x in params) * np.dtype(jax.numpy.dtype(dtype)).itemsize
    check_space(out, need, "the exported drafter", then)
    try:
        save_dflash(drafter, dcfg, out, dtype=dtype)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own type for I/O errors
        if not (isinstance(e, OSError) or type(e).__name__ == "SafetensorError"):
            raise
        raise WriteError(f"writing the exported drafter to {out} failed ({failure(e)}); {then}") from None
    return dcfg
