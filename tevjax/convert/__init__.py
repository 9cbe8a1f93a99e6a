"""Checkpoint converters (Hugging Face safetensors)."""

from tevjax.convert.hf import (
    CheckpointError,
    WeightRule,
    load_hf_target,
    load_target_params,
    read_safetensors_dir,
    save_hf_target,
    target_weight_rules,
)

__all__ = [
    "CheckpointError",
    "WeightRule",
    "load_hf_target",
    "load_target_params",
    "read_safetensors_dir",
    "save_hf_target",
    "target_weight_rules",
]
