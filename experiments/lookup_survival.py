"""Measures `tevjax.builder.LOOKUP_SURVIVAL`: how long a context-lookup chain holds, by match order.

For every position t of a target's answers (first `--tokens` tokens), the chain
`tevjax.builder.context_chain` proposes after t (the latest earlier occurrence of the longest
suffix of order <= 5 that occurred before, continued periodically) is compared with the answer's
next `--depth` tokens. The
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

def survival(tokens: np.ndarray, offsets: np.ndarray, prompt_len: np.ndarray, records: int, answer_tokens: int,
             depth: int) -> tuple[np.ndarray, np.ndarray]:
    """([orders, depth] survival table, [orders] positions per order; row n - 1 is order n) over the
    first `records` records, with the chains `tevjax.builder.context_chain` proposes."""
    import jax

    from tevjax.builder import LOOKUP_ORDERS, context_chain

    # One record's positions at once: the same text, one context length per position.
    chains_at = jax.jit(jax.vmap(context_chain, in_axes=(None, 0, None)), static_argnums=2)
    held = np.zeros((max(LOOKUP_ORDERS), depth + 1))
    for r in range(min(records, len(prompt_len))):
        seq = tokens[offsets[r]:offsets[r + 1]].astype(np.int64)
        end = min(len(seq), prompt_len[r] + answer_tokens)
        t = np.arange(prompt_len[r], end - depth)  # positions with `depth` known tokens after them
        if len(t) == 0:
            continue
        # Padded to buckets (text to a multiple of 256, positions to `answer_tokens`), so a few
        # shapes compile instead of one per record; padded positions are dropped below.
        text = np.zeros(-(-len(seq) // 256) * 256, np.int32)
        text[:len(seq)] = seq
        lengths = np.full(answer_tokens, 1, np.int32)
        lengths[:len(t)] = t + 1
        chains, orders = (np.asarray(x)[:len(t)] for x in chains_at(text, lengths, depth))
        future = seq[t[:, None] + 1 + np.arange(depth)]  # [T, depth]
        k = np.cumprod(chains == future, axis=1).sum(axis=1)  # tokens held from the first on
        np.add.at(held, (orders[orders > 0] - 1, k[orders > 0]), 1)
    counts = held.sum(axis=1)
    at_least = np.cumsum(held[:, ::-1], axis=1)[:, ::-1][:, 1:]  # [orders, depth]: held >= d
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
    for n, (row, count) in enumerate(zip(table, counts), start=1):  # the rows of LOOKUP_SURVIVAL
        print(f"order {n}: {int(count)} positions  ({', '.join(f'{x:.2f}' for x in row)}),")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
