"""The public DFlash checkpoint format <-> `DFlashDrafter`, as one declarative table.

A released drafter (e.g. z-lab/Qwen3-8B-DFlash-b16) is a directory with `config.json` (a Qwen3
config plus `block_size`, `num_target_layers` and `dflash_config: {mask_token_id,
target_layer_ids}`; see `DFlashConfig.from_hf_config`) and `model.safetensors` holding only the
drafter's own tensors, with no `model.` prefix and no embedding or LM head (the drafter uses the
target's; shape letters follow the legend in `tevjax/__init__.py`, and the MLP width is written
out as `inter`, the config's intermediate_size)::

    fc.weight                                   [D, F]
    hidden_norm.weight                          [D]
    layers.{i}.input_layernorm.weight           [D]
    layers.{i}.self_attn.{q,k,v,o}_proj.weight  [H*Dh, D], [K*Dh, D], [K*Dh, D], [D, H*Dh]
    layers.{i}.self_attn.{q,k}_norm.weight      [Dh]
    layers.{i}.post_attention_layernorm.weight  [D]
    layers.{i}.mlp.{gate,up,down}_proj.weight   [inter, D], [inter, D], [D, inter]
    norm.weight                                 [D]
    draft_vocab                                 [Vd] int32, only with dflash_config.draft_vocab_size

`draft_vocab` (a tevjax extension, absent from released drafters) lists the token ids of a
reduced draft vocabulary in increasing order; the drafter then scores only those rows of the
target's LM head.

HF `nn.Linear` weights are [out, in] and flax kernels [in, out], hence the transposes. A `model.`
prefix on every name (some re-exports add one) is accepted when loading; saving writes the
released names.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tevjax.convert.hf import (CheckpointError, WeightRule, checked_tensor, checkpoint_config_path,
                               read_safetensors_dir)
from tevjax.models.config import ModelConfig
from tevjax.models.dflash import DFlashConfig, DFlashDrafter, check_draft_vocab
from tevjax.sharding import place, shardings_by_path

__all__ = ["average_dflash", "dflash_weight_rules", "load_dflash", "load_drafter_params", "save_dflash"]

CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DRAFT_VOCAB = "draft_vocab"
# Recomputed buffers that some exports carry; skipping them is safe.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def dflash_weight_rules(cfg: DFlashConfig) -> list[WeightRule]:
    """The conversion table for a drafter with this config: one rule per HF tensor.

    `WeightRule.param` is the attribute path inside `DFlashDrafter` (list indices as strings).
    """
    d, f, dh = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    qd, kd = cfg.num_heads * dh, cfg.num_kv_heads * dh
    rules = [
        WeightRule("fc.weight", ("fc", "kernel"), "transpose", (d, cfg.feature_dim)),
        WeightRule("hidden_norm.weight", ("hidden_norm", "scale"), "identity", (d,)),
        WeightRule("norm.weight", ("norm", "scale"), "identity", (d,)),
    ]
    per_layer = [
        ("input_layernorm.weight", ("input_layernorm", "scale"), "identity", (d,)),
        ("post_attention_layernorm.weight", ("post_attention_layernorm", "scale"), "identity", (d,)),
        ("self_attn.q_proj.weight", ("self_attn", "q_proj", "kernel"), "transpose", (qd, d)),
        ("self_attn.k_proj.weight", ("self_attn", "k_proj", "kernel"), "transpose", (kd, d)),
        ("self_attn.v_proj.weight", ("self_attn", "v_proj", "kernel"), "transpose", (kd, d)),
        ("self_attn.o_proj.weight", ("self_attn", "o_proj", "kernel"), "transpose", (d, qd)),
        ("self_attn.q_norm.weight", ("self_attn", "q_norm", "scale"), "identity", (dh,)),
        ("self_attn.k_norm.weight", ("self_attn", "k_norm", "scale"), "identity", (dh,)),
        ("mlp.gate_proj.weight", ("mlp", "gate_proj", "kernel"), "transpose", (f, d)),
        ("mlp.up_proj.weight", ("mlp", "up_proj", "kernel"), "transpose", (f, d)),
        ("mlp.down_proj.weight", ("mlp", "down_proj", "kernel"), "transpose", (d, f)),
    ]
    for i in range(cfg.num_layers):
        rules += [WeightRule(f"layers.{i}.{hf}", ("layers", str(i)) + param, transform, shape)
                  for hf, param, transform, shape in per_layer]
    return rules


def _params_by_path(model: nnx.Module) -> dict[tuple[str, ...], nnx.Variable]:
    return {tuple(str(p) for p in path): v for path, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)}


def _canonical_names(tensors: Mapping[str, np.ndarray], expected: set[str]) -> dict[str, np.ndarray]:
    """Strips a `model.` prefix where the stripped name is one the table expects."""
    out: dict[str, np.ndarray] = {}
    for name, x in tensors.items():
        key = name[len("model."):] if name.startswith("model.") and name[len("model."):] in expected else name
        if key in out:
            raise CheckpointError(f"tensor {key!r} is present both with and without the 'model.' prefix")
        out[key] = x
    return out


def load_drafter_params(drafter: DFlashDrafter, tensors: Mapping[str, np.ndarray], *, strict: bool = True,
                        mesh=None) -> None:
    """Fills every parameter of `drafter` from public-named tensors (in place, cast to param_dtype).

    Missing tensors always raise; unexpected ones raise when `strict` (else they are skipped with
    a warning). Both lists are reported by name in one message; a wrong source shape raises
    naming the tensor with expected and actual shapes. With a `mesh`, each tensor goes straight
    into its sharding as it is converted.
    """
    cfg: DFlashConfig = drafter.cfg
    rules = dflash_weight_rules(cfg)
    params = _params_by_path(drafter)
    covered = {r.param for r in rules}
    if covered != set(params):  # the table itself is wrong for this module: a library bug
        raise AssertionError(f"DFlash conversion table out of sync with the module: table-only "
                             f"{sorted(covered - set(params))}, module-only {sorted(set(params) - covered)}")
    expected = {r.hf_name for r in rules} | ({DRAFT_VOCAB} if cfg.draft_vocab_size is not None else set())
    tensors = _canonical_names(tensors, expected)
    missing = sorted(expected - set(tensors))
    extra = sorted(n for n in tensors if n not in expected and not n.endswith(_IGNORED_SUFFIXES))
    if missing or (extra and strict):
        parts = []
        if missing:
            parts.append(f"missing tensor(s): {', '.join(missing)}")
        if extra:
            hint = (" (a DFlash drafter has no embedding or LM head of its own: it uses the target's)"
                    if any("embed_tokens" in n or "lm_head" in n for n in extra) else "")
            parts.append(f"unexpected tensor(s): {', '.join(extra)}{hint}")
        raise CheckpointError(f"checkpoint does not match a {cfg.num_layers}-layer DFlash drafter with "
                              f"{cfg.num_features} tapped target layers; " + "; ".join(parts))
    if extra:
        warnings.warn(f"DFlash checkpoint: skipping unexpected tensor(s) {', '.join(extra)}", stacklevel=2)

    shardings = shardings_by_path(drafter, mesh) if mesh is not None else {}
    if cfg.draft_vocab_size is not None:
        try:
            drafter.draft_vocab.set_value(place(check_draft_vocab(tensors[DRAFT_VOCAB], cfg), jnp.int32,
                                                shardings.get((DRAFT_VOCAB,))))
        except ValueError as e:
            raise CheckpointError(f"tensor {DRAFT_VOCAB!r}: {e}") from None
    dtype = jnp.dtype(cfg.param_dtype)
    for rule in rules:
        value = rule.to_param(rule.hf_name, checked_tensor(rule.hf_name, tensors[rule.hf_name]))
        var = params[rule.param]
        want = tuple(var.get_value().shape)
        if tuple(value.shape) != want:  # a table bug rather than a checkpoint bug
            raise AssertionError(f"{rule.hf_name} -> {'.'.join(rule.param)}: converted shape "
                                 f"{value.shape} != parameter shape {want}")
        var.set_value(place(value, dtype, shardings.get(rule.param)))


def load_dflash(path: str | os.PathLike, target_cfg: ModelConfig | None = None, *,
                dtype: str | None = None, param_dtype: str | None = None,
                strict: bool = True, mesh=None) -> tuple[DFlashConfig, DFlashDrafter]:
    """Loads a public-format DFlash drafter directory.

    `target_cfg`, when given, is checked against the drafter (hidden size, vocabulary, tapped
    layers). `dtype` / `param_dtype` override the compute / storage dtypes (default: the
    checkpoint's `dtype`/`torch_dtype` for both). The module skeleton is built with
    `nnx.eval_shape`, so no random weights are materialised; with a `mesh` every weight is placed
    straight into its sharding.
    """
    path, config_path = checkpoint_config_path(path, "a DFlash checkpoint")
    overrides = {k: v for k, v in (("dtype", dtype), ("param_dtype", param_dtype)) if v is not None}
    cfg = DFlashConfig.from_hf_config(config_path, **overrides)
    if target_cfg is not None:
        cfg.check_target(target_cfg)
    tensors = read_safetensors_dir(path)
    drafter = nnx.eval_shape(lambda: DFlashDrafter(cfg, rngs=nnx.Rngs(0)))
    try:
        load_drafter_params(drafter, tensors, strict=strict, mesh=mesh)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from e
    return cfg, drafter


def average_dflash(paths, weights=None, target_cfg: ModelConfig | None = None
                   ) -> tuple[DFlashConfig, DFlashDrafter]:
    """The weighted average of drafters that share one config, as a float32 `DFlashDrafter`.

    Averaging a model with its own fine-tune (weight-space interpolation, as in WiSE-FT) can keep
    what the fine-tune learned while undoing part of its drift, at no training cost. It is only
    meaningful between drafters of one lineage, so every config (the stored dtype aside) and every
    draft vocabulary must be equal. `weights` default to equal ones and must be positive and sum to
    1; the average is taken in float32.
    """
    paths = [os.fspath(p) for p in paths]
    if len(paths) < 2:
        raise ValueError(f"average_dflash: needs at least 2 drafters, got {len(paths)}")
    weights = [1.0 / len(paths)] * len(paths) if weights is None else [float(w) for w in weights]
    if len(weights) != len(paths):
        raise ValueError(f"average_dflash: {len(weights)} weights for {len(paths)} drafters")
    if not all(np.isfinite(w) and w > 0 for w in weights) or abs(sum(weights) - 1.0) > 1e-6:
        raise ValueError(f"average_dflash: weights must be positive and sum to 1, got {weights}")
    cfg, out = load_dflash(paths[0], target_cfg, dtype="float32", param_dtype="float32")
    acc = jax.tree.map(lambda x: weights[0] * x, nnx.state(out, nnx.Param))
    for path, w in zip(paths[1:], weights[1:]):
        cfg_i, d = load_dflash(path, target_cfg, dtype="float32", param_dtype="float32")
        if cfg_i != cfg:
            raise ValueError(f"average_dflash: {path} has a different config from {paths[0]}")
        if cfg.draft_vocab_size is not None and not bool(jnp.array_equal(d.vocab_ids(), out.vocab_ids())):
            raise ValueError(f"average_dflash: {path} has a different draft vocabulary from {paths[0]}")
        acc = jax.tree.map(lambda a, x: a + w * x, acc, nnx.state(d, nnx.Param))
    nnx.update(out, acc)
    return cfg, out


def _fsync(file_path: str) -> None:
    fd = os.open(file_path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_dflash(drafter: DFlashDrafter, cfg: DFlashConfig, path: str | os.PathLike, *,
                dtype: str | None = None) -> None:
    """Writes `config.json` + `model.safetensors` in the public format.

    `dtype` is the stored tensor dtype (default: the parameters' own dtype, so save -> load is
    lossless; pass "bfloat16" for the compact form of the released checkpoints). Both files are
    written to a temporary directory and fsynced first. A new `path` then appears in one atomic
    rename; an existing directory has each file atomically replaced (weights before config, and a
    stale sharded index removed), so a reader never sees a partial file.
    """
    from safetensors.numpy import save_file

    if drafter.cfg != cfg:
        raise ValueError("save_dflash: cfg differs from the drafter's own config")
    store = jnp.dtype(dtype or cfg.param_dtype)
    if store.name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"save_dflash: dtype {store.name!r} is not float32, bfloat16 or float16")
    params = _params_by_path(drafter)
    tensors: dict[str, np.ndarray] = {}
    for rule in dflash_weight_rules(cfg):
        value = np.asarray(jax.device_get(params[rule.param].get_value()))
        tensors[rule.hf_name] = np.ascontiguousarray(rule.to_hf(value).astype(store))
    if cfg.draft_vocab_size is not None:
        tensors[DRAFT_VOCAB] = np.ascontiguousarray(np.asarray(jax.device_get(drafter.vocab_ids()), np.int32))
    hf_config = cfg.to_hf_config()
    hf_config["dtype"] = store.name
    config_bytes = (json.dumps(hf_config, indent=2) + "\n").encode("utf-8")

    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    try:
        save_file(tensors, os.path.join(tmp, SAFETENSORS_FILE), metadata={"format": "pt"})
        with open(os.path.join(tmp, CONFIG_FILE), "wb") as f:
            f.write(config_bytes)
        for name in (SAFETENSORS_FILE, CONFIG_FILE):
            _fsync(os.path.join(tmp, name))
        if not os.path.exists(path):
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the checkpoint should not be
            os.rename(tmp, path)
            _fsync(parent)  # make the rename itself durable
            return
        if not os.path.isdir(path):
            raise FileExistsError(f"save_dflash: {path} exists and is not a directory")
        os.replace(os.path.join(tmp, SAFETENSORS_FILE), os.path.join(path, SAFETENSORS_FILE))
        # A leftover sharded index would take precedence over the new single file when reading.
        if os.path.exists(os.path.join(path, INDEX_FILE)):
            os.remove(os.path.join(path, INDEX_FILE))
        os.replace(os.path.join(tmp, CONFIG_FILE), os.path.join(path, CONFIG_FILE))
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
