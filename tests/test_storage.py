"""Disk-space checks (tevjax.storage): what counts as a full disk, the margin, the message. The
writes that use them (shards, checkpoints, exports) are tested in test_train."""

from __future__ import annotations

import errno
import shutil

import pytest

from tevjax import storage


def test_a_full_disk_is_told_from_other_failures_in_any_form_it_takes():
    assert storage.is_no_space(OSError(errno.ENOSPC, "No space left on device"))
    assert storage.is_no_space(OSError(errno.EDQUOT, "Disk quota exceeded"))
    # tensorstore's text in orbax's ValueError, and an error raised while handling one.
    assert storage.is_no_space(ValueError("RESOURCE_EXHAUSTED: Failed to write 8329 bytes to file 51: No space left "
                                          "on device [os_error_code='28']"))
    try:
        try:
            raise OSError(errno.ENOSPC, "full")
        except OSError as inner:
            raise RuntimeError("the save failed") from inner
    except RuntimeError as outer:
        assert storage.is_no_space(outer)
    assert not storage.is_no_space(PermissionError(errno.EACCES, "Permission denied"))
    assert not storage.is_no_space(OSError("22528 requested and 20416 written"))  # NumPy's: no errno, no text
    loop = ValueError("a")
    loop.__context__ = loop  # a cycle ends the walk
    assert not storage.is_no_space(loop)


def test_free_space_is_read_where_the_write_will_go_with_a_margin(tmp_path, monkeypatch):
    deep = tmp_path / "not" / "yet" / "made"
    assert storage.free_bytes(deep) == shutil.disk_usage(tmp_path).free > 0  # the nearest existing directory
    assert storage.with_margin(0) == storage.MARGIN_BYTES
    assert storage.with_margin(100 << 20) == int((100 << 20) * (1 + storage.MARGIN_FRACTION)) + storage.MARGIN_BYTES
    monkeypatch.setattr(storage, "free_bytes", lambda path: storage.with_margin(10 << 20))
    assert storage.short_of_space(tmp_path, 10 << 20) is None  # exactly enough
    assert storage.short_of_space(tmp_path, (10 << 20) + 1) == storage.with_margin(10 << 20)
    storage.check_space(tmp_path, 10 << 20, "a shard", "kept")
    with pytest.raises(storage.WriteError) as e:
        storage.check_space(tmp_path / "d", 3 << 30, "checkpoint 7", "the last one is kept")
    assert str(e.value) == (f"not enough disk space for checkpoint 7 under {tmp_path / 'd'}: it needs about 3.15 GiB "
                            f"(3.00 GiB of data and room for the file system's overhead), and 11.5 MiB is free; "
                            f"the last one is kept")
    assert isinstance(e.value, OSError)  # the CLI prints an OSError as its one-line error
