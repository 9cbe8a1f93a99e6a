"""Rebuilds the statistics of a report from the per-prompt (or per-record) counts its results JSON
keeps: no training, no decoding. For when the statistics change and the decoding does not: on
2026-12-07 the paired intervals and the plots' bars moved from the normal quantile (1.96) to Student's
t with n - 1 degrees of freedom (`tevjax.stats.q95`), which the reports made before then still showed.

- `exittrain_ablation.py` and `budget_transfer.py` reports: the tau tables, the summary and the plot.
- `heldout_screen.py` and `round_blocks.py` reports: the paired gains.

The header, the run's own figures (date, wall time, command) and, for the ablations, the training
table are kept; a line under the header says when and how the rest was rebuilt. A report whose
rebuilt part equals its own is left untouched.

    python experiments/rerender.py experiments/results/exittrain_ablation*.json \
        experiments/results/budget_transfer.json experiments/results/heldout_screen_*.json \
        experiments/results/round_blocks*.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import budget_transfer  # noqa: E402
import exittrain_ablation  # noqa: E402
import heldout_screen  # noqa: E402
import round_blocks  # noqa: E402
from exittrain_ablation import plot, pooled_lines, summarise_all, tau_tables  # noqa: E402
from report import QUANTILE  # noqa: E402

NOTE = "- Statistics rebuilt"  # the start of the line this script adds (replaced on a rerun)
TITLES = {"exittrain_ablation.py": exittrain_ablation.png_title, "budget_transfer.py": budget_transfer.png_title}


def _ablation(raw: dict, lines: list[str], png: Path, script: str) -> tuple[int, int, list[str], callable]:
    """(where the rebuilt part starts and ends, its new lines, what writes the rest) for an ablation report."""
    cfg, counts = raw["config"], raw["per_prompt"]
    labels = list(raw["arms"])  # the baseline first, as run_and_report ordered them
    sets, temperatures, budgets = cfg["prompt_sets"], cfg["temperatures"], cfg["budgets"]
    first = f"## {sets[0]}, T = {temperatures[0]:g}"
    if first not in lines:
        raise SystemExit(f"no {first!r} section in the report")
    table = summarise_all(counts, labels[0])
    new = tau_tables(table, labels, sets, temperatures, budgets) + pooled_lines(table, labels, sets, temperatures,
                                                                               budgets)
    image = f"![tau by budget per arm]({png.name})"
    new += ["", image]
    title = TITLES[script](cfg["quick"], cfg["steps"])

    def finish():
        plot(table, labels, sets, temperatures, budgets, png, title, cfg["num_prompts"])
        raw["results"] = table

    start = lines.index(first)
    end = lines.index(image, start) + 1 if image in lines[start:] else len(lines)
    return start, end, new, finish


def _paired(raw: dict, lines: list[str], heading: str, new: list[str]) -> tuple[int, int, list[str], callable]:
    """The same for a report whose statistics are one block of paired lines under `heading` (the blank
    line before it included; the notes after the block kept)."""
    start = lines.index(heading) - 1 if heading in lines else len(lines)
    end = start + 3  # a blank line, the heading, a blank line, then its bullets up to a blank line
    while end < len(lines) and lines[end]:
        end += 1

    def finish():
        raw.pop("z95", None)
        raw["quantile"] = QUANTILE

    return start, end, new, finish


def _screen(raw: dict, lines: list[str], png: Path, script: str) -> tuple[int, int, list[str], callable]:
    runs, cfg = raw["runs"], raw["config"]
    kinds = ("sim", "traj") if cfg.get("trajectory") else ("sim",)
    return _paired(raw, lines, heldout_screen.PAIRED.format(next(iter(runs))),
                   heldout_screen.paired_lines(runs, kinds, cfg["budgets"]))


def _rounds(raw: dict, lines: list[str], png: Path, script: str) -> tuple[int, int, list[str], callable]:
    runs = raw["runs"]
    return _paired(raw, lines, round_blocks.PAIRED.format(next(iter(runs))), round_blocks.paired_lines(runs))


KINDS = {"exittrain_ablation.py": _ablation, "budget_transfer.py": _ablation, "heldout_screen.py": _screen,
         "round_blocks.py": _rounds}


def rerender(json_path: Path, date: str) -> bool:
    """Rebuilds one report (its .md, .json and any .png beside `json_path`); False where nothing changed."""
    raw = json.loads(json_path.read_text(encoding="utf-8"))
    script = raw["command"].split()[1].rsplit("/", 1)[-1]
    if script not in KINDS:
        raise SystemExit(f"{json_path}: made by {script}, not by one of {', '.join(KINDS)}")
    md, png = json_path.with_suffix(".md"), json_path.with_suffix(".png")
    lines = md.read_text(encoding="utf-8").splitlines()
    try:
        start, end, new, finish = KINDS[script](raw, lines, png, script)
    except SystemExit as e:
        raise SystemExit(f"{md}: {e}; is it the report of {json_path}?") from None
    if lines[start:end] == new:
        return False
    head = [line for line in lines[:start] if not line.startswith(NOTE)]
    # After the header's block of bullets (the first blank line after a bullet).
    at = next((i for i in range(2, len(head)) if not head[i] and head[i - 1].startswith(("- ", "  "))), len(head))
    head.insert(at, f"{NOTE} on {date} from the counts in `{json_path.name}` by `python experiments/rerender.py "
                     f"{json_path.name}` (no decoding): intervals{' and bars' if png.exists() else ''} use Student's t "
                     "with n - 1 degrees of freedom (`tevjax.stats.q95`).")
    md.write_text("\n".join(head + new + lines[end:]) + "\n", encoding="utf-8")
    finish()
    json_path.write_text(json.dumps(raw, indent=1) + "\n", encoding="utf-8")
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path, nargs="+", help=f"results JSON made by {', '.join(KINDS)}")
    args = p.parse_args(argv)
    missing = [str(f) for f in args.results if not f.is_file() or not f.with_suffix(".md").is_file()]
    if missing:
        p.error(f"no such results file, or no report beside it: {missing[0]}")
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d")
    for path in args.results:
        print(f"{path}: {'rebuilt' if rerender(path, date) else 'unchanged'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
