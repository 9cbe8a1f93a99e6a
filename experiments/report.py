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
