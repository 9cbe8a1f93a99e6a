"""Shared output step of the benchmark scripts: print a markdown report and write it to a file."""

from __future__ import annotations

import json
from pathlib import Path


# What a results JSON records as the quantile of its paired 95% intervals (`tevjax.stats.paired_gain`).
QUANTILE = "Student's t, n - 1 df (tevjax.stats.q95)"


def emit(lines: list[str], out: str | Path | None) -> str:
    """Prints the report and, unless `out` is None, writes it (creating the folder)."""
    text = "\n".join(lines).rstrip("\n") + "\n"
    print()
    print(text)
    if out is not None:
        out = Path(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"wrote {out}")
    return text


def save(lines: list[str], out: str | Path, payload: dict) -> str:
    """`emit` to `out`, with `payload` (the run's arguments and measurements) written beside it as
    JSON (the same name with .json)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(payload, indent=1))
    return emit(lines, out)


def budget_axes(ax, budgets, ylabel: str, title: str, *, title_size: int = 8) -> None:
    """A panel with tree budgets on a log2 x axis (ticks at the budgets), a grid and a legend."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.minorticks_off()
    ax.set_xlabel("tree budget", fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_title(title, fontsize=title_size)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def require_positive(parser, args, *names: str) -> None:
    """parser.error naming the first of the integer options `names` (attribute spelling) below 1."""
    for name in names:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")


def drafters_and_labels(parser, args, default_label: str = "default") -> None:
    """Checks repeated `--drafter DIR` / `--label NAME` options and sets `args.drafters` (None for the
    shipped drafter when none is given) and `args.label` (one distinct name per drafter; the
    directory names when no label is given)."""
    drafters = args.drafter or [None]
    if args.label is None:
        args.label = [(default_label if d is None else Path(d).name) for d in drafters]
    if len(args.label) != len(drafters):
        parser.error(f"{len(args.label)} --label for {len(drafters)} drafter(s): give one label per --drafter")
    if len(set(args.label)) != len(args.label):
        parser.error(f"labels must be distinct, got {args.label}")
    for d in drafters:
        if d is not None and not Path(d).is_dir():
            parser.error(f"--drafter {d!r}: no such checkpoint directory")
    args.drafters = drafters
