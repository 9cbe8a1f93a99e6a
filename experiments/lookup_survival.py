"""Measures `tevjax.builder.LOOKUP_SURVIVAL`: how long a context-lookup chain holds, by match order.

For every position t of a target's answers (first `--tokens` tokens), the chain `context_chain`
would propose after t (the latest earlier occurrence of the longest suffix of order <= 5 that
occurred before, continued periodically) is compared with the answer's next `--depth` tokens. The
table's row n, column d is the fraction of positions with a match of order n (5: five or more)
whose chain holds at least d tokens. The answers are the GPU run's greedy training records
(`gpu_drafter_scale_records-*.npz`, prompts no evaluation uses); the builder's constants are this
script's output on `-1.npz`'s first 800 records.

    python experiments/lookup_survival.py experiments/results/gpu_drafter_scale_records-1.npz --records 800
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import require_positive  # noqa: E402

ORDERS = (5, 4, 3, 2, 1)


def chain_at(ctx: np.ndarray, depth: int) -> tuple[np.ndarray | None, int]:
    """(chain, order) as `tevjax.builder.context_chain` proposes it after `ctx` (None, 0: no match)."""
    length = len(ctx)
    for n in ORDERS:
        if length < n + 1:
            continue
        key = ctx[length - n:]
        for j in range(length - 2, n - 2, -1):
            if np.array_equal(ctx[j - n + 1:j + 1], key):
                return ctx[j + 1 + np.arange(depth) % (length - 1 - j)], n
    return None, 0


def survival(tokens: np.ndarray, offsets: np.ndarray, prompt_len: np.ndarray, records: int, answer_tokens: int,
             depth: int) -> tuple[np.ndarray, np.ndarray]:
    """([5, depth] survival table, [5] positions per order) over the first `records` records."""
    held = np.zeros((len(ORDERS), depth + 1))
    for r in range(min(records, len(prompt_len))):
        seq = tokens[offsets[r]:offsets[r + 1]].astype(np.int64)
        end = min(len(seq), prompt_len[r] + answer_tokens)
        for t in range(prompt_len[r], end - depth):  # positions with `depth` known tokens after them
            chain, order = chain_at(seq[:t + 1], depth)
            if order == 0:
                continue
            k = 0
            while k < depth and chain[k] == seq[t + 1 + k]:
                k += 1
            held[ORDERS.index(order), k] += 1
    counts = held.sum(axis=1)
    at_least = np.cumsum(held[:, ::-1], axis=1)[:, ::-1][:, 1:]  # [5, depth]: held >= d
    return at_least / np.maximum(counts, 1)[:, None], counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("records_file", type=Path, help="a records .npz (tokens, offsets, prompt_len)")
    p.add_argument("--records", type=int, default=800)
    p.add_argument("--tokens", type=int, default=128, help="answer tokens looked at per record")
    p.add_argument("--depth", type=int, default=8)
    args = p.parse_args(argv)
    require_positive(p, args, "records", "tokens", "depth")
    if not args.records_file.is_file():
        p.error(f"{args.records_file}: no such file")
    data = np.load(args.records_file)
    table, counts = survival(data["tokens"], data["offsets"], data["prompt_len"], args.records, args.tokens,
                             args.depth)
    # Row order of LOOKUP_SURVIVAL: order 1 first.
    for n in sorted(ORDERS):
        i = ORDERS.index(n)
        print(f"order {n}: {int(counts[i])} positions  ({', '.join(f'{x:.2f}' for x in table[i])}),")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
