"""Settings for the whole test session, its xdist workers and the subprocesses tests start."""

import gc
import os

import pytest

# No persistent compilation cache by default. It made the suite ~17% faster (a clean run: 11.5
# min with it, 13.9 without), but XLA:CPU's executable (de)serialisation crashed a worker in 2 of
# about 10 clean runs: a segfault in `put_executable_and_time`, and an abort inside
# `backend.deserialize_executable` for an entry that had decompressed intact (zlib's checksum rules
# out a torn file). A crash is a failed run and, with `--dist loadfile`, xdist then hangs. Set
# JAX_COMPILATION_CACHE_DIR yourself to opt in; then every program is cached, however small.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
# Tests compile far more than they compute (tiny models), so two XLA:CPU settings trade machine
# code speed for compile time; the HLO programs are the same. LLVM's optimisation level 0 halves
# compile time (test_prefill + test_interrupt: 113 s -> 66 s), and XLA's older elemental emitters
# instead of its fusion emitters cut it again (a tiny model's decode loop: 1.53 s -> 0.66 s).
# A flag the environment already sets is left as it is.
_FAST_COMPILE = {"xla_backend_optimization_level": "0", "xla_cpu_use_fusion_emitters": "false"}
for _flag, _value in _FAST_COMPILE.items():
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --{_flag}={_value}".strip()


# Each XLA:CPU executable keeps memory mappings of its own (~10-200 a program). A worker that kept
# every program it compiled passed the kernel's limit of 65,530 mappings (vm.max_map_count) and
# segfaulted inside a compile (as in jax-ml/jax#27201; two test files alone left 15,035 mappings,
# 1,106 with this). So each module's programs are dropped when it ends; modules share few programs,
# so this costs no time.
@pytest.fixture(autouse=True, scope="module")
def _drop_compiled_programs():
    yield
    import jax

    jax.clear_caches()
    gc.collect()


# A fixture two modules share (test_decode_smollm2, test_multihost).
@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """A random 4-layer Llama saved by transformers (safetensors + config.json, no tokenizer).

    Four layers, because the fresh drafter the CLI builds for a target without a drafter taps the
    public default layers, which need a target with >= 4 layers.

    initializer_range 0.3 (not transformers' 0.02) gives O(1) logit gaps, so the greedy path has no
    near-ties."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=10000.0, initializer_range=0.3, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False)
    path = tmp_path_factory.mktemp("tiny_llama")
    transformers.LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path


# A fixture two modules share (test_cli, test_multihost): `tevjax eval` needs text prompts.
@pytest.fixture(scope="module")
def text_target_dir(tmp_path_factory):
    """A random 4-layer Llama with the tiny byte tokenizer of test_tokenizer (text in, text out)."""
    from test_gguf import tiny_vocab
    from test_tokenizer import tiny_meta, write_tok_dir

    from tevjax.convert.hf import save_hf_target
    from tevjax.testing import random_model, tiny_config

    path = tmp_path_factory.mktemp("text_target")
    model = random_model(tiny_config("llama", num_layers=4, max_position_embeddings=128, vocab_size=len(tiny_vocab())),
                         seed=5)
    save_hf_target(model, path)
    write_tok_dir(tiny_meta(), path)
    return path
