"""Disk space for what long jobs write: data shards, training checkpoints, exported drafters.

A job that fills its disk should stop with one message that names the write, the space it needed
and had, what is kept, and how to go on; not with a half-written file and a storage library's
tracebacks (orbax's asynchronous writers print several before the error reaches the caller). So
each of these writes checks the free space first (`check_space`), and a write that fails anyway
(another process took the space meanwhile, a quota, an I/O error) is reported the same way
(`WriteError`, with `is_no_space` telling a full disk from other failures).
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

__all__ = ["DISK_FULL", "WriteError", "check_space", "failure", "free_bytes", "is_no_space", "short_of_space",
           "space_message", "with_margin"]

# Room beyond a write's own bytes: file-system metadata and the small files beside the arrays
# (orbax's metadata, a shard's records.json), and the free space that a file system keeps back.
MARGIN_FRACTION = 0.05
MARGIN_BYTES = 1 << 20
DISK_FULL = "the disk is full"  # what `failure` says of a full disk


class WriteError(OSError):
    """A write that would not fit, or failed; what was written before it is kept."""


def free_bytes(path: str | os.PathLike) -> int:
    """Free bytes, for an unprivileged writer, on the file system that holds `path` (or would: the
    nearest existing directory above it)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def with_margin(need: int) -> int:
    """The free bytes a write of `need` bytes asks for."""
    return int(need * (1 + MARGIN_FRACTION)) + MARGIN_BYTES


def short_of_space(path: str | os.PathLike, need: int) -> int | None:
    """The free bytes under `path` where they are fewer than `with_margin(need)`; None where the
    write fits."""
    free = free_bytes(path)
    return free if free < with_margin(need) else None


def _size(n: float) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20)):
        if n >= scale:
            return f"{n / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{n / 2 ** 10:.0f} KiB"


def space_message(what: str, path: str | os.PathLike, need: int, free: int) -> str:
    asked, has = _size(with_margin(need)), _size(free)
    short = f" ({_size(with_margin(need) - free)} too little)" if asked == has else ""  # rounded alike
    return (f"not enough disk space for {what} under {path}: it needs about {asked} "
            f"({_size(need)} of data and room for the file system's overhead), and {has} is free{short}")


def check_space(path: str | os.PathLike, need: int, what: str, then: str) -> None:
    """Raises WriteError where `need` bytes (plus the margin) would not fit under `path`; `then`
    ends the message: what is kept, and how to go on."""
    free = short_of_space(path, need)
    if free is not None:
        raise WriteError(f"{space_message(what, path, need, free)}; {then}")


def is_no_space(e: BaseException) -> bool:
    """Whether `e` (or an exception it was raised from) is a full disk or an exhausted quota, as
    Python reports it (errno) or as tensorstore, orbax's writer, does (in its text)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(e)
        if "No space left on device" in text or "Disk quota exceeded" in text or "os_error_code='28'" in text:
            return True
        e = e.__cause__ or e.__context__
    return False


def failure(e: BaseException, path: str | os.PathLike | None = None) -> str:
    """Why a write failed, in a few words: "the disk is full", or the error's type and first line.
    With `path`, a failure while its file system has less than MARGIN_BYTES free counts as a full
    disk too (NumPy reports a short write without an errno: "N requested and M written")."""
    if is_no_space(e) or (path is not None and free_bytes(path) < MARGIN_BYTES):
        return DISK_FULL
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
