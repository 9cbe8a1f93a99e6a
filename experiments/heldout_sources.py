"""Which training records share a ShareGPT conversation with a held-out prompt, and the corpus without them.

The packaged ShareGPT file splits long conversations into records "<share id>_<k>"
(`tevjax.prompts.source_conversation`). Until 2026-12-05 the later-turn plan of `tevjax data`
left out only the held-out records themselves, so turns from the rest of 70 held-out prompts'
conversations became training prompts. This script rebuilds that plan (`--exclusion
conversation`, later turns, seed 0, 32,000 prompts), maps each record of the GPU run's records
files to its plan prompt (checking that the record's prompt tokens are that prompt's), and writes:

- `--out` (JSON): the plan indices of the records whose conversation is a held-out prompt's
  (`drop_index`), and how many such records each held-out prompt has;
- `--corpus-out` (npz): the corpus lookup's records (`tevjax.loading.load_ngrams`) without them,
  with each record's plan index (`index`) for provenance.

    python experiments/heldout_sources.py \\
        --corpus-out tevjax/assets/smollm2-dflash/corpus.npz   # ~1 minute on 2 cores
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RECORDS = [HERE / "results" / f"gpu_drafter_scale_records-{k}.npz" for k in (0, 1)]
OUT = HERE / "results" / "gpu_records_heldout_sources.json"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=Path, nargs="+", default=RECORDS, help="records .npz files (index, prompt_len)")
    p.add_argument("--num-prompts", type=int, default=32000, help="the later-turn plan the records' indices refer to")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--corpus-out", type=Path, default=None)
    args = p.parse_args(argv)
    for path in args.records:
        if not path.is_file():
            p.error(f"{path}: no such file")

    from tevjax.convert.embedded import prepare_smollm2
    from tevjax.convert.tokenizer import load_tokenizer
    from tevjax.prompts import source_conversation
    from tevjax.train.rollout import RolloutConfig, select_prompts

    cfg = RolloutConfig(num_prompts=args.num_prompts, turns="later", exclusion="conversation", taps=(0,))
    held, plan = select_prompts(load_tokenizer(prepare_smollm2()), cfg)
    held_of = collections.defaultdict(list)  # share id -> held-out prompt indices
    for r in held:
        held_of[source_conversation(r["id"])].append(r["index"])
    parts = [dict(np.load(path)) for path in args.records]
    index = np.concatenate([z["index"] for z in parts]).astype(np.int64)
    tokens = np.concatenate([z["tokens"] for z in parts])
    lengths = np.concatenate([np.diff(z["offsets"]) for z in parts])
    offsets = np.r_[0, np.cumsum(lengths)]
    prompt_len = np.concatenate([z["prompt_len"] for z in parts]).astype(np.int64)
    for r, i in enumerate(index):  # the records' indices really are this plan's
        if tokens[offsets[r]:offsets[r] + prompt_len[r]].tolist() != plan[i]["prompt_ids"]:
            raise SystemExit(f"record {r} (plan index {i}): its prompt is not the plan's prompt {plan[i]['id']}")
    shared = np.array([source_conversation(plan[i]["id"]) in held_of for i in index])
    affected = collections.Counter(h for i in index[shared] for h in held_of[source_conversation(plan[i]["id"])])
    report = {
        "plan": "tevjax data --num-prompts %d --turns later --exclusion conversation" % args.num_prompts,
        "records": [str(path.relative_to(HERE.parent)) if path.is_relative_to(HERE.parent) else str(path)
                    for path in args.records],
        "num_records": int(len(index)),
        "plan_prompts_sharing": int(sum(source_conversation(r["id"]) in held_of for r in plan)),
        "drop_index": sorted(int(i) for i in index[shared]),
        "heldout_affected": {str(h): n for h, n in sorted(affected.items())},
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{shared.sum()} of {len(index)} records share a conversation with {len(affected)} held-out prompts "
          f"({report['plan_prompts_sharing']} of the plan's {len(plan)} prompts); wrote {args.out}")
    if args.corpus_out is not None:
        keep = np.flatnonzero(~shared)
        seqs = [tokens[offsets[r]:offsets[r + 1]] for r in keep]
        np.savez_compressed(args.corpus_out, tokens=np.concatenate(seqs).astype(np.uint16),
                            offsets=np.r_[0, np.cumsum([len(s) for s in seqs])].astype(np.int64),
                            starts=prompt_len[keep].astype(np.int32), index=index[keep].astype(np.int32))
        print(f"wrote {args.corpus_out}: {len(keep)} records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
