"""Is the drafter's tree shape limited by its calibration? A temperature on the draft marginals.

DDTree keeps the `budget` prefixes with the highest sum of per-depth draft log-probabilities. The
verifiers read only the target's probabilities, so any rescaling of the draft logits keeps decoding
exact and changes only which prefixes make the tree. If the drafter were over- or under-confident
(per depth, or on the paths that matter: those whose earlier tokens are right), a temperature
q_d ~ softmax(z_d / T_d) would pick better trees at no cost per round.

This script measures that on a data directory's records (the target's own greedy responses, so the
accepted length of a tree at an anchor is read off the data, as in the training-time held-out
check, `tevjax.train.heldout`):

1. simulated greedy tau per budget at global temperatures T, paired against T = 1 with records as
   units (`tevjax.stats.paired_gain`);
2. per depth: the mean top-1 draft probability against top-1 accuracy, over all anchors and over
   the anchors whose earlier data tokens were all the drafter's top-1 (the top path's conditional
   calibration, which is what the tree's deep nodes depend on);
3. per-depth temperatures chosen by coordinate descent on tau at one budget, scored on the same
   anchors: an optimistic upper bound on what per-depth calibration could give.

    python experiments/draft_temperature.py --data ~/.cache/tevjax/data-v8 --split heldout
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import numpy as np

from tevjax.stats import paired_gain

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import emit, require_positive  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "draft_temperature.md"
TOP = 32  # draft logits kept per depth: enough for budgets <= 32 (the builder's k = min(budget, V))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--drafter", default=None, help="DFlash drafter directory (default: the shipped one)")
    p.add_argument("--data", type=Path, required=True, help="a `tevjax data` directory")
    p.add_argument("--split", default="heldout", choices=("heldout", "train"))
    p.add_argument("--shards", default=None, help="comma-separated shard names (default: all of the split)")
    p.add_argument("--records", type=int, default=0, help="first N records (0 = all)")
    p.add_argument("--anchors", type=int, default=32, help="anchors per record")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.6, 0.7, 0.8, 0.9, 1.0, 1.15, 1.3, 1.5])
    p.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16, 32])
    p.add_argument("--tune-budget", type=int, default=8, help="budget whose tau the per-depth search maximises")
    p.add_argument("--seed", type=int, default=7, help="anchor sampling seed")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    require_positive(p, args, "anchors")
    if args.records < 0:
        p.error("--records must be >= 0")
    if any(not t > 0 for t in args.temperatures):
        p.error(f"--temperatures must all be > 0, got {args.temperatures}")
    if 1.0 not in args.temperatures:
        p.error("--temperatures must include 1.0 (the reference)")
    if any(not 1 <= b <= TOP for b in args.budgets) or args.tune_budget not in args.budgets:
        p.error(f"--budgets must lie in [1, {TOP}] and include --tune-budget {args.tune_budget}")
    if args.drafter is not None and not Path(args.drafter).is_dir():
        p.error(f"--drafter {args.drafter!r}: no such checkpoint directory")
    if not (args.data / "manifest.json").exists():
        p.error(f"--data {str(args.data)!r}: not a `tevjax data` directory (no manifest.json)")
    return args


def collect(args) -> dict[str, np.ndarray]:
    """Per valid anchor: the top TOP draft logits and ids per depth, log-normalisers per temperature,
    the data's next tokens and where they count, and the record each anchor came from."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from tevjax.loading import load_models
    from tevjax.train.dataset import Batch, TrainData
    from tevjax.train.heldout import block_truth
    from tevjax.train.objectives import batch_anchors

    m = load_models(drafter=args.drafter)
    data = TrainData(args.data, args.split, shards=args.shards.split(",") if args.shards else None)
    cols = data.tap_columns(m.drafter.cfg.target_layer_ids)
    n = len(data) if args.records == 0 else min(args.records, len(data))
    dgd, dstate = nnx.split(m.drafter)
    tgd, tstate = nnx.split(m.target)
    temps = tuple(args.temperatures)

    @jax.jit
    def stats(dstate, tstate, batch, key):
        drafter, target = nnx.merge(dgd, dstate), nnx.merge(tgd, tstate)
        anc, valid = batch_anchors(key, batch.loss_mask, args.anchors)
        z = drafter.logits(target, drafter.train_hidden(target, batch.features, batch.tokens, anc))
        z = z.astype(jnp.float32)  # [B, M, G, Vd]
        truth, ok = block_truth(batch.tokens, batch.loss_mask, anc, valid, z.shape[2])
        top, idx = jax.lax.top_k(z, TOP)
        return dict(top=top, ids=drafter.vocab_ids()[idx],
                    lse=jnp.stack([jax.nn.logsumexp(z / tt, axis=-1) for tt in temps], -1),
                    truth=truth, ok=ok, root=jnp.take_along_axis(batch.tokens, anc, axis=1), valid=valid)

    parts: dict[str, list[np.ndarray]] = {}
    for i, s in enumerate(range(0, n, 8)):
        recs = range(s, min(n, s + 8))
        batch = Batch(**{k: jnp.asarray(v) for k, v in data.batch(recs, cols, 512).items()})
        out = jax.device_get(stats(dstate, tstate, batch, jax.random.fold_in(jax.random.key(args.seed), i)))
        out["record"] = np.broadcast_to(np.asarray(recs)[:, None], out["valid"].shape)
        for k, v in out.items():
            v = np.asarray(v)
            parts.setdefault(k, []).append(v.reshape((-1,) + v.shape[2:]))
    got = {k: np.concatenate(v) for k, v in parts.items()}
    keep = got.pop("valid")
    return {k: v[keep] for k, v in got.items()}


def make_scorer(d: dict[str, np.ndarray], temps: tuple[float, ...], budgets: tuple[int, ...]):
    """score(t_idx [G] ints into temps) -> {budget: accepted tokens per anchor [A]} (1 + depth)."""
    import jax
    import jax.numpy as jnp

    from tevjax.builder import build_ddtree_from_top
    from tevjax.train.heldout import greedy_accepted_depth

    top, ids, lse, truth, ok, root = (jnp.asarray(d[k]) for k in ("top", "ids", "lse", "truth", "ok", "root"))

    @jax.jit
    def score(t_idx):
        t = jnp.asarray(temps, jnp.float32)[t_idx]  # [G]
        norm = jnp.take_along_axis(lse, jnp.broadcast_to(t_idx[None, :, None], lse.shape[:2] + (1,)), -1)
        vals = top / t[None, :, None] - norm
        out = {}
        for b in budgets:
            trees, _ = jax.vmap(build_ddtree_from_top, in_axes=(0, 0, 0, None))(vals[..., :b], ids[..., :b], root, b)
            depth = jax.vmap(greedy_accepted_depth)(trees.tokens, trees.parents, trees.valid, truth, ok)
            out[b] = 1 + depth
        return out

    return lambda t_idx: {b: np.asarray(v, np.float64) for b, v in score(jnp.asarray(t_idx, jnp.int32)).items()}


def per_record(accepted: np.ndarray, record: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(accepted tokens, anchors) summed per record: records are the units of the paired test."""
    recs, inv = np.unique(record, return_inverse=True)
    return np.bincount(inv, weights=accepted, minlength=len(recs)), np.bincount(inv, minlength=len(recs)).astype(float)


def calibration_rows(d: dict[str, np.ndarray], temps: tuple[float, ...]) -> list[str]:
    p1 = np.exp(d["top"][..., 0] - d["lse"][..., temps.index(1.0)])
    ok = d["ok"]
    hit = (d["ids"][..., 0] == d["truth"]) & ok
    rows, prefix = [], np.ones(len(ok), bool)
    for g in range(ok.shape[1]):
        m, c = ok[:, g], ok[:, g] & prefix
        rows.append(f"| {g + 1} | {m.sum()} | {p1[m, g].mean():.3f} | {hit[m, g].mean():.3f} | {c.sum()} | "
                    f"{p1[c, g].mean():.3f} | {hit[c, g].mean():.3f} |")
        prefix &= hit[:, g]
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    temps, budgets = tuple(args.temperatures), tuple(sorted(set(args.budgets)))
    d = collect(args)
    if len(d["root"]) == 0:
        raise SystemExit(f"no usable anchors in {args.data} ({args.split})")
    score = make_scorer(d, temps, budgets)
    depths = d["top"].shape[1]
    one = temps.index(1.0)
    ref = score([one] * depths)
    ref_rec = {b: per_record(ref[b], d["record"]) for b in budgets}
    nrec = len(np.unique(d["record"]))
    drafter = args.drafter or "the shipped one (tevjax/assets/smollm2-dflash)"
    lines = [f"# Draft temperature and the tree's shape ({datetime.date.today()})", "",
             f"`python experiments/draft_temperature.py {' '.join(sys.argv[1:] if argv is None else argv)}`", "",
             f"Drafter {drafter}; {args.data} ({args.split}); {nrec} records, "
             f"{len(d['root'])} anchors (up to {args.anchors} per record, seed {args.seed}). Simulated greedy tau "
             "(1 + depth the data's tokens reach in the drafter's DDTree tree); gains paired against T = 1 with "
             "records as units, 95% intervals.", "",
             "## 1. One temperature for every depth", "",
             "| T | " + " | ".join(f"tau@{b} (gain)" for b in budgets) + " |",
             "|---|" + "---|" * len(budgets)]
    raw = {"drafter": drafter, "data": str(args.data), "split": args.split, "records": nrec,
           "anchors": int(len(d["root"])), "seed": args.seed, "temperatures": list(temps), "global": {}}
    for j, t in enumerate(temps):
        got = ref if j == one else score([j] * depths)
        raw["global"][f"{t:g}"] = {str(b): float(got[b].mean()) for b in budgets}
        cells = []
        for b in budgets:
            tau = got[b].mean()
            if j == one:
                cells.append(f"{tau:.4f}")
            else:
                g = paired_gain(*ref_rec[b], *per_record(got[b], d["record"]))
                cells.append(f"{tau:.4f} ({100 * g['gain']:+.1f}% [{100 * g['lo']:+.1f}, {100 * g['hi']:+.1f}])")
        lines.append(f"| {t:g} | " + " | ".join(cells) + " |")
    lines += ["", "## 2. Calibration per depth (T = 1)", "",
              "All anchors where the depth's data token counts; then only those whose earlier data tokens "
              "were all the drafter's top-1 (the top path).", "",
              "| depth | anchors | mean top-1 prob | top-1 accuracy | top-path anchors | mean top-1 prob | "
              "top-1 accuracy |", "|---|---|---|---|---|---|---|"]
    lines += calibration_rows(d, temps)
    cur = [one] * depths
    best = ref[args.tune_budget].mean()
    for _ in range(2):
        for g in range(depths):
            for j in range(len(temps)):
                cand = cur[:g] + [j] + cur[g + 1:]
                v = score(cand)[args.tune_budget].mean()
                if v > best + 1e-12:
                    best, cur = v, cand
    tuned = score(cur)
    lines += ["", f"## 3. Per-depth temperatures tuned on these anchors (tau@{args.tune_budget}; optimistic)", "",
              "T per depth: " + ", ".join(f"{temps[j]:g}" for j in cur), "",
              "| budget | T = 1 | tuned | gain |", "|---|---|---|---|"]
    for b in budgets:
        g = paired_gain(*ref_rec[b], *per_record(tuned[b], d["record"]))
        lines.append(f"| {b} | {ref[b].mean():.4f} | {tuned[b].mean():.4f} | {100 * g['gain']:+.1f}% "
                     f"[{100 * g['lo']:+.1f}, {100 * g['hi']:+.1f}] |")
    raw["per_depth"] = {"temperatures": [temps[j] for j in cur],
                        "tau": {str(b): float(tuned[b].mean()) for b in budgets}}
    emit(lines, args.out)
    args.out.with_suffix(".json").write_text(json.dumps(raw, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
