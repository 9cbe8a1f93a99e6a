"""Shared output step of the benchmark scripts: print a markdown report and write it to a file."""

from __future__ import annotations

from pathlib import Path


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
