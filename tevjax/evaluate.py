"""`tevjax eval`: tau, tokens/s and speedup against autoregressive decoding, measured in one run.

For each budget the same prompts are decoded with the drafter + DDTree + the chosen verifier and,
once, autoregressively with the same target, cache and sampler (`Decoder` without a drafter);
compilation is excluded from every timing. SR = AR seconds per token / method seconds per token.
At temperature 0 every speculative output must equal the autoregressive one (a mismatch is
counted and reported: it would mean the decoder is not exact).
"""

from __future__ import annotations

import json
import platform
import time
from importlib import resources
from pathlib import Path
from typing import Callable

import numpy as np

__all__ = ["evaluate", "format_table", "load_eval_prompts", "HELDOUT_FILE"]

# The held-out ShareGPT prompts of the shipped drafter's data (never trained on).
HELDOUT_FILE = "heldout.jsonl"


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
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line.strip()]
        return [r["text"] for r in rows[:n]]
    if spec in DATASETS:
        return [p.text for p in load_prompt_sets([spec], n, seed=seed)[spec]]
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"--prompts {spec!r}: not a file and not one of heldout, {', '.join(DATASETS)}")
    lines = [ln for ln in path.read_text(encoding="utf-8").split("\n") if ln.strip()]
    if not lines:
        raise ValueError(f"--prompts {spec!r} holds no prompts")
    return lines[:n]


def _run(decoder, prompts: list[list[int]], batch_size: int, seed: int):
    """(generations, seconds excluding compilation) over all prompts in batches."""
    gens, seconds = [], 0.0
    for s in range(0, len(prompts), batch_size):
        batch = prompts[s: s + batch_size]
        decoder.compile(batch)
        t0 = time.perf_counter()
        gens += decoder.generate(batch, seed=seed)
        seconds += time.perf_counter() - t0
    return gens, seconds


def evaluate(models, texts: list[str], *, budgets=(4, 8, 16, 32), temperature: float = 0.0,
             verifier: str = "tev", max_new_tokens: int = 128, batch_size: int = 1, seed: int = 0,
             log: Callable[[str], None] = print, mesh=None) -> dict:
    """Measures AR and speculative decoding on the same prompts (on `mesh`'s devices if given);
    returns a JSON-ready dict."""
    from tevjax.convert.tokenizer import chat_prompt_ids
    from tevjax.decode.engine import DecodeConfig, Decoder

    if models.tokenizer is None:
        raise ValueError("this target has no tokenizer: evaluation prompts are text")
    prompts = [chat_prompt_ids(models.tokenizer, t) for t in texts]
    base = dict(temperature=temperature, max_new_tokens=max_new_tokens, eos_ids=models.eos_ids)
    ar = Decoder(models.target, None, DecodeConfig(**base), mesh=mesh)  # no drafter: autoregressive
    ar_gens, ar_s = _run(ar, prompts, batch_size, seed)
    ar_tokens = sum(len(g.tokens) for g in ar_gens)
    log(json.dumps({"method": "ar", "tokens": ar_tokens, "seconds": round(ar_s, 3)}))
    rows = []
    for budget in budgets:
        dec = Decoder(models.target, models.drafter, DecodeConfig(verifier=verifier, budget=int(budget), **base),
                      mesh=mesh)
        gens, secs = _run(dec, prompts, batch_size, seed)
        tokens = sum(len(g.tokens) for g in gens)
        rounds = sum(g.rounds for g in gens)
        block = sum(g.tau * g.rounds for g in gens)
        per_prompt = np.array([g.tau for g in gens])
        mismatches = sum(a.tokens != b.tokens for a, b in zip(ar_gens, gens)) if temperature == 0 else None
        row = {"budget": int(budget), "tau": block / max(rounds, 1),
               "tau_prompt_sd": float(per_prompt.std(ddof=1)) if len(gens) > 1 else 0.0,
               "tokens": tokens, "seconds": secs, "tokens_per_s": tokens / secs if secs else None,
               "sr": (ar_s / max(ar_tokens, 1)) / (secs / max(tokens, 1)) if secs else None,
               "mismatches": mismatches}
        rows.append(row)
        log(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}))
    return {
        "verifier": verifier, "temperature": temperature, "max_new_tokens": max_new_tokens,
        "batch_size": batch_size, "num_prompts": len(texts), "seed": seed,
        "drafter_trained": models.drafter_trained,
        "ar": {"tokens": ar_tokens, "seconds": ar_s, "tokens_per_s": ar_tokens / ar_s if ar_s else None},
        "budgets": rows, "mismatches": sum(r["mismatches"] or 0 for r in rows),
        "machine": {"platform": platform.platform(), "processor": platform.processor()},
    }


def format_table(result: dict) -> str:
    """A markdown table of one `evaluate` result."""
    ar = result["ar"]
    lines = [f"{result['num_prompts']} prompts, {result['max_new_tokens']} new tokens, "
             f"temperature {result['temperature']}, verifier {result['verifier']}, batch {result['batch_size']}; "
             f"AR {ar['tokens_per_s']:.2f} tok/s",
             "", "| budget | tau | tok/s | SR vs AR | greedy == AR |", "|---:|---:|---:|---:|:---:|"]
    for r in result["budgets"]:
        same = "n/a" if r["mismatches"] is None else ("yes" if r["mismatches"] == 0 else f"NO ({r['mismatches']})")
        lines.append(f"| {r['budget']} | {r['tau']:.3f} | {r['tokens_per_s']:.2f} | {r['sr']:.3f} | {same} |")
    return "\n".join(lines)
