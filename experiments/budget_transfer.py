"""Budget transfer (paper Table 5): a drafter fine-tuned with ExitTrain at one tree budget, evaluated at others.

The exit loss builds its trees at one budget (`--exit-budget` of `tevjax train`). This script
fine-tunes the ExitTrain arm (`--arm`, default omega = w) at each budget in `--train-budgets`,
with everything else as in `exittrain_ablation.py` (same starting checkpoint, data order, steps and
seed; the same run folders, so arms the ablation trained are reused, not retrained), and evaluates
every drafter at every budget in `--budgets`, next to the token-only arm of the same folder.
The tables' rows are the training budgets and their columns the evaluation budgets: a drafter
trained at B_train that keeps its gain over token-only at B_eval != B_train transfers.

    python experiments/budget_transfer.py                          # trains at 8 and 32 (hours on 2 cores)
    python experiments/budget_transfer.py --train-budgets 8 32 --steps 100 --budgets 4 8 16 32 \\
        --prompt-sets heldout --num-prompts 16 --temperatures 0
    python experiments/budget_transfer.py --quick                  # tiny random target, /tmp
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from exittrain_ablation import ARMS, add_eval_args, add_training_args, check_common, run_and_report  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "budget_transfer.md"
QUICK_RESULTS = Path("/tmp/budget_transfer_quick.md")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arm", default="w", help=f"the exit-loss arm to transfer, one of {', '.join(a for a in ARMS if a != 'token')}")
    p.add_argument("--train-budgets", type=int, nargs="+", default=[8, 32], help="exit-loss tree budgets to train at")
    add_training_args(p, steps=1000)
    add_eval_args(p, budgets=(4, 8, 16, 32, 64), temperatures=(0.0, 1.0), sets=("heldout",), num_prompts=16)
    p.add_argument("--quick", action="store_true", help=f"tiny random target; writes {QUICK_RESULTS} unless --out")
    p.add_argument("--out", type=Path, default=None, help=f"results markdown (default {RESULTS})")
    args = p.parse_args(argv)
    if args.arm not in ARMS or args.arm == "token":
        p.error(f"--arm {args.arm!r}: choose an exit-loss arm, one of {', '.join(a for a in ARMS if a != 'token')}")
    if any(b < 1 for b in args.train_budgets):
        p.error("--train-budgets must be >= 1")
    args.train_budgets = sorted(set(args.train_budgets))
    if args.quick:
        args.train_budgets, args.budgets, args.temperatures, args.prompt_sets = [3, 5], [3, 5], [1.0], ["heldout"]
    check_common(p, args, QUICK_RESULTS, RESULTS, "/tmp/tevjax-ablation-quick")
    return args


def png_title(quick: bool, steps: int) -> str:
    return f"Budget transfer ({'tiny' if quick else 'SmolLM2'}, {steps} steps per arm)"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    specs = [("token", "token", args.train_budgets[0])]
    specs += [(f"{args.arm} @ B_train={b}", args.arm, b) for b in args.train_budgets]
    run_and_report(args, argv, specs, title="Budget transfer: ExitTrain trained at one budget, evaluated at others",
                   script="budget_transfer.py",
                   notes=[f"- Arm `{args.arm}` = {ARMS[args.arm][1]}, trained at exit-loss budgets "
                          f"{args.train_budgets}; `token` = the token-only arm of the same runs. In each table a row "
                          "is a training budget, a column an evaluation budget; the gain is against `token` on "
                          "the same prompts (the column where B = B_train is the in-budget case)."],
                   png_title=png_title(args.quick, args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
