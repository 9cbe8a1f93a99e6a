"""Tensor parallelism of the LM head and the embedding: split the vocabulary or the model width?

`tevjax.sharding.LOGICAL_RULES` can put the `model` mesh axis on either axis of the [V, D]
embedding and the [D, V] LM head. This measures, on forced CPU devices (one `model` axis of 4), the
two stages those matrices touch in a decoding round:

* head + verify: logits [B, N, V] = hidden [B, N, D] @ head, then TEV at temperature 1 on every
  row (what a tree pass and the verifier do);
* embed: the lookup of the [B, N] tree tokens, its result then needed whole on every device (the
  next layer's input);
* draft head: a drafter with a reduced vocabulary of Vd ids scores [B, G, D] hidden states
  through those columns of the (vocabulary-split) head, either by taking the head's columns
  first (`DFlashDrafter.logits`) or by scoring the whole vocabulary and taking the logits'
  columns after (`select_after=True`, what the decoder uses on a mesh).

For each choice it reports the bytes the compiled program moves between devices (the sum of the
result sizes of its collectives, read from the HLO text: deterministic) and the median wall time
(noisy: the forced devices share the machine's cores).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python experiments/lm_head_sharding.py
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import time
from pathlib import Path

if "XLA_FLAGS" not in os.environ:  # before jax is imported
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from report import emit  # noqa: E402  experiments/report.py (scripts run from this folder)
from tevjax.builder import build_ddtree  # noqa: E402
from tevjax.sharding import make_mesh  # noqa: E402
from tevjax.verifiers import verify  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "lm_head_sharding.md"
_COLLECTIVE = re.compile(r"= (\(?[a-z0-9]+\[[^=]*?\]\)?)\S* (all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute)(?:-start)?\(")
_BYTES = {"f32": 4, "s32": 4, "u32": 4, "bf16": 2, "pred": 1, "s8": 1, "u8": 1}


def collective_bytes(hlo: str) -> tuple[int, dict[str, int]]:
    """(total bytes, bytes by collective kind) of the collectives' results in compiled HLO text."""
    by_kind: dict[str, int] = {}
    for m in _COLLECTIVE.finditer(hlo):
        size = 0
        for dtype, dims in re.findall(r"([a-z]+[0-9]*)\[([0-9,]*)\]", m.group(1)):
            size += _BYTES.get(dtype, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
        by_kind[m.group(2)] = by_kind.get(m.group(2), 0) + size
    return sum(by_kind.values()), by_kind


def timed(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--width", type=int, default=576)  # SmolLM2-135M
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--draft-vocab", type=int, default=16384)  # the shipped drafter's
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    mesh = make_mesh(1, len(jax.devices()))
    m = mesh.shape["model"]
    b, n, v, d = args.rows, args.budget + 1, args.vocab, args.width
    rng = np.random.default_rng(0)
    head = rng.standard_normal((d, v), np.float32) / np.sqrt(d)
    hidden = jnp.asarray(rng.standard_normal((b, n, d), np.float32))
    marg = jax.nn.log_softmax(3.0 * jnp.asarray(rng.standard_normal((b, 15, v), np.float32)), axis=-1)
    trees, _ = jax.vmap(build_ddtree, in_axes=(0, 0, None))(marg, jnp.ones(b, jnp.int32), args.budget)
    keys = jax.random.split(jax.random.key(0), b)
    whole = NamedSharding(mesh, P())

    def head_verify(h, w, trees, keys):
        logits = jnp.einsum("bnd,dv->bnv", h, w)
        return jax.vmap(lambda k, t, l: verify(k, t, l, 1.0, "tev"))(keys, trees, logits).tokens

    def embed(e, tokens):
        return jax.lax.with_sharding_constraint(jnp.take(e, tokens, axis=0), whole)

    draft_hidden = jnp.asarray(rng.standard_normal((b, args.block - 1, d), np.float32))
    draft_ids = jnp.asarray(np.sort(rng.choice(v, args.draft_vocab, replace=False)), jnp.int32)

    def draft_rows_first(h, w, ids):
        return jnp.einsum("bgd,dv->bgv", h, jnp.take(w, ids, axis=1))

    def draft_select_after(h, w, ids):
        return jnp.take(jnp.einsum("bgd,dv->bgv", h, w), ids, axis=-1)

    def measure(name, stage, fn, fargs):
        total, kinds = collective_bytes(fn.lower(*fargs).compile().as_text())
        ms = timed(fn, fargs, args.repeats)
        cells[(name, stage)] = (total, ms)
        detail = ", ".join(f"{k} {s / 1024:.1f}" for k, s in sorted(kinds.items())) or "none"
        rows.append(f"| {name} | {stage} | {total / 1024:.1f} | {detail} | {ms:.2f} |")

    rows, cells = [], {}
    for name, head_spec, embed_spec in (("vocab", P(None, "model"), P("model", None)),
                                        ("embed", P("model", None), P(None, "model")),
                                        ("replicated", P(), P())):
        w = jax.device_put(head, NamedSharding(mesh, head_spec))
        e = jax.device_put(np.ascontiguousarray(head.T), NamedSharding(mesh, embed_spec))
        for stage, fn, fargs in (("head + verify", jax.jit(head_verify), (hidden, w, trees, keys)),
                                 ("embed", jax.jit(embed), (e, trees.tokens))):
            measure(name, stage, fn, fargs)
        if name == "vocab":
            for stage, fn in (("draft head, columns first", draft_rows_first),
                              ("draft head, select after", draft_select_after)):
                measure(name, stage, jax.jit(fn), (draft_hidden, w, draft_ids))
    logits_kib = b * n * v * 4 / 1024
    first, after = cells[("vocab", "draft head, columns first")], cells[("vocab", "draft head, select after")]
    lines = [
        "# LM head and embedding: vocabulary- or width-sharded",
        "",
        f"Device: {m} forced CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count={m}`) on "
        f"{os.cpu_count()} shared CPU cores ({platform.machine()}), jax {jax.__version__}; mesh data=1, "
        f"model={m}; B = {b} rows, N = {n} tree slots (budget {args.budget}), V = {v:,}, D = {d}, float32; "
        f"TEV at temperature 1; draft head: G = {args.block - 1} block positions, Vd = {args.draft_vocab:,} "
        f"draft ids. Median of {args.repeats} calls after warm-up.",
        "Command: `python experiments/lm_head_sharding.py`",
        "",
        f"KiB moved = the summed result sizes of the compiled program's collectives (the [B, N, V] logits "
        f"are {logits_kib:.0f} KiB).",
        "",
        "| split | stage | KiB moved | by collective (KiB) | ms |",
        "|---|---|---:|---|---:|",
        *rows,
        "",
        f"Per round, vocab-sharded moves {(cells[('vocab', 'head + verify')][0] + cells[('vocab', 'embed')][0]) / 1024:.1f} "
        f"KiB and width-sharded {(cells[('embed', 'head + verify')][0] + cells[('embed', 'embed')][0]) / 1024:.1f} KiB; "
        f"head + verify time, width- / vocab-sharded: "
        f"{cells[('embed', 'head + verify')][1] / cells[('vocab', 'head + verify')][1]:.2f}x.",
        f"Draft head under the vocabulary split: columns first moves {first[0] / 1024:.1f} KiB per call, select "
        f"after {after[0] / 1024:.1f} KiB ({first[0] / max(after[0], 1):.1f}x less); time, columns first / "
        f"select after: {first[1] / after[1]:.2f}x.",
        "",
        "How to read: the bytes are exact properties of the compiled programs and are what a GPU pays over "
        "its interconnect. The times are not a GPU's: forced CPU devices share this machine's cores and "
        "memory, so a collective is a memory copy, and the times are only comparable within this run.",
    ]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
