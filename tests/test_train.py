"""The training system on tiny random models: data generation and its resume, the step (frozen
target, data-parallel equality), orbax checkpoints (exact resume, crash safety, clear errors),
export, training trees == decoder trees, and the CLI's one-line errors."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tevjax.cli import main
from tevjax.convert.dflash_ckpt import load_dflash
from tevjax.decode.engine import DecodeConfig, Decoder, draft, draft_trees
from tevjax.loading import LoadedTarget
from tevjax.models import KVCache, causal_mask
from tevjax.models.dflash import DFlashConfig, DFlashDrafter, draft_vocab_from_counts, features_from_output
from tevjax.seeding import seed_key
from tevjax.sharding import make_mesh
from tevjax.testing import forced_devices_env, random_model, tiny_config
from tevjax.train.dataset import Batch, TrainData
from tevjax.train.heldout import HeldoutEval, greedy_accepted_depth, trajectory_blocks
from tevjax.train.objectives import batch_anchors
from tevjax.train.rollout import FORMAT_VERSION, RolloutConfig, generate_data, read_manifest
from tevjax.train.run import DivergedError, RunError, export_run, train
from tevjax.train.step import TrainConfig, Trainer, loss_terms, teacher_logits

TAPS = (1, 3)
BS = 6


def _target():
    return random_model(tiny_config(num_layers=4), seed=0)


def _loaded(target):
    return LoadedTarget(name="tiny", hf_dir=Path("."), target_cfg=target.cfg, target=target, tokenizer=None,
                        eos_ids=(2,), notes=[])


def _prompts(n, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 300, rng.integers(4, 12)).tolist() for _ in range(n)]


ROLLOUT = RolloutConfig(num_prompts=12, heldout_prompts=4, heldout_records=4, max_new_tokens=20,
                        max_prompt_tokens=64, batch_size=4, taps=TAPS)
PROMPTS = (_prompts(4, 1), _prompts(12, 2))


def _drafter(target, seed=0):
    cfg = DFlashConfig.for_target(target.cfg, num_layers=1, block_size=BS, mask_token_id=5, target_layer_ids=TAPS)
    return DFlashDrafter(cfg, rngs=nnx.Rngs(seed))


# `loss_terms` compiled (the config static): op-by-op it takes ~1.3 s a call, 8 s for the first.
_loss_terms = nnx.jit(loss_terms, static_argnums=4)


@functools.partial(nnx.jit, static_argnums=4)
def _grad_norm(drafter, target, batch, key, cfg):
    """The global norm of the loss's gradients in the drafter's parameters (`nnx.grad`'s default)."""
    return optax.global_norm(nnx.grad(lambda d: loss_terms(d, target, batch, key, cfg)[0])(drafter))


CFG = TrainConfig(steps=4, batch_size=4, anchors=6, seq_len=40, lr=3e-3, exit_lambda=0.1, exit_budget=5,
                  exit_anchors=3)


@pytest.fixture(scope="module")
def target():
    return _target()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory, target):
    out = tmp_path_factory.mktemp("data") / "d"
    generate_data(_loaded(target), ROLLOUT, out, prompts=PROMPTS, progress=False, log=lambda _: None)
    return out


def _records(data_dir, split):
    data = TrainData(data_dir, split)
    return [tuple(data.record(i, [0, 1])[0].tolist()) for i in range(len(data))]


def test_data_directory_holds_greedy_responses_and_features(data_dir, target):
    manifest = read_manifest(data_dir)
    assert manifest["complete"] and set(manifest["shards"]) == {"heldout-00000", "train-00000", "train-00001",
                                                                  "train-00002"}
    data = TrainData(data_dir, "train")
    assert len(data) == 12
    dec = Decoder(target, None, DecodeConfig(max_new_tokens=20, eos_ids=(2,)))
    for i in (0, 7):
        tokens, mask, feats = data.record(i, [0, 1])
        prompt = PROMPTS[1][i]
        gen = dec.generate([prompt])[0].tokens
        assert tokens.tolist() == prompt + gen  # the target's own greedy response
        assert mask.tolist() == [False] * len(prompt) + [True] * len(gen)
        # Features are the decoder's kept hidden states: those of one causal forward over the text,
        # stored as bfloat16 (so equal to within one bfloat16 rounding); the last token has none.
        from tevjax.train.rollout import sequence_hidden

        ref = sequence_hidden(target, [tokens.tolist()], TAPS)[0].astype(np.float32).reshape(len(tokens), -1)
        np.testing.assert_allclose(feats[:-1], ref[:-1], rtol=2 ** -7, atol=1e-5)
        assert not np.any(feats[-1])


def test_batch_features_on_the_device_are_the_stored_features(data_dir, target):
    from tevjax.train.rollout import batch_features

    data = TrainData(data_dir, "train")
    host = data.batch([0, 5, 7, 11], [0, 1], seq_len=40)  # every record is shorter than 40: none cropped
    assert host["length"].min() > 4 and host["length"].max() < 40
    graphdef, state = nnx.split(target)
    got = np.asarray(batch_features(state, jnp.asarray(host["tokens"]), jnp.asarray(host["length"]),
                                    graphdef=graphdef, taps=TAPS))
    assert got.shape == host["features"].shape and got.dtype == np.float32
    # Both are bfloat16 roundings of the same states (the decoder's passes vs one causal forward).
    np.testing.assert_allclose(got, host["features"], rtol=2 ** -7, atol=1e-5)
    for row, n in zip(got, host["length"]):
        assert np.all(np.any(row[: n - 1] != 0, axis=-1)) and not np.any(row[n - 1:])


def test_data_files_reach_the_disk_before_they_are_renamed_into_place(tmp_path, target, monkeypatch):
    """A power loss can keep a rename and lose the bytes it names (an empty manifest.json, which
    --resume refuses, or an empty prompts.jsonl): every file `tevjax data` renames into place is
    fsynced first, as the shards' files are."""
    synced, unsynced = set(), []
    fsync, replace = os.fsync, os.replace

    def recording_fsync(fd):
        synced.add(os.fstat(fd).st_ino)
        fsync(fd)

    def recording_replace(src, dst):
        if os.path.isfile(src) and os.stat(src).st_ino not in synced:
            unsynced.append(os.path.basename(dst))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "replace", recording_replace)
    generate_data(_loaded(target), ROLLOUT, tmp_path / "d", prompts=PROMPTS, progress=False, log=lambda _: None,
                  stop_after_shards=1)
    assert (tmp_path / "d" / "shards" / "heldout-00000").is_dir() and synced
    assert unsynced == []


def test_data_resume_loses_and_duplicates_nothing(tmp_path, data_dir, target):
    out = tmp_path / "d"
    loaded = _loaded(target)
    with pytest.raises(FileNotFoundError, match="holds no data directory to complete"):  # a mistyped path
        generate_data(loaded, ROLLOUT, out, prompts=PROMPTS, resume=True, progress=False, log=lambda _: None)
    assert not out.exists()
    stray = tmp_path / "stray"  # files but no plan: nothing to complete, and not a place to start
    stray.mkdir()
    (stray / "heldout.jsonl").write_text("")
    (stray / "notes.txt").write_text("")
    with pytest.raises(FileExistsError, match="holds files but no manifest.json.*remove it"):
        generate_data(loaded, ROLLOUT, stray, prompts=PROMPTS, resume=True, progress=False, log=lambda _: None)
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        generate_data(loaded, ROLLOUT, stray, prompts=PROMPTS, progress=False, log=lambda _: None)
    # A start killed before its first manifest leaves only its prompt files: nothing to complete,
    # and a new start (without --resume) writes there.
    (stray / "notes.txt").unlink()
    (stray / "prompts.jsonl.tmp").write_text('{"ind')
    with pytest.raises(FileNotFoundError, match="a start stopped before writing its plan.*leave out --resume"):
        generate_data(loaded, ROLLOUT, stray, prompts=PROMPTS, resume=True, progress=False, log=lambda _: None)
    generate_data(loaded, ROLLOUT, stray, prompts=PROMPTS, progress=False, log=lambda _: None, stop_after_shards=1)
    assert read_manifest(stray)["format"] == FORMAT_VERSION
    generate_data(loaded, ROLLOUT, out, prompts=PROMPTS, progress=False, log=lambda _: None, stop_after_shards=2)
    assert not read_manifest(out).get("complete")
    # A crash mid-shard leaves a temporary directory behind; it must not count.
    (out / "shards" / ".tmp-train-00001").mkdir()
    (out / "shards" / ".tmp-train-00001" / "tokens.npy").write_bytes(b"partial")
    with pytest.raises(FileExistsError, match="--resume"):
        generate_data(loaded, ROLLOUT, out, prompts=PROMPTS, progress=False, log=lambda _: None)
    other = RolloutConfig(**{**ROLLOUT.__dict__, "max_new_tokens": 21})
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_data(loaded, other, out, resume=True, progress=False, log=lambda _: None)
    manifest = generate_data(loaded, ROLLOUT, out, resume=True, progress=False, log=lambda _: None)
    assert manifest["complete"] and not (out / "shards" / ".tmp-train-00001").exists()
    for split in ("train", "heldout"):
        assert _records(out, split) == _records(data_dir, split)


def _free_until(monkeypatch, calls: int):
    """`tevjax.storage.free_bytes` as it is for the first `calls` calls, then a full disk (1 KiB)."""
    import tevjax.storage as storage

    real, seen = storage.free_bytes, []

    def free(path):
        seen.append(path)
        return real(path) if len(seen) <= calls else 1024

    monkeypatch.setattr(storage, "free_bytes", free)


def test_a_full_disk_stops_data_at_a_shard_and_resume_completes_it(tmp_path, data_dir, target, monkeypatch):
    """The disk fills before the third shard: `generate_data` stops there with a WriteError that
    names the shard and the space, leaves the two shards before it and no partial one, and a
    resume once there is space makes the records an uninterrupted run makes."""
    from tevjax.storage import WriteError

    out, loaded = tmp_path / "d", _loaded(target)
    _free_until(monkeypatch, 2)
    with pytest.raises(WriteError, match=r"not enough disk space for shard train-00001 under .*shards: it needs about "
                                         r"1\.\d MiB \(\d+ KiB of data .*\), and 1 KiB is free; the shards written "
                                         r"before it are kept: free some space, then resume \(`tevjax data --resume`"):
        generate_data(loaded, ROLLOUT, out, prompts=PROMPTS, progress=False, log=lambda _: None)
    assert sorted(os.listdir(out / "shards")) == ["heldout-00000", "train-00000"]  # nothing partial
    monkeypatch.undo()
    generate_data(loaded, ROLLOUT, out, prompts=PROMPTS, resume=True, progress=False, log=lambda _: None)
    for split in ("train", "heldout"):
        assert _records(out, split) == _records(data_dir, split)


def test_data_train_shard_slices_make_the_single_runs_shards(tmp_path, data_dir, target):
    # Two slices of the plan (a later session, or two hosts) give the records one run gives.
    loaded = _loaded(target)
    out = tmp_path / "d"
    manifest = generate_data(loaded, ROLLOUT, out, prompts=PROMPTS, progress=False, log=lambda _: None,
                             train_shards=(2, 3))
    assert sorted(manifest["shards"]) == ["heldout-00000", "train-00002"] and not manifest["complete"]
    with pytest.raises(ValueError, match="outside the plan's 3"):
        generate_data(loaded, ROLLOUT, out, resume=True, progress=False, log=lambda _: None, train_shards=(1, 4))
    manifest = generate_data(loaded, ROLLOUT, out, resume=True, progress=False, log=lambda _: None,
                             train_shards=(0, 2))
    assert manifest["complete"]
    for split in ("train", "heldout"):
        assert _records(out, split) == _records(data_dir, split)


def test_shard_records_and_summaries_describe_the_records(data_dir):
    """records.json gives each record its prompt's index, the prompt and response lengths that its
    tokens and loss mask show, and its stop reason; the manifest's per-shard summary adds them up."""
    manifest = read_manifest(data_dir)
    for split, prompts in (("heldout", PROMPTS[0]), ("train", PROMPTS[1])):
        data = TrainData(data_dir, split)
        i = 0
        for name in data.shard_names:
            shard = data_dir / "shards" / name
            metas = json.loads((shard / "records.json").read_text())
            for m in metas:
                tokens, mask, _ = data.record(i, [0])
                assert m["prompt_index"] == i and m["prompt_len"] == len(prompts[i]) == int((~mask).sum())
                assert m["response_len"] == int(mask.sum()) == len(tokens) - len(prompts[i]) > 0
                assert m["stop"] == ("eos" if tokens[-1] == 2 else "length"), m
                assert m["stop"] == "eos" or m["response_len"] == ROLLOUT.max_new_tokens
                i += 1
            offsets, mask = np.load(shard / "offsets.npy"), np.load(shard / "loss_mask.npy")
            eos = sum(int(np.load(shard / "tokens.npy")[e - 1]) == 2 for e in offsets[1:])
            assert manifest["shards"][name] == {"records": len(offsets) - 1, "response_tokens": int(mask.sum()),
                                                "tokens": int(offsets[-1]), "eos": eos}, name
        assert i == len(data) == len(prompts)


def test_step_anchors_follow_the_seed_and_the_step(data_dir, target):
    """Step s samples its anchors with fold_in(seed_key(seed), s) (a resume at s draws what the
    uninterrupted run drew): the step's token loss is `loss_terms`' at that key, other at each step."""
    cfg = dataclasses.replace(CFG, exit_lambda=0.0, seed=11)
    batch, drafter = _batch(data_dir, 0), _drafter(target)
    trainer = Trainer(_drafter(target), target, cfg, make_mesh())
    losses = []
    for s in (0, 3):
        # A copy: the step donates its state, and init_state's arrays are the Trainer's own.
        state = dataclasses.replace(jax.tree.map(jnp.copy, trainer.init_state()), step=jnp.asarray(s, jnp.int32))
        _, metrics = trainer.step(state, batch)
        key = jax.random.fold_in(seed_key(cfg.seed), s)
        want = float(_loss_terms(drafter, target, batch, key, cfg)[0])
        np.testing.assert_allclose(float(metrics["loss_tok"]), want, rtol=1e-5, err_msg=f"step {s}")
        losses.append(want)
    assert losses[0] != losses[1]  # the anchors differ from step to step
    # The logged grad_norm is the global norm of the gradients (before clipping), not of the
    # parameters: here, of the last step's loss at its key.
    np.testing.assert_allclose(float(metrics["grad_norm"]), float(_grad_norm(drafter, target, batch, key, cfg)),
                               rtol=1e-4)


def test_batches_are_a_pure_function_of_seed_and_step(data_dir):
    data = TrainData(data_dir, "train")
    a = [data.order(0, s, 5).tolist() for s in range(6)]
    assert a == [data.order(0, s, 5).tolist() for s in range(6)]
    flat = sum(a, [])
    # Every epoch (12 records) visits each record once.
    assert sorted(flat[:12]) == list(range(12)) and sorted(flat[12:24]) == list(range(12))
    assert a != [data.order(1, s, 5).tolist() for s in range(6)]
    # Epoch e is the permutation of (seed, e), so epochs differ: a repeated order would give every
    # epoch's batches the same records side by side.
    assert flat[:12] == np.random.default_rng([0, 0]).permutation(12).tolist()
    assert flat[12:24] == np.random.default_rng([0, 1]).permutation(12).tolist() != flat[:12]
    with pytest.raises(ValueError, match="not stored"):
        data.tap_columns((2,))


def test_tap_columns_follow_the_drafters_tap_order(data_dir):
    """A drafter tapping the stored layers in another order reads the stored columns in its own
    order: its features are the stored blocks, permuted."""
    data = TrainData(data_dir, "train")
    assert data.tap_columns(TAPS) == [0, 1] and data.tap_columns(TAPS[::-1]) == [1, 0]
    d = data.hidden_size
    _, _, stored = data.record(2, [0, 1])
    _, _, swapped = data.record(2, data.tap_columns(TAPS[::-1]))
    np.testing.assert_array_equal(swapped, np.concatenate([stored[:, d:], stored[:, :d]], axis=1))


def _batch(data_dir, step=0):
    data = TrainData(data_dir, "train")
    host = data.batch(data.order(0, step, CFG.batch_size), [0, 1], CFG.seq_len)
    return Batch(**{k: jnp.asarray(v) for k, v in host.items()})


def test_step_trains_only_the_drafter(data_dir, target):
    tstate_before = jax.tree.map(np.array, nnx.state(target))
    trainer = Trainer(_drafter(target), target, CFG, make_mesh())
    state = trainer.init_state()
    p0 = jax.tree.map(np.array, state.params)
    for s in range(3):
        state, metrics = trainer.step(state, _batch(data_dir, s))
        assert all(np.isfinite(float(v)) for v in metrics.values())
        assert float(metrics["loss_exit"]) > 0 and float(metrics["blocks"]) > 0
        # The step minimises the token loss plus lambda times ExitTrain's exit loss.
        np.testing.assert_allclose(float(metrics["loss"]),
                                   float(metrics["loss_tok"]) + CFG.exit_lambda * float(metrics["loss_exit"]),
                                   rtol=1e-5)
    # The target, whose embedding and LM head the drafter shares, is bit-identical.
    jax.tree.map(np.testing.assert_array_equal, tstate_before, jax.tree.map(np.array, nnx.state(target)))
    jax.tree.map(np.testing.assert_array_equal, tstate_before, jax.tree.map(np.array, trainer.tstate))
    changed = jax.tree.leaves(jax.tree.map(lambda a, b: not np.array_equal(a, np.asarray(b)), p0, state.params))
    assert all(changed)  # every drafter parameter moved
    names = {"/".join(map(str, p)) for p, _ in jax.tree_util.tree_flatten_with_path(state.params)[0]}
    assert not any("embed" in n or "lm_head" in n for n in names)


def test_a_step_donates_a_copy_not_the_callers_drafter(target):
    """The step donates the state it is given. On one device `device_put` placed the drafter's own
    parameters into the initial state unchanged, so the first step deleted them: the caller's drafter
    (and a second `init_state`) then raised "Array has been deleted"."""
    drafter = _drafter(target)
    before = jax.tree.map(np.array, nnx.state(drafter, nnx.Param))
    trainer = Trainer(drafter, target, CFG, make_mesh(devices=jax.devices()[:1]))
    b, t, f = CFG.batch_size, CFG.seq_len, len(TAPS) * target.cfg.hidden_size
    rng = np.random.default_rng(0)
    batch = Batch(tokens=jnp.asarray(rng.integers(3, 300, (b, t)), jnp.int32), loss_mask=jnp.ones((b, t), bool),
                  features=jnp.asarray(rng.normal(size=(b, t, f)), jnp.float32), length=jnp.full((b,), t, jnp.int32))
    state, _ = trainer.step(trainer.init_state(), batch)
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.array, nnx.state(drafter, nnx.Param)))
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.array, trainer.init_state().params))
    assert int(state.step) == 1


def test_distillation_teacher_is_the_targets_own_distribution(data_dir, target):
    """Soft labels come from the stored last-layer state with no target forward: row g-1 of anchor
    a holds the target's logits at a + g - 1 (the distribution of the token at a + g), here checked
    against a fresh forward over the record, restricted to a draft vocabulary."""
    data = TrainData(data_dir, "train")
    tokens, _, feats = data.record(3, [0, 1])
    n = len(tokens)
    vocab = np.arange(0, target.cfg.vocab_size, 3, dtype=np.int32)
    drafter = DFlashDrafter(dataclasses.replace(_drafter(target).cfg, draft_vocab_size=len(vocab)),
                            rngs=nnx.Rngs(0), draft_vocab=vocab)
    anchors = np.array([[0, 2, n - BS, n - 2]], np.int32)
    got = np.asarray(teacher_logits(drafter, target, jnp.asarray(feats)[None], jnp.asarray(anchors), BS - 1))
    out = target(jnp.asarray(tokens)[None], jnp.arange(n)[None], KVCache.init(target.cfg, 1, n),
                 jnp.zeros((1,), jnp.int32), causal_mask(n)[None])
    ref = np.asarray(out.logits)[0][:, vocab]
    # The last anchor's rows past the record (no token to distil, weight 0) read its last state,
    # finite: a 0-weighted NaN would still poison the sums.
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[0, 3, 2:], np.broadcast_to(got[0, 3, 1], got[0, 3, 2:].shape))
    for j, a in enumerate(anchors[0, :3]):
        # bfloat16 storage of the hidden state: equal to about 2^-8 of the logits' scale.
        np.testing.assert_allclose(got[0, j], ref[a:a + BS - 1], rtol=0, atol=2e-2 * np.abs(ref).max())
        assert (got[0, j].argmax(-1) == ref[a:a + BS - 1].argmax(-1)).mean() >= 0.8


def test_distillation_step_trains_and_needs_the_last_layer(tmp_path, data_dir, target):
    cfg = dataclasses.replace(CFG, exit_lambda=0.0, distill=0.5)
    trainer = Trainer(_drafter(target), target, cfg, make_mesh())
    state = trainer.init_state()
    losses = []
    for s in range(4):
        state, metrics = trainer.step(state, _batch(data_dir, s % 2))
        assert np.isfinite(float(metrics["loss_kd"])) and float(metrics["loss_kd"]) > 0
        if s == 0:
            # The soft-label loss takes the position decay too: without it (gamma None) the same
            # parameters, batch and anchors give another mean. An untrained drafter's positions
            # lose nearly alike, so the gap is small (3.5e-4), but float32 noise is ~1e-6 of it.
            flat = _loss_terms(_drafter(target), target, _batch(data_dir, 0), jax.random.fold_in(seed_key(cfg.seed), 0),
                               dataclasses.replace(cfg, gamma=None))[1]["loss_kd"]
            assert abs(float(flat) / float(metrics["loss_kd"]) - 1) > 1e-4, (flat, metrics)
        # The step's loss is the stated mix of the two cross entropies.
        mix = 0.5 * float(metrics["loss_tok"]) + 0.5 * float(metrics["loss_kd"])
        np.testing.assert_allclose(float(metrics["loss"]), mix, rtol=1e-5)
        losses.append(float(metrics["loss"]))
    assert losses[2] < losses[0] and losses[3] < losses[1]  # the same two batches, after training on them
    no_last = DFlashDrafter(dataclasses.replace(_drafter(target).cfg, target_layer_ids=(1,)), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"last layer \(3\), which the drafter does not tap"):
        Trainer(no_last, target, cfg, make_mesh())
    # Refused before the run directory is made, so the same --out works once the command is fixed.
    with pytest.raises(ValueError, match="does not tap"):
        train(target, no_last, data_dir, tmp_path / "r", cfg, target_name="tiny", progress=False, log=lambda _: None)
    assert not (tmp_path / "r").exists()
    with pytest.raises(ValueError, match=r"distill must be a weight in \[0, 1\]"):
        dataclasses.replace(cfg, distill=1.5)


def test_training_trees_are_the_decoders_trees(target):
    drafter = _drafter(target, seed=3)
    rng = np.random.default_rng(9)
    tokens = rng.integers(3, 300, (1, 30)).astype(np.int32)
    # float32 features, as the decoder's context cache holds (the data directory stores bfloat16).
    out = target(jnp.asarray(tokens), jnp.arange(30)[None], KVCache.init(target.cfg, 1, 30), jnp.zeros((1,), jnp.int32),
                 causal_mask(30)[None], hidden_layers=TAPS, compute_logits=False)
    feats = features_from_output(out, drafter.cfg, target.cfg)
    anchors = jnp.asarray([[7, 16, 25]], jnp.int32)
    z = drafter.logits(target, drafter.train_hidden(target, feats, jnp.asarray(tokens), anchors))
    train_trees = draft_trees(z[0], jnp.asarray(tokens[0, [7, 16, 25]]), 8)
    dec = Decoder(target, drafter, DecodeConfig(budget=8, max_new_tokens=4))
    draft_fn = jax.jit(lambda st: draft(drafter, target, st.root, st.cache_len, st.drafter_cache))
    for j, a in enumerate([7, 16, 25]):
        # The decoder at context tokens[:a + 1]: prefill tokens[:a], root tokens[a], one draft.
        state = dec.prefill([tokens[0, : a + 1].tolist()])
        logits = draft_fn(state)
        dec_tree = draft_trees(logits, state.root, 8)
        np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(z[0, j]), atol=2e-5)
        for field in ("tokens", "parents", "depth", "valid"):
            np.testing.assert_array_equal(np.asarray(getattr(dec_tree, field)[0]),
                                          np.asarray(getattr(train_trees, field)[j]), err_msg=field)


def test_greedy_accepted_depth_follows_the_data_down_the_tree():
    # root 0; children 1 (token 5) and 2 (6); 3 (7) under 1; 4 (8) under 3; 5 (9) under 4 is padding.
    tokens = jnp.array([0, 5, 6, 7, 8, 9])
    parents = jnp.array([-1, 0, 0, 1, 3, 4])
    valid = jnp.array([True, True, True, True, True, False])
    ok = jnp.ones(4, bool)
    depth = lambda truth, truth_ok=ok: int(greedy_accepted_depth(tokens, parents, valid, jnp.array(truth),  # noqa: E731
                                                                 truth_ok))
    assert depth([5, 7, 8, 9]) == 3  # the padding node below 4 is never a match
    assert depth([6, 7, 8, 9]) == 1  # 7 hangs under 1, not under 2
    assert depth([5, 8, 7, 9]) == 1  # a grandchild's token is not a child's
    assert depth([9, 5, 7, 8]) == 0
    assert depth([5, 7, 8, 9], jnp.array([True, True, False, True])) == 2  # the data ends (or is unsupervised)


def test_block_truth_stops_at_the_end_of_the_batch():
    """A depth counts only inside the batch's T positions: a record cropped at T whose last position
    is supervised has no truth past it (its clamped index would read that position again)."""
    from tevjax.train.heldout import block_truth

    tokens, mask = jnp.array([[3, 4, 5, 6]]), jnp.array([[False, True, True, True]])
    truth, ok = block_truth(tokens, mask, jnp.array([[1, 2]]), jnp.array([[True, True]]), 3)
    assert np.asarray(truth)[0, 0].tolist() == [5, 6, 6] and np.asarray(ok).tolist() == [[[True, True, False],
                                                                                          [True, False, False]]]
    _, ok = block_truth(tokens, mask, jnp.array([[1, 2]]), jnp.array([[True, False]]), 3)
    assert not np.asarray(ok)[0, 1].any()  # nothing counts after an invalid anchor


def test_heldout_records_sum_to_the_check(data_dir, target):
    data = TrainData(data_dir, "heldout")
    drafter = _drafter(target)
    ev = HeldoutEval(data, data.tap_columns(TAPS), records=4, anchors=5, seq_len=40, budgets=(2, 5), batch=3)
    rec = ev.per_record(drafter, target)
    assert rec["anchors"].shape == rec["tau_2"].shape == (4,) and rec["acc_hits"].shape == (4, BS - 1)
    assert np.all(rec["anchors"] >= 1) and np.all(rec["anchors"] <= 5)
    # A block is 1 (the bonus) to BS tokens, and a larger budget's tree holds the smaller one's path.
    assert np.all(rec["tau_2"] >= rec["anchors"]) and np.all(rec["tau_5"] <= BS * rec["anchors"])
    assert np.all(rec["tau_5"] >= rec["tau_2"])
    assert np.all(rec["acc_hits"] <= rec["acc_count"])
    metrics = ev(drafter, target)
    n = rec["anchors"].sum()
    assert metrics["tau_sim@2"] == pytest.approx(rec["tau_2"].sum() / n)
    assert metrics["tau_sim@5"] == pytest.approx(rec["tau_5"].sum() / n)
    assert metrics["acc@1"] == pytest.approx(rec["acc_hits"][:, 0].sum() / rec["acc_count"][:, 0].sum())
    assert [k for k in metrics if k.startswith("acc@")] == ["acc@1", "acc@2", "acc@3", "acc@4"]  # of G = 5
    # `records` takes the split's first records, batched (no drafter needed to see which).
    few = HeldoutEval(data, data.tap_columns(TAPS), records=2, seq_len=40, batch=3)
    assert [b["tokens"].shape for b in few.batches] == [(2, 40)]
    np.testing.assert_array_equal(few.batches[0]["tokens"], ev.batches[0]["tokens"][:2])
    # The anchors depend on the data and the seed only: the same drafter scores the same again.
    again = ev.per_record(drafter, target)
    for k in rec:
        np.testing.assert_array_equal(rec[k], again[k], err_msg=k)


class _Oracle(DFlashDrafter):
    """A stub drafter (a class of its own, so its programs are traced anew) whose block rows are
    the data's next tokens, except at positions divisible by 5, where it proposes another token:
    it hits and misses where a test can count them."""

    def train_hidden(self, target, features, tokens, anchors, **_):
        g = self.cfg.block_size - 1
        pos = jnp.minimum(anchors[..., None] + jnp.arange(1, g + 1), tokens.shape[1] - 1)  # [B, M, G]
        data = jnp.take_along_axis(tokens, pos.reshape(pos.shape[0], -1), axis=1).reshape(pos.shape)
        proposed = jnp.where(pos % 5 == 0, (data + 1) % self.cfg.vocab_size, data)
        return jax.nn.one_hot(proposed, self.cfg.vocab_size)

    def logits(self, target, hidden, head=None, **_):
        return 10.0 * hidden  # the proposed token at ~1 - V e^-10 of the mass: the chain comes first


def test_heldout_tau_and_accuracy_equal_a_walk_of_the_data(data_dir, target):
    """tau_<b> and acc_hits against a brute-force walk: at each valid anchor a, position a + g
    counts where it lies in the record and is supervised, is a hit where the stub proposes the data
    token, and a budget-b tree holds the stub's chain to depth min(b, G)."""
    from tevjax.train.heldout import _evaluate

    data = TrainData(data_dir, "heldout")
    host = data.batch(range(3), data.tap_columns(TAPS), 40)
    batch = Batch(**{k: jnp.asarray(v) for k, v in host.items()})
    oracle = _Oracle(_drafter(target).cfg, rngs=nnx.Rngs(0))
    dgd, dstate = nnx.split(oracle)
    tgd, tstate = nnx.split(target)
    out = _evaluate(dstate, tstate, batch, jax.random.key(3), dgd=dgd, tgd=tgd, budgets=(2, 5), anchors=6,
                    per_anchor=True)
    anc, valid = np.asarray(out["anchor"]), np.asarray(out["valid"])
    mask, t, g = np.asarray(host["loss_mask"]), np.asarray(host["tokens"]).shape[1], BS - 1
    want = {"tau_2": np.zeros(3, int), "tau_5": np.zeros(3, int), "acc_hits": np.zeros((3, g), int),
            "acc_count": np.zeros((3, g), int)}
    for r in range(3):
        for a in anc[r][valid[r]]:
            counts = [a + k < t and bool(mask[r, a + k]) for k in range(1, g + 1)]
            hits = [c and (a + k) % 5 != 0 for k, c in enumerate(counts, start=1)]
            want["acc_count"][r] += counts
            want["acc_hits"][r] += hits
            depth = next((k for k, h in enumerate(hits) if not h), g)
            for b in (2, 5):
                want[f"tau_{b}"][r] += 1 + min(depth, b)
    assert want["acc_hits"].sum() > 0 and (want["acc_hits"] < want["acc_count"]).any()  # hits and misses
    assert (want["tau_5"] > want["tau_2"]).any()  # the budget matters
    for k, v in want.items():
        np.testing.assert_array_equal(np.asarray(out[k]), v, err_msg=k)


def test_acc1_is_block_position_ones_hit_rate(data_dir, target):
    """The step's running acc1 against the stub's known hits: the token after each valid anchor,
    where the stub proposes the data token (the anchors are `batch_anchors`' for the step's key)."""

    batch, key = _batch(data_dir, 0), jax.random.key(7)
    cfg = dataclasses.replace(CFG, exit_lambda=0.0)
    _, metrics = _loss_terms(_Oracle(_drafter(target).cfg, rngs=nnx.Rngs(0)), target, batch, key, cfg)
    b, t = batch.tokens.shape
    anchors, valid = batch_anchors(key, batch.loss_mask, cfg.anchors)
    anchors, valid = np.asarray(anchors), np.asarray(valid)
    hits = [(a + 1) % 5 != 0 for r in range(b) for a in anchors[r][valid[r]]]
    assert 0 < sum(hits) < len(hits)
    assert float(metrics["acc1"]) == pytest.approx(sum(hits) / len(hits))


def _masked_batch(data_dir, keep):
    """Batch 0 with row 1 unsupervised (every anchor invalid) and row 3 supervised only at its
    first `keep` response positions (fewer eligible anchors than M: the rest invalid)."""
    batch = _batch(data_dir, 0)
    mask = np.array(batch.loss_mask)
    mask[1] = False
    mask[3, np.flatnonzero(mask[3])[keep:]] = False
    return dataclasses.replace(batch, loss_mask=jnp.asarray(mask))


def test_acc1_and_blocks_count_only_valid_anchors(data_dir, target):
    """Invalid anchors (index 0, whose next token the stub hits) neither hit nor count: acc1 is
    the hit rate over the valid anchors and `blocks` their number."""
    batch, key = _masked_batch(data_dir, keep=2), jax.random.key(7)
    cfg = dataclasses.replace(CFG, exit_lambda=0.0)  # acc1's test's program: no new compile
    _, metrics = _loss_terms(_Oracle(_drafter(target).cfg, rngs=nnx.Rngs(0)), target, batch, key, cfg)
    anchors, valid = (np.asarray(x) for x in batch_anchors(key, batch.loss_mask, cfg.anchors))
    assert not valid[1].any() and valid[3].sum() == 2 and valid.sum() < valid.size
    hits = [(a + 1) % 5 != 0 for r in range(len(anchors)) for a in anchors[r][valid[r]]]
    assert 0 < sum(hits) < len(hits)
    assert float(metrics["blocks"]) == valid.sum()
    assert float(metrics["acc1"]) == pytest.approx(sum(hits) / len(hits))


def test_an_unsupervised_row_moves_no_loss_or_metric(data_dir, target):
    """A row with no supervised token has only invalid anchors: its trees (rooted at index 0) and
    rows count in no loss, and coverage averages over the valid exit anchors alone, so changing
    that row's tokens and features changes nothing."""
    drafter, batch, key = _drafter(target), _masked_batch(data_dir, keep=100), jax.random.key(5)
    tokens, feats = np.array(batch.tokens), np.array(batch.features)
    tokens[1] = (tokens[1] + 17) % 300 + 3
    feats[1] = feats[1][::-1]
    moved = dataclasses.replace(batch, tokens=jnp.asarray(tokens), features=jnp.asarray(feats))
    base = _loss_terms(drafter, target, batch, key, CFG)[1]  # the evenly-spread test's program
    other = _loss_terms(drafter, target, moved, key, CFG)[1]
    assert float(base["loss_exit"]) > 0
    for k in ("loss", "loss_tok", "loss_exit", "coverage", "acc1", "blocks"):
        np.testing.assert_allclose(float(other[k]), float(base[k]), rtol=1e-6, err_msg=k)


def test_the_exit_weight_reaches_the_step(data_dir, target):
    """`exit_weight` picks omega in the step: the stub's trees are chains (its proposals hold ~all
    the draft mass), so "w_depth" weighs each node's term by its depth, 1 .. exit_budget, against
    "w"'s 1, with the same denominator; a step that ignored the setting would give equal losses.
    (The random target puts little exit mass below depth 1, hence the ~2% gap: float32 noise is
    ~1e-6 of it.)"""
    batch, key, oracle = _batch(data_dir, 0), jax.random.key(5), _Oracle(_drafter(target).cfg, rngs=nnx.Rngs(0))
    loss = {kind: float(_loss_terms(oracle, target, batch, key, dataclasses.replace(CFG, exit_weight=kind))[1]
                        ["loss_exit"]) for kind in ("w", "w_depth")}
    assert loss["w"] > 0
    assert 1.01 * loss["w"] < loss["w_depth"] <= CFG.exit_budget * loss["w"] * (1 + 1e-6), loss


class _IndexZero(DFlashDrafter):
    """A stub drafter whose every draft row proposes draft-vocabulary index 0."""

    def logits(self, target, hidden, head=None, **_):
        v = self.cfg.draft_vocab_size
        return jnp.broadcast_to(jnp.where(jnp.arange(v) == 0, 10.0, 0.0), hidden.shape[:-1] + (v,))


def test_acc1_counts_a_label_outside_the_draft_vocabulary_as_a_miss(data_dir, target):
    """Such a label's draft index is 0 as well (`draft_index`), yet a row proposing index 0 hits
    only the token that index 0 stands for."""

    vocab = np.arange(0, target.cfg.vocab_size, 3, dtype=np.int32)
    drafter = _IndexZero(dataclasses.replace(_drafter(target).cfg, draft_vocab_size=len(vocab)), rngs=nnx.Rngs(0),
                         draft_vocab=vocab)
    batch, key = _batch(data_dir, 0), jax.random.key(7)
    cfg = dataclasses.replace(CFG, exit_lambda=0.0)
    _, metrics = _loss_terms(drafter, target, batch, key, cfg)
    anchors, valid = batch_anchors(key, batch.loss_mask, cfg.anchors)
    tokens, anchors, valid = np.asarray(batch.tokens), np.asarray(anchors), np.asarray(valid)
    labels = [int(tokens[r, a + 1]) for r in range(len(tokens)) for a in anchors[r][valid[r]]]
    assert any(t % 3 for t in labels)  # some labels lie outside the vocabulary
    assert float(metrics["acc1"]) == pytest.approx(sum(t == vocab[0] for t in labels) / len(labels))


def test_exit_trees_sit_on_evenly_spread_anchors(data_dir, target):
    """E = 3 of M = 6 anchors get trees: anchors 0, 2 and 5 (`linspace`), so the last anchor's
    root token moves the exit loss (the first three anchors alone would never read it), and the
    token after it does not."""

    drafter, batch, key = _drafter(target), _batch(data_dir, 0), jax.random.key(5)
    b = batch.tokens.shape[0]
    anchors, valid = batch_anchors(key, batch.loss_mask, CFG.anchors)
    assert np.asarray(valid).all()
    tokens = np.array(batch.tokens)
    last = np.asarray(anchors)[:, -1]
    tokens[np.arange(b), last] = (tokens[np.arange(b), last] + 17) % 300 + 3
    moved = dataclasses.replace(batch, tokens=jnp.asarray(tokens))
    exit_of = lambda bt: float(_loss_terms(drafter, target, bt, key, CFG)[1]["loss_exit"])  # noqa: E731
    base = exit_of(batch)
    assert exit_of(moved) != base
    # A tree is rooted at its anchor's token: the token after the last anchor is no tree's to read.
    tokens = np.array(batch.tokens)
    tokens[np.arange(b), last + 1] = (tokens[np.arange(b), last + 1] + 17) % 300 + 3
    assert exit_of(dataclasses.replace(batch, tokens=jnp.asarray(tokens))) == base


def test_trajectory_walks_decodings_rounds():
    # Anchors 4..11 (the answer is positions 5..12); invalid padding anchors never count.
    anchors = np.array([4, 5, 6, 7, 8, 9, 10, 11, 40, 40])
    valid = np.array([True] * 8 + [False] * 2)
    depth = np.array([2, 0, 0, 1, 5, 0, 3, 0, 7, 7])
    # Roots 4 (emits 3), 7 (2), 9 (1) and 10 (2 of its 4: the answer ends at 12): the 8 answer tokens.
    assert trajectory_blocks(anchors, valid, depth) == (8, 4)
    assert trajectory_blocks(anchors, valid, np.zeros(10, int)) == (8, 8)  # every round emits its bonus alone
    assert trajectory_blocks(anchors, valid, np.full(10, 7)) == (8, 1)  # one round reaches the end
    assert trajectory_blocks(anchors, np.zeros(10, bool), depth) == (0, 0)


def test_heldout_trajectory_emits_each_answer_once(data_dir, target):
    """With `trajectory`, every record's rounds emit exactly its answer's tokens, at least one and
    at most BS per round, and tau_traj is their ratio; the uniform-anchor sums are unchanged in
    kind (every eligible position is an anchor)."""
    data = TrainData(data_dir, "heldout")
    drafter = _drafter(target)
    ev = HeldoutEval(data, data.tap_columns(TAPS), records=4, seq_len=40, budgets=(2, 5), batch=3, trajectory=True)
    rec = ev.per_record(drafter, target)
    answer = np.asarray(data.batch(range(4), data.tap_columns(TAPS), 40)["loss_mask"]).sum(axis=1)
    assert rec["anchors"].tolist() == answer.tolist()  # each answer token's predecessor is an anchor
    for b in (2, 5):
        tokens, rounds = rec[f"traj_tokens_{b}"], rec[f"traj_rounds_{b}"]
        assert tokens.tolist() == answer.tolist()
        assert np.all(rounds >= 1) and np.all(rounds <= tokens) and np.all(BS * rounds >= tokens)
    metrics = ev(drafter, target)
    assert metrics["tau_traj@5"] == pytest.approx(rec["traj_tokens_5"].sum() / rec["traj_rounds_5"].sum())


def test_exit_loss_reads_only_its_exit_sequences(data_dir, target):
    # exit_sequences=2 of 4: trees come from rows 0 and 2 only. Changing rows 1 and 3 leaves the
    # exit loss as it was; changing row 2 moves it; all four rows give the default's loss.

    drafter, batch = _drafter(target), _batch(data_dir, 0)
    key = jax.random.key(5)
    cfg = dataclasses.replace(CFG, exit_sequences=2)
    exit_of = lambda c, bt: float(_loss_terms(drafter, target, bt, key, c)[1]["loss_exit"])  # noqa: E731

    def with_rows(rows, shift):
        tokens, feats = np.array(batch.tokens), np.array(batch.features)
        tokens[rows] = (tokens[rows] + shift) % 300 + 3
        feats[rows] = feats[rows][:, ::-1]
        return dataclasses.replace(batch, tokens=jnp.asarray(tokens), features=jnp.asarray(feats))

    base = exit_of(cfg, batch)
    assert base > 0
    assert exit_of(cfg, with_rows([1, 3], 17)) == base
    assert exit_of(cfg, with_rows([2], 17)) != base
    assert exit_of(dataclasses.replace(CFG, exit_sequences=4), batch) == exit_of(CFG, batch)
    with pytest.raises(ValueError, match="exit_sequences must be a positive divisor of batch_size"):
        dataclasses.replace(CFG, exit_sequences=3)


def test_exit_law_truncation_follows_the_decoders_target(data_dir, target):
    """Exit weights under top-k 1 at temperature 1 are the greedy law's (the target is the argmax's
    point mass either way), and differ from the untruncated temperature-1 law's."""

    drafter, batch = _drafter(target), _batch(data_dir, 0)
    key = jax.random.key(5)
    metrics = {name: _loss_terms(drafter, target, batch, key, dataclasses.replace(CFG, **kw))[1] for name, kw in (
        ("top1", {"exit_temperature": 1.0, "exit_top_k": 1}), ("greedy", {"exit_temperature": 1e-6}),
        ("sampled", {"exit_temperature": 1.0}), ("top_p", {"exit_temperature": 1.0, "exit_top_p": 0.5}))}
    for field in ("loss_exit", "coverage"):
        assert float(metrics["top1"][field]) == pytest.approx(float(metrics["greedy"][field]), rel=1e-6), field
        assert float(metrics["sampled"][field]) != pytest.approx(float(metrics["greedy"][field]), rel=1e-3), field
        assert float(metrics["top_p"][field]) != pytest.approx(float(metrics["sampled"][field]), rel=1e-3), field
    # Here the cut raises coverage (kept tokens gain mass; not a law: cut tokens lose theirs).
    assert float(metrics["top_p"]["coverage"]) > float(metrics["sampled"]["coverage"])
    assert float(metrics["top1"]["loss_tok"]) == float(metrics["sampled"]["loss_tok"])  # the token loss is untouched
    with pytest.raises(ValueError, match=r"TrainConfig.exit_top_p must be in \(0, 1\]"):
        dataclasses.replace(CFG, exit_top_p=0.0)


def _params(run_dir, target):
    out = run_dir.parent / (run_dir.name + "-export")
    export_run(run_dir, out, target.cfg, dtype="float32")
    _, d = load_dflash(out, target.cfg)
    shutil.rmtree(out)
    return {"/".join(map(str, p)): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(nnx.state(d))[0]}


def test_a_full_disk_stops_training_at_a_checkpoint_and_resume_ends_exactly(tmp_path, data_dir, target,
                                                                             monkeypatch):
    """The disk fills before checkpoint 3 (one every step): training stops with a WriteError that
    names the checkpoint, the space and the last complete checkpoint (2), which is kept, with
    nothing of 3 on disk; resumed once there is space, it ends where an uninterrupted run ends. A
    save that fails anyway (orbax's own text for a full disk) stops it the same way, and an export
    that would not fit writes nothing."""
    import errno

    import orbax.checkpoint as ocp

    from tevjax.storage import WriteError

    quiet = dict(progress=False, log=lambda _: None, target_name="tiny", heldout_records=4)
    straight = train(target, _drafter(target), data_dir, tmp_path / "a", CFG, **quiet)
    run = tmp_path / "b"
    _free_until(monkeypatch, 2)
    with pytest.raises(WriteError, match=r"not enough disk space for checkpoint 3 under .*checkpoints: .*1 KiB is "
                                         r"free; the last complete checkpoint, step 2, is kept: free some space, "
                                         r"then rerun the same command with --resume") as refused:
        train(target, _drafter(target), data_dir, run, CFG, checkpoint_every_s=0.0, **quiet)
    assert sorted(os.listdir(run / "checkpoints")) == ["1", "2"]
    monkeypatch.undo()
    try:
        raise refused.value
    except WriteError:  # a caller's retry, in its handler: an error train() itself did not raise
        resumed = train(target, _drafter(target), data_dir, run, CFG, resume=True, **quiet)
    assert sorted(os.listdir(run / "checkpoints")) == ["1", "2", str(CFG.steps)]  # the final save was made
    for a, b in ((straight.params, resumed.params), (straight.opt, resumed.opt)):
        jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, a), jax.tree.map(np.asarray, b))

    save, tried = ocp.CheckpointManager.save, []

    def failing(mgr, step, *args, **kwargs):
        tried.append(step)
        if step == 2:
            raise ValueError("RESOURCE_EXHAUSTED: Error writing local file \"x\": No space left on device "
                             "[os_error_code='28']")
        return save(mgr, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "save", failing)
    with pytest.raises(WriteError, match=r"writing checkpoint 2 under .*checkpoints failed \(the disk is full\); "
                                         r"the last complete checkpoint, step 1, is kept"):
        train(target, _drafter(target), data_dir, tmp_path / "c", CFG, checkpoint_every_s=0.0, **quiet)
    assert sorted(os.listdir(tmp_path / "c" / "checkpoints")) == ["1"] and tried == [1, 2]  # no final save after it
    monkeypatch.undo()
    # The log's first line (step 2, the last before --until) finds the disk full.
    import builtins

    real_open = builtins.open

    def full_log(file, mode="r", *args, **kwargs):
        if str(file).endswith("log.jsonl") and "a" in mode:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", full_log)
    with pytest.raises(WriteError, match=r"writing .*log.jsonl failed \(the disk is full\); the last complete "
                                         r"checkpoint, step 1, is kept"):
        train(target, _drafter(target), data_dir, tmp_path / "e", CFG, checkpoint_every_s=0.0, until=2, **quiet)
    monkeypatch.undo()

    _free_until(monkeypatch, 0)
    with pytest.raises(WriteError, match=r"not enough disk space for the exported drafter under .*: .*; nothing "
                                         r"was exported$"):
        export_run(run, tmp_path / "export", target.cfg)
    assert not (tmp_path / "export").exists()


def test_a_seq_len_that_crops_every_response_is_refused(tmp_path, data_dir, target):
    """Records are cropped to seq_len from their start, and anchors need a supervised next token:
    a seq_len no longer than every prompt trained on nothing (zero blocks, a loss of 0, and a
    "finished" run). It is refused before anything is written, naming the shortest prompt; one
    that crops only some records trains, with a note that counts them."""
    from tevjax.train.dataset import TrainData

    first = TrainData(data_dir).first_supervised()
    assert sorted(first.tolist()) == sorted(len(p) for p in PROMPTS[1])  # a record's response follows its prompt
    shortest = int(first.min())
    quiet = dict(progress=False, target_name="tiny", heldout_records=4)

    def cfg(seq_len):
        return TrainConfig(**{**CFG.__dict__, "seq_len": seq_len})

    with pytest.raises(RunError, match=f"--seq-len {shortest} crops all {len(first)} training records before their "
                                       f"responses, so there is nothing to train on; the shortest prompt is "
                                       f"{shortest} tokens"):
        train(target, _drafter(target), data_dir, tmp_path / "run", cfg(shortest), log=lambda _: None, **quiet)
    assert not (tmp_path / "run").exists()
    logged = []
    train(target, _drafter(target), data_dir, tmp_path / "run", cfg(shortest + 1), until=1, log=logged.append, **quiet)
    cropped = int((first > shortest).sum())
    assert 0 < cropped < len(first)
    assert any(f"crops {cropped} of {len(first)} training records" in line for line in logged), logged
    # Every held-out prompt here is longer than the shortest training prompt: the held-out check
    # would report zeros, so there is none, and a note says why.
    assert (TrainData(data_dir, "heldout").first_supervised() > shortest).all()
    assert any("no held-out evaluation" in line for line in logged), logged
    assert not any('"heldout"' in line for line in logged), logged


def test_exact_resume_and_checkpoint_safety(tmp_path, data_dir, target):
    quiet = dict(progress=False, log=lambda _: None, target_name="tiny", heldout_records=4)
    # A checkpoint after every step, the last `keep` kept (rotated, as orbax's manager does); a
    # held-out check after every step too.
    straight = train(target, _drafter(target), data_dir, tmp_path / "a", CFG, checkpoint_every_s=0.0, keep=2,
                     eval_every_s=0.0, **quiet)
    assert sorted(os.listdir(tmp_path / "a" / "checkpoints")) == [str(CFG.steps - 1), str(CFG.steps)]
    train(target, _drafter(target), data_dir, tmp_path / "b", CFG, until=2, **quiet)
    assert sorted(os.listdir(tmp_path / "b" / "checkpoints")) == ["2"]
    # A save that crashed half-way (orbax's temporary directory) is never taken for a checkpoint.
    partial = tmp_path / "b" / "checkpoints" / "3.orbax-checkpoint-tmp-1"
    partial.mkdir()
    (partial / "junk").write_text("x")
    with pytest.raises(RunError, match="--resume"):
        train(target, _drafter(target), data_dir, tmp_path / "b", CFG, **quiet)
    with pytest.raises(RunError, match="exit_budget"):
        train(target, _drafter(target), data_dir, tmp_path / "b",
              TrainConfig(**{**CFG.__dict__, "exit_budget": 6}), resume=True, **quiet)
    lines = []
    resumed = train(target, _drafter(target), data_dir, tmp_path / "b", CFG, resume=True,
                    **{**quiet, "log": lines.append})
    # The checkpoint's metadata names the data position: step 2 of batches of B records.
    event = next(json.loads(x) for x in lines if '"resume"' in x)
    assert event["checkpoint_meta"] == {"step": 2, "data_position": 2 * CFG.batch_size, "seed": CFG.seed,
                                        "records": 12}
    assert int(resumed.step) == int(straight.step) == CFG.steps
    steps = sorted(n for n in os.listdir(tmp_path / "b" / "checkpoints") if n.isdigit())
    assert steps == ["2", str(CFG.steps)]  # the final step is saved next to the one it resumed from
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, straight.params),
                 jax.tree.map(np.asarray, resumed.params))
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, straight.opt),
                 jax.tree.map(np.asarray, resumed.opt))
    # What a kill (SIGKILL, power loss) after run.json but before the first checkpoint finished
    # leaves: orbax's temporary directory only, and a log line cut mid-way. --resume refused it
    # ("no complete checkpoint"), and so did a fresh start (the run exists); it starts over from
    # step 0 instead, ends identical, and the torn line is cut rather than glued to the next one.
    (tmp_path / "c").mkdir()  # where an earlier start with a draft vocabulary was killed before run.json
    (tmp_path / "c" / "draft_vocab.npy").write_bytes(b"\x93NUMPY")
    train(target, _drafter(target), data_dir, tmp_path / "c", CFG, until=1, **quiet)
    assert not (tmp_path / "c" / "draft_vocab.npy").exists()  # this drafter has none: not left to mislead
    shutil.rmtree(tmp_path / "c" / "checkpoints")
    (tmp_path / "c" / "checkpoints" / "1.orbax-checkpoint-tmp-1").mkdir(parents=True)
    with open(tmp_path / "c" / "log.jsonl", "a", encoding="utf-8") as f:
        f.write('{"step": 2, "loss_t')
    lines = []
    killed = train(target, _drafter(target), data_dir, tmp_path / "c", CFG, resume=True,
                   **{**quiet, "log": lines.append})
    assert {"event": "resume", "step": 0, "note": "no checkpoint yet: starting from step 0"} in map(json.loads, lines)
    assert sorted(os.listdir(tmp_path / "c" / "checkpoints")) == [str(CFG.steps)]  # the cut save's directory is gone
    for a, b in ((straight.params, killed.params), (straight.opt, killed.opt)):
        jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, a), jax.tree.map(np.asarray, b))
    log = [json.loads(line) for line in (tmp_path / "c" / "log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log if "loss_tok" in e] == [1, CFG.steps]
    log = [json.loads(line) for line in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert any("heldout" in e and "tau_sim@8" in e["heldout"] for e in log)
    # Held-out checks follow eval_every_s: none mid-run at the default 600 s (only the final one,
    # which the stop at step 2 did not make), one per step at 0 s (then the final one).
    checks = lambda run: [(e["step"], e.get("final", False)) for e in  # noqa: E731
                          map(json.loads, (tmp_path / run / "log.jsonl").read_text().splitlines()) if "heldout" in e]
    assert checks("b") == [(CFG.steps, True)]
    assert checks("a") == [(s, False) for s in range(1, CFG.steps + 1)] + [(CFG.steps, True)]

    # Export == the trained parameters (float32 export is lossless); the drafter then decodes.
    exported = _params(tmp_path / "a", target)
    trained = {"/".join(map(str, p)): np.asarray(v)
               for p, v in jax.tree_util.tree_flatten_with_path(straight.params)[0]}
    assert exported.keys() == trained.keys()
    resumed_export = _params(tmp_path / "b", target)  # the latest of its two checkpoints, not step 2
    for k in trained:
        np.testing.assert_array_equal(exported[k], trained[k], err_msg=k)
        np.testing.assert_array_equal(resumed_export[k], trained[k], err_msg=k)

    # A corrupt checkpoint is a clear error naming it.
    ckpt = tmp_path / "a" / "checkpoints" / str(CFG.steps)
    for f in ckpt.rglob("*"):
        if f.is_file() and f.stat().st_size > 64 and "state" in str(f):
            f.write_bytes(b"\0" * f.stat().st_size)
    with pytest.raises(RunError, match=f"checkpoints/{CFG.steps}: checkpoint is corrupt"):
        train(target, _drafter(target), data_dir, tmp_path / "a", CFG, resume=True, **quiet)
    with pytest.raises(RunError, match=f"checkpoints/{CFG.steps}: cannot read the drafter parameters"):
        export_run(tmp_path / "a", tmp_path / "a-export", target.cfg)
    assert not (tmp_path / "a-export").exists()
    with pytest.raises(RunError, match=f"checkpoints/{CFG.steps}"):
        export_run(tmp_path / "a", tmp_path / "x", target.cfg)


def test_a_damaged_data_directory_is_named(tmp_path, data_dir):
    """Token ids outside the target's vocabulary (which the embedding gather would clamp in silence)
    and a manifest that is not the object `tevjax data` writes are errors naming the file."""
    bad = tmp_path / "d"
    shutil.copytree(data_dir, bad)
    shard = sorted((bad / "shards").glob("train-*"))[1]
    tokens = np.load(shard / "tokens.npy")
    tokens[3] = read_manifest(bad)["target_config"]["vocab_size"]
    np.save(shard / "tokens.npy", tokens)
    with pytest.raises(ValueError, match=f"{shard}: damaged shard: token ids .* not all in the target's vocabulary"):
        TrainData(bad, "train")
    TrainData(bad, "heldout")  # the other split's shards are intact
    tokens[3] = -1
    np.save(shard / "tokens.npy", tokens)
    with pytest.raises(ValueError, match=f"{shard}: damaged shard: token ids -1\\.\\."):
        TrainData(bad, "train")
    manifest = bad / "manifest.json"
    saved = json.loads(manifest.read_text())
    for content, message in (("[]", "a JSON list, not an object"),
                             (json.dumps({k: v for k, v in saved.items() if k != "rollout"}),
                              "damaged manifest: 'rollout' must be an object with 'taps'")):
        manifest.write_text(content)
        with pytest.raises(ValueError, match=message):
            read_manifest(bad)


def _npy(shard: Path, name: str, change) -> None:
    np.save(shard / name, change(np.load(shard / name)))


@pytest.mark.parametrize("change, message", [
    (lambda sh: _npy(sh, "features.npy", lambda a: a[:-5]), r"features.npy holds uint16 \(\d+, 2, 64\)"),
    (lambda sh: _npy(sh, "features.npy", lambda a: a[:, :1]), r"the manifest's 2 taps"),
    (lambda sh: _npy(sh, "features.npy", lambda a: a.astype(np.float32)), r"features.npy holds float32"),
    (lambda sh: _npy(sh, "loss_mask.npy", lambda a: a[:-5]), r"loss_mask.npy has shape"),
    (lambda sh: _npy(sh, "offsets.npy", lambda a: np.append(a[:-1], a[-1] - 3)), r"offsets.npy does not split"),
    (lambda sh: _npy(sh, "tokens.npy", lambda a: a.astype(np.float32)), r"tokens.npy holds float32"),
    (lambda sh: (sh / "features.npy").write_bytes(b""), r"\(No data left in file\)"),
])
def test_a_shard_whose_arrays_disagree_is_named_when_the_data_is_opened(tmp_path, data_dir, change, message):
    """Arrays of a shard that disagree (a copy cut short, files from another directory) are named
    when the data is opened: they failed with numpy's own words (an empty file: EOFError, an
    internal error) when a batch first read the record, mid-run, or cropped records in silence."""
    bad = tmp_path / "d"
    shutil.copytree(data_dir, bad)
    shard = bad / "shards" / "train-00001"
    change(shard)
    with pytest.raises(ValueError, match=re.escape(str(shard)) + r": (damaged|unreadable) shard.*" + message):
        TrainData(bad, "train")


def test_a_copy_beside_a_shard_is_not_read(tmp_path, data_dir):
    """Only the plan's shard names are read: a copy left beside a shard ("train-00001.bak") was read
    too, its records twice."""
    data = tmp_path / "d"
    shutil.copytree(data_dir, data)
    before = _records(data, "train")
    for name in ("train-00001.bak", "train-00001 copy"):
        shutil.copytree(data / "shards" / "train-00001", data / "shards" / name)
    assert _records(data, "train") == before


def _all_finite(tree) -> bool:
    return all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(tree))


def test_a_diverged_run_saves_nothing_non_finite(tmp_path, data_dir, target, monkeypatch):
    """A run whose weights turn NaN (lr 1e30) stops with DivergedError and never writes that state:
    checkpoints (one after every step here) stop at the last finite one, which exports and resumes.
    A NaN checkpoint written before tevjax checked (simulated) is refused by resume and export."""
    import tevjax.train.run as run_mod

    quiet = dict(progress=False, log=lambda _: None, target_name="tiny", heldout_records=4, eval_every_s=1e9)
    cfg = dataclasses.replace(CFG, lr=1e30, steps=6, warmup=0.0)
    with pytest.raises(DivergedError, match=r"step \d: training diverged .*the last checkpoint, step \d, is"):
        train(target, _drafter(target), data_dir, tmp_path / "d", cfg, checkpoint_every_s=0.0, **quiet)
    steps = sorted(int(p.name) for p in (tmp_path / "d" / "checkpoints").iterdir())
    assert steps and steps[-1] < cfg.steps, steps
    exported = _params(tmp_path / "d", target)
    assert _all_finite(exported)
    # The kept checkpoint resumes (and diverges again, saving nothing new).
    with pytest.raises(DivergedError):
        train(target, _drafter(target), data_dir, tmp_path / "d", cfg, resume=True, checkpoint_every_s=0.0,
              **quiet)
    assert sorted(int(p.name) for p in (tmp_path / "d" / "checkpoints").iterdir())[-1] == steps[-1]

    # Before the check: the same run saved its NaN state at the end.
    monkeypatch.setattr(run_mod, "_finite", lambda state: True)
    with pytest.raises(DivergedError, match="non-finite training metrics"):
        train(target, _drafter(target), data_dir, tmp_path / "old", cfg, **quiet)
    monkeypatch.undo()
    with pytest.raises(RunError, match="checkpoint holds non-finite values"):
        train(target, _drafter(target), data_dir, tmp_path / "old", cfg, resume=True, **quiet)
    with pytest.raises(RunError, match="holds non-finite values .*nothing was exported"):
        export_run(tmp_path / "old", tmp_path / "old-export", target.cfg)
    assert not (tmp_path / "old-export").exists()


def test_export_paths(tmp_path, data_dir, target, monkeypatch):
    """`export_run` reads a run given by a relative path, replaces an earlier export, and refuses
    to write over another model, a run or a data directory."""
    from tevjax.convert.hf import save_hf_target

    quiet = dict(progress=False, log=lambda _: None, target_name="tiny", heldout_records=4)
    train(target, _drafter(target), data_dir, tmp_path / "r", dataclasses.replace(CFG, steps=1), **quiet)
    monkeypatch.chdir(tmp_path)
    export_run("r", "out", target.cfg)
    first = (tmp_path / "out" / "model.safetensors").read_bytes()
    (tmp_path / "out" / "notes.txt").write_text("kept")
    export_run("r", "out", target.cfg, dtype="float32")  # an earlier export: replaced, other files kept
    assert (tmp_path / "out" / "model.safetensors").read_bytes() != first
    assert (tmp_path / "out" / "notes.txt").read_text() == "kept"
    save_hf_target(target, tmp_path / "model")
    before = {f.name: f.read_bytes() for f in (tmp_path / "model").iterdir()}
    with pytest.raises(RunError, match="holds another model's config.json"):
        export_run("r", "model", target.cfg)
    assert {f.name: f.read_bytes() for f in (tmp_path / "model").iterdir()} == before
    for where, message in (("r", "inside the training run"), ("r/sub", "inside the training run"),
                           (str(data_dir), "holds a data directory")):
        with pytest.raises(RunError, match=message):
            export_run("r", where, target.cfg)
    assert not (tmp_path / "r" / "config.json").exists() and not (tmp_path / "r" / "sub").exists()


def test_two_device_step_equals_one_device_step(tmp_path, data_dir):
    script = textwrap.dedent(f"""
        import sys, jax, numpy as np
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_train import _batch, _drafter, _target, CFG
        from tevjax.sharding import make_mesh
        from tevjax.train.step import Trainer
        assert len(jax.devices()) == 2
        target = _target()
        batch = _batch({str(data_dir)!r})
        out = {{}}
        for name, mesh in (("one", make_mesh(devices=jax.devices()[:1])), ("two", make_mesh())):
            tr = Trainer(_drafter(target), target, CFG, mesh)
            st = tr.init_state()
            for _ in range(2):
                st, m = tr.step(st, batch)
            out[name] = (jax.tree.map(np.asarray, st.params), {{k: float(v) for k, v in m.items()}})
            if name == "two":
                assert len(st.params["fc"]["kernel"].value.sharding.device_set) == 2
        # Reductions are split across devices, so float32 sums round differently (~1e-7 relative);
        # Adam divides by sqrt(v), so after two steps a parameter may differ by a few 1e-6: the
        # stated tolerance is 2e-5 absolute on parameters (lr 3e-3) and 1e-5 relative on metrics.
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-5), out["one"][0], out["two"][0])
        for k in out["one"][1]:
            np.testing.assert_allclose(out["one"][1][k], out["two"][1][k], rtol=1e-5, atol=1e-6, err_msg=k)
        print("OK")
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=forced_devices_env(2),
                         timeout=900)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


@pytest.mark.parametrize("argv, message", [
    (["train", "--data", "/nonexistent", "--out", "/tmp/x", "--steps", "2"], "--data '/nonexistent': no such directory"),
    (["train", "--data", "/dev/null", "--out", "/tmp/x", "--steps", "2"],
     "--data '/dev/null': a file, not a `tevjax data` directory"),
    (["train", "--data", ".", "--out", "/tmp/x", "--steps", "0"], "--steps must be >= 1"),
    (["train", "--data", ".", "--out", "/tmp/x", "--steps", "2", "--exit-weight", "bogus"], "--exit-weight 'bogus'"),
    (["train", "--data", ".", "--out", "/tmp/x", "--steps", "2", "--anchors", "4", "--exit-anchors", "5"],
     "--exit-anchors 5 exceeds --anchors 4"),
    (["train", "--data", ".", "--out", "/tmp/x", "--steps", "2", "--lr", "-1"], "--lr must be a finite number > 0"),
    (["train", "--data", ".", "--out", "/tmp/x", "--steps", "2", "--exit-top-p", "0"], "--exit-top-p must be in (0, 1]"),
    (["train", "--data", ".", "--out", "/tmp/x", "--steps", "2", "--exit-temperature", "0"],
     "--exit-temperature must be a finite number > 0"),
    (["train", "--data", ".", "--out", "/tmp/x", "--steps", "2", "--distill", "1.5"],
     "--distill must be a weight in [0, 1]"),
    # TrainConfig's own checks, named by their flags, before the target or the data is read.
    (["train", "--data", ".", "--out", "/tmp/x", "--steps", "2", "--exit-temperature", "1e39"],
     "--exit-temperature must be a finite float32 number > 0, got 1e+39"),
    (["train", "--data", ".", "--out", "/tmp/x", "--steps", "2", "--warmup", "5"],
     "--warmup must be a fraction in [0, 1)"),
    (["train", "--data", ".", "--out", "/tmp/x", "--steps", "2", "--seed", "-1"], "--seed must be in [0, 2**64)"),
    (["train", "--data", ".", "--out", "/tmp/x", "--steps", "2", "--init", ".", "--mask-token", "3"],
     "--mask-token chooses a fresh drafter's mask token"),
    # Settings of a fresh drafter: an --init drafter keeps its own, so they would be ignored.
    (["train", "--data", ".", "--out", "/tmp/x", "--steps", "2", "--init", ".", "--taps", "1"],
     "--taps chooses a fresh drafter's target layers"),
    (["train", "--data", ".", "--out", "/tmp/x", "--steps", "2", "--init", ".", "--block-size", "8"],
     "--block-size chooses a fresh drafter's block size"),
    (["data", "--num-prompts", "3", "--out", "/tmp/x", "--seed", "18446744073709551616"], "--seed must be in [0, 2**64)"),
    (["eval", "--seed", "x"], "--seed must be an integer"),
    (["train", "export", "/nonexistent", "/tmp/y"], "no run.json"),
    (["eval", "--verifier", "ar"], "--verifier 'ar'"),
    (["eval", "--prompts", "/nonexistent.txt"], "not a file"),
    (["data", "--num-prompts", "3", "--out", "/dev/null"], "is a file"),
])
def test_cli_errors_are_one_line(capsys, argv, message):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own usage errors
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_train_taps_must_be_stored_in_the_data(capsys, tmp_path):
    """--taps naming a layer the data directory does not store is refused by its flag, from the
    manifest alone, before the target loads (a stand-in manifest: nothing else is read)."""
    from tevjax.train.rollout import MANIFEST

    data = tmp_path / "data"
    data.mkdir()
    (data / MANIFEST).write_text(json.dumps({"format": FORMAT_VERSION, "rollout": {"taps": [1, 8, 29]}, "shards": {},
                                             "target_config": {"hidden_size": 4, "vocab_size": 9, "num_layers": 30}}))
    code = main(["train", "--data", str(data), "--out", str(tmp_path / "run"), "--steps", "2", "--taps", "8,9,10"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"--taps 8,9,10: --data '{data}' stores the target layers 1,8,29 only" in err, err
    assert not (tmp_path / "run").exists()


def test_train_flags_reach_the_train_config(monkeypatch, capsys, tmp_path):
    """`tevjax train`'s flags become TrainConfig's fields (a stand-in that records them and refuses,
    so nothing loads): --gamma 0 is "off" (None), --exit-anchors defaults to 8 or --anchors if fewer,
    and a refusal names the flag, not the field."""
    import tevjax.train.step as step

    seen = []

    def refuse(**kw):
        seen.append(kw)
        raise ValueError("TrainConfig.seq_len: refused by the stand-in")

    monkeypatch.setattr(step, "TrainConfig", refuse)
    base = ["train", "--data", str(tmp_path), "--out", str(tmp_path / "run"), "--steps", "5"]
    assert main([*base, "--batch", "4", "--anchors", "6", "--seq-len", "64", "--lr", "0.001", "--warmup", "0.5",
                 "--weight-decay", "0.1", "--gamma", "0", "--distill", "0.25", "--exit-lambda", "0.5",
                 "--exit-weight", "w_depth", "--exit-budget", "3", "--exit-sequences", "2", "--exit-temperature",
                 "0.5", "--exit-top-k", "4", "--exit-top-p", "0.75", "--exit-min-p", "0.125", "--seed", "9"]) == 2
    assert "tevjax: error: --seq-len: refused by the stand-in" in capsys.readouterr().err
    assert seen[-1] == dict(steps=5, batch_size=4, anchors=6, seq_len=64, lr=0.001, warmup=0.5, weight_decay=0.1,
                            gamma=None, distill=0.25, exit_lambda=0.5, exit_weight="w_depth", exit_budget=3,
                            exit_anchors=6, exit_sequences=2, exit_temperature=0.5, exit_top_k=4, exit_top_p=0.75,
                            exit_min_p=0.125, seed=9)
    assert main([*base, "--gamma", "3", "--exit-anchors", "5"]) == 2
    assert (seen[-1]["gamma"], seen[-1]["exit_anchors"], seen[-1]["anchors"]) == (3.0, 5, 32)
    assert main(base) == 2
    assert (seen[-1]["gamma"], seen[-1]["exit_anchors"], seen[-1]["exit_sequences"]) == (7.0, 8, None)


def test_data_flags_reach_the_rollout_config(monkeypatch, capsys, tmp_path):
    """`tevjax data`'s flags become RolloutConfig's fields and `generate_data`'s arguments (stand-ins
    for the target and the generation): the default taps are 5 spread layers plus the last one, the
    held-out records are at most the held-out prompts; the summary line sums the shards."""
    from types import SimpleNamespace

    import tevjax.loading as loading
    import tevjax.train.rollout as rollout

    seen = []

    def generate_data(loaded, cfg, out, **kw):
        seen.append((cfg, out, kw))
        return {"shards": {"0": {"records": 3, "response_tokens": 40}, "1": {"records": 2, "response_tokens": 7}},
                "complete": False, "timings": {"generate": 1.5}}

    monkeypatch.setattr(loading, "load_target", lambda *a, **k: SimpleNamespace(
        target_cfg=SimpleNamespace(num_layers=12), notes=[]))
    monkeypatch.setattr(rollout, "generate_data", generate_data)
    out = tmp_path / "data"
    assert main(["data", "--num-prompts", "6", "--out", str(out), "--heldout", "3", "--heldout-records", "3",
                 "--max-new-tokens", "20", "--max-prompt-tokens", "30", "--batch-size", "2", "--seed", "4",
                 "--responses", "sharegpt", "--turns", "later", "--exclusion", "conversation", "--train-shards", "1:3",
                 "--no-progress"]) == 0
    cfg, where, kw = seen[-1]
    assert (cfg.num_prompts, cfg.heldout_prompts, cfg.heldout_records, cfg.max_new_tokens, cfg.max_prompt_tokens,
            cfg.batch_size, cfg.taps, cfg.seed, cfg.responses, cfg.turns, cfg.exclusion) == \
        (6, 3, 3, 20, 30, 2, (1, 3, 5, 7, 9, 11), 4, "sharegpt", "later", "conversation")
    assert where == out
    assert (kw["resume"], kw["progress"], kw["train_shards"], kw["mesh"]) == (False, False, (1, 3), None)
    assert json.loads(capsys.readouterr().out) == {"out": str(out), "complete": False, "records": 5,
                                                   "response_tokens": 47, "timings": {"generate": 1.5}}
    assert main(["data", "--num-prompts", "6", "--out", str(out), "--taps", "2,4"]) == 0
    cfg, _, kw = seen[-1]
    assert (cfg.taps, cfg.heldout_prompts, cfg.heldout_records, kw["train_shards"], kw["progress"]) == \
        ((2, 4), 256, 64, None, True)
    # --heldout-records' default is cut to --heldout; a number given past it is refused, not cut.
    assert main(["data", "--num-prompts", "6", "--out", str(out), "--heldout", "5"]) == 0
    assert seen[-1][0].heldout_records == 5
    assert main(["data", "--num-prompts", "6", "--out", str(out), "--heldout", "3", "--heldout-records", "5"]) == 2
    assert "--heldout-records 5 exceeds --heldout 3" in capsys.readouterr().err


def test_adam_decays_are_checked():
    for name, bad in (("b1", 1.5), ("b1", -1.0), ("b2", float("nan")), ("b2", 1.0)):
        with pytest.raises(ValueError, match=rf"TrainConfig.{name} must be in \[0, 1\)"):
            dataclasses.replace(CFG, **{name: bad})


def test_train_config_refuses_settings_the_losses_cannot_use():
    """Each bad setting is refused by name (CFG: anchors 6); the edges the losses accept pass."""
    for change, message in (({"gamma": 0.0}, "gamma must be > 0 or None"), ({"gamma": -7.0}, "gamma must be > 0"),
                            ({"exit_anchors": 7}, r"exit_anchors \(7\) exceeds anchors \(6\)"),
                            ({"exit_weight": "P"}, "exit_weight 'P' is not one of w, w_depth"),
                            ({"anchors": 0}, "anchors must be a positive int"),
                            ({"exit_lambda": -0.1}, "exit_lambda must be a finite float32 number >= 0"),
                            ({"warmup": 1.0}, r"warmup must be a fraction in \[0, 1\)")):
        with pytest.raises(ValueError, match=rf"TrainConfig.{message}"):
            dataclasses.replace(CFG, **change)
    for fine in ({"gamma": None}, {"gamma": 0.5}, {"distill": 1.0}, {"exit_anchors": 6}, {"exit_weight": "P_floored"}):
        dataclasses.replace(CFG, **fine)


def test_a_gamma_float32_reads_as_zero_is_refused():
    """A gamma below float32's smallest normal number passed the > 0 check, became 0 in the step's
    float32 division and made the first row's decay weight exp(-0 / 0) = NaN: the token loss read 0
    and every gradient NaN. The smallest accepted gamma keeps the weights finite."""
    from tevjax.train.objectives import ratio, token_loss_terms

    for tiny in (1e-50, 1e-40):
        with pytest.raises(ValueError, match=r"TrainConfig.gamma must be at least float32's smallest normal"):
            dataclasses.replace(CFG, gamma=tiny)
    gamma = dataclasses.replace(CFG, gamma=float(np.finfo(np.float32).tiny)).gamma
    tokens, mask = jnp.arange(6)[None] % 5, jnp.ones((1, 6), bool)

    def loss(logits):
        terms = token_loss_terms(jax.nn.logsumexp(logits, -1), logits, tokens, mask, jnp.array([[1]]),
                                 jnp.array([[True]]), gamma)
        return ratio(terms)

    value, grad = jax.value_and_grad(loss)(jnp.zeros((1, 1, 3, 5)))
    # Only block position 1 counts (weight 1; the others exp(-huge) = 0): CE of a uniform row.
    np.testing.assert_allclose(float(value), np.log(5), rtol=1e-6)
    assert np.isfinite(np.asarray(grad)).all()


def test_train_config_numbers_are_numbers_and_numpy_ints_are_ints():
    """float() read lr=True as 1.0 and warmup=False as 0.0, and a string failed with "could not
    convert string to float" without the field's name; NumPy ints were refused as counts."""
    for name, bad in (("lr", True), ("lr", "3e-3"), ("lr", None), ("warmup", False), ("gamma", "7"),
                      ("distill", True), ("exit_lambda", True), ("b1", "0.9")):
        with pytest.raises(TypeError, match=f"TrainConfig.{name} must be a number, got {bad!r}"):
            dataclasses.replace(CFG, **{name: bad})
    cfg = dataclasses.replace(CFG, steps=np.int64(4), batch_size=np.int32(4), exit_sequences=np.int64(2),
                              seed=np.uint64(3), lr=np.float32(0.5))
    assert (cfg.steps, cfg.batch_size, cfg.exit_sequences, cfg.seed, cfg.lr) == (4, 4, 2, 3, 0.5)
    assert {type(cfg.steps), type(cfg.batch_size), type(cfg.exit_sequences), type(cfg.seed)} == {int}
    assert type(cfg.lr) is float


def test_optimizer_is_clipped_adamw_on_warmup_cosine():
    """`make_optimizer` against Adam worked out by hand: the gradient clipped to global norm
    clip_norm, AdamW with the config's b1, b2 and decoupled weight decay, and the learning rate
    rising linearly from 0 over round(warmup * steps) steps, then a cosine to 0 at `steps`."""
    import optax

    from tevjax.train.step import make_optimizer

    cfg = TrainConfig(steps=10, lr=0.1, warmup=0.2, clip_norm=1.0, b1=0.8, b2=0.95, weight_decay=0.05)
    rng = np.random.default_rng(0)
    # Norms from 0.3 to 4: about half the gradients are clipped, and they differ in size, so Adam's
    # normalisation does not hide the clipping.
    grads = [rng.standard_normal(3) * s for s in np.linspace(0.3, 4.0, cfg.steps)[rng.permutation(cfg.steps)]]
    assert 0 < sum(np.linalg.norm(g) > cfg.clip_norm for g in grads) < cfg.steps
    tx = make_optimizer(cfg)
    params = jnp.asarray([3.0, -2.0, 0.5], jnp.float32)
    opt = tx.init(params)
    p, m, v = np.array([3.0, -2.0, 0.5]), np.zeros(3), np.zeros(3)
    warm = 2
    for t, g in enumerate(grads):
        upd, opt = tx.update(jnp.asarray(g, jnp.float32), opt, params)
        params = optax.apply_updates(params, upd)
        g = g * min(1.0, cfg.clip_norm / np.linalg.norm(g))
        m, v = cfg.b1 * m + (1 - cfg.b1) * g, cfg.b2 * v + (1 - cfg.b2) * g * g
        adam = (m / (1 - cfg.b1 ** (t + 1))) / (np.sqrt(v / (1 - cfg.b2 ** (t + 1))) + 1e-8)
        lr = cfg.lr * (t / warm if t < warm else 0.5 * (1 + np.cos(np.pi * (t - warm) / (cfg.steps - warm))))
        p = p - lr * (adam + cfg.weight_decay * p)
        np.testing.assert_allclose(np.asarray(params), p, rtol=1e-5, atol=1e-6, err_msg=f"step {t + 1}")
        if t == 0:  # the warmup starts at a learning rate of 0: the first step moves nothing
            np.testing.assert_array_equal(np.asarray(params), [3.0, -2.0, 0.5])


def test_train_mask_token_flag(target):
    """--mask-token: taken as given inside the vocabulary, refused outside it; without it, a target
    whose tokenizer offers no mask token is an error that names the flag."""
    from types import SimpleNamespace

    from tevjax.cli import CliError, _mask_token

    loaded = SimpleNamespace(target_cfg=target.cfg, tokenizer=None)
    assert _mask_token(SimpleNamespace(mask_token=7), loaded) == 7
    with pytest.raises(CliError, match=rf"--mask-token {target.cfg.vocab_size} is not in the target's vocabulary"):
        _mask_token(SimpleNamespace(mask_token=target.cfg.vocab_size), loaded)
    with pytest.raises(CliError, match=r"needs the target's tokenizer .*\(--mask-token ID\)"):
        _mask_token(SimpleNamespace(mask_token=None), loaded)


def test_train_init_cannot_remove_layers(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    assert main(["train", "--data", ".", "--out", str(tmp_path / "run"), "--steps", "2", "--init", str(tmp_path),
                 "--layers", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "--layers 1: the --init drafter already has 2 layers" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_a_run_keeps_its_draft_vocabulary_and_its_shards(tmp_path, data_dir, target):
    quiet = dict(progress=False, log=lambda _: None, target_name="tiny", heldout_records=4)
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    cfg = DFlashConfig.for_target(target.cfg, num_layers=1, block_size=BS, mask_token_id=5, target_layer_ids=TAPS,
                                  draft_vocab_size=64)
    counts = TrainData(data, "train").token_counts(target.cfg.vocab_size)
    assert counts.sum() == TrainData(data, "train").response_tokens  # every supervised token, once
    ids = draft_vocab_from_counts(counts, 64, always=(2,))
    train(target, DFlashDrafter(cfg, rngs=nnx.Rngs(0), draft_vocab=ids), data, tmp_path / "r", CFG, until=2, **quiet)
    before = TrainData(data, "train")
    # More data arrives; the resumed run reads its recorded shards and its own vocabulary, whatever
    # vocabulary the drafter it is handed carries.
    shutil.copytree(data / "shards" / "train-00000", data / "shards" / "train-00099")
    assert len(TrainData(data, "train")) > len(before)
    other = DFlashDrafter(cfg, rngs=nnx.Rngs(0), draft_vocab=np.arange(64))
    # A run recorded before the distillation option existed resumes as one without it, and only so.
    run_json = tmp_path / "r" / "run.json"
    record = json.loads(run_json.read_text())
    del record["train"]["distill"]
    run_json.write_text(json.dumps(record))
    with pytest.raises(RunError, match="distill: 0.0 saved, 0.5 now"):
        train(target, other, data, tmp_path / "r", dataclasses.replace(CFG, distill=0.5), resume=True, **quiet)
    state = train(target, other, data, tmp_path / "r", CFG, resume=True, **quiet)
    assert int(state.step) == CFG.steps
    record = json.loads((tmp_path / "r" / "run.json").read_text())
    assert record["train_shards"] == before.shard_names
    export_run(tmp_path / "r", tmp_path / "x", target.cfg)
    _, exported = load_dflash(tmp_path / "x", target.cfg)
    np.testing.assert_array_equal(np.asarray(exported.vocab_ids()), ids)


@pytest.mark.parametrize("change, error, message", [
    ({"num_prompts": "12"}, TypeError, "RolloutConfig.num_prompts must be an int, got '12'"),
    ({"heldout_records": 1.5}, TypeError, "RolloutConfig.heldout_records must be an int"),
    ({"batch_size": 0}, ValueError, "batch_size must be >= 1"),
    ({"num_prompts": 0}, ValueError, "num_prompts must be >= 1"),
    ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be >= 1"),
    ({"max_prompt_tokens": 0}, ValueError, "max_prompt_tokens must be >= 1"),
    ({"seed": -1}, ValueError, r"RolloutConfig.seed must be in \[0, 2\*\*64\)"),
    ({"taps": (1, -2)}, ValueError, "RolloutConfig.taps must be target layer indices >= 0"),
    ({"taps": ()}, ValueError, "taps must name at least one target layer"),
    ({"taps": (1, 3, 1)}, ValueError, r"RolloutConfig.taps lists layer 1 twice"),
    ({"taps": 3}, ValueError, "RolloutConfig.taps must be a tuple of target layer indices, got 3"),
    ({"heldout_records": 5, "heldout_prompts": 4}, ValueError, r"need 0 <= heldout_records \(5\) <= heldout_prompts"),
])
def test_bad_rollout_settings_are_named(change, error, message):
    with pytest.raises(error, match=message):
        dataclasses.replace(ROLLOUT, **change)


def test_data_and_train_refuse_a_bad_out_before_writing_or_loading(tmp_path, target, capsys):
    """`generate_data` refuses training shards outside the plan before it writes the plan (a rerun
    would otherwise find a data directory and ask for --resume), and `tevjax train` refuses an --out
    that is a file or already holds a run before it reads --data or loads the target."""
    with pytest.raises(ValueError, match="training shards 5:6 are outside the plan's 3"):
        generate_data(_loaded(target), ROLLOUT, tmp_path / "d", prompts=PROMPTS, progress=False,
                      log=lambda _: None, train_shards=(5, 6))
    assert not (tmp_path / "d").exists()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run.json").write_text("{}")
    (tmp_path / "file").write_text("x")
    base = ["train", "--data", str(tmp_path), "--steps", "2"]  # no manifest.json: not read first
    for out, resume, message in (("run", [], "already holds a training run: pass --resume"),
                                 ("file", [], "--out '" + str(tmp_path / "file") + "' is a file, not a directory"),
                                 ("new", ["--resume"], "holds no training run to resume")):
        assert main([*base, "--out", str(tmp_path / out), *resume]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    # What a start killed before run.json leaves (its draft vocabulary, run.json's temporary file) is
    # no run: a new start may write there. Anything else in the directory is refused.
    from tevjax.train.run import DRAFT_VOCAB_FILE, RunError, check_run_out

    killed = tmp_path / "killed"
    killed.mkdir()
    (killed / DRAFT_VOCAB_FILE).write_bytes(b"\x93NUMPY")
    (killed / "run.json.tmp").write_text('{"trunc')
    check_run_out(killed, resume=False)
    with pytest.raises(RunError, match="holds no training run to resume"):
        check_run_out(killed, resume=True)
    (killed / "notes.txt").write_text("mine")
    with pytest.raises(RunError, match="exists and is not empty"):
        check_run_out(killed, resume=False)


def test_numpy_rollout_counts_go_into_the_manifest_as_ints():
    """The config is written to the JSON manifest: a NumPy int there failed with "Object of type
    int64 is not JSON serializable", after the config had been accepted."""
    cfg = dataclasses.replace(ROLLOUT, num_prompts=np.int64(12), batch_size=np.int32(4), seed=np.uint64(3),
                              taps=(np.int64(1),))
    assert json.loads(json.dumps(dataclasses.asdict(cfg)))["num_prompts"] == 12
    assert (cfg.batch_size, cfg.seed, cfg.taps) == (4, 3, (1,))


def test_the_shard_plan_covers_each_split_once_held_out_first():
    """Shards of batch_size prompts, the last one short; the held-out split has heldout_records
    records (not heldout_prompts) and comes first."""
    from tevjax.train.rollout import _shard_plan

    cfg = dataclasses.replace(ROLLOUT, num_prompts=10, heldout_prompts=4, heldout_records=3, batch_size=4)
    assert _shard_plan(cfg) == [("heldout-00000", "heldout", 0, 3), ("train-00000", "train", 0, 4),
                                ("train-00001", "train", 4, 8), ("train-00002", "train", 8, 10)]


def test_a_resume_lists_shards_the_manifest_missed(tmp_path, data_dir, target):
    """A stop between a shard's rename and the manifest's rewrite leaves a shard the manifest does not
    list: a resume lists it again (with its summary) and makes only the missing shards; the directory
    is complete only when every shard of the plan is there."""
    out = tmp_path / "d"
    shutil.copytree(data_dir, out)
    manifest = read_manifest(out)
    summary = manifest["shards"].pop("train-00000")
    del manifest["shards"]["train-00002"]
    manifest["complete"] = False
    (out / "manifest.json").write_text(json.dumps(manifest))
    shutil.rmtree(out / "shards" / "train-00002")
    quiet = dict(progress=False, log=lambda _: None, resume=True)
    partial = generate_data(_loaded(target), ROLLOUT, out, stop_after_shards=0, **quiet)
    assert partial["shards"]["train-00000"] == summary and not partial["complete"]  # 3 of the 4 shards
    with pytest.raises(ValueError, match="training shards 1:1 are outside the plan's 3"):  # an empty slice
        generate_data(_loaded(target), ROLLOUT, out, train_shards=(1, 1), **quiet)
    assert generate_data(_loaded(target), ROLLOUT, out, **quiet)["complete"]
    assert _records(out, "train") == _records(data_dir, "train")


def test_a_tap_past_the_last_layer_is_refused(tmp_path, target):
    with pytest.raises(ValueError, match=r"tap 4 is outside the target's layers \[0, 4\)"):
        generate_data(_loaded(target), dataclasses.replace(ROLLOUT, taps=(1, 4)), tmp_path / "d", prompts=PROMPTS,
                      progress=False, log=lambda _: None)
    assert not (tmp_path / "d").exists()


class _TurnTokenizer:
    """A chat template that ends each assistant turn with "$" and a newline (one token per
    character): what `_reply_ids` must cut a ShareGPT reply at."""

    chat_template = "x"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        text = "".join(f"U:{m['content']}|" if m["role"] == "user" else f"A:{m['content']}$\n" for m in messages)
        return text + ("A:" if add_generation_prompt else "")

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_a_sharegpt_reply_is_the_assistant_turn_up_to_its_end_of_turn():
    """`_reply_ids`: the reply's tokens after the prompt, through the end-of-turn token and no
    further; a reply that fits max_new_tokens exactly ends in "eos", a longer one is cut ("length")."""
    from tevjax.convert.tokenizer import chat_prompt_ids
    from tevjax.train.rollout import _reply_ids

    tok = _TurnTokenizer()
    row = {"text": "hi", "reply": "hello", "prompt_ids": chat_prompt_ids(tok, "hi")}
    eos = (ord("$"),)
    whole = [ord(c) for c in "hello$"]
    assert _reply_ids(tok, row, eos, 6) == (whole, "eos")
    assert _reply_ids(tok, row, eos, 50) == (whole, "eos")
    assert _reply_ids(tok, row, eos, 3) == (whole[:3], "length")


def test_a_batch_crops_each_record_to_seq_len_and_pads_the_rest(data_dir):
    """`TrainData.batch`: a row holds its record's first seq_len tokens, mask and features, and
    `length` is what it holds; past it everything is padding (token 0, mask False, zero features)."""
    data = TrainData(data_dir, "train")
    records = [data.record(i, [1, 0]) for i in (3, 8)]
    short = data.batch([3, 8], [1, 0], seq_len=6)
    assert short["length"].tolist() == [6, 6] and all(len(t) > 6 for t, _, _ in records)
    long = data.batch([3, 8], [1, 0], seq_len=40)
    assert long["length"].tolist() == [len(t) for t, _, _ in records]
    for host, t in ((short, 6), (long, 40)):
        for j, (tokens, mask, feats) in enumerate(records):
            n = int(host["length"][j])
            np.testing.assert_array_equal(host["tokens"][j, :n], tokens[:n])
            np.testing.assert_array_equal(host["loss_mask"][j, :n], mask[:n])
            np.testing.assert_array_equal(host["features"][j, :n], feats[:n])
            assert host["tokens"].shape == host["loss_mask"].shape == (2, t)
            assert not host["tokens"][j, n:].any() and not host["loss_mask"][j, n:].any()
            assert not host["features"][j, n:].any()


def _hand_made_data(root: Path, masks: list[list[int]]) -> Path:
    """A data directory with one training shard whose records have the given loss masks (tokens
    3.., one tap of width 2): for records that `tevjax data` does not make."""
    shard = root / "shards" / "train-00000"
    shard.mkdir(parents=True)
    mask = np.concatenate([np.asarray(m, np.uint8) for m in masks])
    np.save(shard / "tokens.npy", np.arange(3, 3 + len(mask), dtype=np.int32))
    np.save(shard / "loss_mask.npy", mask)
    np.save(shard / "offsets.npy", np.cumsum([0] + [len(m) for m in masks]).astype(np.int64))
    np.save(shard / "features.npy", np.zeros((len(mask), 1, 2), np.uint16))
    (root / "manifest.json").write_text(json.dumps({
        "format": 1, "rollout": {"taps": [0]}, "shards": {},
        "target_config": {"hidden_size": 2, "vocab_size": 64, "num_layers": 1}}))
    return root


def test_first_supervised_and_cropping_on_edge_records(tmp_path):
    """A record's first supervised position from its own start: 0 where the response starts the
    record, -1 where there is none (the last record of a shard included, whose search ends at the
    shard's end). A record is cropped when it has no supervised position in 1 .. seq_len - 1:
    position 0 has no anchor before it, so a response that starts the record counts from 1 on."""
    masks = [[0, 0, 1, 1], [1, 1, 1], [0, 0], [0, 0, 0, 0, 1], [1, 0, 0], [0, 0, 0]]
    data = TrainData(_hand_made_data(tmp_path, masks))
    assert data.first_supervised().tolist() == [2, 0, -1, 4, 0, -1]
    assert data.first_supervised(1).tolist() == [2, 1, -1, 4, -1, -1]
    assert data.cropped(2).tolist() == [True, False, True, True, True, True]
    assert data.cropped(3).tolist() == [False, False, True, True, True, True]
    assert data.cropped(4).tolist() == [False, False, True, True, True, True]  # position 4 is not below 4
    assert data.cropped(5).tolist() == [False, False, True, False, True, True]


@pytest.mark.parametrize("weights", ["model.safetensors", "model.safetensors.index.json"])
def test_export_keeps_weights_it_has_no_config_for(tmp_path, weights):
    """A directory holding a model.safetensors (or a sharded model's index, which the export
    deletes) without a DFlash config.json is not an earlier export: it was overwritten in silence.
    Refused before the run's checkpoint is read."""
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "run.json").write_text("{}")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / weights).write_bytes(b"someone's weights")
    with pytest.raises(RunError, match=f"holds a {re.escape(weights)} but no DFlash drafter's config.json"):
        export_run(tmp_path / "r", tmp_path / "out")
    assert (tmp_path / "out" / weights).read_bytes() == b"someone's weights"


def test_a_signal_stops_training_with_a_checkpoint_and_the_cli_exits_130(tmp_path, data_dir, target, monkeypatch,
                                                                        capsys):
    """SIGTERM (a batch system's preemption, or a first Ctrl-C) during step 2 of 4: that step ends,
    is checkpointed, and `tevjax train` exits 130 with a line that says how to go on. It exited 0,
    as a finished run does, so `train && train export` exported a partly trained drafter and a
    preempted job was not requeued. `--resume` then ends the run (exit 0)."""
    from tevjax.convert.hf import save_hf_target

    save_hf_target(target, tmp_path / "model")
    order = TrainData.order

    def signalled(self, seed, step, batch_size):
        if step == 1:  # the signal arrives while step 2 reads its batch
            signal.raise_signal(signal.SIGTERM)
        return order(self, seed, step, batch_size)

    monkeypatch.setattr(TrainData, "order", signalled)
    argv = ["train", "--target", str(tmp_path / "model"), "--data", str(data_dir), "--out", str(tmp_path / "run"),
            "--steps", "4", "--batch", "4", "--anchors", "6", "--seq-len", "40", "--exit-lambda", "0",
            "--layers", "1", "--block-size", str(BS), "--mask-token", "5", "--taps", ",".join(map(str, TAPS)),
            "--eval-every", "1000", "--no-progress"]
    assert main(argv) == 130
    out, err = capsys.readouterr()
    assert json.loads(out.splitlines()[-1]) == {"run": str(tmp_path / "run"), "step": 2, "steps": 4}
    assert err.splitlines()[-1] == ("tevjax: interrupted at step 2 of 4, with a checkpoint of step 2: rerun the "
                                    "same command with --resume to go on"), err
    assert "2" in os.listdir(tmp_path / "run" / "checkpoints")
    monkeypatch.undo()
    assert main([*argv, "--resume"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["step"] == 4
