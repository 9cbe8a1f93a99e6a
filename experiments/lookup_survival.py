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

`--temperature T` measures the table for sampled decoding instead: the target answers the same
prompts again, sampling at T (autoregressive, `--tokens + --depth` new tokens each), and the
chains are compared with those answers. A sampled answer holds a fixed chain's next token with the
target's probability of it, which is also the probability that speculative verification accepts a
single proposed path, so this is the table `DecodeConfig.lookup_survival` wants at T.

    python experiments/lookup_survival.py experiments/results/gpu_drafter_scale_records-1.npz --records 256 \
        --temperature 1
"""

from __future__ import annotations

import argparse
import json
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


def sampled_answers(data, records: int, new_tokens: int, temperature: float, batch: int = 32
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, offsets, prompt_len) as in a records file: the first `records` prompts of `data`,
    each followed by the target's answer sampled at `temperature` (seed: the batch index)."""
    from tevjax.decode.engine import DecodeConfig, Decoder
    from tevjax.loading import load_models

    models = load_models("smollm2", None, dtype="float32")
    n = min(records, len(data["prompt_len"]))
    prompts = [data["tokens"][o:o + int(k)].astype(np.int64).tolist()
               for o, k in zip(data["offsets"][:n], data["prompt_len"][:n])]
    cfg = DecodeConfig(temperature=temperature, max_new_tokens=new_tokens, eos_ids=models.eos_ids, prompt_bucket=128)
    decoder = Decoder(models.target, None, cfg)
    seqs = []
    for b, i in enumerate(range(0, n, batch)):
        gens = decoder.generate(prompts[i:i + batch], seed=b)
        seqs += [p + g.tokens for p, g in zip(prompts[i:i + batch], gens)]
        print(f"sampled {len(seqs)}/{n} answers", flush=True)
    offsets = np.concatenate([[0], np.cumsum([len(q) for q in seqs])])
    return np.concatenate(seqs).astype(np.int64), offsets, np.array([len(p) for p in prompts])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("records_file", type=Path, help="a records .npz (tokens, offsets, prompt_len)")
    p.add_argument("--records", type=int, default=800)
    p.add_argument("--tokens", type=int, default=128, help="answer tokens looked at per record")
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--temperature", type=float, default=None,
                   help="sample new answers to the records' prompts at this temperature (default: the records' own)")
    p.add_argument("--json", type=Path, default=None,
                   help="also write the table there, for `DecodeConfig.lookup_survival` or `lookup_gain.py --survival`")
    args = p.parse_args(argv)
    require_positive(p, args, "records", "tokens", "depth")
    if args.temperature is not None and not 0 < args.temperature < float("inf"):
        p.error(f"--temperature must be finite and > 0, got {args.temperature}")
    if not args.records_file.is_file():
        p.error(f"{args.records_file}: no such file")
    data = np.load(args.records_file)
    tokens, offsets, prompt_len = data["tokens"], data["offsets"], data["prompt_len"]
    if args.temperature is not None:
        tokens, offsets, prompt_len = sampled_answers(data, args.records, args.tokens + args.depth, args.temperature)
    table, counts = survival(tokens, offsets, prompt_len, args.records, args.tokens, args.depth)
    for n, (row, count) in enumerate(zip(table, counts), start=1):  # the rows of LOOKUP_SURVIVAL
        print(f"order {n}: {int(count)} positions  ({', '.join(f'{x:.2f}' for x in row)}),")
    if args.json is not None:
        # A depth that no chain of an order reached gets half a position's worth, so that its log is
        # finite (a survival table holds probabilities in (0, 1]).
        floor = 0.5 / np.maximum(counts, 1)[:, None]
        args.json.write_text(json.dumps([[round(float(x), 5) for x in row] for row in np.maximum(table, floor)]) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
