"""Prepares the two folders that `drafter_scale.sh` carries to a GPU machine (two calls of at most 64 MiB).

    python experiments/gpu/stage_drafter_scale.py STAGE1 STAGE2 [--turns first later] [--no-records]

STAGE1 (call 1, `drafter_scale.sh probe STAGE1`): the first half of the embedded target's GGUF
(`gguf.partA`), its HF `config.json`, `prompts.npz` and the wheels the machine lacks (`gguf`, and
`optax`; never flax, whose carried wheel broke under the machine's jax). STAGE2 (call 2,
`drafter_scale.sh run STAGE2 ...`): the GGUF's second half, its SHA-256, the wheels again, and by
default the GPU run's records with the list of those to leave out
(`experiments/results/gpu_drafter_scale_records-*.npz`, `gpu_records_heldout_sources.json`; pass
`--records ... --drop-index ...` in DS_ARGS).

`prompts.npz` holds every training prompt of the plans of `--turns` that fits 256 tokens, in that
order (generation runs in order until its deadline, so the first plan is answered first), less
those whose greedy answers the GPU run's records already hold (`--all-prompts` keeps them): the
plans `tevjax data` makes today, which leave out every turn of a held-out prompt's ShareGPT
conversation. `index` is the prompt's row in its plan, plus 1,000,000 for first turns. The folders
must lie inside the working tree, untracked and not ignored, to travel. Each call sends the tree
too, so `experiments/checkpoints`, `experiments/results` and the shipped corpus (none needed there)
move out of it for both calls, and each call's other folder as well; the GGUF is split so that
the two calls weigh the same, and the script fails if either would pass the 64 MiB cap.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from drafter_scale import load_records  # noqa: E402  (this folder's)

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "experiments" / "results"
FIRST_TURN_OFFSET = 1_000_000  # index of first-turn prompts in prompts.npz: row + this
CAP = 64 * 2**20
RECORDS = sorted(RESULTS.glob("gpu_drafter_scale_records-*.npz"))  # the first GPU run's answers
MARGIN = 2**20  # the call's own bookkeeping, and files the tree gains before the call
# Not needed on the GPU machine; the tree cannot carry them next to half of the GGUF.
MOVE_OUT = tuple(ROOT / p for p in ("experiments/checkpoints", "experiments/results",
                                    "tevjax/assets/smollm2-dflash/corpus.npz"))
WHEELS = ("gguf", "optax")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stage1", type=Path)
    p.add_argument("stage2", type=Path)
    p.add_argument("--turns", nargs="+", choices=["first", "later"], default=["first", "later"])
    p.add_argument("--wheels", type=Path, default=Path("/opt/pypi/files"),
                   help="a folder with gguf-*.whl and optax-*.whl (else they are fetched with pip download)")
    p.add_argument("--no-records", action="store_true", help="do not carry the GPU run's records to STAGE2")
    p.add_argument("--all-prompts", action="store_true",
                   help="keep the prompts the GPU run's records already answer (for sampled responses, "
                        "--temperature 1; by default they are left out, as their greedy answers travel in STAGE2)")
    p.add_argument("--max-prompts", type=int, default=None, help="at most this many prompts per plan (tests)")
    args = p.parse_args(argv)
    for d in (args.stage1, args.stage2):
        if d.exists() and any(d.iterdir()):
            p.error(f"{d} exists and is not empty")
    if args.max_prompts is not None and args.max_prompts < 1:
        p.error(f"--max-prompts must be >= 1, got {args.max_prompts}")
    return args


def answered_prompts() -> set[tuple[int, ...]]:
    """The prompts (token ids) the GPU run's records already answer."""
    return {tuple(p) for f in RECORDS for p, _, _ in load_records(f)}


def plan_prompts(turns: list[str], max_prompts: int | None,
                 skip: set[tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids uint16, offsets, index) of every training prompt of the plans, first plan first, less
    those in `skip`."""
    from tevjax.convert.embedded import prepare_smollm2
    from tevjax.convert.tokenizer import load_tokenizer
    from tevjax.train.rollout import RolloutConfig, select_prompts

    tokenizer = load_tokenizer(prepare_smollm2())
    seqs, index = [], []
    for plan in turns:
        cfg = RolloutConfig(num_prompts=max_prompts or 10**6, turns=plan, taps=(0,))
        _, rows = select_prompts(tokenizer, cfg, exact=False)
        kept = [r for r in rows if tuple(r["prompt_ids"]) not in skip]
        seqs += [r["prompt_ids"] for r in kept]
        index += [r["index"] + (FIRST_TURN_OFFSET if plan == "first" else 0) for r in kept]
        print(f"{plan} turns: {len(kept)} prompts ({len(rows) - len(kept)} already answered)")
    if max(max(s) for s in seqs) >= 2**16:
        raise SystemExit("token ids do not fit uint16")
    return (np.concatenate([np.asarray(s, np.uint16) for s in seqs]), np.r_[0, np.cumsum([len(s) for s in seqs])],
            np.asarray(index, np.int64))


def wheels(folder: Path, into: Path) -> None:
    for name in WHEELS:
        found = sorted(folder.glob(f"{name}-*.whl")) if folder.is_dir() else []
        if found:
            shutil.copy2(found[-1], into)
        else:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(into), name],
                           check=True)


def tree_bytes(exclude: tuple[Path, ...]) -> int:
    """What the working tree sends (tracked files and untracked ones that git does not ignore),
    less the paths in `exclude`."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout.decode()
    files = [(ROOT / f).resolve() for f in out.split("\0") if f]
    return sum(f.stat().st_size for f in files
               if f.is_file() and not any(f == e or f.is_relative_to(e) for e in exclude))


def main(argv=None) -> int:
    args = parse_args(argv)
    from tevjax.convert.embedded import prepare_smollm2, smollm2_gguf_path

    for d in (args.stage1, args.stage2):
        d.mkdir(parents=True, exist_ok=True)
    shutil.copy2(prepare_smollm2() / "config.json", args.stage1 / "config.json")
    ids, offsets, index = plan_prompts(args.turns, args.max_prompts, set() if args.all_prompts else answered_prompts())
    np.savez_compressed(args.stage1 / "prompts.npz", ids=ids, offsets=offsets, index=index)
    for d in (args.stage1, args.stage2):
        wheels(args.wheels, d)
    if not args.no_records:
        for f in RECORDS + [RESULTS / "gpu_records_heldout_sources.json"]:
            shutil.copy2(f, args.stage2)
    # The GGUF is split so that both calls send the same amount, with the tree they travel in.
    stages = (args.stage1, args.stage2)
    other = [sum(f.stat().st_size for f in d.iterdir()) for d in stages]
    tree = tree_bytes(exclude=MOVE_OUT + tuple(d.resolve() for d in stages))
    gguf = smollm2_gguf_path().read_bytes()
    a = min(max((len(gguf) + other[1] - other[0]) // 2, 0), len(gguf))
    (args.stage1 / "gguf.partA").write_bytes(gguf[:a])
    (args.stage2 / "gguf.partB").write_bytes(gguf[a:])
    (args.stage2 / "gguf.sha256").write_text(hashlib.sha256(gguf).hexdigest() + "\n")
    calls = [tree + other[0] + a, tree + other[1] + len(gguf) - a]
    print(json.dumps({"prompts": int(len(index)), "tree_bytes": tree, "call_bytes": calls, "cap": CAP}))
    print("For both calls, move these out of the working tree: " + ", ".join(str(p.relative_to(ROOT)) for p in MOVE_OUT)
          + "; and each call's other folder.")
    for d in stages:
        if not d.resolve().is_relative_to(ROOT):
            print(f"note: {d} is outside the working tree: a call sends it only from inside")
    if max(calls) > CAP - MARGIN:
        raise SystemExit(f"a call would send {max(calls) / 2**20:.1f} MiB, over the cap of 64 MiB less "
                         f"{MARGIN / 2**20:g} MiB of margin: carry fewer prompts or records, or split the GGUF "
                         "in three")
    return 0


if __name__ == "__main__":
    sys.exit(main())
