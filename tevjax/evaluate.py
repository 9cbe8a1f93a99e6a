"""`tevjax eval`: tau, tokens/s and speedup against autoregressive decoding, measured in one run.

The same prompts are decoded autoregressively (`Decoder` without a drafter: same target, cache and
sampler) and, for each budget, with the drafter + DDTree + the chosen verifier. The methods run
interleaved batch by batch (AR and every budget back to back on each batch, in an order rotated
per batch), so machine noise hits them alike; compilation is excluded from every timing.
SR = AR seconds per token / method seconds per token over all batches; `sr_range` is the 10-90%
range of the per-batch SRs (the spread a shared machine adds). At temperature 0 every
speculative output must equal the autoregressive one (a mismatch is counted and reported: it
would mean the decoder is not exact).
"""

from __future__ import annotations

import hashlib
import json
import platform
import time
from importlib import resources
from pathlib import Path
from typing import Callable

import numpy as np

from tevjax import stats

__all__ = ["evaluate", "format_table", "load_eval_prompts", "HELDOUT_FILE"]

# The held-out ShareGPT prompts of the shipped drafter's data (never trained on).
HELDOUT_FILE = "heldout.jsonl"


def _read_text(path: Path, spec: str) -> str:
    try:
        # A byte-order mark (Notepad's UTF-8) is not part of the first prompt, as in generate's --batch-file.
        return path.read_text(encoding="utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise ValueError(f"--prompts {spec}: {path} is not UTF-8 text ({e})") from None


def load_eval_prompts(spec: str, n: int, *, seed: int = 0) -> list[str]:
    """Prompt texts for `spec`: heldout (the shipped drafter's held-out prompts), heldout:DATA_DIR,
    mtbench, humaneval, gsm, or a text file with one prompt per line."""
    from tevjax.prompts import DATASETS, load_prompt_sets

    if spec == "heldout" or spec.startswith("heldout:"):
        if spec == "heldout":
            path = resources.files("tevjax").joinpath("assets", HELDOUT_FILE)
        else:
            path = Path(spec.split(":", 1)[1]) / HELDOUT_FILE
        if not path.is_file():
            raise FileNotFoundError(f"--prompts {spec}: {path} does not exist")
        texts = []
        for i, line in enumerate(_read_text(path, spec).split("\n")):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"--prompts {spec}: {path}, line {i + 1}: not JSON ({e})") from None
            if not isinstance(row, dict) or not isinstance(row.get("text"), str) or not row["text"].strip():
                raise ValueError(f"--prompts {spec}: {path}, line {i + 1}: not an object with a non-empty \"text\"")
            texts.append(row["text"])
        if not texts:
            raise ValueError(f"--prompts {spec}: {path} holds no prompts")
        return texts[:n]
    if spec in DATASETS:
        return [p.text for p in load_prompt_sets([spec], n, seed=seed)[spec]]
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"--prompts {spec!r}: not a file and not one of heldout, {', '.join(DATASETS)}")
    if path.suffix.lower() in (".json", ".jsonl"):  # each line of JSON would be measured as a prompt's text
        raise ValueError(f"--prompts {spec!r} is JSON, not a text file (one prompt per line); a data directory's "
                         f"{HELDOUT_FILE} is read with heldout:DIR")
    lines = [ln for ln in _read_text(path, spec).split("\n") if ln.strip()]
    if not lines:
        raise ValueError(f"--prompts {spec!r} holds no prompts")
    return lines[:n]


def evaluate(models, texts: list[str], *, budgets=(4, 8, 16, 32), temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0, verifier: str = "tev",
             max_new_tokens: int = 128, batch_size: int = 1, seed: int = 0,
             lookup: int | None = None, corpus: int | None = None, fallback_below: float = 0.0,
             fallback_rounds: int = 4, log: Callable[[str], None] = print, mesh=None) -> dict:
    """Measures AR and speculative decoding on the same prompts (on `mesh`'s devices if given);
    returns a JSON-ready dict. `lookup`: the context-lookup chain length (`DecodeConfig.lookup`),
    capped at each budget; None: the budget itself; 0: the drafter's trees alone. `corpus`: the
    corpus-lookup chain length (`DecodeConfig.corpus`), likewise, where `models.ngrams` is a table
    (None without one: off). `fallback_below` / `fallback_rounds`: `DecodeConfig`'s (0: off); with
    them tau counts the plain rounds too, and each row also gives the plain rounds and the tau of
    the drafted rounds alone."""
    for name, value in (("lookup", lookup), ("corpus", corpus)):
        if value is not None and value < 0:
            raise ValueError(f"{name} must be >= 0 or None, got {value}")
    from tevjax.convert.tokenizer import chat_prompt_ids
    from tevjax.decode.engine import DecodeConfig, Decoder
    from tevjax.law import is_greedy

    if models.tokenizer is None:
        raise ValueError("this target has no tokenizer: evaluation prompts are text")
    prompts = [chat_prompt_ids(models.tokenizer, t) for t in texts]
    batches = [prompts[s: s + batch_size] for s in range(0, len(prompts), batch_size)]
    base = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, max_new_tokens=max_new_tokens,
                eos_ids=models.eos_ids)
    methods = {"ar": Decoder(models.target, None, DecodeConfig(**base), mesh=mesh)}  # no drafter: autoregressive
    for budget in budgets:
        methods[int(budget)] = Decoder(models.target, models.drafter,
                                       DecodeConfig(verifier=verifier, budget=int(budget),
                                                    lookup=lookup_for(int(budget), lookup),
                                                    corpus=corpus_for(int(budget), corpus, models.ngrams),
                                                    fallback_below=fallback_below, fallback_rounds=fallback_rounds,
                                                    **base),
                                       mesh=mesh, ngrams=models.ngrams)
    gens = {m: [] for m in methods}
    secs = {m: np.zeros(len(batches)) for m in methods}
    toks = {m: np.zeros(len(batches)) for m in methods}
    names = list(methods)
    for i, batch in enumerate(batches):
        for m in names[i % len(names):] + names[: i % len(names)]:  # rotated order
            methods[m].compile(batch)
            t0 = time.perf_counter()
            out = methods[m].generate(batch, seed=seed, first_row=i * batch_size)  # batches' streams differ
            secs[m][i] = time.perf_counter() - t0
            toks[m][i] = sum(len(g.tokens) for g in out)
            gens[m] += out
    ar_tokens, ar_s = int(toks["ar"].sum()), float(secs["ar"].sum())
    log(json.dumps({"method": "ar", "tokens": ar_tokens, "seconds": round(ar_s, 3)}))
    ar_rate = secs["ar"] / np.maximum(toks["ar"], 1)  # per-batch seconds per token
    rows = []
    for budget in methods:
        if budget == "ar":
            continue
        g = gens[budget]
        tokens, seconds = int(toks[budget].sum()), float(secs[budget].sum())
        emitted = [int(round(x.tau * x.rounds)) for x in g]  # per prompt: output-block tokens, bonus included
        per_rounds = [int(x.rounds) for x in g]
        # tau counts each round's whole verified block, as the exit law's ceiling 1 + C_p does; a
        # prompt's last block is cut at its end (end-of-turn, a stop string, the token limit), so the
        # tokens it outputs per round (tau_out) are fewer, by more where blocks are long.
        out_tokens = [len(x.tokens) for x in g]
        rounds, block = sum(per_rounds), sum(emitted)
        per_prompt = np.array(emitted) / np.maximum(per_rounds, 1)  # each prompt's own tau
        # Prompts are the independent units; the per-prompt counts stay in the row so that two runs on
        # the same prompts can be compared paired (`tevjax.stats.paired_gain`).
        tau_se = stats.tau_se(emitted, per_rounds)[1] if len(g) > 1 and rounds else None
        tau_out_se = stats.tau_se(out_tokens, per_rounds)[1] if len(g) > 1 and rounds else None
        per_batch_sr = ar_rate / (secs[budget] / np.maximum(toks[budget], 1))
        # Greedy is any temperature below GREEDY_BELOW (1e-5), not just 0: the exactness check applies to all.
        mismatches = sum(a.tokens != b.tokens for a, b in zip(gens["ar"], g)) if is_greedy(temperature) else None
        row = {"budget": budget, "lookup": lookup_for(budget, lookup),
               "corpus": corpus_for(budget, corpus, models.ngrams), "tau": block / max(rounds, 1),
               "tau_se": tau_se, "tau_prompt_sd": float(per_prompt.std(ddof=1)) if len(g) > 1 else 0.0,
               "tau_out": sum(out_tokens) / max(rounds, 1), "tau_out_se": tau_out_se,
               "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else None,
               "sr": (ar_s / max(ar_tokens, 1)) / (seconds / max(tokens, 1)) if seconds else None,
               "sr_range": [float(np.percentile(per_batch_sr, 10)), float(np.percentile(per_batch_sr, 90))],
               "mismatches": mismatches}
        if fallback_below > 0:
            plain = sum(x.plain_rounds for x in g)  # each plain round emitted exactly one token
            row |= {"plain_rounds": plain, "tau_drafted": (block - plain) / max(rounds - plain, 1)}
        log(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}))
        rows.append(row | {"prompt_emitted": emitted, "prompt_rounds": per_rounds, "prompt_tokens": out_tokens})
    return {
        "verifier": verifier, "temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
        "max_new_tokens": max_new_tokens,
        "batch_size": batch_size, "num_prompts": len(texts), "seed": seed, "lookup": lookup, "corpus": corpus,
        # The texts themselves, in order: the per-prompt counts pair by position (`compare_evals`), and
        # the same --prompts spec can name other texts (a prompt file edited or read from another directory).
        "prompts_sha256": prompts_digest(texts),
        "fallback_below": fallback_below, "fallback_rounds": fallback_rounds,
        "drafter_trained": models.drafter_trained,
        "ar": {"tokens": ar_tokens, "seconds": ar_s, "tokens_per_s": ar_tokens / ar_s if ar_s else None},
        "budgets": rows, "mismatches": sum(r["mismatches"] or 0 for r in rows),
        "machine": {"platform": platform.platform(), "processor": platform.processor()},
    }


def prompts_digest(texts: list[str]) -> str:
    """SHA-256 of the prompt texts in order (JSON-encoded): equal digests, the same prompts in the same order."""
    return hashlib.sha256(json.dumps(list(texts), ensure_ascii=False).encode("utf-8")).hexdigest()


def lookup_for(budget: int, lookup: int | None) -> int:
    """The lookup chain length a `budget` decodes with: `lookup` capped at the budget; None: the budget."""
    return budget if lookup is None else min(lookup, budget)


def corpus_for(budget: int, corpus: int | None, ngrams) -> int:
    """The corpus chain length a `budget` decodes with: 0 without an n-gram table; else `corpus`
    capped at the budget, None meaning the budget."""
    return 0 if ngrams is None else lookup_for(budget, corpus)


def truncation_text(top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> str:
    """", top-k 50, top-p 0.9" for the truncation settings that are on; "" when none is."""
    on = (("top-k", top_k, 0), ("top-p", top_p, 1.0), ("min-p", min_p, 0.0))
    return "".join(f", {name} {value}" for name, value, off in on if value != off)


def _banded(value: float, se: float | None, q: float) -> str:
    """`value [lo, hi]`, the interval value +- q se; a round emits at least one token, so a mean per
    round is >= 1 and a few prompts' band is cut there."""
    return f"{value:.3f}" + ("" if se is None else f" [{max(value - q * se, 1.0):.3f}, {value + q * se:.3f}]")


def format_table(result: dict) -> str:
    """A markdown table of one `evaluate` result."""
    ar = result["ar"]
    cut = truncation_text(result.get("top_k", 0), result.get("top_p", 1.0), result.get("min_p", 0.0))
    fallback = result.get("fallback_below", 0.0) > 0
    lines = [f"{result['num_prompts']} prompts, {result['max_new_tokens']} new tokens, "
             f"temperature {result['temperature']}{cut}, verifier {result['verifier']}, batch {result['batch_size']}"
             + (f", fallback below {result['fallback_below']:g} (tau counts the plain rounds)" if fallback else "")
             + f"; AR {ar['tokens_per_s']:.2f} tok/s",
             "", "| budget | lookup | corpus | tau [95% over prompts] | output tokens per round [95%] | tok/s "
             "| SR vs AR [10-90% over batches] | greedy == AR |"
             + (" plain rounds | tau of drafted rounds |" if fallback else ""),
             "|---:|---:|---:|---:|---:|---:|---:|:---:|" + ("---:|---:|" if fallback else "")]
    for r in result["budgets"]:
        same = "n/a" if r["mismatches"] is None else ("yes" if r["mismatches"] == 0 else f"NO ({r['mismatches']})")
        lo, hi = r["sr_range"]
        # t with n - 1 df, not 1.96: the SE comes from the n prompts themselves (`stats.q95`).
        q = stats.q95(len(r["prompt_emitted"]) if "prompt_emitted" in r else result["num_prompts"])
        out = "n/a" if "tau_out" not in r else _banded(r["tau_out"], r["tau_out_se"], q)  # older files lack it
        lines.append(f"| {r['budget']} | {r.get('lookup', 0)} | {r.get('corpus', 0)} "
                     f"| {_banded(r['tau'], r.get('tau_se'), q)} | {out} | {r['tokens_per_s']:.2f} "
                     f"| {r['sr']:.3f} [{lo:.2f}-{hi:.2f}] "
                     f"| {same} |" + (f" {r['plain_rounds']} | {r['tau_drafted']:.3f} |" if fallback else ""))
    return "\n".join(lines)
