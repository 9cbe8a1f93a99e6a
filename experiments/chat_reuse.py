"""Chat turns with and without the last turn's caches (`Decoder.prefill(..., reuse=...)`).

Each conversation sends `--turns` held-out ShareGPT prompts, cut at `--max-chars` characters, as
successive user messages to the embedded SmolLM2 with `tevjax chat`'s settings (prompt bucket 256,
capacity bucket 512, TEV at budget 8 with both lookup chains, greedy, 128 new tokens). Every turn
renders the conversation with the chat template (`tevjax.chat.Conversation`, which also trims the
oldest exchanges to fit) and decodes it twice, back to back in an order that alternates by turn:
once from a fresh prefill ("fresh"), once from the reusing arm's state of the previous turn
("reuse"). The reusing arm's replies carry its conversation on; the fresh arm decodes the same
renderings, so both see the same prompts and greedy replies must agree.

The whole set of conversations runs twice and only the second pass is timed: the first compiles
every shape the second meets (each cache capacity, and each chunk size the reusing arm prefills
its new tokens in). Reported per turn index: the prompt's tokens, the tokens the reusing arm
prefilled, each arm's prefill time (until the state is ready: the wait before the first round)
and whole-turn time, the ratio of the turn times with its range over conversations, and how many
replies were equal.

    nice -n 19 python experiments/chat_reuse.py        # experiments/results/chat_reuse.md (+ .json)
    python experiments/chat_reuse.py --conversations 2 --turns 3 --out /tmp/chat_reuse.md
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import save  # noqa: E402  experiments/report.py


def run(texts: list[list[str]], *, budget: int, max_new_tokens: int, passes: int = 2) -> list[dict]:
    """Per conversation and turn, the last pass's measurements (see the module docstring)."""
    from tevjax.chat import Conversation
    from tevjax.cli import CHAT_CAPACITY_BUCKET, CHAT_PROMPT_BUCKET
    from tevjax.decode.engine import DecodeConfig, Decoder
    from tevjax.loading import load_models

    models = load_models("smollm2")
    cfg = DecodeConfig(verifier="tev", budget=budget, lookup=budget, corpus=budget, max_new_tokens=max_new_tokens,
                       eos_ids=models.eos_ids, prompt_bucket=CHAT_PROMPT_BUCKET, capacity_bucket=CHAT_CAPACITY_BUCKET)
    decoder = Decoder(models.target, models.drafter, cfg, ngrams=models.ngrams)
    rows = []
    for _ in range(passes):
        rows = []
        for c, messages in enumerate(texts):
            conv = Conversation(models.tokenizer, models.target_cfg.max_position_embeddings,
                                max_new_tokens + decoder.tree_slots)
            cached = None
            for t, text in enumerate(messages):
                ids, dropped = conv.ask(text)
                decoder.compile([ids])
                got = {}
                for arm in (("fresh", "reuse") if t % 2 == 0 else ("reuse", "fresh")):
                    reuse = cached if arm == "reuse" else None
                    # The slots the reusing arm keeps, by the decoder's own rule (it reads the state only).
                    kept = decoder._reused_prefix([ids], reuse) if reuse is not None else 0
                    t0 = time.perf_counter()
                    state = decoder.prefill([ids], reuse=reuse)
                    t1 = time.perf_counter()
                    state = decoder.run(state)
                    t2 = time.perf_counter()
                    gen = decoder.results(state)[0]
                    got[arm] = {"prefill_s": t1 - t0, "turn_s": t2 - t0, "tokens": gen.tokens,
                                "prefilled": len(ids) - 1 - kept}
                    if arm == "reuse":
                        cached = (state, [ids])
                reply = models.tokenizer.decode(got["reuse"]["tokens"], skip_special_tokens=True)
                conv.answer(reply)
                rows.append({"conversation": c, "turn": t, "prompt_tokens": len(ids), "dropped": dropped,
                             "equal": got["fresh"]["tokens"] == got["reuse"]["tokens"],
                             "new_tokens": len(got["reuse"]["tokens"]),
                             **{f"{arm}_{k}": v for arm in got for k, v in got[arm].items() if k != "tokens"}})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def report(rows: list[dict], args, seconds: float) -> list[str]:
    lines = ["# Chat turns with and without the last turn's caches", "",
             f"Command: `python experiments/chat_reuse.py --conversations {args.conversations} --turns {args.turns} "
             f"--max-chars {args.max_chars}` ({time.strftime('%Y-%m-%d')}, {seconds / 60:.1f} min in all). Machine: "
             f"{platform.processor() or platform.machine()}, {platform.platform()}.",
             f"SmolLM2-135M-Instruct (fp32) with the shipped drafter, `tevjax chat`'s settings: TEV at budget "
             f"{args.budget} with both lookup chains, greedy, {args.max_new_tokens} new tokens, prompt bucket 256, "
             f"capacity bucket 512. Each conversation sends {args.turns} held-out prompts (cut at {args.max_chars} "
             "characters) as its user messages; each turn decodes the rendered conversation from a fresh prefill and "
             "from the reusing arm's last state, back to back, in an order alternating by turn; the second of two "
             "passes is timed. Times are medians over conversations; the ratio is the reusing arm's turn time over "
             "the fresh arm's, median [min-max] over conversations.", "",
             "| turn | prompt tokens | prefilled (reuse) | prefill s: fresh | prefill s: reuse | turn s: fresh "
             "| turn s: reuse | turn time ratio | replies equal |",
             "|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for t in sorted({r["turn"] for r in rows}):
        g = [r for r in rows if r["turn"] == t]
        med = lambda k: float(np.median([r[k] for r in g]))  # noqa: E731
        ratio = np.array([r["reuse_turn_s"] / r["fresh_turn_s"] for r in g])
        lines.append(f"| {t + 1} | {med('prompt_tokens'):.0f} | {med('reuse_prefilled'):.0f} "
                     f"| {med('fresh_prefill_s'):.2f} | {med('reuse_prefill_s'):.2f} | {med('fresh_turn_s'):.2f} "
                     f"| {med('reuse_turn_s'):.2f} | {np.median(ratio):.2f} [{ratio.min():.2f}-{ratio.max():.2f}] "
                     f"| {sum(r['equal'] for r in g)} of {len(g)} |")
    later = [r for r in rows if r["turn"] > 0]
    if later:
        fresh, reuse = sum(r["fresh_turn_s"] for r in later), sum(r["reuse_turn_s"] for r in later)
        fp, rp = sum(r["fresh_prefill_s"] for r in later), sum(r["reuse_prefill_s"] for r in later)
        lines += ["", f"Turns 2 on, pooled: prefill {fp:.1f} s fresh against {rp:.1f} s reused ({rp / fp:.2f}x); "
                      f"whole turns {fresh:.1f} s against {reuse:.1f} s ({reuse / fresh:.2f}x). Replies equal: "
                      f"{sum(r['equal'] for r in rows)} of {len(rows)}."]
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-chars", type=int, default=600, help="user messages are cut at this many characters")
    parser.add_argument("--budget", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "chat_reuse.md"))
    args = parser.parse_args(argv)
    for name in ("conversations", "turns", "max_chars", "budget", "max_new_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args


def main() -> None:
    args = parse_args()
    from tevjax.evaluate import load_eval_prompts

    flat = load_eval_prompts("heldout", args.conversations * args.turns)
    texts = [[m[: args.max_chars] for m in flat[c * args.turns: (c + 1) * args.turns]]
             for c in range(args.conversations)]
    t0 = time.perf_counter()
    rows = run(texts, budget=args.budget, max_new_tokens=args.max_new_tokens)
    save(report(rows, args, time.perf_counter() - t0), args.out, {"args": vars(args), "turns": rows})


if __name__ == "__main__":
    main()
