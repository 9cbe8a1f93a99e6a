"""Measures the corpus chain (`tevjax.builder.corpus_chain`) against answers its table never saw.

The table is counted on one records file; the chains are proposed at every position of the first
`--tokens` answer tokens of `--records` records of another, and compared with the answer's next
`--depth` tokens. Printed: how often the first step holds, by the corpus fraction p of the
matched n-gram's continuation (the basis of `NGRAM_CALIBRATION`, which maps p to a reach estimate
alpha * p ** beta); and how the corpus chain and the context chain
(`context_chain`) cover the positions, alone and together. The records are the GPU run's greedy
answers to later-turn training prompts; no evaluation prompt is among them.

    python experiments/corpus_calibration.py experiments/results/gpu_drafter_scale_records-0.npz \
        experiments/results/gpu_drafter_scale_records-1.npz --records 300
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import emit, require_positive  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "corpus_calibration.md"
BINS = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0001)


def held(chains: np.ndarray, future: np.ndarray, proposed: np.ndarray) -> np.ndarray:
    """[P] tokens each chain holds from its first on (0 where nothing was proposed)."""
    return np.where(proposed, np.cumprod(chains == future, axis=1).sum(axis=1), 0)


def measure(table_file: Path, test_file: Path, records: int, answer_tokens: int, depth: int) -> dict:
    import jax

    from tevjax.builder import NGRAM_CALIBRATION, context_chain, corpus_chain, ngram_table

    with np.load(table_file) as z:
        table = ngram_table(z["tokens"], z["offsets"], z["prompt_len"], calibration=(1.0, 1.0))  # log p itself
    with np.load(test_file) as test:
        tokens, offsets, prompt_len = test["tokens"].astype(np.int64), test["offsets"], test["prompt_len"]
    corpus_at = jax.jit(jax.vmap(corpus_chain, in_axes=(None, 0, None, None)), static_argnums=2)
    context_at = jax.jit(jax.vmap(context_chain, in_axes=(None, 0, None)), static_argnums=2)
    first_p, corpus_held, context_held = [], [], []
    for r in range(min(records, len(prompt_len))):
        seq = tokens[offsets[r]:offsets[r + 1]]
        t = np.arange(prompt_len[r], min(len(seq), prompt_len[r] + answer_tokens) - depth)
        if len(t) == 0:
            continue
        text = np.zeros(-(-len(seq) // 256) * 256, np.int32)  # a few padded shapes, not one per record
        text[:len(seq)] = seq
        lengths = np.ones(answer_tokens, np.int32)
        lengths[:len(t)] = t + 1
        chains, scores = (np.asarray(x)[:len(t)] for x in corpus_at(text, lengths, depth, table))
        ctx, order = (np.asarray(x)[:len(t)] for x in context_at(text, lengths, depth))
        future = seq[t[:, None] + 1 + np.arange(depth)]
        first_p.append(np.exp(scores[:, 0]))  # 0 where no n-gram matched
        corpus_held.append(held(chains, future, np.isfinite(scores[:, 0])))
        context_held.append(held(ctx, future, order > 0))
    p, lc, lx = (np.concatenate(x) for x in (first_p, corpus_held, context_held))
    return {"p": p, "corpus": lc, "context": lx, "calibration": NGRAM_CALIBRATION, "entries": table.num_entries}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("table_records", type=Path, help="records .npz (tokens, offsets, prompt_len) the table counts")
    p.add_argument("test_records", type=Path, help="records .npz the chains are tested on")
    p.add_argument("--records", type=int, default=300)
    p.add_argument("--tokens", type=int, default=128, help="answer tokens looked at per test record")
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    require_positive(p, args, "records", "tokens", "depth")
    for path in (args.table_records, args.test_records):
        if not path.is_file():
            p.error(f"{path}: no such file")
    m = measure(args.table_records, args.test_records, args.records, args.tokens, args.depth)
    prob, lc, lx = m["p"], m["corpus"], m["context"]
    alpha, beta = m["calibration"]
    lines = [
        "# How the corpus chain holds on answers its table never saw",
        "",
        f"`python experiments/corpus_calibration.py {' '.join(sys.argv[1:] if argv is None else argv)}`: a table of "
        f"{m['entries']:,} n-grams, chains of {args.depth} at {len(prob):,} positions.",
        "",
        "| corpus fraction p of the first step | share of positions | first step holds | mean p | "
        f"estimate {alpha:g} p^{beta:g} | tokens held |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for lo, hi in zip(BINS[:-1], BINS[1:]):
        sel = (prob > 0) & (prob >= lo) & (prob < hi)
        if sel.any():
            mean_p = prob[sel].mean()
            lines.append(f"| [{lo:g}, {min(hi, 1):g}{']' if hi > 1 else ')'} | {sel.mean():.3f} | "
                         f"{(lc[sel] > 0).mean():.3f} | {mean_p:.3f} | {alpha * np.mean(prob[sel] ** beta):.3f} | "
                         f"{lc[sel].mean():.2f} |")
    both = np.maximum(lc, lx)
    lines += [
        "",
        "| chain | positions with a proposal holding >= 1 token | mean tokens held |",
        "|---|---:|---:|",
        f"| context | {(lx > 0).mean():.3f} | {lx.mean():.3f} |",
        f"| corpus | {(lc > 0).mean():.3f} | {lc.mean():.3f} |",
        f"| the better of the two | {(both > 0).mean():.3f} | {both.mean():.3f} |",
    ]
    emit(lines, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
