"""Disk-space checks (tevjax.storage): what counts as a full disk, the margin, the message. The
writes that use them (shards, checkpoints, exports) are tested in test_train."""

from __future__ import annotations

import errno
import os
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


def test_a_failed_write_is_told_in_a_few_words(tmp_path, monkeypatch):
    assert storage.failure(OSError(errno.ENOSPC, "No space left on device")) == "the disk is full"
    assert storage.failure(PermissionError("no\nmore")) == "PermissionError: no"
    short = OSError("22528 requested and 20416 written")  # NumPy's short write: no errno
    assert storage.failure(short, tmp_path) == "OSError: 22528 requested and 20416 written"  # room: not a full disk
    monkeypatch.setattr(storage, "free_bytes", lambda path: storage.MARGIN_BYTES - 1)
    assert storage.failure(short, tmp_path) == "the disk is full"
    assert storage.failure(short) == "OSError: 22528 requested and 20416 written"  # no path: not looked at


def test_free_space_is_read_where_the_write_will_go_with_a_margin(tmp_path, monkeypatch):
    deep = tmp_path / "not" / "yet" / "made"
    # Where it looks, not a second reading of the free space: another process may write between two.
    usage, asked = shutil.disk_usage, []
    monkeypatch.setattr(shutil, "disk_usage", lambda p: asked.append(p) or usage(p))
    assert storage.free_bytes(deep) > 0 and asked == [tmp_path]  # the nearest existing directory
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
    # Where the two round alike, the message says by how much the space falls short.
    assert storage.space_message("a shard", tmp_path, 45 << 10, storage.with_margin(45 << 10) - (23 << 10)).endswith(
        "it needs about 1.0 MiB (45 KiB of data and room for the file system's overhead), and 1.0 MiB is free "
        "(23 KiB too little)")


def test_a_full_cache_costs_the_ngram_table_its_cache_entry_and_leaves_no_partial_file(tmp_path, monkeypatch):
    """The corpus n-gram table is cached as it is built; where the cache is full (the write fails
    half-way), the table is still returned, and neither the entry nor the partial file is left."""
    import numpy as np

    from tevjax.loading import load_ngrams

    corpus = tmp_path / "corpus.npz"
    tokens = np.array([5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 9], np.int32)
    np.savez(corpus, tokens=tokens, offsets=np.array([0, 6, 12]), starts=np.array([1, 1]))
    monkeypatch.setenv("TEVJAX_CACHE", str(tmp_path / "cache"))
    savez = np.savez

    def full(path, **arrays):
        with open(path, "wb") as f:
            f.write(b"PK\x03\x04 half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np, "savez", full)
    table = load_ngrams(corpus)
    assert table.num_entries > 0 and os.listdir(tmp_path / "cache" / "ngrams") == []
    monkeypatch.setattr(np, "savez", savez)
    cached = load_ngrams(corpus)  # with room: built again, the same, and cached
    np.testing.assert_array_equal(np.asarray(cached.tokens), np.asarray(table.tokens))
    assert [p.suffix for p in (tmp_path / "cache" / "ngrams").iterdir()] == [".npz"]
