"""Writes the weighted parameter average of DFlash drafters that share one config.

    python experiments/average_drafters.py A B [--weights 0.5 0.5] --out DIR [--dtype bfloat16]

Used for a drafter and its own fine-tune (weight-space interpolation, as in WiSE-FT); decode the
result against both with `experiments/round_blocks.py` before trusting it.
"""

from __future__ import annotations

import argparse
import json
import sys

from tevjax.convert.dflash_ckpt import average_dflash, save_dflash
from tevjax.convert.hf import CheckpointError


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("drafters", nargs="+", help="DFlash drafter directories (at least 2)")
    p.add_argument("--weights", type=float, nargs="+", default=None,
                   help="one per drafter, summing to 1 (default: equal)")
    p.add_argument("--out", required=True, help="directory to write")
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    args = p.parse_args(argv)
    try:
        cfg, drafter = average_dflash(args.drafters, args.weights)
        save_dflash(drafter, cfg, args.out, dtype=args.dtype)
    except (ValueError, CheckpointError, OSError) as e:
        print(f"average_drafters: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"out": args.out, "drafters": args.drafters, "weights": args.weights, "dtype": args.dtype}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
