"""`tevjax.evaluate.evaluate` on a tiny random target and drafter: every method decodes every
prompt once, interleaved; tau, tokens, SR and its spread are consistent with the generations, and
greedy speculative outputs equal the autoregressive ones."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

from tevjax.builder import ngram_table
from tevjax.decode.engine import DecodeConfig, Decoder
from tevjax.evaluate import evaluate, format_table
from tevjax.loading import LoadedModels
from tevjax.models.dflash import DFlashConfig, DFlashDrafter
from tevjax.testing import random_model, tiny_config


class _CharTokenizer:
    """A test double with a chat template: one token per character (ids 3..)."""

    chat_template = "x"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return "".join(m["content"] for m in messages) + ">"

    def encode(self, text, add_special_tokens=False):
        return [3 + (ord(c) % 200) for c in text]


class _Clock:
    """`time` for `tevjax.evaluate`: each timed generate call lasts the next of `durations` seconds
    (cycling), so the reported speedups are known numbers."""

    def __init__(self, durations):
        self.now, self.calls, self.durations = 0.0, 0, durations

    def perf_counter(self):
        if self.calls % 2:  # the end of a timed call
            self.now += self.durations[(self.calls // 2) % len(self.durations)]
        self.calls += 1
        return self.now


def test_evaluate_interleaves_methods_and_reports_consistent_numbers(monkeypatch):
    import tevjax.evaluate

    # Calls in the rotated order: batch 0 runs ar, 2, 5; batch 1 runs 2, 5, ar.
    monkeypatch.setattr(tevjax.evaluate, "time", _Clock([1.0, 0.5, 0.25, 0.4, 2.0, 0.8]))
    target = random_model(tiny_config(num_layers=4), seed=0)
    dcfg = DFlashConfig.for_target(target.cfg, num_layers=1, block_size=6, mask_token_id=5, target_layer_ids=(1, 3))
    drafter = DFlashDrafter(dcfg, rngs=nnx.Rngs(0))
    models = LoadedModels(target_cfg=target.cfg, target=target, tokenizer=_CharTokenizer(), drafter=drafter,
                          drafter_trained=False, eos_ids=(2,), notes=[])
    texts = ["hello there", "some prompt"]
    lines = []
    result = evaluate(models, texts, budgets=(2, 5), max_new_tokens=12, batch_size=1, log=lines.append)
    assert result["mismatches"] == 0 and len(result["budgets"]) == 2 and result["num_prompts"] == 2
    ar = Decoder(target, None, DecodeConfig(max_new_tokens=12, eos_ids=(2,)))
    want = sum(len(g.tokens) for g in ar.generate([_CharTokenizer().encode(t + ">") for t in texts]))
    assert result["ar"]["tokens"] == want
    for row in result["budgets"]:
        assert row["tokens"] == want  # greedy: the same tokens, so the same count
        assert 1.0 <= row["tau"] <= 6.0
        # Per-prompt counts, in prompt order: they give the pooled tau back, and its standard error.
        emitted, rounds = np.array(row["prompt_emitted"]), np.array(row["prompt_rounds"])
        assert emitted.shape == rounds.shape == (2,) and np.all(rounds >= 1) and np.all(emitted >= rounds)
        assert np.isclose(row["tau"], emitted.sum() / rounds.sum())
        d = emitted / emitted.sum() - rounds / rounds.sum()
        assert np.isclose(row["tau_se"], row["tau"] * np.sqrt(2 * np.sum(d * d)))
        # The spread of the prompts' own taus: the sample standard deviation (n - 1).
        assert row["tau_prompt_sd"] == pytest.approx(np.std(emitted / rounds, ddof=1))
        lo, hi = row["sr_range"]
        assert 0 < lo <= hi and np.isfinite(row["sr"])
        # SR is the ratio of per-token times over all batches.
        assert np.isclose(row["sr"], (result["ar"]["seconds"] / want) / (row["seconds"] / row["tokens"]))
    # Both batches have the same tokens in every method (greedy), so a batch's speedup is AR's time
    # over the method's: budget 2 took half of AR's time in both; budget 5 was 4x and 0.4x of AR.
    assert result["ar"]["seconds"] == pytest.approx(1.8)
    b2, b5 = result["budgets"]
    assert b2["seconds"] == pytest.approx(0.9) and b2["sr"] == pytest.approx(2.0)
    assert b2["sr_range"] == pytest.approx([2.0, 2.0])
    assert b5["sr"] == pytest.approx(1.8 / 2.25)
    assert b5["sr_range"] == pytest.approx([0.4 + 0.1 * 3.6, 0.4 + 0.9 * 3.6])  # 10th / 90th percentiles
    assert [row["lookup"] for row in result["budgets"]] == [2, 5]  # default: a chain as long as the budget
    assert [row["corpus"] for row in result["budgets"]] == [0, 0]  # no n-gram table: no corpus chain
    table = format_table(result)
    assert "| 2 | 2 | 0 |" in table and "| 5 | 5 | 0 |" in table and "yes" in table
    capped = evaluate(models, texts[:1], budgets=(2, 5), max_new_tokens=12, lookup=3, log=lines.append)
    assert [row["lookup"] for row in capped["budgets"]] == [2, 3] and capped["mismatches"] == 0
    assert [row["tau_se"] for row in capped["budgets"]] == [None, None]  # one prompt: no spread to measure
    row = result["budgets"][0]
    # Two prompts: the band's quantile is t with 1 df (12.706), not the normal 1.96.
    lo, hi = row["tau"] - 12.706204736174694 * row["tau_se"], row["tau"] + 12.706204736174694 * row["tau_se"]
    assert f"| {row['tau']:.3f} [{max(lo, 1.0):.3f}, {hi:.3f}] |" in table
    # A round emits at least one token: the band stops at tau = 1.
    wide = {**result, "num_prompts": 300, "budgets": [{k: v for k, v in row.items() if not k.startswith("prompt_")}
                                                       | {"tau": 1.1, "tau_se": 0.2}]}
    assert "| 1.100 [1.000, 1.494] |" in format_table(wide)  # t with 299 df: 1.968
    with pytest.raises(ValueError, match="lookup must be >= 0 or None"):
        evaluate(models, texts, budgets=(2,), lookup=-1)
    with pytest.raises(ValueError, match="corpus must be >= 0 or None"):
        evaluate(models, texts, budgets=(2,), corpus=-1)
    # With a table (the AR answers themselves) the corpus chain defaults to the budget, capped by `corpus`.
    answers = [_CharTokenizer().encode(t + ">") + g.tokens for t, g in
               zip(texts, ar.generate([_CharTokenizer().encode(t + ">") for t in texts]))]
    ngrams = ngram_table(np.concatenate(answers), np.cumsum([0] + [len(a) for a in answers]), np.zeros(2, int),
                         min_count=1)
    with_table = dataclasses.replace(models, ngrams=ngrams)
    corpus = evaluate(with_table, texts, budgets=(2, 5), max_new_tokens=12, corpus=4, log=lines.append)
    assert [row["corpus"] for row in corpus["budgets"]] == [2, 4] and corpus["mismatches"] == 0
    assert sum(r["tau"] for r in corpus["budgets"]) > sum(r["tau"] for r in result["budgets"])


def test_a_damaged_heldout_file_is_named(tmp_path):
    """`--prompts heldout:DIR` reads DIR/heldout.jsonl: an empty file, a line that is not JSON, a
    record without its text and bytes that are not UTF-8 are each an error naming the file."""
    from tevjax.evaluate import HELDOUT_FILE, load_eval_prompts

    path = tmp_path / HELDOUT_FILE
    spec = f"heldout:{tmp_path}"
    for content, message in ((b"\n\n", "holds no prompts"), (b'{"text": "a"}\n{bad\n', "line 2: not JSON"),
                             (b"[1]\n", 'line 1: not an object with a non-empty "text"'),
                             (b'{"x": 1}\n', 'line 1: not an object with a non-empty "text"'),
                             (b'{"text": " \\n"}\n', 'line 1: not an object with a non-empty "text"'),
                             (b'{"text": "\xff"}\n', "is not UTF-8 text")):
        path.write_bytes(content)
        with pytest.raises(ValueError, match=message) as e:
            load_eval_prompts(spec, 4)
        assert str(path) in str(e.value)
    path.write_bytes(b'{"text": "first"}\n\n{"text": "second", "id": 7}\n')
    assert load_eval_prompts(spec, 4) == ["first", "second"]
    assert load_eval_prompts(spec, 1) == ["first"]
    # Plain "heldout" reads the packaged file, the shipped drafter's held-out prompts.
    shipped = Path(__file__).resolve().parents[1] / "tevjax" / "assets" / HELDOUT_FILE
    want = [json.loads(line)["text"] for line in shipped.read_text(encoding="utf-8").split("\n")[:2]]
    assert load_eval_prompts("heldout", 2) == want
    (tmp_path / "p.txt").write_bytes(b"ok\n\xff\n")
    with pytest.raises(ValueError, match="p.txt is not UTF-8 text"):
        load_eval_prompts(str(tmp_path / "p.txt"), 4)
    # A JSON file given as a prompt file would be measured on its lines of JSON text.
    with pytest.raises(ValueError, match=r"heldout.jsonl' is JSON, not a text file .*heldout:DIR"):
        load_eval_prompts(str(path), 4)


def test_prompt_sets_take_evenly_spaced_items_across_the_whole_source():
    """`--prompts mtbench` / `humaneval`: n items at indices floor(i * N / n), so a small sample spans
    MT-Bench's eight categories and the whole HumanEval file; MT-Bench gives each question's first turn,
    HumanEval each stub inside its instruction. n >= N gives every item once."""
    import gzip
    import json

    from tevjax.prompts import (_HUMANEVAL_FILE, _MTBENCH_FILE, HUMANEVAL_INSTRUCTION, _package_file, humaneval,
                                mtbench)

    rows = [json.loads(line) for line in _package_file(*_MTBENCH_FILE, "").read_text().splitlines() if line.strip()]
    got = mtbench(3)  # 80 // 3 is not 80 / 3: a spacing of 26 would end at index 52, not 53
    assert [p.text for p in got] == [rows[i]["turns"][0] for i in (0, 26, 53)]
    assert [p.id for p in got] == [f"mtbench/{rows[i]['question_id']} {rows[i]['category']}" for i in (0, 26, 53)]
    assert len({p.id.split()[1] for p in mtbench(8)}) == 8  # one per category
    assert len(mtbench(1000)) == len(rows) == 80
    with gzip.open(_package_file(*_HUMANEVAL_FILE, ""), "rt", encoding="utf-8") as f:
        stubs = [json.loads(line) for line in f if line.strip()]
    got = humaneval(5)
    assert [p.id for p in got] == [stubs[i]["task_id"] for i in (0, 32, 65, 98, 131)]
    assert got[1].text == HUMANEVAL_INSTRUCTION.format(prompt=stubs[32]["prompt"])
    assert len(humaneval(1000)) == 164


def test_gsm_prompts_are_drawn_with_the_given_seed(monkeypatch):
    """`--prompts gsm --seed S` draws reasoning-gym's gsm_symbolic problems with seed S (through
    `load_eval_prompts` and `load_prompt_sets`); the package is a stand-in here."""
    import sys
    import types

    from tevjax.evaluate import load_eval_prompts
    from tevjax.prompts import load_prompt_sets

    calls = []

    def create_dataset(name, size, seed):
        calls.append((name, size, seed))
        return [{"question": f"q{seed}-{i}"} for i in range(size)]

    monkeypatch.setitem(sys.modules, "reasoning_gym", types.SimpleNamespace(create_dataset=create_dataset))
    assert load_eval_prompts("gsm", 2, seed=5) == ["q5-0", "q5-1"]
    sets = load_prompt_sets(["gsm"], 3, seed=7)
    assert [p.id for p in sets["gsm"]] == ["gsm/0 (seed 7)", "gsm/1 (seed 7)", "gsm/2 (seed 7)"]
    assert calls == [("gsm_symbolic", 2, 5), ("gsm_symbolic", 3, 7)]
    with pytest.raises(ValueError, match="unknown prompt set 'gms'"):
        load_prompt_sets(["gms"], 1)


class _ScriptedDecoder:
    """A stand-in for `Decoder` in `evaluate`: each method's generation of each prompt (told apart
    by length) is scripted, so a row's statistics are known numbers; nothing compiles."""

    AR = {3: [7] * 15, 5: [8] * 8}  # prompt length -> the autoregressive tokens
    # (budget, prompt length) -> (tokens, rounds, plain rounds, verified tokens cut from the last block);
    # budget 4 ends prompt 1 otherwise, one token longer, and cuts 2 tokens of prompt 0's last block.
    SPEC = {(2, 3): ([7] * 15, 11, 3, 0), (2, 5): ([8] * 8, 4, 1, 0), (4, 3): ([7] * 15, 5, 0, 2),
            (4, 5): ([8] * 7 + [9, 9], 2, 0, 0)}

    def __init__(self, target, drafter, cfg, mesh=None, ngrams=None):
        self.drafter, self.cfg = drafter, cfg

    def compile(self, batch):
        pass

    def generate(self, batch, seed=0, first_row=0):
        from types import SimpleNamespace

        out = []
        for p in batch:
            if self.drafter is None:
                tokens, rounds, plain, cut = self.AR[len(p)], len(self.AR[len(p)]), 0, 0
            else:
                tokens, rounds, plain, cut = self.SPEC[(self.cfg.budget, len(p))]
            # tau as the decoder computes it (whole verified blocks): a float whose product with rounds
            # need not be an integer (15 / 11 * 11 = 14.999...), so the emitted count must be rounded.
            out.append(SimpleNamespace(tokens=tokens, rounds=rounds, tau=(len(tokens) + cut) / rounds,
                                       plain_rounds=plain))
        return out


def test_evaluate_rows_follow_the_per_prompt_counts(monkeypatch):
    """With scripted generations: per-prompt emitted tokens and rounds in prompt order, the pooled
    tau and its delta-method SE from them, the fallback columns (plain rounds; the drafted rounds'
    own tau), greedy mismatches counted per budget and in total (none counted when sampling), and
    lookup / corpus 0 accepted; a batch's SR is per token of each method's own count."""
    from types import SimpleNamespace

    import tevjax.decode.engine
    import tevjax.evaluate
    from tevjax.evaluate import truncation_text

    monkeypatch.setattr(tevjax.decode.engine, "Decoder", _ScriptedDecoder)
    monkeypatch.setattr(tevjax.evaluate, "time", _Clock([1.0]))  # every generate call takes 1 s
    models = SimpleNamespace(tokenizer=_CharTokenizer(), eos_ids=(2,), target=None, drafter="drafter", ngrams=None,
                             drafter_trained=True)
    result = evaluate(models, ["ab", "abcd"], budgets=(2, 4), batch_size=1, lookup=0, corpus=0, fallback_below=1.5,
                      log=lambda _: None)
    b2, b4 = result["budgets"]
    # The prompt texts' digest, for pairing two runs by prompt (`compare_evals`): order matters.
    from tevjax.evaluate import prompts_digest

    assert result["prompts_sha256"] == prompts_digest(["ab", "abcd"]) != prompts_digest(["abcd", "ab"])
    assert (b2["prompt_emitted"], b2["prompt_rounds"]) == ([15, 8], [11, 4])
    assert (b4["prompt_emitted"], b4["prompt_rounds"], b4["prompt_tokens"]) == ([17, 9], [5, 2], [15, 9])
    assert b2["tau"] == pytest.approx(23 / 15) and b4["tau"] == pytest.approx(26 / 7)
    # Output tokens per round: the last block cut at the prompt's end counts only what was output.
    assert b2["tau_out"] == pytest.approx(23 / 15) and b4["tau_out"] == pytest.approx(24 / 7)
    t, r4 = np.array([15, 9]), np.array([5, 2])
    d4 = t / t.sum() - r4 / r4.sum()
    assert b4["tau_out_se"] == pytest.approx(24 / 7 * np.sqrt(2 * np.sum(d4 * d4)))
    e, r = np.array([15, 8]), np.array([11, 4])
    d = e / e.sum() - r / r.sum()  # each prompt's influence; n / (n - 1) = 2 for two prompts
    assert b2["tau_se"] == pytest.approx(23 / 15 * np.sqrt(2 * np.sum(d * d)))
    assert b2["tau_prompt_sd"] == pytest.approx(np.std([15 / 11, 2.0], ddof=1))
    assert (b2["plain_rounds"], b2["tau_drafted"]) == (4, pytest.approx((23 - 4) / (15 - 4)))
    assert (b4["plain_rounds"], b4["tau_drafted"]) == (0, pytest.approx(26 / 7))
    assert [b2["lookup"], b4["lookup"], b2["corpus"]] == [0, 0, 0]
    assert (b2["mismatches"], b4["mismatches"], result["mismatches"]) == (0, 1, 1)
    assert result["ar"]["tokens"] == b2["tokens"] == 23 and b4["tokens"] == 24
    # Batch SRs: (1 s / 15) / (1 s / 15) and (1 s / 8) / (1 s / 9); over all batches, (2 s / 23) / (2 s / 24).
    assert b4["sr"] == pytest.approx(24 / 23) and b4["sr_range"] == pytest.approx([1 + 0.1 / 8, 1 + 0.9 / 8])
    sampled = evaluate(models, ["ab", "abcd"], budgets=(2, 4), temperature=0.5, log=lambda _: None)
    assert [row["mismatches"] for row in sampled["budgets"]] == [None, None] and sampled["mismatches"] == 0
    # The table's first line names only the truncations that are on.
    assert "top-" not in format_table(result).splitlines()[0] and "min-p" not in format_table(result)
    assert truncation_text(50, 0.9) == ", top-k 50, top-p 0.9" and truncation_text(min_p=0.1) == ", min-p 0.1"
