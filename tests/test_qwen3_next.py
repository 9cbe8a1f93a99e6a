"""Qwen3-Next (hybrid Gated DeltaNet + gated attention, with experts) against transformers on a tiny
random checkpoint: the whole model, cached chunks with padding, tree passes and the commit of an
accepted path, greedy decoding (autoregressive and TEV), saving, and the config's translation."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from tevjax.convert import load_hf_target, save_hf_target
from tevjax.models import KVCache, ModelConfig, causal_mask, forward
from tevjax.tree import DraftTree

# Four layers: three Gated DeltaNet layers (2 key heads of 8, 4 value heads of 6: each key head
# serves two value heads), then gated attention (4 heads of 16, a quarter rotated). Qwen3-Next and
# Qwen3.5-MoE have 4 experts of width 24, 2 per token, and a shared expert of width 40 in every
# layer; Qwen3.5 (dense) an MLP of width 96.
BASE = dict(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6, bos_token_id=1, eos_token_id=2,
            initializer_range=0.1)
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40)
VARIANTS = {
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(intermediate_size=96, **EXPERTS)),
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(intermediate_size=96)),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", EXPERTS),
}


FWD = jax.jit(forward, static_argnames=("graphdef", "hidden_layers", "compute_logits"))


def randomise(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # zero-centred (1 + w) norms, but the gated norm's w is the scale
                p.copy_(0.2 * torch.randn_like(p) + (1.0 if "linear_attn.norm" in name else 0.0))
            elif name.endswith("mlp.gate.weight"):  # a router: decisive picks
                p.copy_(torch.randn_like(p) / 4.0)
    return model


def build_hf(variant: str = "qwen3_next", seed: int = 0):
    config_cls, model_cls, extra = VARIANTS[variant]
    torch.manual_seed(seed)
    config = getattr(transformers, config_cls)(**BASE, **extra)
    return randomise(getattr(transformers, model_cls)(config).float().eval())


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    hf = build_hf(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path, safe_serialization=True)
    cfg, model = load_hf_target(path)
    return hf, cfg, model, path


def hf_logits(hf, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.from_numpy(np.asarray(tokens, np.int64))).logits.numpy()


def test_linear_layers_split_their_heads_over_model(pair):
    """The linear mixers' per-head parameters and their recurrent state split over `model` with the
    heads (the mesh never changes a value, so only the specs can show a replicated one)."""
    from jax.sharding import AbstractMesh
    from jax.sharding import PartitionSpec as P

    from tevjax.sharding import linear_shardings, param_shardings

    _, cfg, model, _ = pair
    if cfg.architecture != "qwen3_next":
        pytest.skip("the layout is checked on Qwen3-Next")
    mesh = AbstractMesh((1, 2), ("data", "model"))
    flat = jax.tree_util.tree_flatten_with_path(param_shardings(model, mesh))[0]
    specs = {".".join(str(getattr(k, "key", getattr(k, "idx", ""))) for k in path[:-1]): s.spec for path, s in flat}
    for name in ("A_log", "dt_bias"):
        assert specs[f"linear_layers.linear_attn.{name}"] == P(None, "model"), name
    for name in ("in_proj_a", "in_proj_b", "in_proj_qkv", "in_proj_z"):
        assert specs[f"linear_layers.linear_attn.{name}.kernel"] == P(None, None, "model"), name
    state = linear_shardings(mesh)
    assert state.state.spec == P(None, "data", "model", None, None)
    assert state.tree_v.spec == P(None, "data", None, "model", None)
    assert state.tree_gb.spec == P(None, "data", None, None, "model")


def test_config_translation(pair):
    hf, cfg, _, path = pair
    assert cfg.architecture == hf.config.model_type
    assert cfg.linear_layers == (0, 1, 2) and cfg.layer_period == ("linear", "linear", "linear", "attention")
    assert (cfg.linear_key_heads, cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim,
            cfg.linear_conv) == (2, 4, 8, 6, 4)
    assert cfg.rotary_dim == 4 and cfg.attn_output_gate and cfg.norm_offset == 1.0 and cfg.qk_norm
    assert (cfg.num_experts, cfg.experts_per_token, cfg.shared_expert_size, cfg.intermediate_size) == (
        (0, 0, 0, 96) if cfg.architecture == "qwen3_5_text" else (4, 2, 40, 24))
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg
    with open(path / "config.json") as f:
        c = json.load(f)
    refusals = [("layer_types", ["linear_attention", "sliding_attention", "linear_attention", "full_attention"],
                 "layer_types"), ("partial_rotary_factor", 1.5, "partial_rotary_factor")]
    if cfg.architecture == "qwen3_next":
        refusals += [("mlp_only_layers", [1], "mlp_only_layers"), ("decoder_sparse_step", 2, "sparse_step")]
    for key, value, what in refusals:
        with pytest.raises(ValueError, match=what):
            ModelConfig.from_hf_config({**c, key: value})
    with pytest.raises(ValueError, match="Qwen3-Next's and Qwen3.5's"):
        ModelConfig(**{**{f.name: getattr(cfg, f.name) for f in cfg.__dataclass_fields__.values()},
                       "architecture": "qwen3", "shared_expert_size": 0, "num_experts": 0, "experts_per_token": 0})


def test_whole_model_parity_causal_and_tree_form(pair):
    """The logits and every layer's output match transformers within 1e-4, from a causal run and
    from a tree pass over the same tokens as one chain (13 tokens, two rows)."""
    hf, cfg, model, _ = pair
    b, t = 2, 13
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (b, t)).astype(np.int32)
    with torch.no_grad():
        ref = hf(torch.from_numpy(tokens.astype(np.int64)), output_hidden_states=True)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    zero = jnp.zeros((b,), jnp.int32)
    causal = model(jnp.asarray(tokens), pos, KVCache.init(cfg, b, 16), zero, None, hidden_layers=(0, 1, 2))
    tree = model(jnp.asarray(tokens), pos, KVCache.init(cfg, b, 16, tree_slots=t), zero,
                 jnp.broadcast_to(causal_mask(t), (b, t, t)), hidden_layers=(0, 1, 2))
    for out in (causal, tree):
        np.testing.assert_allclose(np.asarray(out.logits), ref.logits.numpy(), atol=1e-4, rtol=0)
        for i in range(3):
            np.testing.assert_allclose(np.asarray(out.hidden[:, :, i]), ref.hidden_states[i + 1].numpy(), atol=1e-4,
                                       rtol=0, err_msg=f"layer {i}")


def test_ordered_weight_slices_change_no_value(pair, monkeypatch):
    """On one CPU device the layer scan indexes each layer's weights, and its MLP's, at an index
    that reads their input (`ORDER_WEIGHT_SLICES`, a speed matter only): the logits and the state a
    prefill leaves are the ones the plain indexing gives, to float32 rounding (XLA compiles the two
    programs' products apart: 6e-5 on logits of 3.5); a layer's weights taken for another's would
    move them by O(1). 2 periods of 4 layers."""
    import tevjax.models.transformer as transformer
    from tevjax.testing import random_model

    hf, cfg, _, _ = pair
    assert jax.device_count() == 1 and jax.default_backend() == "cpu"
    cfg = dataclasses.replace(cfg, num_layers=8, linear_layers=(0, 1, 2, 4, 5, 6))
    model = random_model(cfg, seed=3)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 7)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32), (2, 7))
    outs = []
    for ordered in (True, False):
        monkeypatch.setattr(transformer, "ORDER_WEIGHT_SLICES", ordered)
        out = model(tokens, pos, KVCache.init(cfg, 2, 16), jnp.zeros((2,), jnp.int32), None)
        outs.append(jax.tree.map(np.asarray, (out.logits, out.cache.linear.state, out.cache.k)))
    for got, want in zip(*outs):
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


def test_chunks_with_padding_tree_pass_and_commit_match_the_sequence(pair):
    """Two rows share one sequence, prefilled to 8 and 6 tokens in two chunks (the second padded
    past each row's length). A tree pass whose path 0 -> 2 -> 5 -> 6 spells the sequence's next
    tokens gives their logits at those nodes; committing root, 2 and 5 and then a one-token causal
    run gives the logits of the token after, as transformers computes them on the sequence."""
    hf, cfg, model, _ = pair
    rng = np.random.default_rng(1)
    seq = rng.integers(0, cfg.vocab_size, (14,)).astype(np.int32)
    ref = hf_logits(hf, seq[None])[0]  # [14, V]
    lengths = np.array([8, 6])
    graphdef, state = nnx.split(model)

    def fwd(_, *args, **kw):
        return FWD(graphdef, state, *args, **kw)

    cache = KVCache.init(cfg, 2, 32, tree_slots=7)
    for start, size in ((0, 5), (5, 5)):
        tokens = np.stack([seq[start:start + size]] * 2)
        pos = jnp.asarray(np.broadcast_to(np.arange(start, start + size), (2, size)), jnp.int32)
        valid = jnp.asarray(np.arange(start, start + size)[None] < lengths[:, None])
        cache = fwd(model, jnp.asarray(tokens), pos, cache, jnp.full((2,), start, jnp.int32), None,
                    valid=valid, compute_logits=False).cache
    parents = np.array([-1, 0, 0, 1, 2, 2, 5])
    trees, cl = [], lengths
    for r in range(2):
        toks = rng.integers(0, cfg.vocab_size, (7,)).astype(np.int32)
        toks[[0, 2, 5, 6]] = seq[cl[r]:cl[r] + 4]
        trees.append(DraftTree.from_parents(toks, parents))
    tree = jax.tree.map(lambda *x: jnp.stack(x), *trees)
    out = fwd(model, tree.tokens, jnp.asarray(cl)[:, None] + tree.depth, cache, jnp.asarray(cl, jnp.int32),
              tree.ancestors)
    for r in range(2):
        for node, i in zip((0, 2, 5, 6), range(4)):
            np.testing.assert_allclose(np.asarray(out.logits[r, node]), ref[cl[r] + i], atol=1e-4, rtol=0,
                                       err_msg=f"row {r} node {node}")
    # Accept root, node 2 and node 5 (node 6 becomes the bonus token's place in the sequence).
    path = jnp.asarray([[2, 5], [2, 5]], jnp.int32)
    committed = out.cache.move_slots(jnp.asarray(cl)[:, None] + path, jnp.asarray(cl + 1, jnp.int32))
    committed = committed.advance(jnp.asarray([[0, 2, 5], [0, 2, 5]], jnp.int32), jnp.asarray([3, 3], jnp.int32))
    nxt = cl + 3
    step = fwd(model, jnp.asarray(seq[nxt][:, None]), jnp.asarray(nxt[:, None], jnp.int32), committed,
               jnp.asarray(nxt, jnp.int32), None)
    for r in range(2):
        np.testing.assert_allclose(np.asarray(step.logits[r, 0]), ref[nxt[r]], atol=1e-4, rtol=0)
    # The commit matters: advancing along another path gives other logits.
    wrong = out.cache.advance(jnp.asarray([[0, 1, 3], [0, 1, 3]], jnp.int32), jnp.asarray([3, 3], jnp.int32))
    other = fwd(model, jnp.asarray(seq[nxt][:, None]), jnp.asarray(nxt[:, None], jnp.int32), wrong,
                jnp.asarray(nxt, jnp.int32), None)
    assert np.abs(np.asarray(other.logits[0, 0]) - ref[nxt[0]]).max() > 1e-2


def test_a_tree_larger_than_the_recorded_slots_is_refused(pair):
    _, cfg, model, _ = pair
    with pytest.raises(ValueError, match="tree_slots=5"):
        model(jnp.zeros((1, 5), jnp.int32), jnp.arange(5, dtype=jnp.int32)[None], KVCache.init(cfg, 1, 8, tree_slots=4),
              jnp.zeros((1,), jnp.int32), causal_mask(5)[None])


def test_greedy_decoding_equals_transformers_generate(pair):
    """Autoregressive and speculative (TEV over a fresh drafter and the context chain) greedy
    decoding give transformers' tokens for two prompts of different lengths in one batch; some
    rounds take several tokens, so accepted paths below the root are committed into the state.
    A reused state (a chat's next turn) prefills again and gives the same tokens."""
    from tevjax.decode import DecodeConfig, Decoder
    from tevjax.models.dflash import DFlashConfig, DFlashDrafter

    hf, cfg, model, _ = pair
    if cfg.architecture != "qwen3_next":  # the decoder is the same for the three: once is enough
        pytest.skip("decoding is checked on Qwen3-Next")
    prompts = [[5, 17, 42, 8, 99, 23, 61, 7, 150], [3, 250, 14, 77]]
    hf.generation_config.eos_token_id = None
    want = []
    for prompt in prompts:
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=20, do_sample=False, pad_token_id=0)
        want.append(out[0, len(prompt):].tolist())
    kw = dict(max_new_tokens=20, prompt_bucket=16, capacity=64)
    ar = Decoder(model, None, DecodeConfig(**kw)).generate(prompts)
    assert [g.tokens for g in ar] == want
    drafter = DFlashDrafter(DFlashConfig.for_target(cfg, num_layers=1, block_size=4, mask_token_id=299),
                            rngs=nnx.Rngs(1))
    dec = Decoder(model, drafter, DecodeConfig(verifier="tev", budget=8, lookup=8, **kw))
    first = dec.prefill(prompts)
    first = dec.run(first)
    spec = dec.results(first, prompts)
    assert [g.tokens for g in spec] == want
    assert sum(g.rounds for g in spec) < 40
    second = dec.run(dec.prefill(prompts, reuse=(first, prompts)))
    assert [g.tokens for g in dec.results(second, prompts)] == want
    # One-token prompts need no prefill chunk: the first tree pass starts each row's state afresh,
    # and so does the commit after it, whatever the reused row held.
    others = [[7], [9]]  # no prefill chunk at all
    fresh = [g.tokens for g in dec.generate(others)]
    assert [g.tokens for g in dec.results(dec.run(dec.prefill(others, reuse=(second, prompts))), others)] == fresh


def test_a_chats_next_turn_goes_on_from_the_recurrent_state(pair):
    """A next turn whose prompt extends the whole earlier text (prompt + answer) goes on from the
    state the rounds left: prefill starts at the earlier cache length, not at 0, and decodes what a
    fresh prefill of the whole conversation decodes. The rows that finished first kept their state
    while the others decoded on (a row's state has run over exactly its cache_len tokens)."""
    from tevjax.decode import DecodeConfig, Decoder
    from tevjax.models.dflash import DFlashConfig, DFlashDrafter

    _, cfg, model, _ = pair
    if cfg.architecture != "qwen3_next":
        pytest.skip("decoding is checked on Qwen3-Next")
    drafter = DFlashDrafter(DFlashConfig.for_target(cfg, num_layers=1, block_size=4, mask_token_id=299),
                            rngs=nnx.Rngs(1))
    dec = Decoder(model, drafter, DecodeConfig(verifier="tev", budget=8, lookup=8, max_new_tokens=12,
                                               prompt_bucket=16, capacity=96))
    # Row 0 asks for 4 tokens and finishes rounds before row 1 (12 tokens); both end at cache length 18.
    first = [[5, 17, 42, 8, 99, 23, 61, 7, 150, 33, 2, 44, 8, 8, 9], [3, 250, 14, 77, 9, 9, 4]]
    limits = [4, 12]
    state = dec.run(dec.prefill(first, max_new_tokens=limits))
    answers = dec.results(state, first)
    assert [len(g.tokens) for g in answers] == limits and set(np.asarray(state.cache_len).tolist()) == {18}
    assert answers[0].rounds < answers[1].rounds  # row 0 waited, done, while row 1 decoded on
    nxt = [p + g.tokens + [11, 12, 13] for p, g in zip(first, answers)]
    start = dec._reused_prefix(nxt, (state, first))
    assert start == 18  # every row goes on from its state: all of its text but its last answer token
    again = dec.results(dec.run(dec.prefill(nxt, reuse=(state, first))), nxt)
    assert [g.tokens for g in again] == [g.tokens for g in dec.generate(nxt)]
    # A row whose answer is not in its next prompt makes every row prefill again (and still decode right).
    state = dec.run(dec.prefill(first, max_new_tokens=limits))
    changed = [nxt[0], first[1] + [11, 12]]
    assert dec._reused_prefix(changed, (state, first)) == 0
    again = dec.results(dec.run(dec.prefill(changed, reuse=(state, first))), changed)
    assert [g.tokens for g in again] == [g.tokens for g in dec.generate(changed)]


def test_save_round_trip_loads_in_transformers(pair, tmp_path):
    hf, cfg, model, _ = pair
    save_hf_target(model, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).float().eval()
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, (1, 9))
    np.testing.assert_allclose(hf_logits(back, tokens), hf_logits(hf, tokens), atol=1e-5, rtol=0)
    for (name, a), (_, b) in zip(sorted(hf.state_dict().items()), sorted(back.state_dict().items())):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=name)


def test_a_multimodal_qwen3_5_checkpoint_loads_its_text_model(tmp_path):
    """A Qwen3_5ForConditionalGeneration checkpoint (the released Qwen3.5 files: the text model under
    `model.language_model`, a vision tower beside it, the config's `text_config`) loads as its text
    model, whose logits on text equal the wrapper's; a Qwen3-Next file's `mtp.*` tensors are left out."""
    text = dict(BASE, intermediate_size=96, rope_parameters=dict(rope_type="default", rope_theta=10_000.0,
                                                                 partial_rotary_factor=0.25,
                                                                 mrope_section=[1, 1, 0], mrope_interleaved=True))
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
                  temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16)
    torch.manual_seed(0)
    hf = transformers.Qwen3_5ForConditionalGeneration(
        transformers.Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=297, video_token_id=298,
                                   vision_start_token_id=296, vision_end_token_id=295)).float().eval()
    randomise(hf)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    cfg, model = load_hf_target(tmp_path)
    assert cfg.architecture == "qwen3_5_text" and cfg.rotary_dim == 4
    tokens = np.random.default_rng(3).integers(0, 290, (1, 11))
    out = model(jnp.asarray(tokens, jnp.int32), jnp.arange(11, dtype=jnp.int32)[None], KVCache.init(cfg, 1, 16),
                jnp.zeros((1,), jnp.int32), None)
    np.testing.assert_allclose(np.asarray(out.logits), hf_logits(hf, tokens), atol=1e-4, rtol=0)

    from safetensors.numpy import load_file, save_file
    nxt = tmp_path / "next"
    build_hf("qwen3_next").save_pretrained(nxt, safe_serialization=True)
    tensors = load_file(nxt / "model.safetensors")
    save_file({**tensors, "mtp.fc.weight": np.zeros((4, 4), np.float32)}, nxt / "model.safetensors")
    assert load_hf_target(nxt)[0].architecture == "qwen3_next"


@pytest.mark.slow
def test_a_drafter_trains_on_a_qwen3_next_target(pair, tmp_path):
    """`tevjax data` on a hybrid target stores the greedy answers and their tapped features (equal to a
    forward pass of each whole sequence), and the token loss trains a drafter on them, with the exit
    loss as well."""
    from pathlib import Path

    from tevjax.loading import LoadedTarget
    from tevjax.models.dflash import DFlashConfig, DFlashDrafter
    from tevjax.sharding import make_mesh
    from tevjax.train.dataset import Batch, TrainData
    from tevjax.train.rollout import RolloutConfig, generate_data, sequence_hidden
    from tevjax.train.step import TrainConfig, Trainer

    hf, cfg, model, _ = pair
    if cfg.architecture != "qwen3_next":
        pytest.skip("training is checked on Qwen3-Next")
    rng = np.random.default_rng(5)
    prompts = [[rng.integers(3, 290, rng.integers(4, 10)).tolist() for _ in range(n)] for n in (2, 6)]
    loaded = LoadedTarget(name="tiny", hf_dir=Path("."), target_cfg=cfg, target=model, tokenizer=None, eos_ids=(2,),
                          notes=[])
    rollout = RolloutConfig(num_prompts=6, heldout_prompts=2, heldout_records=2, max_new_tokens=12,
                            max_prompt_tokens=32, batch_size=2, taps=(1, 3))
    generate_data(loaded, rollout, tmp_path / "d", prompts=tuple(prompts), progress=False, log=lambda _: None)
    data = TrainData(tmp_path / "d", "train")
    host = data.batch(data.order(0, 0, 4), [0, 1], 32)
    # the stored features are the whole sequences' own (a one-row forward, no padding)
    row = int(np.argmax(host["length"]))
    n = int(host["length"][row])
    own = sequence_hidden(model, [host["tokens"][row, :n].tolist()], (1, 3), bucket=8)[0]
    feats = np.asarray(host["features"][row, : n - 1], np.float32).reshape(n - 1, 2, -1)
    np.testing.assert_allclose(feats, np.asarray(own[: n - 1], np.float32), atol=0.05, rtol=0.02)
    dcfg = DFlashConfig.for_target(cfg, num_layers=1, block_size=4, mask_token_id=5, target_layer_ids=(1, 3))
    train_cfg = TrainConfig(steps=3, batch_size=4, anchors=4, seq_len=32, lr=3e-3, exit_anchors=2)
    trainer = Trainer(DFlashDrafter(dcfg, rngs=nnx.Rngs(0)), model, train_cfg, make_mesh())
    state = trainer.init_state()
    p0 = jax.tree.map(np.array, state.params)
    losses = []
    for step in range(3):
        batch = Batch(**{k: jnp.asarray(v) for k, v in data.batch(data.order(0, 0, 4), [0, 1], 32).items()})
        state, metrics = trainer.step(state, batch)
        losses.append(float(metrics["loss"]))
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: not np.array_equal(a, np.asarray(b)), p0, state.params)))
    # The exit loss too: its trees are scored in one pass (next test), and a step with it trains.
    exit_cfg = dataclasses.replace(train_cfg, exit_lambda=0.1, exit_budget=5)
    trainer = Trainer(DFlashDrafter(dcfg, rngs=nnx.Rngs(0)), model, exit_cfg, make_mesh())
    state, metrics = trainer.step(trainer.init_state(), batch)
    assert np.isfinite(float(metrics["loss"])) and float(metrics["loss_exit"]) > 0


def test_exit_trees_scored_in_one_pass_equal_per_anchor_prefills_and_tree_passes():
    """`score_trees` on a hybrid target (the sequence and every anchor's tree in one pass under the
    ancestor relation) gives each node the logits the decoder gets from prefilling the tokens before
    its anchor (a causal run: the recurrent state after them) and a tree pass."""
    from tevjax.decode.engine import draft_trees, tree_pass
    from tevjax.testing import random_model, tiny_config
    from tevjax.train.step import score_trees

    cfg = tiny_config("qwen3_next", num_layers=4, linear_layers=(0, 1, 2))
    target = random_model(cfg, seed=1)
    rng = np.random.default_rng(7)
    b, q, e, budget = 2, 20, 3, 5
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, q)), jnp.int32)
    anchors = jnp.asarray([[3, 9, 15], [5, 6, 18]], jnp.int32)
    logits = rng.standard_normal((b * e, 3, cfg.vocab_size))
    logits[:, :, 7] += 6.0  # one sure token per depth: the trees reach depth 3
    log_q = jnp.asarray(logits, jnp.float32)
    flat = draft_trees(log_q, jnp.take_along_axis(tokens, anchors, axis=1).reshape(-1), budget)
    trees = jax.tree.map(lambda x: x.reshape((b, e) + x.shape[1:]), flat)
    assert int(np.asarray(trees.depth).max()) >= 2  # paths below the root's children are checked
    fast = np.asarray(score_trees(target, tokens, anchors, trees))
    graphdef, state = nnx.split(target)

    @jax.jit
    def decoders_way(row, a, tree):
        # The tokens before the anchor prefilled (the rest of the row is padding: `valid`, and slots the
        # tree pass does not see), then the tree pass at slot `a`.
        model = nnx.merge(graphdef, state)
        cache = KVCache.init(cfg, 1, q + budget + 1, tree_slots=budget + 1)
        cache = model(row, jnp.arange(q, dtype=jnp.int32)[None], cache, jnp.zeros((1,), jnp.int32), None,
                      compute_logits=False, valid=jnp.arange(q)[None] < a).cache
        return tree_pass(model, tree, a[None], cache).logits[0]

    for i in range(b):
        for j in range(e):
            tree = jax.tree.map(lambda x: x[i:i + 1, j], trees)
            ref = np.asarray(decoders_way(tokens[i:i + 1], anchors[i, j], tree))
            valid = np.asarray(tree.valid[0])
            # float32 rounding: the one pass solves one triangular system over all 38 tokens of a row
            # (the sequence and three trees), the reference a system per prefill and per tree
            np.testing.assert_allclose(fast[i, j][valid], ref[valid], atol=5e-4, rtol=1e-4)


@pytest.mark.slow
def test_the_cli_decodes_a_saved_qwen3_next_target(capsys, tmp_path):
    """`tevjax generate --target DIR` on a saved hybrid target, speculative with its fresh drafter and
    continuous batching over three prompts in two rows, prints the AR tokens of each prompt."""
    from tevjax.cli import main
    from tevjax.decode import DecodeConfig, Decoder
    from tevjax.testing import random_model, tiny_config

    model = random_model(tiny_config("qwen3_next", num_layers=4, linear_layers=(0, 1, 2), vocab_size=48,
                                     max_position_embeddings=64), seed=3)
    save_hf_target(model, tmp_path / "next")
    prompts = [[1, 2, 3], [1, 5], [1, 7, 7, 9]]
    want = [g.tokens for g in Decoder(model, None, DecodeConfig(max_new_tokens=6, eos_ids=(2,))).generate(prompts)]
    batch = tmp_path / "prompts.jsonl"
    batch.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    for extra in ([], ["--continuous"]):
        code = main(["generate", "--target", str(tmp_path / "next"), "--batch-file", str(batch), "--batch-size", "2",
                     "--max-new-tokens", "6", "--budget", "4", "--json", *extra])
        out, err = capsys.readouterr()
        assert code == 0, err
        records = sorted((json.loads(line) for line in out.strip().splitlines()), key=lambda r: r["index"])
        assert [r["tokens"] for r in records] == want, extra
