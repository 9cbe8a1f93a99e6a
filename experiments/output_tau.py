"""Output tokens per round for `tevjax eval --json` runs made before eval kept them (greedy only).

`tau` in an eval row counts each round's whole verified block (`prompt_emitted`), as the exit law's
ceiling 1 + C_p does. A prompt's last block is cut where its output ends (end-of-turn, the token
limit), so the tokens a prompt outputs per round are fewer, and by more where blocks are long
(lookup chains in a loop). Runs since 2026-12-07 keep both (`tau_out`, `prompt_tokens`); this
script recovers `prompt_tokens` for older greedy runs: a greedy speculative output equals the
autoregressive one (each file counts its mismatches), so one batched AR pass over the same prompts
gives every prompt's output length. Its total must equal each file's AR token count, or nothing is
reported. For each file and budget it prints both figures with 95% intervals (Student t over
prompts, `tevjax.stats`), and, with --a / --b arms, the paired gain of B over A on each. The
command behind `results/output_tau.md` (the held-out runs of the model card) heads that file.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_evals import CompareError, load_arm  # noqa: E402
from report import emit, require_positive, save  # noqa: E402

from tevjax.stats import paired_gain, q95, tau_se  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", nargs="+", required=True, help="eval JSON files of arm A (greedy, same prompts)")
    p.add_argument("--b", nargs="+", default=[], help="eval JSON files of arm B, compared paired against A")
    p.add_argument("--label-a", default="A")
    p.add_argument("--label-b", default="B")
    p.add_argument("--batch", type=int, default=16, help="rows of the AR pass (greedy outputs do not depend on it)")
    p.add_argument("--out", default=None, help="markdown file (and .json beside it)")
    args = p.parse_args(argv)
    # Before the model loads: a step of 0 stopped the AR pass with a traceback, a negative one ran no
    # batch and was reported as an AR pass that output 0 tokens.
    require_positive(p, args, "batch")
    return args


def load(paths: list[str]) -> tuple[dict, dict[int, dict], str | None]:
    """(shared settings, {budget: row}, the prompt texts' digest if the files keep it) of one arm's
    greedy files, as `compare_evals` reads an arm."""
    from tevjax.law import is_greedy

    try:
        settings, rows, digest, _ = load_arm(paths)
    except CompareError as e:
        raise SystemExit(str(e)) from None
    if not is_greedy(settings["temperature"]):
        raise SystemExit(f"{paths[0]}: temperature {settings['temperature']}: only greedy outputs equal AR's")
    for b, row in rows.items():
        if row["mismatches"]:
            raise SystemExit(f"{' '.join(paths)}: budget {b} has {row['mismatches']} outputs unlike AR's")
    return settings, rows, None if digest is None else digest[1]


def output_lengths(settings: dict, batch: int, digest: str | None = None) -> list[int]:
    """Each prompt's greedy output length, from one batched AR pass over the eval's prompts (the
    texts the runs decoded, where their digest says so)."""
    from tevjax.convert.tokenizer import chat_prompt_ids
    from tevjax.decode import DecodeConfig, Decoder
    from tevjax.evaluate import load_eval_prompts, prompts_digest
    from tevjax.loading import load_models

    models = load_models("smollm2")
    texts = load_eval_prompts(settings["prompts"], settings["num_prompts"], seed=settings["seed"])  # gsm: by seed
    if digest is not None and prompts_digest(texts) != digest:
        raise SystemExit(f"--prompts {settings['prompts']} now gives other texts than the runs decoded")
    prompts = [chat_prompt_ids(models.tokenizer, t) for t in texts]
    dec = Decoder(models.target, None, DecodeConfig(temperature=0.0, max_new_tokens=settings["max_new_tokens"],
                                                    eos_ids=models.eos_ids))
    lengths = []
    for s in range(0, len(prompts), batch):
        lengths += [len(g.tokens) for g in dec.generate(prompts[s: s + batch])]
    return lengths


def band(value: float, se: float, q: float) -> str:
    return f"{value:.3f} [{value - q * se:.3f}, {value + q * se:.3f}]"


def main(argv=None) -> list[str]:
    args = parse_args(argv)
    settings, rows_a, digest = load(args.a)
    arms = {args.label_a: rows_a}
    if args.b:
        settings_b, rows_b, digest_b = load(args.b)
        if settings_b != settings or None not in (digest, digest_b) and digest != digest_b:
            raise SystemExit("the arms ran on other prompts or settings")
        digest = digest or digest_b
        arms[args.label_b] = rows_b
    t0 = time.perf_counter()
    lengths = output_lengths(settings, args.batch, digest)
    seconds = time.perf_counter() - t0
    for label, rows in arms.items():
        for b, row in rows.items():  # with no mismatch, a row's tokens are AR's too
            if sum(lengths) != row["tokens"]:
                raise SystemExit(f"{label}, budget {b}: the AR pass output {sum(lengths)} tokens, "
                                 f"the run {row['tokens']}")
    q = q95(len(lengths))
    lines = ["# Output tokens per round against whole verified blocks per round (greedy)", "",
             f"`{shlex.join(['python', *sys.argv])}`", "",
             f"- {settings['num_prompts']} prompts ({settings['prompts']}), {settings['max_new_tokens']} new tokens, "
             f"temperature 0. The AR pass ({args.batch} rows, {seconds:.0f} s) output {sum(lengths)} tokens, "
             "equal to every file's speculative (and so AR) totals.",
             "- tau: each round's whole verified block (bonus included), what `tevjax eval` has reported as tau; "
             "output tokens per round: the same rounds, each prompt's last block cut where its output ends.",
             f"- 95% intervals: delta method over prompts, Student t with {len(lengths) - 1} df ({q:.4f}).", "",
             "| arm | budget | tau [95%] | output tokens per round [95%] | difference |",
             "|---|---:|---:|---:|---:|"]
    payload = {"settings": settings, "output_tokens": lengths, "arms": {}}
    for label, rows in arms.items():
        for b in sorted(rows):
            r = rows[b]
            tau, se = tau_se(r["prompt_emitted"], r["prompt_rounds"])
            out, se_out = tau_se(lengths, r["prompt_rounds"])
            lines.append(f"| {label} | {b} | {band(tau, se, q)} | {band(out, se_out, q)} | {out / tau - 1:+.1%} |")
            payload["arms"].setdefault(label, {})[b] = {"tau": tau, "tau_se": se, "tau_out": out, "tau_out_se": se_out}
    if args.b:
        lines += ["", f"Paired gain of {args.label_b} over {args.label_a}:", "",
                  "| budget | on tau [95%] | on output tokens per round [95%] |", "|---:|---:|---:|"]
        for b in sorted(set(rows_a) & set(arms[args.label_b])):
            ra, rb = rows_a[b], arms[args.label_b][b]
            g = paired_gain(ra["prompt_emitted"], ra["prompt_rounds"], rb["prompt_emitted"], rb["prompt_rounds"])
            go = paired_gain(lengths, ra["prompt_rounds"], lengths, rb["prompt_rounds"])
            lines.append(f"| {b} | {g['gain']:+.1%} [{g['lo']:+.1%}, {g['hi']:+.1%}] "
                         f"| {go['gain']:+.1%} [{go['lo']:+.1%}, {go['hi']:+.1%}] |")
            payload.setdefault("gains", {})[b] = {"tau": g, "tau_out": go}
    save(lines, args.out, payload) if args.out else emit(lines, None)
    return lines


if __name__ == "__main__":
    main()
