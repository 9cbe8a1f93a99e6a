"""A reduced draft vocabulary (EAGLE-3's idea on a DFlash drafter): the drafter scores only Vd token
ids through those rows of the target's LM head. Checked here: the logits are exactly the full
logits' columns, id <-> index lookups, the checkpoint round trip and its errors, exact decoding,
the training losses (a complete "reduced" vocabulary reproduces the full one; labels outside are
not counted) and a training run that keeps its own vocabulary across resume and export."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tevjax.convert.dflash_ckpt import load_dflash, save_dflash
from tevjax.convert.hf import CheckpointError
from tevjax.decode.engine import DecodeConfig, Decoder, draft_trees
from tevjax.models.dflash import DFlashConfig, DFlashDrafter, draft_vocab_from_counts
from tevjax.sharding import make_mesh
from tevjax.testing import random_model, tiny_config
from tevjax.train.objectives import token_loss_terms
from tevjax.train.step import TrainConfig, Trainer, loss_terms

TAPS = (1, 3)
BS = 6


@pytest.fixture(scope="module")
def target():
    return random_model(tiny_config(num_layers=4), seed=0)


def _cfg(target, size):
    return DFlashConfig.for_target(target.cfg, num_layers=1, block_size=BS, mask_token_id=5, target_layer_ids=TAPS,
                                   draft_vocab_size=size)


def _vocab(target, size, seed=0):
    counts = np.random.default_rng(seed).integers(0, 1000, target.cfg.vocab_size)
    return draft_vocab_from_counts(counts, size, always=(2,))


def test_vocabulary_from_counts_is_the_top_k_with_forced_ids():
    counts = np.array([5, 9, 9, 1, 0, 7])
    np.testing.assert_array_equal(draft_vocab_from_counts(counts, 3), [1, 2, 5])
    # Ties go to the lower id; a forced id displaces the least frequent of the rest.
    np.testing.assert_array_equal(draft_vocab_from_counts(counts, 2), [1, 2])
    np.testing.assert_array_equal(draft_vocab_from_counts(counts, 3, always=(4,)), [1, 2, 4])
    np.testing.assert_array_equal(draft_vocab_from_counts(counts, 3, never=(2,)), [0, 1, 5])
    # A tie AT the cut (ids 1, 2 and 3 tied, room for two): the lower ids win, in any order of the counts.
    np.testing.assert_array_equal(draft_vocab_from_counts(np.array([3, 7, 7, 7, 1]), 2), [1, 2])
    np.testing.assert_array_equal(draft_vocab_from_counts(np.array([0, 7, 7, 7, 9]), 2), [1, 4])
    with pytest.raises(ValueError, match="outside"):
        draft_vocab_from_counts(counts, 7)


@pytest.mark.parametrize("ids, message", [
    ([3, 2, 7], "strictly increasing"),
    ([1, 1, 7], "strictly increasing"),
    ([1, 2, 300], r"\[0, 300\)"),
    ([1, 2], "shape"),
    (np.array([1.0, 2.0, 3.0]), "integers"),
])
def test_bad_vocabulary_is_rejected_by_name(target, ids, message):
    with pytest.raises(ValueError, match=message):
        DFlashDrafter(_cfg(target, 3), rngs=nnx.Rngs(0), draft_vocab=np.asarray(ids))


def test_config_field_is_checked_and_round_trips(target):
    with pytest.raises(ValueError, match="draft_vocab_size"):
        _cfg(target, 0)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        _cfg(target, target.cfg.vocab_size + 1)
    cfg = _cfg(target, 40)
    hf = cfg.to_hf_config()
    assert hf["dflash_config"]["draft_vocab_size"] == 40 and cfg.draft_vocab_dim == 40
    assert DFlashConfig.from_hf_config(hf) == cfg
    assert "draft_vocab_size" not in _cfg(target, None).to_hf_config()["dflash_config"]
    with pytest.raises(ValueError, match="draft_vocab_size must be an int"):
        DFlashConfig.from_hf_config({**hf, "dflash_config": {**hf["dflash_config"], "draft_vocab_size": "40"}})


def test_logits_are_the_full_logits_columns_and_lookups_invert(target):
    ids = _vocab(target, 40)
    full = DFlashDrafter(_cfg(target, None), rngs=nnx.Rngs(1))
    small = DFlashDrafter(_cfg(target, 40), rngs=nnx.Rngs(1), draft_vocab=ids)
    h = jax.random.normal(jax.random.key(0), (2, 3, target.cfg.hidden_size))
    np.testing.assert_array_equal(np.asarray(small.logits(target, h)), np.asarray(full.logits(target, h))[..., ids])
    idx, inside = small.draft_index(jnp.asarray(ids))
    np.testing.assert_array_equal(np.asarray(idx), np.arange(40))
    assert bool(jnp.all(inside))
    np.testing.assert_array_equal(np.asarray(small.token_ids(idx)), ids)
    outside = np.setdiff1d(np.arange(target.cfg.vocab_size), ids)
    idx, inside = small.draft_index(jnp.asarray(outside))
    assert not bool(jnp.any(inside)) and not bool(jnp.any(idx))
    # The full-vocabulary drafter's lookups are the identity.
    idx, inside = full.draft_index(jnp.asarray([0, 7, 299]))
    np.testing.assert_array_equal(np.asarray(idx), [0, 7, 299])
    assert bool(jnp.all(inside)) and full.vocab_ids() is None


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])  # untied lm_head, tied embedding
def test_a_pre_gathered_head_gives_the_same_logits(architecture):
    model = random_model(tiny_config(architecture, num_layers=4), seed=5)
    assert (model.lm_head is None) == (architecture == "qwen3")
    ids = jnp.asarray(_vocab(model, 40))
    head = model.head_rows(ids)
    assert head.shape == (40, model.cfg.hidden_size)
    h = jax.random.normal(jax.random.key(1), (2, 3, model.cfg.hidden_size))
    got, ref = np.asarray(model.logits(h, ids, head=head)), np.asarray(model.logits(h, ids))
    if model.lm_head is None:  # the same rows in the same layout: bit for bit
        np.testing.assert_array_equal(got, ref)
    else:  # head_rows stores the [D, V] kernel's columns as [Vd, D] rows: float32 rounding only
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(model.logits(h, ids)), np.asarray(model.logits(h))[..., np.asarray(ids)],
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="head has 39 rows for 40 vocabulary ids"):
        model.logits(h, ids, head=head[:39])


def test_the_decoder_gathers_the_draft_head_once_at_prefill(target):
    ids = _vocab(target, 60)
    small = DFlashDrafter(_cfg(target, 60), rngs=nnx.Rngs(3), draft_vocab=ids)
    full = DFlashDrafter(_cfg(target, None), rngs=nnx.Rngs(3))
    prompts = [[7, 8, 9, 10]]
    state = Decoder(target, small, DecodeConfig(budget=4, max_new_tokens=8)).prefill(prompts)
    np.testing.assert_array_equal(np.asarray(state.draft_head), np.asarray(target.head_rows(jnp.asarray(ids))))
    # The round passes it on unchanged, and its draft equals the per-call gather's.
    dec = Decoder(target, small, DecodeConfig(budget=4, max_new_tokens=8))
    after = dec.step(dec.prefill(prompts))
    np.testing.assert_array_equal(np.asarray(after.draft_head), np.asarray(state.draft_head))
    from tevjax.decode.engine import draft
    args = (target, state.root, state.cache_len, state.drafter_cache)
    np.testing.assert_array_equal(np.asarray(draft(small, *args, state.draft_head)), np.asarray(draft(small, *args)))
    # Nothing to gather without a reduced vocabulary, or without a drafter.
    assert Decoder(target, full, DecodeConfig(budget=4, max_new_tokens=8)).prefill(prompts).draft_head is None
    assert Decoder(target, None, DecodeConfig(max_new_tokens=8)).prefill(prompts).draft_head is None


def test_checkpoint_round_trip_and_errors(target, tmp_path):
    ids = _vocab(target, 40)
    cfg = _cfg(target, 40)
    drafter = DFlashDrafter(cfg, rngs=nnx.Rngs(2), draft_vocab=ids)
    save_dflash(drafter, cfg, tmp_path / "d", dtype="bfloat16")
    loaded_cfg, loaded = load_dflash(tmp_path / "d", target.cfg)
    assert loaded_cfg == DFlashConfig.from_hf_config(tmp_path / "d")
    np.testing.assert_array_equal(np.asarray(loaded.vocab_ids()), ids)

    from safetensors.numpy import load_file, save_file

    tensors = load_file(tmp_path / "d" / "model.safetensors")
    assert tensors["draft_vocab"].dtype == np.int32
    for bad, message in [(ids[::-1].copy(), "strictly increasing"), (ids[:-1].copy(), "shape"),
                         (None, "missing tensor.*draft_vocab")]:
        edited = dict(tensors)
        if bad is None:
            del edited["draft_vocab"]
        else:
            edited["draft_vocab"] = bad
        save_file(edited, tmp_path / "d" / "model.safetensors")
        with pytest.raises(CheckpointError, match=message):
            load_dflash(tmp_path / "d", target.cfg)


def test_decoding_is_exact_and_drafts_only_vocabulary_tokens(target):
    ids = _vocab(target, 60)
    drafter = DFlashDrafter(_cfg(target, 60), rngs=nnx.Rngs(3), draft_vocab=ids)
    prompts = [[7, 8, 9, 10], [11, 12, 13, 14, 15, 16]]
    cfg = dict(max_new_tokens=24, temperature=0.0)
    ar = Decoder(target, None, DecodeConfig(**cfg)).generate(prompts)
    spec = Decoder(target, drafter, DecodeConfig(budget=6, **cfg)).generate(prompts)
    for a, s in zip(ar, spec):
        assert s.tokens == a.tokens
    logits = jax.random.normal(jax.random.key(4), (3, BS - 1, 60))
    trees = draft_trees(logits, jnp.asarray([1, 2, 3]), 6, drafter.vocab_ids())
    drafted = np.asarray(trees.valid & (trees.parents >= 0))
    assert drafted.sum() == 3 * 6 and np.isin(np.asarray(trees.tokens)[drafted], ids).all()
    np.testing.assert_array_equal(np.asarray(trees.tokens)[:, 0], [1, 2, 3])  # roots stay ids


def _batch(target, seed=0, b=2, t=24):
    from tevjax.train.dataset import Batch

    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, target.cfg.vocab_size, (b, t)).astype(np.int32)
    mask = np.zeros((b, t), bool)
    mask[:, 6:] = True
    feats = rng.normal(size=(b, t, len(TAPS) * target.cfg.hidden_size)).astype(np.float32)
    return Batch(tokens=jnp.asarray(tokens), loss_mask=jnp.asarray(mask), features=jnp.asarray(feats),
                 length=jnp.full((b,), t, jnp.int32))


CFG = TrainConfig(steps=2, batch_size=2, anchors=5, seq_len=24, exit_lambda=0.2, exit_budget=5, exit_anchors=2)


def test_a_complete_vocabulary_reproduces_the_full_losses(target):
    batch, key = _batch(target), jax.random.key(5)
    full = DFlashDrafter(_cfg(target, None), rngs=nnx.Rngs(6))
    every = DFlashDrafter(_cfg(target, target.cfg.vocab_size), rngs=nnx.Rngs(6),
                          draft_vocab=np.arange(target.cfg.vocab_size))
    # Jitted: eagerly, the exit loss's many small ops cost more than compiling them.
    terms = nnx.jit(loss_terms, static_argnums=4)
    _, m_full = terms(full, target, batch, key, CFG)
    _, m_every = terms(every, target, batch, key, CFG)
    for k in m_full:
        np.testing.assert_allclose(float(m_every[k]), float(m_full[k]), rtol=1e-5, err_msg=k)


def test_labels_outside_the_vocabulary_are_not_counted(target):
    batch = _batch(target, seed=1)
    labels = np.asarray(batch.tokens)
    ids = np.unique(labels[:, ::2])  # the even positions' tokens (odd positions mostly fall outside)
    drafter = DFlashDrafter(_cfg(target, len(ids)), rngs=nnx.Rngs(7), draft_vocab=ids)
    anchors = jnp.asarray([[6, 9, 12], [7, 10, 15]], jnp.int32)
    valid = jnp.ones((2, 3), bool)
    z = drafter.logits(target, drafter.train_hidden(target, batch.features, batch.tokens, anchors))
    lse = jax.nn.logsumexp(z, axis=-1)
    idx, inside = drafter.draft_index(batch.tokens)
    num, den = token_loss_terms(lse, z, idx, batch.loss_mask & inside, anchors, valid, None)
    # Reference: a loop over (anchor, offset) pairs whose label is supervised and in the vocabulary.
    ref_num, ref_den = 0.0, 0
    for r in range(2):
        for j, a in enumerate(np.asarray(anchors[r])):
            for k in range(1, BS):
                p = a + k
                if p < 24 and labels[r, p] in ids and bool(batch.loss_mask[r, p]):
                    col = int(np.searchsorted(ids, labels[r, p]))
                    ref_num += float(lse[r, j, k - 1] - z[r, j, k - 1, col])
                    ref_den += 1
    assert 0 < ref_den < 2 * 3 * (BS - 1)  # some labels were outside
    np.testing.assert_allclose(float(num), ref_num, rtol=1e-5)
    assert float(den) == ref_den


def test_the_steps_losses_under_a_reduced_vocabulary(target):
    """`loss_terms` with a reduced vocabulary: the token loss counts only labels inside it, and the
    exit loss (trees, law and node logits) is that of the full-vocabulary drafter of the same
    weights whose logits outside the vocabulary are -1e9, which reads its nodes by token id where
    the reduced one must read them by draft index."""
    from tevjax.train.objectives import batch_anchors, ratio

    batch, key = _batch(target, seed=1), jax.random.key(5)
    ids = np.unique(np.asarray(batch.tokens)[:, ::2])  # the odd positions' tokens mostly fall outside
    keep = np.isin(np.arange(target.cfg.vocab_size), ids)

    class Masked(DFlashDrafter):
        def logits(self, target, hidden, head=None, **kw):
            return jnp.where(keep, super().logits(target, hidden, head, **kw), -1e9)

    reduced = DFlashDrafter(_cfg(target, len(ids)), rngs=nnx.Rngs(7), draft_vocab=ids)
    masked = Masked(_cfg(target, None), rngs=nnx.Rngs(7))
    terms = nnx.jit(loss_terms, static_argnums=4)
    _, m_reduced = terms(reduced, target, batch, key, CFG)
    _, m_masked = terms(masked, target, batch, key, CFG)
    for k in ("loss_exit", "coverage"):
        np.testing.assert_allclose(float(m_reduced[k]), float(m_masked[k]), rtol=1e-5, err_msg=k)
    anchors, valid = batch_anchors(key, batch.loss_mask, CFG.anchors)
    z = reduced.logits(target, reduced.train_hidden(target, batch.features, batch.tokens, anchors))
    idx, inside = reduced.draft_index(batch.tokens)
    assert not bool(jnp.all(inside | ~batch.loss_mask))  # some supervised labels lie outside
    want = ratio(token_loss_terms(jax.nn.logsumexp(z, -1), z, idx, batch.loss_mask & inside, anchors, valid,
                                  CFG.gamma))
    np.testing.assert_allclose(float(m_reduced["loss_tok"]), float(want), rtol=1e-5)


def test_step_trains_parameters_only_and_keeps_the_vocabulary(target):
    ids = _vocab(target, 80)
    drafter = DFlashDrafter(_cfg(target, 80), rngs=nnx.Rngs(8), draft_vocab=ids)
    trainer = Trainer(drafter, target, CFG, make_mesh())
    state = trainer.init_state()
    for s in range(2):
        state, metrics = trainer.step(state, _batch(target, seed=10 + s))
        assert all(np.isfinite(float(v)) for v in metrics.values()) and float(metrics["loss_exit"]) > 0
    names = {"/".join(map(str, p)) for p, _ in jax.tree_util.tree_flatten_with_path(state.params)[0]}
    assert not any("draft_vocab" in n for n in names)
    np.testing.assert_array_equal(np.asarray(trainer.drafter(state).vocab_ids()), ids)
