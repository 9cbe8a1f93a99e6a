"""`tevjax generate`: argument checking (one line, exit 2, nothing loaded) and a tiny end-to-end run."""

import json
import sys
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tevjax.cli import main
from tevjax.convert.hf import save_hf_target
from tevjax.decode import DecodeConfig, Decoder
from tevjax.evaluate import format_table
from tevjax.testing import random_model, tiny_config
from test_gguf import SPECIALS, tiny_vocab
from test_tokenizer import tiny_meta, write_tok_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    model = random_model(tiny_config("llama", num_layers=4, max_position_embeddings=64, vocab_size=48), seed=5)
    save_hf_target(model, path)
    return path, model


def _run(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse-level errors exit from inside parse_args
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "--prompt", "hi", "--temperature", "-1"], "temperature must be a finite float32 number >= 0"),
        (["generate", "--prompt", "hi", "--temperature", "nan"], "temperature must be a finite float32 number >= 0"),
        (["generate", "--prompt", "hi", "--temperature", "1e39"], "temperature must be a finite float32 number >= 0"),
        # What Python makes of bytes that are not UTF-8 on the command line (surrogate escapes).
        (["generate", "--prompt", "hi \udcff"], "--prompt is not UTF-8 text (byte 0xff at character 3)"),
        (["generate", "--prompt", "hi", "--stop", "\udcfe"], "--stop is not UTF-8 text (byte 0xfe at character 0)"),
        (["generate", "--prompt", "hi", "--verifier", "eagle"], "--verifier 'eagle' is not one of"),
        (["generate", "--prompt", "   "], "--prompt is empty"),
        (["generate", "--prompt-ids", "1,x"], "--prompt-ids must be comma-separated integers"),
        (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        (["generate", "--prompt", "hi", "--budget", "-3"], "--budget must be >= 1"),
        (["generate", "--prompt", "hi", "--lookup", "-1"], "--lookup must be >= 0"),
        (["eval", "--budgets", "8,0"], "--budgets must all be >= 1, got '8,0'"),
        (["train", "--data", "d", "--out", "o", "--steps", "1", "--taps", "1,-2"], "--taps must all be >= 0"),
        (["generate", "--prompt", "hi", "--budget", "4", "--lookup", "5"], "--lookup 5 exceeds --budget 4"),
        (["demo", "--budget", "2", "--lookup", "3"], "--lookup 3 exceeds --budget 2"),
        (["generate", "--prompt", "hi", "--drafter", "/no/such/drafter"], "no such checkpoint directory"),
        (["generate", "--prompt", "hi", "--target", "/no/such/model"], "--target '/no/such/model': not a directory"),
        (["generate", "--batch-file", "/no/such/file.txt"], "no such file"),
        (["generate", "--batch-file", "/"], "--batch-file '/': a directory, not a file"),
        (["generate"], "one of the arguments --prompt --prompt-ids --batch-file is required"),
        (["generate", "--prompt", "hi", "--seed", "-1"], "--seed must be in [0, 2**64) = [0, 18446744073709551615], got -1"),
        (["generate", "--prompt", "hi", "--seed", "18446744073709551616"], "got 18446744073709551616"),
        (["generate", "--prompt", "hi", "--seed", "1.5"], "--seed must be an integer, got '1.5'"),
        (["generate", "--prompt", "hi", "--top-p", "0"], "--top-p must be in (0, 1], got '0'"),
        (["generate", "--prompt", "hi", "--top-p", "x"], "--top-p must be a number in (0, 1], got 'x'"),
        (["generate", "--prompt", "hi", "--min-p", "1"], "--min-p must be in [0, 1), got '1'"),
        (["eval", "--min-p", "nan"], "--min-p must be in [0, 1), got 'nan'"),
        (["eval", "--top-k", "-1"], "--top-k must be >= 0, got -1"),
        (["generate", "--prompt", "hi", "--heartbeat-timeout", "0"], "--heartbeat-timeout must be >= 1"),
        (["generate", "--prompt", "hi", "--fallback-below", "-1"], "--fallback-below must be a finite number >= 0"),
        (["chat", "--fallback-below", "inf"], "--fallback-below must be a finite number >= 0.0, got 'inf'"),
        (["eval", "--fallback-rounds", "0"], "--fallback-rounds must be >= 1"),
        (["generate", "--prompt", "hi", "--stop", ""], "--stop is empty"),
        (["generate", "--prompt", "hi", *(a for i in range(33) for a in ("--stop", f"s{i}"))],
         "33 distinct stop strings in --stop and the batch file: at most 32"),
        (["generate", "--prompt", "hi", "--logprobs"], "--logprobs needs --json"),
        (["data", "--out", "/no/such/data", "--resume", "--num-prompts", "4"], "--resume: /no/such/data holds no data directory to complete"),
        (["train", "--data", "d", "--out", "o", "--steps", "1", "--heartbeat-timeout", "2.5"],
         "--heartbeat-timeout must be an integer"),
    ],
)
def test_bad_input_is_one_clear_line(capsys, argv, message):
    code, out, err = _run(capsys, *argv)
    assert code == 2
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["eval"], ["data", "--out", "d", "--num-prompts", "4"],
                                     ["train", "--data", "d", "--out", "o", "--steps", "1"]])
def test_the_multi_host_timeouts_reach_the_join(monkeypatch, capsys, command):
    """--join-timeout and --heartbeat-timeout are handed to `initialize_distributed`, with
    jax.distributed's defaults (300 s, 100 s) where they are not given; the join comes before the
    commands' own checks, so the stand-in's refusal is the command's error."""
    from tevjax import multihost

    seen = []

    def join(*args, **kwargs):
        seen.append(kwargs)
        raise ValueError("refused by the test's stand-in")

    monkeypatch.setattr(multihost, "initialize_distributed", join)
    job = ["--coordinator", "localhost:1", "--num-processes", "2", "--process-id", "0"]
    code, _, err = _run(capsys, *command, *job, "--heartbeat-timeout", "7", "--join-timeout", "9.5")
    assert code == 2 and "refused by the test's stand-in" in err, err
    code, _, err = _run(capsys, *command, *job)
    assert code == 2, err
    assert [(k["timeout_s"], k["heartbeat_timeout_s"]) for k in seen] == [(9.5, 7), (300.0, 100)]


TRAIN = ["train", "--data", "d", "--out", "o", "--steps", "5"]


@pytest.mark.parametrize("argv, message", [
    # Drafter flags without a drafter (--verifier ar).
    (["generate", "--prompt", "hi", "--verifier", "ar", "--budget", "4", "--fallback-rounds", "2"],
     "--budget, --fallback-rounds: read only with a drafter, and --verifier ar decodes without one"),
    (["generate", "--prompt", "hi", "--verifier", "ar", "--drafter", "/no/such/drafter", "--corpus", "0",
      "--fallback-below", "1"], "--drafter, --corpus, --fallback-below: read only with a drafter"),
    (["chat", "--verifier", "ar", "--lookup", "0"], "--lookup: read only with a drafter, and --verifier ar"),
    # --fallback-rounds where nothing falls back.
    (["generate", "--prompt", "hi", "--fallback-below", "0", "--fallback-rounds", "2"],
     "--fallback-rounds 2 does nothing: --fallback-below is 0"),
    (["eval", "--fallback-rounds", "2"], "--fallback-rounds 2 does nothing: --fallback-below is not given"),
    (["eval", "--fallback-below", "0", "--fallback-rounds", "3"], "--fallback-rounds 3 does nothing"),
    # generate's batch and chat-template flags without a batch file or text.
    (["generate", "--prompt", "hi", "--batch-size", "2"], "--batch-size needs --batch-file"),
    (["generate", "--prompt-ids", "1,2", "--chat"], "--chat wraps text prompts in the chat template, and --prompt-ids"),
    # demo's model-part flags with --skip-models.
    (["demo", "--skip-models", "--budget", "4", "--repeats", "2"],
     "--budget, --repeats: read only by the model part, which --skip-models leaves out"),
    (["demo", "--skip-models", "--max-new-tokens", "5", "--corpus", "0"], "--max-new-tokens, --corpus: read only"),
    # The exit loss's flags with the exit loss off, and --until past the last step.
    ([*TRAIN, "--exit-lambda", "0", "--exit-top-p", "0.9", "--exit-sequences", "2"],
     "--exit-top-p, --exit-sequences: read only by the exit loss, which --exit-lambda 0 turns off"),
    ([*TRAIN, "--exit-lambda", "0", "--exit-weight", "w"], "--exit-weight: read only by the exit loss"),
    ([*TRAIN, "--until", "6"], "--until 6 is past --steps 5"),
    # Multi-host flags without a job to join.
    (["generate", "--prompt", "hi", "--num-processes", "2", "--process-id", "1"],
     "--num-processes, --process-id: no multi-host job to join"),
    (["eval", "--join-timeout", "5"], "--join-timeout: no multi-host job to join"),
    (["train", "--data", "d", "--out", "o", "--steps", "1", "--heartbeat-timeout", "9"],
     "--heartbeat-timeout: no multi-host job to join"),
])
def test_a_flag_the_other_flags_make_useless_is_refused_before_loading(monkeypatch, capsys, argv, message):
    """A flag that the command would accept and then never read, given the other flags (a drafter's
    flag without a drafter, an exit-loss flag with the exit loss off, ...), is one error naming it,
    before any model loads."""
    import tevjax.loading as loading

    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_JOB_ID",
                 "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name in ("load_models", "load_target"):
        monkeypatch.setattr(loading, name, lambda *a, **k: pytest.fail("a model was loaded"))
    code, _, err = _run(capsys, *argv)
    assert code == 2 and message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_flags_that_are_not_given_keep_their_defaults(monkeypatch, capsys, tmp_path):
    """The flags whose default became "not given" (None) still decode and train with the stated
    defaults: demo's 64 tokens, budget 8 and 3 repeats; train's exit loss settings, also where
    --exit-lambda 0 is given alone."""
    import tevjax.demo as demo
    import tevjax.train.step as step

    seen = []
    monkeypatch.setattr(demo, "main", lambda **kw: seen.append(kw) or 0)
    assert _run(capsys, "demo")[0] == 0
    assert _run(capsys, "demo", "--skip-models")[0] == 0
    assert [(kw["max_new_tokens"], kw["budget"], kw["repeats"], kw["skip_models"]) for kw in seen] == \
        [(64, 8, 3, False), (64, 8, 3, True)]

    def config(**kw):
        seen.append(kw)
        raise ValueError("refused by the test's stand-in")

    monkeypatch.setattr(step, "TrainConfig", config)
    seen.clear()
    for extra in ([], ["--exit-lambda", "0"]):
        code, _, err = _run(capsys, "train", "--data", str(tmp_path), "--out", str(tmp_path / "run"), "--steps", "5",
                            *extra)
        assert code == 2 and "refused by the test's stand-in" in err, err
    want = dict(exit_weight="w", exit_budget=8, exit_temperature=1.0, exit_top_k=0, exit_top_p=1.0, exit_min_p=0.0,
                exit_anchors=8, exit_sequences=None)
    assert [{k: kw[k] for k in want} for kw in seen] == [want, want]
    assert [kw["exit_lambda"] for kw in seen] == [0.1, 0.0]


def test_help_lists_the_commands_users_type(capsys):
    code, out, _ = _run(capsys, "--help")
    assert code == 0 and "{generate,chat,data,train,eval,demo}" in out
    assert "SUPPRESS" not in out and "train-export" not in out  # reached as `train export`
    code, out, _ = _run(capsys, "train", "export", "--help")
    assert code == 0 and out.startswith("usage: tevjax train export ")
    code, _, err = _run(capsys, "foo")
    assert code == 2 and err.startswith("tevjax: error: argument {generate,chat,data,train,eval,demo}: invalid choice: "
                                        "'foo' (choose from 'generate', 'chat', 'data', 'train', 'eval', 'demo')"), err


def test_verifier_choices_follow_the_library(monkeypatch, capsys):
    """--verifier takes the names in `VERIFIERS` (plus "ar", no drafter, for generate only)."""
    from tevjax import verifiers
    from tevjax.cli import verifier_choices

    assert verifier_choices(autoregressive=True) == (*verifiers.VERIFIERS, "ar")
    assert verifier_choices(autoregressive=False) == tuple(verifiers.VERIFIERS)
    monkeypatch.setitem(verifiers.VERIFIERS, "mine", verifiers.VERIFIERS["tev"])
    assert "mine" in verifier_choices(autoregressive=False)
    code, _, err = _run(capsys, "eval", "--verifier", "ar")
    assert code == 2 and "--verifier 'ar' is not one of tev, predraw, sequential, mine" in err


def test_seed_accepts_the_full_unsigned_64_bit_range():
    from tevjax.cli import build_parser

    for text, value in (("0", 0), ("4294967296", 2**32), ("18446744073709551615", 2**64 - 1)):
        assert build_parser().parse_args(["generate", "--prompt", "hi", "--seed", text]).seed == value


def test_model_level_errors(capsys, tiny_dir):
    path, _ = tiny_dir
    code, _, err = _run(capsys, "generate", "--target", str(path), "--prompt-ids", ",".join(["3"] * 60),
                        "--max-new-tokens", "2")
    assert code == 2 and "prompt 0 (--prompt-ids) is 60 tokens" in err and "exceeds the target's 64 positions" in err
    code, _, err = _run(capsys, "generate", "--target", str(path), "--prompt", "hello", "--max-new-tokens", "8")
    assert code == 2 and "no tokenizer: give --prompt-ids" in err
    code, _, err = _run(capsys, "generate", "--target", str(path), "--prompt-ids", "1,2,48", "--max-new-tokens", "8")
    assert code == 2 and "prompt 0 (--prompt-ids) holds token id 48 outside the vocabulary [0, 48)" in err


def test_a_prompt_set_whose_package_is_missing_is_one_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` fails, as if not installed
    code, _, err = _run(capsys, "eval", "--prompts", "gsm", "--num-prompts", "1")
    assert code == 2 and "package 'reasoning_gym' is not installed" in err and "tevjax[experiments]" in err, err
    assert "internal error" not in err and len(err.strip().splitlines()) == 1


def test_generate_json_matches_autoregressive_greedy(capsys, tiny_dir):
    path, model = tiny_dir
    code, out, err = _run(capsys, "generate", "--target", str(path), "--prompt-ids", "1,2,3", "--max-new-tokens", "8",
                          "--budget", "4", "--json")
    assert code == 0, err
    assert "UNTRAINED" in err  # no drafter given: a fresh one is used and the user is told
    record = json.loads(out.strip().splitlines()[-1])
    for field in ("tokens", "text", "rounds", "tau", "seconds", "tokens_per_second"):
        assert field in record
    reference = Decoder(model, None, DecodeConfig(max_new_tokens=8, eos_ids=(2,))).generate([[1, 2, 3]])[0]
    assert record["tokens"] == reference.tokens
    assert record["tau"] >= 1.0 and record["rounds"] >= 1 and "logprobs" not in record
    assert record["tokens_per_second"] == pytest.approx(len(record["tokens"]) / record["seconds"], rel=0.02)
    assert record["budget"] == 4 and record["lookup"] == 4  # the chain defaults to the budget
    code, out, _ = _run(capsys, "generate", "--target", str(path), "--prompt-ids", "1,2,3", "--max-new-tokens", "8",
                        "--budget", "4", "--lookup", "0", "--json")
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["lookup"] == 0
    assert json.loads(out.strip().splitlines()[-1])["tokens"] == reference.tokens
    code, out, err = _run(capsys, "generate", "--target", str(path), "--prompt-ids", "1,2,3", "--max-new-tokens", "8",
                          "--verifier", "ar", "--json", "--logprobs")
    record = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and record["tokens"] == reference.tokens
    logprobs = Decoder(model, None, DecodeConfig(max_new_tokens=8, eos_ids=(2,), logprobs=True)).generate([[1, 2, 3]])
    np.testing.assert_allclose(record["logprobs"], logprobs[0].logprobs, atol=1e-5)
    assert "drafter" not in err, err  # the baseline loads no drafter, so no note about one
    # Without --budget, the CPU's default: 8, the faster of 8 and 16 on this CPU.
    code, out, err = _run(capsys, "generate", "--target", str(path), "--prompt-ids", "1,2,3", "--max-new-tokens", "8",
                          "--json")
    record = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and (record["budget"], record["lookup"]) == (8, 8) and record["tokens"] == reference.tokens, err
    # An untrained drafter on a CPU falls back to plain steps by default (the runs above with
    # --budget 4 too); a threshold no tree reaches makes most rounds plain. The tokens stay AR's.
    assert record["fallback_below"] == 1.8
    code, out, err = _run(capsys, "generate", "--target", str(path), "--prompt-ids", "1,2,3", "--max-new-tokens",
                          "8", "--budget", "4", "--json", "--fallback-below", "50", "--fallback-rounds", "1")
    record = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and record["tokens"] == reference.tokens, err
    assert 0 < record["plain_rounds"] < record["rounds"] and record["fallback_below"] == 50, record


# A model that answers with a fixed byte string: every layer's output projections are zero, so
# the last hidden state is the current token's embedding, and lm_head row succ(t) is t's
# embedding, so greedy decoding walks the chain token -> successor (one token per AR round).
SCRIPTED = "🙂 é".encode()


def write_scripted_target(path, successors, max_positions: int = 64):
    """Saves a 1-layer target (with the tiny byte tokenizer) whose greedy next token after t is
    successors[t]: layer outputs are zero, so the last hidden state is t's normalised embedding,
    and lm_head row successors[t] is 50 times that embedding."""
    from safetensors.numpy import load_file, save_file

    save_hf_target(random_model(tiny_config("llama", num_layers=1, max_position_embeddings=max_positions,
                                            vocab_size=len(tiny_vocab())), seed=3), path)
    tensors = load_file(path / "model.safetensors")
    emb = tensors["model.embed_tokens.weight"]
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    head = np.zeros_like(emb)
    for t, succ in successors:
        head[succ] = emb[t] * 50.0
    for name in tensors:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = np.zeros_like(tensors[name])
    tensors["model.norm.weight"] = np.ones_like(tensors["model.norm.weight"])
    tensors["lm_head.weight"] = head
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    write_tok_dir(tiny_meta(), path)


def test_moe_dispatch_flag_chooses_the_experts_dispatch(capsys, tmp_path, tiny_dir):
    """--moe-dispatch (generate, eval, chat): either dispatch of a mixture-of-experts target gives AR's
    tokens; a dense target says it has no effect; a value outside the library's is refused."""
    from tevjax.cli import MOE_DISPATCHES
    from tevjax.models.layers import MOE_DISPATCHES as LIBRARY

    assert MOE_DISPATCHES == LIBRARY
    model = random_model(tiny_config("qwen3_moe", num_layers=2, max_position_embeddings=64, vocab_size=48), seed=3)
    save_hf_target(model, tmp_path / "moe")
    reference = Decoder(model, None, DecodeConfig(max_new_tokens=6, eos_ids=(2,))).generate([[1, 2, 3]])[0].tokens
    for dispatch in ("dense", "ragged"):
        code, out, err = _run(capsys, "generate", "--target", str(tmp_path / "moe"), "--prompt-ids", "1,2,3",
                              "--max-new-tokens", "6", "--budget", "4", "--moe-dispatch", dispatch, "--json")
        assert code == 0 and json.loads(out.strip().splitlines()[-1])["tokens"] == reference, (dispatch, err)
        assert "no effect" not in err
    code, _, err = _run(capsys, "generate", "--target", str(tiny_dir[0]), "--prompt-ids", "1,2", "--max-new-tokens",
                        "2", "--moe-dispatch", "ragged", "--json")
    assert code == 0 and "--moe-dispatch ragged has no effect: the target has no experts" in err
    code, _, err = _run(capsys, "eval", "--moe-dispatch", "sparse")
    assert code == 2 and "invalid choice: 'sparse'" in err


def test_continuous_prints_each_prompt_as_it_ends(tmp_path, capsys):
    """`--continuous` with 2 rows over "z", "a", "a", "a" (a scripted target: "a" answers "ok" and
    ends, "z" runs to --max-new-tokens): the "a" prompts end and print while "z" decodes, so "z"
    prints last; every record equals the fixed batches' record of the same prompt."""
    a, z = (len(SPECIALS) + b for b in b"az")
    chain = [a] + [len(SPECIALS) + b for b in b"ok"] + [2]  # byte b is token 3 + b; 2 = EOS
    write_scripted_target(tmp_path / "t", [*zip(chain, chain[1:]), (z, z)])
    lines = tmp_path / "prompts.txt"
    lines.write_text("z\na\na\na\n")
    argv = ["generate", "--target", str(tmp_path / "t"), "--batch-file", str(lines), "--batch-size", "2", "--no-chat",
            "--verifier", "ar", "--max-new-tokens", "40", "--json"]
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    fixed = [json.loads(line) for line in out.splitlines()]
    assert [r["index"] for r in fixed] == [0, 1, 2, 3] and [r["text"] for r in fixed] == ["z" * 40] + ["ok"] * 3
    code, out, err = _run(capsys, *argv, "--continuous")
    assert code == 0, err
    flowing = [json.loads(line) for line in out.splitlines()]
    assert [r["index"] for r in flowing] == [1, 2, 3, 0]
    for r in flowing:
        want = fixed[r["index"]]
        assert (r["prompt"], r["tokens"], r["text"], r["stop"]) == (want["prompt"], want["tokens"], want["text"],
                                                                   want["stop"])
    assert flowing[-1]["seconds"] >= flowing[0]["seconds"]  # seconds run from the start of decoding
    code, _, err = _run(capsys, "generate", "--prompt", "hi", "--continuous")
    assert code == 2 and "--continuous needs --batch-file" in err


def test_sampled_batches_do_not_repeat_each_others_random_streams(tmp_path, capsys, tiny_dir):
    """One prompt four times at temperature 1: prompt i samples with stream i whatever --batch-size
    (as with --continuous), so the four samples differ, and batches of 1, 2 or 4 give the same ones.
    Each batch used its rows' streams 0, 1, ..., so every batch repeated the first one's samples."""
    lines = tmp_path / "same.jsonl"
    lines.write_text("".join(json.dumps({"prompt_ids": [1, 5, 7]}) + "\n" for _ in range(4)))
    runs = {}
    for extra in (["--batch-size", "1"], ["--batch-size", "2"], ["--batch-size", "4", "--continuous"]):
        code, out, err = _run(capsys, "generate", "--target", str(tiny_dir[0]), "--batch-file", str(lines),
                              "--no-chat", "--verifier", "ar", "--temperature", "1.0", "--max-new-tokens", "12",
                              "--json", *extra)
        assert code == 0, err
        runs[extra[1]] = [r["tokens"] for r in sorted(map(json.loads, out.splitlines()), key=lambda r: r["index"])]
    assert len({tuple(t) for t in runs["1"]}) > 1, runs["1"]  # (two may both end at once, at EOS)
    assert runs["1"] == runs["2"] == runs["4"]


def test_jsonl_batch_file_gives_each_prompt_its_temperature_and_length(tmp_path, capsys, tiny_dir):
    """A .jsonl batch file: each record's prompt ids, temperature and length. The greedy rows
    decode the flags' greedy tokens and the sampled row the tokens of the same row in a batch all
    at its temperature, each cut at its own length; bad records are refused by line and key."""
    path, _ = tiny_dir
    base = ["generate", "--target", str(path), "--verifier", "ar", "--max-new-tokens", "8", "--seed", "4", "--json"]

    def records(lines: list[dict], *extra) -> list[dict]:
        f = tmp_path / "prompts.jsonl"
        f.write_text("".join(json.dumps(r) + "\n" for r in lines))
        code, out, err = _run(capsys, *base, "--batch-file", str(f), "--batch-size", "3", *extra)
        assert code == 0, err
        return [json.loads(line) for line in out.splitlines()]

    ids = [[1, 5, 7], [1, 3], [6]]
    greedy = records([{"prompt_ids": p} for p in ids])
    hot = records([{"prompt_ids": p} for p in ids], "--temperature", "1")
    mixed = records([{"prompt_ids": ids[0], "temperature": 1, "top_k": 1}, {"prompt_ids": ids[1], "temperature": 1.0},
                     {"prompt_ids": ids[2], "max_new_tokens": 5}])
    # top-k 1 at temperature 1 samples the greedy tokens
    assert [r["tokens"] for r in mixed] == [greedy[0]["tokens"], hot[1]["tokens"], greedy[2]["tokens"][:5]]
    assert hot[1]["tokens"] != greedy[1]["tokens"]  # the row really sampled
    assert [(r["temperature"], r["top_k"], r["max_new_tokens"]) for r in mixed] == [(1, 1, 8), (1.0, 0, 8),
                                                                                  (0.0, 0, 5)]

    f = tmp_path / "bad.jsonl"
    for line, message in [("[1, 2]", "line 2: not a JSON object, got list"),
                          ('{"prompt_ids": [1], "temp": 1}', "line 2: unknown key(s) 'temp'"),
                          ('{"prompt": "a", "prompt_ids": [1]}', 'line 2: give one of "prompt" (text) and'),
                          ('{"prompt_ids": [1], "temperature": -1}',
                           'line 2: "temperature" must be a finite float32 number >= 0'),
                          ('{"prompt_ids": [1], "temperature": 1e39}',  # inf in float32
                           'line 2: "temperature" must be a finite float32 number >= 0'),
                          ('{"prompt_ids": [1], "max_new_tokens": 9}',
                           'line 2: "max_new_tokens" must be an integer in [1, 8]'),
                          ('{"prompt_ids": []}', 'line 2: "prompt_ids" must be a non-empty list of token ids'),
                          ('{"prompt_ids": [1], "top_p": 0}', 'line 2: "top_p" must be a number in (0, 1] (1: off)'),
                          ('{"prompt_ids": [1], "top_k": 1.5}', 'line 2: "top_k" must be an integer >= 0'),
                          ("{'prompt': 1}", "line 2: not a JSON object (Expecting property name")]:
        f.write_text('{"prompt_ids": [1]}\n' + line + "\n")
        code, _, err = _run(capsys, *base, "--batch-file", str(f))
        assert code == 2 and f"--batch-file '{f}': " + message in err, err
    f.write_text('{"prompt": "hello"}\n')
    code, _, err = _run(capsys, *base, "--batch-file", str(f))
    assert code == 2 and 'no tokenizer: give --prompt-ids (or "prompt_ids" in a .jsonl batch file)' in err, err


def test_a_text_prompt_too_long_for_the_target_is_one_error(capfd, text_target_dir):
    """A text prompt longer than the target's positions: the CLI's one-line error, naming the
    prompt and its length, and not also transformers' warning that the model will fail with
    indexing errors (printed as the tokenizer passes its limit, before tevjax's own check)."""
    try:
        code = main(["generate", "--target", str(text_target_dir), "--no-chat", "--prompt", "ab" * 100,
                     "--max-new-tokens", "4", "--budget", "2"])
    except SystemExit as e:
        code = e.code
    _, err = capfd.readouterr()
    assert code == 2 and "prompt 0 (--prompt) is 200 tokens" in err and "exceeds the target's 128 positions" in err
    assert "indexing errors" not in err and "longer than the specified maximum" not in err, err


def test_a_text_prompt_that_encodes_to_no_tokens_is_named_before_any_generation(capsys, text_target_dir, tmp_path,
                                                                                 monkeypatch):
    """A tokenizer may drop text it cannot read (a byte-level one, like the tests', never does, so
    its `encode` is made to drop line 3 here). The error names the prompt and its line, and comes
    before line 1 is generated: nothing is printed on stdout."""
    from tevjax import cli

    lines = tmp_path / "prompts.txt"
    lines.write_text("ab\nba\nunreadable\n")
    encode = cli._encode

    def dropping(models, prompts, chat):
        models.tokenizer.encode = lambda text, _plain=models.tokenizer.encode: [] if text == "unreadable" \
            else _plain(text)
        return encode(models, prompts, chat)

    monkeypatch.setattr(cli, "_encode", dropping)
    code, out, err = _run(capsys, "generate", "--target", str(text_target_dir), "--batch-file", str(lines),
                          "--no-chat", "--max-new-tokens", "4", "--budget", "2")
    assert code == 2 and out == "", (out, err)
    assert f"tevjax: error: prompt 2 (line 3 of {lines}) encodes to no tokens" in err, err


def test_eval_measures_ar_and_each_budget_on_a_prompt_file(capsys, text_target_dir, tmp_path):
    """`tevjax eval --json`: AR and every budget on the same prompts (the file's first
    --num-prompts lines), greedy outputs equal to AR's, tau the pooled block length of the
    per-prompt counts it reports; without --json, the same run as a table."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("hello\n\nworld\nabc\nxyz\nnot read\n")
    argv = ["eval", "--target", str(text_target_dir), "--prompts", str(prompts), "--num-prompts", "4",
            "--budgets", "2,4", "--max-new-tokens", "8"]
    code, out, err = _run(capsys, *argv, "--json")
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert (result["num_prompts"], result["prompts"], result["mismatches"]) == (4, str(prompts), 0)
    assert [r["budget"] for r in result["budgets"]] == [2, 4]
    for row in result["budgets"]:
        assert row["mismatches"] == 0 and row["tokens"] == result["ar"]["tokens"] > 0
        assert len(row["prompt_emitted"]) == len(row["prompt_rounds"]) == 4
        assert row["tau"] == pytest.approx(sum(row["prompt_emitted"]) / sum(row["prompt_rounds"]))
        assert row["tau"] >= 1.0 and row["sr"] > 0
        assert "plain_rounds" not in row  # eval falls back only when asked: its tau measures the trees
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    assert "| budget | lookup | corpus | tau" in out and "4 prompts, 8 new tokens" in out
    # With --fallback-below, tau counts the plain rounds (one token each) and the drafted rounds'
    # own tau is given beside it.
    code, out, err = _run(capsys, *argv, "--json", "--fallback-below", "50", "--fallback-rounds", "1")
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    for row in result["budgets"]:
        rounds, block = sum(row["prompt_rounds"]), sum(row["prompt_emitted"])
        assert row["mismatches"] == 0 and 0 < row["plain_rounds"] < rounds
        assert row["tau_drafted"] == pytest.approx((block - row["plain_rounds"]) / (rounds - row["plain_rounds"]))
    table = format_table(result)  # what the same command prints without --json
    assert "fallback below 50" in table and "| plain rounds | tau of drafted rounds |" in table


def test_eval_checks_every_greedy_temperature_and_says_when_the_set_is_short(capsys, text_target_dir, tmp_path):
    """A temperature below 1e-5 decodes greedily, so eval checks its outputs against AR's as at 0 (it
    reported n/a and checked nothing); a prompt file with a byte-order mark measures the prompt
    without it; a set shorter than --num-prompts is measured whole, with a note saying so."""
    from tevjax.evaluate import load_eval_prompts

    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes("\ufeffhello\nworld\n".encode())
    assert load_eval_prompts(str(prompts), 8) == ["hello", "world"]
    code, out, err = _run(capsys, "eval", "--target", str(text_target_dir), "--prompts", str(prompts), "--num-prompts",
                          "5", "--budgets", "2", "--max-new-tokens", "4", "--temperature", "1e-6", "--json")
    assert code == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result["num_prompts"] == 2 and result["budgets"][0]["mismatches"] == 0
    assert f"tevjax: note: --prompts {prompts} holds 2 prompts, fewer than --num-prompts 5: measuring those 2" in err
    assert "| yes |" in format_table(result)


def test_generate_uses_the_drafters_corpus_by_default(capsys, tiny_dir, tmp_path):
    """A drafter directory with a corpus.npz decodes with a corpus chain as long as the budget
    (`--corpus 0` turns it off); the tokens stay AR's. Without a corpus file the chain is off."""
    from tevjax.convert.dflash_ckpt import save_dflash
    from tevjax.loading import fresh_drafter

    path, model = tiny_dir
    drafter = fresh_drafter(model.cfg, seed=3, num_layers=1, block_size=6, mask_token_id=47)
    save_dflash(drafter, drafter.cfg, tmp_path / "drafter")
    reference = Decoder(model, None, DecodeConfig(max_new_tokens=8, eos_ids=(2,))).generate([[1, 2, 3]])[0]
    argv = ["generate", "--target", str(path), "--drafter", str(tmp_path / "drafter"), "--prompt-ids", "1,2,3",
            "--max-new-tokens", "8", "--budget", "4", "--json"]
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["corpus"] == 0  # no corpus file: off
    code, _, err = _run(capsys, *argv, "--corpus", "2")  # asked for, but there is no chain to draw
    assert code == 2 and "--corpus 2: the drafter has no corpus table" in err, err
    answer = [1, 2, 3] + reference.tokens
    np.savez(tmp_path / "drafter" / "corpus.npz", tokens=np.array(answer * 2), offsets=np.array([0, len(answer),
             2 * len(answer)]), starts=np.array([3, 3]))
    for extra, corpus in (([], 4), (["--corpus", "2"], 2), (["--corpus", "0"], 0)):
        code, out, err = _run(capsys, *argv, *extra)
        assert code == 0, err
        record = json.loads(out.strip().splitlines()[-1])
        assert record["corpus"] == corpus and record["tokens"] == reference.tokens
    code, out, err = _run(capsys, *argv[:-1])  # streamed: the round-by-round path
    assert code == 0 and "corpus 4," in out, err
    code, _, err = _run(capsys, *argv, "--corpus", "5")
    assert code == 2 and "--corpus 5 exceeds --budget 4" in err


@pytest.fixture(scope="module")
def scripted_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("scripted")
    chain = [len(SPECIALS) + b for b in b"a" + SCRIPTED] + [2]  # byte b is token 3 + b; 2 = EOS
    write_scripted_target(path, zip(chain, chain[1:]))
    return path, chain[0]


def test_streamed_text_completes_characters(capsys, scripted_dir):
    """An emoji arrives as four byte tokens over four rounds; the stream must show it whole."""
    path, start = scripted_dir
    argv = ["generate", "--target", str(path), "--prompt-ids", f"1,{start}", "--max-new-tokens", "12",
            "--verifier", "ar"]
    code, out, err = _run(capsys, *argv, "--json")
    assert code == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    assert record["text"] == SCRIPTED.decode() and record["stop"] == "eos"
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    streamed, summary = out.rsplit("\n[tevjax] ", 1)
    assert streamed == record["text"] and "\ufffd" not in out
    assert summary.startswith(f"{len(record['tokens'])} tokens")


# The scripted answer is one token per byte, then the EOS: the kept tokens run to the one that
# completes the stop string.
@pytest.mark.parametrize("stops, text, stop, kept", [
    ([" "], "🙂", "stop", 5),
    (["é", "x"], "🙂 ", "stop", 7),  # é's two bytes are two tokens: the second completes it
    (["\\n", "é!"], "🙂 é", "eos", 8),  # "é" could begin "é!" until the EOS: held back, then shown
])
def test_stop_strings_cut_the_streamed_and_json_text(capsys, scripted_dir, stops, text, stop, kept):
    path, start = scripted_dir
    argv = ["generate", "--target", str(path), "--prompt-ids", f"1,{start}", "--max-new-tokens", "12",
            *(a for s in stops for a in ("--stop", s))]
    code, out, err = _run(capsys, *argv, "--json")
    assert code == 0, err
    record = json.loads(out.strip().splitlines()[-1])
    assert (record["text"], record["stop"]) == (text, stop)
    full = json.loads(_run(capsys, *argv[:-2 * len(stops)], "--json")[1].strip().splitlines()[-1])["tokens"]
    assert record["tokens"] == full[:kept] and len(full) == 8
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    assert out.rsplit("\n[tevjax] ", 1)[0] == text


def test_jsonl_rows_cut_at_their_own_stop_strings(capsys, scripted_dir, tmp_path):
    """A .jsonl record's "stop" replaces --stop for its prompt: three rows of one batch, each cut at
    its own strings (the union builds one automaton), the text and the stop reason per row as a
    single prompt with those --stop flags gives them."""
    path, start = scripted_dir
    f = tmp_path / "prompts.jsonl"
    rows = [{"prompt_ids": [1, start], "stop": [" "]}, {"prompt_ids": [1, start], "stop": ["é", "x"]},
            {"prompt_ids": [1, start]}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["generate", "--target", str(path), "--max-new-tokens", "12", "--json"]
    code, out, err = _run(capsys, *base, "--batch-file", str(f), "--batch-size", "3", "--stop", "x")
    assert code == 0, err
    got = [json.loads(line) for line in out.splitlines()]
    assert [(r["text"], r["stop"]) for r in got] == [("🙂", "stop"), ("🙂 ", "stop"), (SCRIPTED.decode(), "eos")]
    # --continuous refills rows with their own stop strings too.
    code, out, err = _run(capsys, *base, "--batch-file", str(f), "--batch-size", "2", "--stop", "x", "--continuous")
    assert code == 0, err
    flowing = sorted(map(json.loads, out.splitlines()), key=lambda r: r["index"])
    assert [(r["tokens"], r["text"], r["stop"]) for r in flowing] == [(r["tokens"], r["text"], r["stop"]) for r in got]
    for r, stops in zip(got, ([" "], ["é", "x"], ["x"])):
        code, out, err = _run(capsys, *base, "--prompt-ids", f"1,{start}", *(a for s in stops for a in ("--stop", s)))
        alone = json.loads(out.strip().splitlines()[-1])
        assert (r["tokens"], r["text"], r["stop"]) == (alone["tokens"], alone["text"], alone["stop"])
    f.write_text('{"prompt_ids": [1], "stop": "x"}\n')
    code, _, err = _run(capsys, *base, "--batch-file", str(f))
    assert code == 2 and 'line 1: "stop" must be a list of non-empty strings' in err, err


def test_stop_needs_a_tokenizer_and_reads_escapes(capsys, tiny_dir):
    from tevjax.cli import _stop_string

    assert [_stop_string(s) for s in ("a\\nb", "\\t\\r", "\\\\n", "\\q")] == ["a\nb", "\t\r", "\\n", "\\q"]
    code, _, err = _run(capsys, "generate", "--target", str(tiny_dir[0]), "--prompt-ids", "1,2", "--stop", "x",
                     "--max-new-tokens", "8")
    assert code == 2 and err.strip().splitlines()[-1] == ("tevjax: error: --stop needs the target's tokenizer, and "
                                                          "this target has none (no tokenizer.json)")
    assert "Traceback" not in err


@pytest.mark.slow
def test_smollm2_streams_emoji_as_the_json_text(capsys):
    """The reported case: SmolLM2 answering about emoji streamed U+FFFD where --json had them."""
    argv = ["generate", "--prompt", "🙂🚀 What do these emoji mean?", "--max-new-tokens", "12"]
    code, out, err = _run(capsys, *argv, "--json")
    assert code == 0, err
    text = json.loads(out.strip().splitlines()[-1])["text"]
    assert any(ord(c) > 0xFFFF for c in text)  # the answer holds a 4-byte character
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    assert out.rsplit("\n[tevjax] ", 1)[0] == text


def test_seed_high_bits_change_sampling(capsys, tiny_dir):
    """Seeds that differ only above bit 32 (or at the top of the 64-bit range) sample differently."""
    path, _ = tiny_dir
    argv = ["generate", "--target", str(path), "--prompt-ids", "1,2,3", "--max-new-tokens", "8",
            "--temperature", "1.0", "--verifier", "ar", "--json"]
    tokens = {}
    for seed in ("0", "4294967296", "18446744073709551615"):
        code, out, err = _run(capsys, *argv, "--seed", seed)
        assert code == 0, err
        tokens[seed] = json.loads(out.strip().splitlines()[-1])["tokens"]
    assert len({tuple(t) for t in tokens.values()}) == 3


def test_top_k_1_samples_the_greedy_text_and_greedy_notes_that_cuts_do_nothing(capsys, tiny_dir):
    """Sampling at temperature 1 from the one most probable token is greedy decoding, on the
    baseline and through the verifier: the same tokens, whatever the seed."""
    path, model = tiny_dir
    reference = Decoder(model, None, DecodeConfig(max_new_tokens=8, eos_ids=(2,))).generate([[1, 2, 3]])[0].tokens
    base = ["generate", "--target", str(path), "--prompt-ids", "1,2,3", "--max-new-tokens", "8", "--json"]
    for extra in (["--verifier", "ar"], ["--budget", "4"]):
        for seed in ("0", "7"):
            code, out, err = _run(capsys, *base, *extra, "--temperature", "1", "--top-k", "1", "--seed", seed)
            record = json.loads(out.strip().splitlines()[-1])
            assert code == 0 and record["tokens"] == reference, (extra, seed, err)
            assert (record["top_k"], record["top_p"], record["min_p"]) == (1, 1.0, 0.0)
            assert "change nothing when greedy" not in err
    code, out, err = _run(capsys, *base, "--verifier", "ar", "--top-p", "0.5")
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["tokens"] == reference
    assert "--top-k, --top-p and --min-p change nothing when greedy" in err


def test_batch_file_lines(tmp_path, capsys, tiny_dir):
    """Only newlines split prompts (a form feed or U+2028 stays inside its line), a byte-order mark is
    dropped, and every line is checked before any is generated; errors name the line and the file."""
    from tevjax.cli import build_parser, _read_prompts

    f = tmp_path / "prompts.txt"
    f.write_bytes("\ufeffone\x0cstill one\r\n\ntwo\u2028still two\n".encode("utf-8"))
    prompts, where, settings = _read_prompts(build_parser().parse_args(["generate", "--batch-file", str(f)]))
    assert prompts == ["one\x0cstill one", "two\u2028still two"] and settings == [{}, {}]
    assert where == [f"line 1 of {f}", f"line 3 of {f}"]

    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"fine\ncaf\xe9\n")
    code, _, err = _run(capsys, "generate", "--batch-file", str(bad))
    assert code == 2 and f"--batch-file '{bad}': not UTF-8 text (bad byte 0xe9 on line 2)" in err

    # A tokenizer-less target reads id prompts only, so check a too-long prompt through --prompt-ids
    # above (test_model_level_errors); here the budget alone exceeds the positions, refused before
    # the model is loaded and naming the budget.
    path, _ = tiny_dir
    code, _, err = _run(capsys, "generate", "--target", str(path), "--prompt-ids", "1,2", "--budget", "10000")
    assert code == 2 and "--budget 10000" in err and "exceeds the target's 64 positions" in err


def test_target_without_tokenizer_prints_ids(capsys, tiny_dir):
    path, _ = tiny_dir
    code, out, err = _run(capsys, "generate", "--target", str(path), "--prompt-ids", "1,2,3", "--max-new-tokens", "4",
                          "--verifier", "ar")
    assert code == 0, err
    ids = json.loads(out.strip().splitlines()[0])
    assert isinstance(ids, list) and len(ids) == 4 and all(isinstance(t, int) for t in ids)


def test_nonfinite_weights_fail_loudly(tmp_path, capsys, tiny_dir):
    """NaN weights are refused as they load, naming the tensor; finite weights whose logits
    overflow (a final-norm scale of 1e38 here) are refused when the first logits come out."""
    _, model = tiny_dir
    bad = random_model(model.cfg, seed=5)
    emb = bad.embed_tokens.embedding
    emb.set_value(emb.get_value() * jnp.nan)
    save_hf_target(bad, tmp_path / "nan")
    argv = ("--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--json")
    code, out, err = _run(capsys, "generate", "--target", str(tmp_path / "nan"), *argv)
    assert code == 2 and "tensor 'model.embed_tokens.weight' holds" in err and "non-finite value(s)" in err
    assert out == ""
    huge = random_model(model.cfg, seed=5)
    huge.norm.scale.set_value(jnp.full_like(huge.norm.scale.get_value(), 1e38))
    save_hf_target(huge, tmp_path / "huge")
    code, out, err = _run(capsys, "generate", "--target", str(tmp_path / "huge"), *argv)
    assert code == 2 and "produced non-finite logits for prompt 0 (--prompt-ids)" in err and out == ""


class _IdsTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _tiny_demo_models(monkeypatch, tiny_dir):
    """`tevjax demo` on the tiny random target (no SmolLM2 load): prompts become fixed id lists."""
    import tevjax.convert.tokenizer as tokenizer_mod
    import tevjax.loading as loading

    _, model = tiny_dir
    models = loading.LoadedModels(
        target_cfg=model.cfg, target=model, tokenizer=_IdsTokenizer(),
        drafter=loading.fresh_drafter(model.cfg, seed=1, block_size=4, mask_token_id=47),
        drafter_trained=False, eos_ids=(), notes=[])
    monkeypatch.setattr(loading, "load_models", lambda *a, **k: models)
    monkeypatch.setattr(tokenizer_mod, "chat_prompt_ids", lambda tok, text: [1 + len(text) % 40, 3, 5])


def _exit_law_tables(out: str) -> tuple[list[list[float]], list[list[float]], dict[str, list[float]]]:
    """Part 1 of the demo: its node table (node, depth, P, rho, w), its empirical table (node, w, one
    frequency per verifier) and its two summary rows."""
    lines = out.splitlines()
    nodes = lines.index("  node  token    depth   P(v)     rho(v)   w(v)")
    laws = next(i for i, x in enumerate(lines) if x.startswith("  node   exact w"))
    numbers = lambda x: [float(v) for v in re.findall(r"-?\d+\.?\d*", x)]  # noqa: E731
    node_rows = [numbers(x) for x in lines[nodes + 1:nodes + 11]]  # (the tokens are words, no digits)
    law_rows = [numbers(x) for x in lines[laws + 1:laws + 11]]
    summary = {x.split("  ")[1]: numbers(x.split("(")[0]) for x in lines[laws + 11:laws + 13]}
    return node_rows, law_rows, summary


def test_demo_times_interleaved_repeats_and_checks_losslessness(monkeypatch, capsys, tiny_dir):
    _tiny_demo_models(monkeypatch, tiny_dir)
    order = []  # which decoder each generate call ran: the methods alternate prompt by prompt and repeat by repeat
    real_generate = Decoder.generate
    monkeypatch.setattr(Decoder, "generate", lambda self, prompts, **kw: order.append(
        "ar" if self.dgd is None else "spec") or real_generate(self, prompts, **kw))
    code, out, err = _run(capsys, "demo", "--samples", "2000", "--max-new-tokens", "6", "--repeats", "2")
    assert code == 0, err
    assert order == ["spec", "ar", "ar", "spec", "spec", "ar"] + ["ar", "spec", "spec", "ar", "ar", "spec"]
    # Part 1's tables reconcile: w = P rho, each verifier's frequencies are a law, its mean block length
    # is that law's mean of depth + 1, and its total variation is half the L1 distance to w (to rounding).
    node_rows, law_rows, summary = _exit_law_tables(out)
    assert "sum w = 1.000000" in out
    for (node, depth, p, rho, w), (node2, w2, *_) in zip(node_rows, law_rows):
        assert node == node2 and w == w2 and abs(p * rho - w) < 2e-4, (node, p, rho, w)
    freqs = np.array([row[2:] for row in law_rows])  # [node, verifier]
    depth, w = np.array([row[1] for row in node_rows]), np.array([row[1] for row in law_rows])
    assert freqs.shape == (10, 3)
    np.testing.assert_allclose(freqs.sum(0), 1, atol=1e-3)
    np.testing.assert_allclose(summary["mean block length"], ((depth + 1)[:, None] * freqs).sum(0), atol=3e-3)
    np.testing.assert_allclose(summary["total variation to w"], 0.5 * np.abs(freqs - w[:, None]).sum(0), atol=1e-3)
    assert out.count("output identical to autoregressive greedy") == 3
    assert "median of 2 interleaved repeats, range" in out
    # The per-repeat line reconciles: each speedup is its repeat's rate ratio, and the headline is their median.
    line = next(x for x in out.splitlines() if x.startswith("overall, per interleaved repeat:"))
    spec, ar, sr = (list(map(float, re.findall(r"[\d.]+", part))) for part in
                    re.match(r".*DDTree\+TEV (.*) tok/s, AR (.*) tok/s, speedup (.*)x$", line).groups())
    assert len(spec) == len(ar) == len(sr) == 2
    for s_r, a_r, x in zip(spec, ar, sr):
        assert abs(s_r / a_r - x) < 0.01 + 0.06 * x  # rates are printed to 0.1 tok/s
    median = float(re.search(r"overall: speedup ([\d.]+)x", out).group(1))
    assert abs(median - sum(sr) / 2) < 0.006
    assert "UNTRAINED" in out


def test_demo_skip_models_runs_only_the_exit_laws(monkeypatch, capsys):
    import tevjax.demo_laws as demo_laws
    import tevjax.loading as loading

    calls = []
    monkeypatch.setattr(demo_laws, "main", lambda **kw: calls.append(kw))
    monkeypatch.setattr(loading, "load_models", lambda *a, **k: pytest.fail("--skip-models loaded a model"))
    code, out, err = _run(capsys, "demo", "--skip-models", "--samples", "7")
    assert code == 0, err
    assert calls == [dict(samples=7, temperature=1.0)] and "Part 2" not in out


def test_demo_tree_drawing():
    from tevjax.demo_laws import render_tree, synthetic_case

    tokens, parents, _ = synthetic_case()
    assert render_tree(tokens, parents, str) == [
        "0", "├── 1", "│   ├── 4", "│   │   ├── 7", "│   │   └── 8", "│   └── 5", "├── 2", "│   └── 6", "│       └── 9",
        "└── 3"]


def test_demo_synthetic_case_follows_its_seed():
    from tevjax.demo_laws import synthetic_case

    (tokens, parents, logits), (tokens1, parents1, logits1) = synthetic_case(0), synthetic_case(1)
    assert (tokens == tokens1).all() and (parents == parents1).all() and not np.allclose(logits, logits1)


def test_demo_laws_pass_their_settings_and_print_what_they_computed(monkeypatch, capsys):
    """`demo_laws.main` with stubs for the exact law (a w summing to 0.5, so that the printed sum is
    read, not assumed) and the verifiers (no compile of the real ones): the temperature reaches the
    law and every verifier, the seed the keys; each node row names its token's word; both ceilings
    are 1 + C_p."""
    from typing import NamedTuple

    import tevjax.demo_laws as demo_laws
    from tevjax.law import ExitLaw

    class Out(NamedTuple):
        exit_node: jax.Array
        num_tokens: jax.Array

    seen = {"law": [], "verify": [], "key": []}
    real_key = jax.random.key

    def law(tree, logits, temperature):
        seen["law"].append(temperature)
        n = len(logits)
        return ExitLaw(prefix_prob=np.ones(n), local_exit=np.ones(n), exit_prob=np.full(n, 0.5 / n),
                       coverage=np.float32(1.25))

    def verify(key, tree, logits, temperature, method):
        seen["verify"].append((temperature, method))
        return Out(jnp.int32(3), jnp.int32(2))  # every sample exits at node 3, after 2 tokens

    monkeypatch.setattr(demo_laws, "exit_law", law)
    monkeypatch.setattr(demo_laws, "verify", verify)
    monkeypatch.setattr(jax.random, "key", lambda seed, *a, **k: seen["key"].append(seed) or real_key(seed, *a, **k))
    demo_laws.main(samples=4, temperature=0.5, seed=1)
    out = capsys.readouterr().out
    assert seen["law"] == [0.5] and seen["verify"] == [(0.5, m) for m in demo_laws.VERIFIERS] and seen["key"] == [1]
    tokens = demo_laws.synthetic_case(1)[0]
    lines = out.splitlines()
    rows = lines[lines.index("  node  token    depth   P(v)     rho(v)   w(v)") + 1:][:len(tokens)]
    assert [row.split()[1] for row in rows] == [repr(demo_laws.WORDS[t]) for t in tokens]
    assert "sum w = 0.500000" in out
    assert "coverage C_p = 1.2500" in out and out.count("ceiling 1 + C_p = 2.2500") == 2
    assert "mean block length  " + "     2.0000" * len(demo_laws.VERIFIERS) in out


def test_demo_fails_when_outputs_differ(monkeypatch, capsys, tiny_dir):
    """A speculative output that differs from AR's is an error (non-zero exit, as `tevjax eval`), not
    only a line of text."""
    _tiny_demo_models(monkeypatch, tiny_dir)
    real_generate = Decoder.generate

    def corrupted(self, prompts, **kw):
        results = real_generate(self, prompts, **kw)
        if self.dgd is not None:  # the speculative decoder: change its first token
            results[0].tokens[0] = (results[0].tokens[0] + 1) % 48
        return results

    monkeypatch.setattr(Decoder, "generate", corrupted)
    code, out, err = _run(capsys, "demo", "--samples", "2000", "--max-new-tokens", "6", "--repeats", "1")
    assert code == 2
    assert out.count("DIFFERENT FROM") == 3
    assert "3 greedy outputs differ from autoregressive decoding" in err


def test_jsonl_records_are_checked_before_anything_loads():
    """A .jsonl record's own settings are refused as the flags would be: a length of 0, a min-p of 1
    (it would cut every token), JSON booleans for numbers; a --stop ending in a lone backslash keeps it."""
    from tevjax.cli import CliError, _jsonl_record, _stop_string, build_parser

    args = build_parser().parse_args(["generate", "--prompt-ids", "1", "--max-new-tokens", "8"])
    for record, message in [({"max_new_tokens": 0}, '"max_new_tokens" must be an integer in [1, 8]'),
                            ({"max_new_tokens": True}, '"max_new_tokens" must be an integer in [1, 8]'),
                            ({"min_p": 1}, '"min_p" must be a number in [0, 1) (0: off)'),
                            ({"top_p": 1.5}, '"top_p" must be a number in (0, 1] (1: off)'),
                            ({"top_k": True}, '"top_k" must be an integer >= 0'),
                            ({"top_p": True}, '"top_p" must be a number in (0, 1]'),
                            ({"temperature": False}, '"temperature" must be a finite float32 number >= 0'),
                            ({"prompt_ids": [1, -2]}, '"prompt_ids" must be a non-empty list of token ids >= 0')]:
        with pytest.raises(CliError, match=re.escape(f"line 3: {message}")):
            _jsonl_record(json.dumps({"prompt_ids": [1], **record}), "line 3", args)
    prompt, own = _jsonl_record('{"prompt_ids": [4], "max_new_tokens": 1, "min_p": 0.5, "top_k": 2, "stop": '
                                '["a", "a", "b"]}', "line 1", args)
    assert prompt == [4] and own == {"max_new_tokens": 1, "min_p": 0.5, "top_k": 2, "stop": ("a", "b")}
    assert [_stop_string(s) for s in ("a\\", "\\")] == ["a\\", "\\"]  # nothing to escape: kept


def test_generate_json_records_describe_each_prompt(capsys, tiny_dir, tmp_path):
    """`generate --json` over a batch file in batches of 2 and with --continuous: each record names
    its own prompt ("prompt" is None for token ids), its own length, and what decoded it (the
    baseline: no budget, chains, fallback or drafter); its tokens are the prompt's AR tokens alone."""
    path, model = tiny_dir
    ids = [[1, 5, 7], [1, 3], [6]]
    f = tmp_path / "prompts.jsonl"
    f.write_text(json.dumps({"prompt_ids": ids[0]}) + "\n" + json.dumps({"prompt_ids": ids[1], "max_new_tokens": 3})
                 + "\n" + json.dumps({"prompt_ids": ids[2]}) + "\n")
    decoder = Decoder(model, None, DecodeConfig(max_new_tokens=6, eos_ids=(2,)))
    want = [decoder.generate([p], max_new_tokens=[n])[0].tokens for p, n in zip(ids, (6, 3, 6))]
    base = ["generate", "--target", str(path), "--batch-file", str(f), "--max-new-tokens", "6", "--json"]
    for extra in ([], ["--continuous"]):
        code, out, err = _run(capsys, *base, "--verifier", "ar", "--batch-size", "2", *extra)
        assert code == 0, err
        records = sorted((json.loads(line) for line in out.splitlines()), key=lambda r: r["index"])
        assert [(r["index"], r["prompt"], r["prompt_ids"], r["tokens"], r["max_new_tokens"]) for r in records] == \
            [(i, None, p, w, n) for i, (p, w, n) in enumerate(zip(ids, want, (6, 3, 6)))], extra
        for r in records:
            assert (r["verifier"], r["budget"], r["lookup"], r["corpus"], r["fallback_below"], r["drafter_trained"],
                    r["plain_rounds"]) == ("ar", 0, 0, 0, 0.0, None, 0), r
    code, out, err = _run(capsys, *base, "--budget", "4", "--batch-size", "3")
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["tokens"] for r in records] == want
    assert {(r["verifier"], r["budget"], r["lookup"], r["drafter_trained"]) for r in records} == {("tev", 4, 4, False)}


def test_continuous_samples_each_prompt_as_one_batch_of_all_of_them(capsys, tiny_dir, tmp_path):
    """--continuous with 2 rows gives every prompt of a .jsonl file what one batch of all of them
    gives it (`Decoder.continuous`): the same --seed, and each record's own temperature, top-k and
    length reach the refilled rows."""
    path, _ = tiny_dir
    f = tmp_path / "prompts.jsonl"
    rows = [{"prompt_ids": [1, 5, 7], "temperature": 1}, {"prompt_ids": [1, 3], "temperature": 1, "max_new_tokens": 3},
            {"prompt_ids": [6], "temperature": 1, "top_k": 3}, {"prompt_ids": [4, 4]}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    base = ["generate", "--target", str(path), "--batch-file", str(f), "--max-new-tokens", "8", "--verifier", "ar",
            "--json"]

    def tokens(*extra):
        code, out, err = _run(capsys, *base, *extra)
        assert code == 0, err
        return {r["index"]: r["tokens"] for r in map(json.loads, out.splitlines())}

    one_batch = tokens("--batch-size", "4", "--seed", "9")
    assert tokens("--batch-size", "2", "--continuous", "--seed", "9") == one_batch
    assert len(one_batch[1]) <= 3
    assert tokens("--batch-size", "4", "--seed", "0") != one_batch  # the seed decides the sampled rows


def test_top_p_and_min_p_reach_the_decoder(capsys, tiny_dir):
    """A top-p so small, or a min-p so large, that only the most probable token is left samples the
    greedy tokens at temperature 1, on the baseline and through the verifier."""
    path, model = tiny_dir
    reference = Decoder(model, None, DecodeConfig(max_new_tokens=8, eos_ids=(2,))).generate([[1, 2, 3]])[0].tokens
    base = ["generate", "--target", str(path), "--prompt-ids", "1,2,3", "--max-new-tokens", "8", "--json",
            "--temperature", "1", "--seed", "7"]
    code, out, err = _run(capsys, *base, "--verifier", "ar")
    assert code == 0 and json.loads(out.strip().splitlines()[-1])["tokens"] != reference, err  # it does sample
    for extra, cut in ((["--verifier", "ar"], ["--top-p", "1e-6"]), (["--verifier", "ar"], ["--min-p", "0.999"]),
                       (["--budget", "4"], ["--min-p", "0.999"])):
        code, out, err = _run(capsys, *base, *extra, *cut)
        assert code == 0 and json.loads(out.strip().splitlines()[-1])["tokens"] == reference, (extra, cut, err)


def test_eval_hands_every_flag_to_evaluate(monkeypatch, capsys, tiny_dir, tmp_path):
    """`tevjax eval`'s flags reach `load_models`, `load_eval_prompts` and `evaluate` unchanged (both
    stand-ins here); greedy outputs that differ from AR's are an error after the result is printed."""
    import types

    import tevjax.evaluate as evaluate_mod
    import tevjax.loading as loading

    _, model = tiny_dir
    seen = {}
    # A stand-in corpus table: --corpus is refused without one.
    models = loading.LoadedModels(target_cfg=model.cfg, target=model, tokenizer=None, drafter=None,
                                  drafter_trained=False, eos_ids=(2,), notes=["from the stand-in"], ngrams=object())

    def load(target, drafter, **kw):
        seen["load"] = (target, drafter)
        return models

    def evaluate(m, texts, **kw):
        assert m is models
        seen["texts"], seen["kw"] = texts, kw
        return {"budgets": [], "mismatches": seen.get("mismatches", 0)}

    monkeypatch.setattr(loading, "load_models", load)
    monkeypatch.setattr(evaluate_mod, "evaluate", evaluate)
    f = tmp_path / "prompts.txt"
    f.write_text("a\nb\nc\nd\n")
    code, out, err = _run(capsys, "eval", "--target", "T", "--drafter", "D", "--prompts", str(f), "--num-prompts", "3",
                          "--budgets", "3,5", "--lookup", "2", "--corpus", "1", "--temperature", "0.5", "--top-k", "5",
                          "--top-p", "0.9", "--min-p", "0.05", "--verifier", "predraw", "--fallback-below", "1.5",
                          "--fallback-rounds", "3", "--max-new-tokens", "9", "--batch-size", "2", "--seed", "11",
                          "--json")
    assert code == 0, err
    assert seen["load"] == ("T", "D") and seen["texts"] == ["a", "b", "c"] and "note: from the stand-in" in err
    kw = seen["kw"]
    assert kw.pop("mesh") is None and callable(kw.pop("log"))
    assert kw == dict(budgets=(3, 5), temperature=0.5, top_k=5, top_p=0.9, min_p=0.05, verifier="predraw",
                      max_new_tokens=9, batch_size=2, seed=11, lookup=2, corpus=1, fallback_below=1.5,
                      fallback_rounds=3)
    assert json.loads(out) == {"budgets": [], "mismatches": 0, "prompts": str(f)}
    # The defaults: no chains asked for (each budget's own), no fallback (tau measures the trees).
    code, out, err = _run(capsys, "eval", "--prompts", str(f), "--json")
    assert code == 0 and seen["load"] == ("smollm2", None) and seen["texts"] == ["a", "b", "c", "d"], err
    assert {k: seen["kw"][k] for k in ("lookup", "corpus", "fallback_below", "fallback_rounds", "seed", "batch_size")} \
        == {"lookup": None, "corpus": None, "fallback_below": 0.0, "fallback_rounds": 4, "seed": 0, "batch_size": 1}
    # --seed also draws the gsm problems (reasoning-gym is a stand-in).
    gym = types.SimpleNamespace(create_dataset=lambda name, size, seed: [{"question": f"q{seed}"}] * size)
    monkeypatch.setitem(sys.modules, "reasoning_gym", gym)
    code, _, err = _run(capsys, "eval", "--prompts", "gsm", "--num-prompts", "2", "--seed", "4", "--json")
    assert code == 0 and seen["texts"] == ["q4", "q4"], err
    seen["mismatches"] = 2
    code, out, err = _run(capsys, "eval", "--prompts", str(f), "--json")
    assert code == 2 and json.loads(out)["mismatches"] == 2
    assert "2 greedy outputs differ from autoregressive decoding" in err


def test_dtype_reaches_the_target_and_the_drafter(monkeypatch, capsys, tiny_dir, tmp_path):
    """`generate --dtype`: the target and the drafter compute (and hold their weights) in it; without
    it the checkpoint's dtype, the drafter's included: a bfloat16 drafter beside a float32 target
    runs in float32 (it runs the target's embedding and LM head)."""
    from flax import nnx

    import tevjax.loading as loading
    from tevjax.convert.dflash_ckpt import save_dflash

    path, model = tiny_dir
    drafter = loading.fresh_drafter(model.cfg, seed=3, num_layers=1, block_size=6, mask_token_id=47)
    save_dflash(drafter, drafter.cfg, tmp_path / "drafter", dtype="bfloat16")
    real, loaded = loading.load_models, []
    monkeypatch.setattr(loading, "load_models", lambda *a, **k: loaded.append(real(*a, **k)) or loaded[-1])

    def dtypes(m):
        return {str(x.dtype) for x in jax.tree.leaves(nnx.state(m, nnx.Param))}, m.cfg.dtype

    argv = ["generate", "--target", str(path), "--drafter", str(tmp_path / "drafter"), "--prompt-ids", "1,2,3",
            "--max-new-tokens", "4", "--budget", "4", "--json"]
    for extra, want in (([], "float32"), (["--dtype", "bfloat16"], "bfloat16")):
        code, _, err = _run(capsys, *argv, *extra)
        assert code == 0, err
        assert dtypes(loaded[-1].target) == dtypes(loaded[-1].drafter) == ({want}, want), extra


def test_load_models_builds_a_fresh_drafter_for_the_targets_tokenizer(tmp_path):
    """Without a drafter directory (and no shipped one): a fresh drafter with seed 0 whose mask token
    is `mask_token_for`'s choice (here the first embedding row past the tokenizer's vocabulary), a
    note saying it is untrained, no corpus; the end-of-sequence ids are the config's and the
    tokenizer's. The baseline loads no drafter."""
    from flax import nnx

    from tevjax.loading import fresh_drafter, load_models

    vocab = len(tiny_vocab())
    model = random_model(tiny_config("llama", num_layers=4, max_position_embeddings=64, vocab_size=vocab + 4,
                                     eos_token_ids=(5,)), seed=2)
    save_hf_target(model, tmp_path / "t")
    write_tok_dir(tiny_meta(), tmp_path / "t")  # its end-of-sequence token is 2
    models = load_models(str(tmp_path / "t"))
    assert models.eos_ids == (2, 5) and models.ngrams is None and not models.drafter_trained
    assert models.drafter.cfg.mask_token_id == vocab
    assert any("UNTRAINED" in note and "seed 0" in note for note in models.notes), models.notes
    want = nnx.state(fresh_drafter(models.target_cfg, seed=0, mask_token_id=vocab), nnx.Param)
    for got, ref in zip(jax.tree.leaves(nnx.state(models.drafter, nnx.Param)), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
    ar = load_models(str(tmp_path / "t"), with_drafter=False)
    assert ar.drafter is None and not ar.drafter_trained and ar.eos_ids == (2, 5)
    assert not any("drafter" in note for note in ar.notes)


def test_the_position_limits_are_exact(capsys, tiny_dir):
    """The target's 64 positions hold the prompt, --max-new-tokens and a round's budget + 1 tree slots:
    a prompt that fills them exactly decodes, one token more is refused; without a prompt, the flags
    alone are refused (before the load) once they leave no room for a 1-token prompt."""
    path, _ = tiny_dir
    base = ["generate", "--target", str(path), "--budget", "4", "--json"]
    code, out, err = _run(capsys, *base, "--prompt-ids", ",".join(["3"] * 51), "--max-new-tokens", "8")
    assert code == 0 and len(json.loads(out.strip().splitlines()[-1])["tokens"]) <= 8, err  # 51 + 8 + 5 = 64
    code, _, err = _run(capsys, *base, "--prompt-ids", ",".join(["3"] * 52), "--max-new-tokens", "8")
    assert code == 2 and "prompt 0 (--prompt-ids) is 52 tokens" in err, err
    code, _, err = _run(capsys, *base, "--prompt-ids", "3", "--max-new-tokens", "59")
    assert code == 2 and "--max-new-tokens 59 + 5 tree slots (--budget 4 + root) need 65 positions" in err, err
    code, _, err = _run(capsys, *base[:3], *base[5:], "--prompt-ids", "3", "--max-new-tokens", "59", "--verifier", "ar")
    assert code == 0, err  # 1 + 59 + the next token's slot = 61 (no --budget: refused without a drafter)


def test_number_flags_take_their_bounds():
    """Each number flag accepts its bound itself and refuses the value just past it: the bounds are
    the documented ones (0 turns --lookup and --fallback-below off, a weight may be 1, a shard range
    may start at shard 0), and a trailing comma in a list is no extra entry."""
    import argparse

    from tevjax.cli import _float, _fraction, _int_list, _prompt_ids, _shard_range, _weight, build_parser

    args = build_parser().parse_args(["generate", "--prompt", "hi", "--lookup", "0", "--budget", "1",
                                      "--fallback-below", "0", "--top-p", "1", "--min-p", "0"])
    assert (args.lookup, args.budget, args.fallback_below, args.top_p, args.min_p) == (0, 1, 0.0, 1.0, 0.0)
    assert _weight("--distill")("1") == 1.0 and _float("--lr", 0.0, inclusive=True)("0") == 0.0
    assert _fraction("f", zero=True, one=True)("0") == 0.0 and _fraction("f", zero=True, one=True)("1") == 1.0
    assert _int_list("--budgets", 1)("1, 8,") == (1, 8) and _prompt_ids("0, 5,") == [0, 5]
    assert _shard_range("0:1") == (0, 1) and _shard_range("2:5") == (2, 5)
    for parse, text, message in [(_float("--join-timeout", 0.0, inclusive=False), "0", "finite number > 0.0"),
                                 (_weight("--distill"), "1.0001", "weight in [0, 1]"),
                                 (_int_list("--budgets", 1), ",", "--budgets is empty"),
                                 (_prompt_ids, " , ", "--prompt-ids is empty"),
                                 (_shard_range, "3:3", "0 <= FIRST < END"), (_shard_range, "-1:2", "0 <= FIRST < END"),
                                 (_shard_range, "4", "FIRST:END")]:
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
            parse(text)


def test_fallback_default_follows_the_rows_sampling_and_the_drafter():
    """--fallback-below 0 is "always speculate", not "the default"; without the flag, a CPU falls back
    when any row samples (a batch file's own temperatures included) or the drafter is untrained, and
    not for greedy rows with a trained drafter."""
    from types import SimpleNamespace

    from tevjax.cli import CPU_FALLBACK_BELOW, CliError, _fallback_below

    assert jax.default_backend() == "cpu"  # the tests' platform: the CPU defaults
    assert _fallback_below(SimpleNamespace(fallback_below=0.0, temperature=1.0), False) == 0.0
    assert _fallback_below(SimpleNamespace(fallback_below=2.5, temperature=0.0), True) == 2.5
    greedy, hot = SimpleNamespace(fallback_below=None, temperature=0.0), SimpleNamespace(fallback_below=None,
                                                                                        temperature=1.0)
    assert _fallback_below(greedy, True) == 0.0 and _fallback_below(greedy, False) == CPU_FALLBACK_BELOW
    assert _fallback_below(hot, True) == CPU_FALLBACK_BELOW
    assert _fallback_below(greedy, True, [0.0, 1.0]) == CPU_FALLBACK_BELOW  # one sampled row is enough
    assert _fallback_below(hot, True, [0.0, 0.0]) == 0.0  # the rows' own temperatures, not the flag's
    # --fallback-rounds given where that default is 0 would do nothing: refused, by its flag.
    given = SimpleNamespace(fallback_below=None, temperature=0.0, fallback_rounds=2, fallback_rounds_given=True)
    assert _fallback_below(given, False) == CPU_FALLBACK_BELOW
    with pytest.raises(CliError, match="--fallback-rounds 2 does nothing: --fallback-below defaults to 0 here"):
        _fallback_below(given, True)


def test_a_chain_may_fill_the_budget_and_greedy_notes_only_real_cuts(capsys):
    """--lookup / --corpus equal to --budget are accepted (one past it is not); the greedy note comes
    only when a truncation flag cuts something and the temperature is below GREEDY_BELOW."""
    from types import SimpleNamespace

    from tevjax.cli import CliError, _check_lookup, _note_truncation
    from tevjax.law import GREEDY_BELOW

    _check_lookup(SimpleNamespace(budget=4, lookup=4, corpus=4))
    with pytest.raises(CliError, match="--corpus 5 exceeds --budget 4"):
        _check_lookup(SimpleNamespace(budget=4, lookup=None, corpus=5))
    for t, cut, noted in [(0.0, dict(top_k=1), True), (0.0, {}, False), (GREEDY_BELOW, dict(top_k=1), False),
                          (1.0, dict(min_p=0.5), False)]:
        _note_truncation(SimpleNamespace(temperature=t, **{"top_k": 0, "top_p": 1.0, "min_p": 0.0, **cut}))
        assert ("change nothing when greedy" in capsys.readouterr().err) == noted, (t, cut)
    # A .jsonl row that samples at its own temperature uses the flags: no note.
    for rows, noted in [([0.0, 0.0], True), ([0.0, 1.0], False)]:
        _note_truncation(SimpleNamespace(temperature=0.0, top_k=1, top_p=1.0, min_p=0.0), rows)
        assert ("change nothing when greedy" in capsys.readouterr().err) == noted, rows


def test_batch_file_kinds_and_blank_lines(tmp_path):
    """A whitespace-only line is no prompt, a file of them is an error, and the .jsonl suffix is read
    whatever its case."""
    from tevjax.cli import CliError, _read_prompts, build_parser

    def read(name, text):
        f = tmp_path / name
        f.write_text(text)
        return _read_prompts(build_parser().parse_args(["generate", "--batch-file", str(f)]))

    prompts, where, _ = read("p.txt", "a\n \t \nb\n")
    assert prompts == ["a", "b"] and [w.split(" of ")[0] for w in where] == ["line 1", "line 3"]
    assert read("P.JSONL", '{"prompt_ids": [3]}\n')[0] == [[3]]
    with pytest.raises(CliError, match="holds no prompts"):
        read("blank.txt", "\n  \n")


def test_jsonl_record_bounds_and_types():
    """A record's own settings take the flags' bounds (a length equal to --max-new-tokens, top-p 1,
    min-p 0, token id 0, top-k up to int32) and refuse what the flags refuse (blank text, booleans as
    ids, an empty stop string, a record with no prompt); temperatures become floats."""
    from tevjax.cli import CliError, _jsonl_record, build_parser

    args = build_parser().parse_args(["generate", "--prompt-ids", "1", "--max-new-tokens", "8"])
    prompt, own = _jsonl_record('{"prompt_ids": [0, 5], "max_new_tokens": 8, "top_p": 1, "min_p": 0, "top_k": '
                                f'{2**31 - 1}, "temperature": 1}}', "line 1", args)
    assert prompt == [0, 5] and own == {"max_new_tokens": 8, "top_p": 1, "min_p": 0, "top_k": 2**31 - 1,
                                        "temperature": 1.0}
    assert isinstance(own["temperature"], float)
    for record, message in [({"temperature": 1}, 'give one of "prompt" (text) and "prompt_ids"'),
                            ({"prompt": " \n"}, '"prompt" must be non-empty text'),
                            ({"prompt_ids": [1, True]}, '"prompt_ids" must be a non-empty list of token ids'),
                            ({"prompt_ids": [1], "top_k": 2**31}, '"top_k" must be an integer >= 0'),
                            ({"prompt_ids": [1], "stop": ["a", ""]}, '"stop" must be a list of non-empty strings')]:
        with pytest.raises(CliError, match=re.escape(f"line 2: {message}")):
            _jsonl_record(json.dumps(record), "line 2", args)


def test_the_position_check_before_the_load_is_exact(tiny_dir):
    """`_check_positions` (the flags alone, a 1-token prompt): 64 positions hold 1 + 58 new tokens + 5
    tree slots, or 1 + 62 + the next token's slot without a drafter; one more is refused."""
    from types import SimpleNamespace

    from tevjax.cli import CliError, _check_positions

    target = str(tiny_dir[0])
    _check_positions(SimpleNamespace(target=target, budget=4, max_new_tokens=58), speculative=True)
    _check_positions(SimpleNamespace(target=target, budget=4, max_new_tokens=62), speculative=False)
    with pytest.raises(CliError, match="need 65 positions"):
        _check_positions(SimpleNamespace(target=target, budget=4, max_new_tokens=63), speculative=False)


class _FakeTokenizer:
    """What `_encode` / `_decode` use of a transformers tokenizer; records how it was called."""
    chat_template = None
    name_or_path = "/models/x"

    def __init__(self):
        self.calls = []

    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids, **kw):
        self.calls.append(kw)
        return "".join(map(chr, ids))


def test_encode_keeps_id_prompts_and_decode_skips_special_tokens():
    """Id prompts pass through beside text prompts, a chat needs the tokenizer's template (the error
    says to use --no-chat), decoding drops special tokens, and without a tokenizer the ids are the text."""
    from types import SimpleNamespace

    from tevjax.cli import CliError, _decode, _encode, _plain_text

    tok = _FakeTokenizer()
    models = SimpleNamespace(tokenizer=tok)
    assert _encode(models, [[5, 6], "hi"], chat=False) == [[5, 6], [104, 105]]
    with pytest.raises(CliError, match=r"x/tokenizer_config.json has no 'chat_template'\): use --no-chat"):
        _encode(models, ["hi"], chat=True)
    assert _encode(SimpleNamespace(tokenizer=None), [[7]], chat=True) == [[7]]  # ids need no tokenizer
    assert _decode(models, [104, 105]) == "hi" and tok.calls == [{"skip_special_tokens": True}]
    assert _decode(SimpleNamespace(tokenizer=None), [1, 2]) == "[1, 2]"
    assert _plain_text(SimpleNamespace(plain_rounds=0)) == ""
    assert _plain_text(SimpleNamespace(plain_rounds=3)) == ", 3 of them plain"


def test_main_exit_codes_debug_and_the_job_abort(monkeypatch, capsys):
    """An expected error exits 2, an unexpected one 1 with its type and a pointer to --debug, which
    re-raises either instead; both end a multi-host job (`abort_job`, a no-op alone) with that code.
    Exactly 32 distinct stop strings are allowed (the run gets as far as the missing target)."""
    from types import SimpleNamespace

    from tevjax import cli, multihost

    aborts = []
    monkeypatch.setattr(multihost, "abort_job", lambda why, code: aborts.append((why, code)))
    code, _, err = _run(capsys, "generate", "--prompt", " ")
    assert code == 2 and err == "tevjax: error: --prompt is empty\n" and aborts == [("--prompt is empty", 2)]
    with pytest.raises(cli.CliError, match="--prompt is empty"):
        main(["--debug", "generate", "--prompt", " "])

    def boom(args):
        raise RuntimeError("boom")

    monkeypatch.setattr(cli, "_read_prompts", boom)
    code, _, err = _run(capsys, "generate", "--prompt", "hi")
    assert code == 1 and "internal error: RuntimeError: boom (rerun with --debug" in err
    assert aborts[-1] == ("RuntimeError: boom", 1)
    with pytest.raises(RuntimeError, match="boom"):
        main(["--debug", "generate", "--prompt", "hi"])
    monkeypatch.undo()
    # Without --mesh or a job: no mesh, or (train's default) one over every device.
    flags = dict(mesh=None, coordinator=None, num_processes=None, process_id=None, join_timeout=None,
                 heartbeat_timeout=None)
    assert cli._mesh(SimpleNamespace(**flags), default_all=False) is None
    assert cli._mesh(SimpleNamespace(**flags), default_all=True).size == jax.device_count()
    code, _, err = _run(capsys, "generate", "--prompt", "hi", "--target", "/no/such/model",
                        *(a for i in range(32) for a in ("--stop", f"s{i}")))
    assert code == 2 and "--target '/no/such/model': not a directory" in err, err


def test_spaces_inside_a_list_entry_are_an_error():
    """--prompt-ids and the integer lists allow spaces around an entry but not inside one: "1 2" is a
    mistyped list, not the id 12."""
    import argparse

    from tevjax.cli import _int_list, _prompt_ids

    assert _prompt_ids(" 1 , 2 ") == [1, 2] and _int_list("--budgets", 1)("4, 8") == (4, 8)
    for parse, text in ((_prompt_ids, "1 2"), (_int_list("--budgets", 1), "4 8")):
        with pytest.raises(argparse.ArgumentTypeError, match="comma-separated integers"):
            parse(text)


def test_a_repeated_list_entry_is_an_error():
    """--taps 1,1 would tap one layer twice (a drafter reading it twice; `tevjax data` wrote its plan,
    then failed), and --budgets 8,8 measured budget 8 once: a repeated entry is refused."""
    import argparse

    from tevjax.cli import _int_list

    assert _int_list("--taps", 0)("3,1") == (3, 1)
    for name, text, twice in (("--taps", "1, 3,1", 1), ("--budgets", "8,8", 8)):
        with pytest.raises(argparse.ArgumentTypeError, match=f"{name} lists {twice} twice"):
            _int_list(name, 0)(text)


def test_batch_files_that_would_be_misread_are_refused(tmp_path):
    """A .jsonl record with a key given twice (JSON keeps the last, in silence) and a .json batch file
    (read as text, each of its lines a prompt) are errors naming the file."""
    from tevjax.cli import CliError, _read_prompts, build_parser

    def read(name, text):
        f = tmp_path / name
        f.write_text(text)
        return _read_prompts(build_parser().parse_args(["generate", "--batch-file", str(f)]))

    with pytest.raises(CliError, match='line 2: key "temperature" appears twice'):
        read("p.jsonl", '{"prompt_ids": [3]}\n{"prompt_ids": [3], "temperature": 0, "temperature": 1}\n')
    with pytest.raises(CliError, match=r"p.json'.*a \.json file.*\.jsonl"):
        read("p.json", '[{"prompt": "a"}]\n')
