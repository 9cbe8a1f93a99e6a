"""Paired screen of drafters on the held-out records: simulated greedy tau, in seconds not minutes.

A data directory's held-out records are the target's own greedy responses to held-out prompts,
with the target's features. At an anchor in a response, the drafter's DDTree at budget b accepts,
under greedy verification, exactly the path that follows the recorded continuation, so the block
length there can be read off the data without running the target (`tevjax.train.heldout`). This
script scores several drafters at the same anchors of every held-out record and compares them
paired over records (records are the independent units; `tevjax.stats.paired_gain`).

It measures the same quantity as decoding (`round_blocks.py`), weighted differently: anchors
sample every response position, where decoding's rounds start wherever the previous block ended.
On 64 records x 128 anchors it resolves about +-0.7% of tau at budget 8 in ~25 s per drafter; a
decoding test of that precision takes ~16 minutes. Use it to choose what to decode, not instead of
the decoding test: the held-out records are prompts 0-63 of `tevjax/assets/heldout.jsonl`, so a
decoding test that should be independent of a screen uses other prompts (`--first-prompt 64`).

`--trajectory` scores every position and walks the rounds as decoding takes them (each round's
root is the token the previous tree missed; `tevjax.train.heldout.trajectory_blocks`): tau_traj is
decoding's own tau on the recorded answers, which uniform anchors overstate (decoding's roots are
the harder positions). It costs ~4x the anchors of the default 128 per record.

    python experiments/heldout_screen.py --data DATA --drafter A --label a --drafter B --label b
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np

from tevjax.stats import paired_gain

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_trees import machine_facts, versions  # noqa: E402
from report import QUANTILE, drafters_and_labels, emit, require_positive  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "heldout_screen.md"
PAIRED = "Paired over records against {} (95% interval of the relative gain):"  # where the paired lines start


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, required=True,
                   help="a `tevjax data` directory with held-out records (its heldout shard)")
    p.add_argument("--drafter", action="append", default=None,
                   help="DFlash checkpoint directory (repeat to compare; default: the shipped drafter)")
    p.add_argument("--label", action="append", default=None, help="one per --drafter")
    p.add_argument("--records", type=int, default=64, help="held-out records scored (at most those stored)")
    p.add_argument("--anchors", type=int, default=128, help="anchors drawn per record")
    p.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--seq-len", type=int, default=512, help="record length read (prompt + response)")
    p.add_argument("--seed", type=int, default=1234, help="anchor draw (the same for every drafter)")
    p.add_argument("--trajectory", action="store_true",
                   help="also score decoding's rounds along each record (every position is an anchor)")
    p.add_argument("--out", type=Path, default=RESULTS, help="results markdown; .json goes next to it")
    args = p.parse_args(argv)
    require_positive(p, args, "records", "anchors", "seq_len")
    if min(args.budgets) < 1:
        p.error(f"--budgets must all be >= 1, got {args.budgets}")
    if not (args.data / "manifest.json").is_file():
        p.error(f"--data {str(args.data)!r}: not a `tevjax data` directory (no manifest.json)")
    drafters_and_labels(p, args, default_label="shipped")
    return args


def _sums(run: dict, kind: str, budget: int) -> tuple[list, list]:
    """Per record (blocks, rounds) of one tau: uniform anchors ("sim") or decoding's rounds ("traj")."""
    if kind == "sim":
        return run[f"tau_{budget}"], run["anchors"]
    return run[f"traj_tokens_{budget}"], run[f"traj_rounds_{budget}"]


def _tau(run: dict, kind: str, budget: int) -> float:
    blocks, rounds = _sums(run, kind, budget)
    return sum(blocks) / max(sum(rounds), 1)


def paired_lines(runs: dict, kinds, budgets) -> list[str]:
    """Each drafter's paired gain over the first one's, per kind of tau and budget (none for one drafter)."""
    labels = list(runs)
    if len(labels) < 2:
        return []
    first = runs[labels[0]]
    lines = ["", PAIRED.format(labels[0]), ""]
    for label in labels[1:]:
        for kind in kinds:
            parts = []
            for b in budgets:
                g = paired_gain(*_sums(first, kind, b), *_sums(runs[label], kind, b))
                parts.append(f"@{b} {g['gain']:+.1%} [{g['lo']:+.1%}, {g['hi']:+.1%}]")
            lines.append(f"- {label}, tau_{kind}: " + "; ".join(parts) + ".")
    return lines


def main(argv=None) -> int:
    started, date = time.perf_counter(), datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    from tevjax.convert.dflash_ckpt import load_dflash  # after the arguments: a bad command line fails at once
    from tevjax.loading import EMBEDDED, TRAINED_DRAFTERS, load_target
    from tevjax.train.dataset import TrainData
    from tevjax.train.heldout import HeldoutEval

    loaded = load_target(EMBEDDED, dtype="float32")
    try:
        data = TrainData(args.data, "heldout")
    except FileNotFoundError:
        raise SystemExit(f"--data {str(args.data)!r}: holds no held-out records") from None
    runs = {}
    screen = None
    for label, path in zip(args.label, args.drafters):
        _, drafter = load_dflash(Path(path or TRAINED_DRAFTERS[EMBEDDED]), loaded.target_cfg, dtype="float32",
                                 param_dtype="float32")
        if screen is None:  # the same records and anchors for every drafter (their taps must agree)
            taps = drafter.cfg.target_layer_ids
            screen = HeldoutEval(data, data.tap_columns(taps), records=args.records, anchors=args.anchors,
                                 seq_len=args.seq_len, budgets=tuple(args.budgets), seed=args.seed,
                                 trajectory=args.trajectory)
        elif drafter.cfg.target_layer_ids != taps:
            raise SystemExit(f"{label}: taps {drafter.cfg.target_layer_ids} differ from {args.label[0]}'s {taps}")
        t0 = time.perf_counter()
        rec = screen.per_record(drafter, loaded.target)
        acc = rec["acc_hits"].sum(0) / np.maximum(rec["acc_count"].sum(0), 1)
        runs[label] = {"drafter": path or "shipped", "seconds": time.perf_counter() - t0,
                       "anchors": rec["anchors"].tolist(), "acc": acc[:4].tolist(),
                       **{k: rec[k].tolist() for k in rec if k.startswith(("tau_", "traj_"))}}
        print(f"{label}: {runs[label]['seconds']:.0f} s", flush=True)

    first = next(iter(runs.values()))
    kinds = ("sim", "traj") if args.trajectory else ("sim",)
    lines = [
        "# Held-out screen: simulated greedy tau, paired over records",
        "",
        f"- Date: {date}; wall time {(time.perf_counter() - started) / 60:.1f} min.",
        f"- Command: `python experiments/heldout_screen.py {' '.join(argv)}`",
        f"- Machine: {machine_facts()}.",
        f"- {len(first['anchors'])} held-out records of `{args.data.name}`, {int(sum(first['anchors']))} anchors "
        + ("(every position of each answer" if args.trajectory
           else f"(up to {args.anchors} per record, seed {args.seed}")
        + ", the same for every drafter). tau_sim@b: the greedy "
        "block length (accepted + bonus) of the drafter's DDTree at budget b against the target's recorded "
        "continuation. acc@k: top-1 accuracy at block position k."
        + (" tau_traj@b: tokens per round along decoding's rounds (`--trajectory`)." if args.trajectory else ""),
        "",
        "| drafter | " + " | ".join(f"tau_{kind}@{b}" for kind in kinds for b in args.budgets)
        + " | acc@1 | acc@2 | acc@3 | acc@4 |",
        "|---|" + "---:|" * (len(kinds) * len(args.budgets) + 4),
    ]
    for label, run in runs.items():
        lines.append(f"| {label} | " + " | ".join(f"{_tau(run, kind, b):.3f}" for kind in kinds for b in args.budgets)
                     + " | " + " | ".join(f"{a:.3f}" for a in run["acc"]) + " |")
    lines += paired_lines(runs, kinds, args.budgets)
    emit(lines, args.out)
    payload = {"date": date, "command": "python experiments/heldout_screen.py " + " ".join(argv),
               "machine": machine_facts(), "versions": versions(), "quantile": QUANTILE,
               "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "runs": runs}
    Path(args.out).with_suffix(".json").write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
