"""Reading a `tevjax data` directory as fixed-shape training batches.

Shape letters follow the legend in `tevjax/__init__.py`: B sequences per (global) batch, T the
padded sequence length, F = n*D the feature width.

The data order is a pure function of (seed, step): epoch e visits the records in the permutation
`default_rng([seed, e]).permutation(number of records)`, and global batch `step` holds the
records at flat positions step*B .. step*B + B - 1 of that endless sequence. Resuming at step k
therefore reads exactly the batches an uninterrupted run would have read, with no state to save
beyond the step. In a multi-process run every process reads its own contiguous slice of each
global batch.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax
import numpy as np

from tevjax.train.rollout import SHARDS, is_shard_name, read_manifest

__all__ = ["Batch", "TrainData"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    """One fixed-shape batch of training sequences (padding: token 0, mask False, zero features)."""

    tokens: jax.Array  # [B, T] int32
    loss_mask: jax.Array  # [B, T] bool  supervised (response) tokens
    features: jax.Array  # [B, T, F] tapped target hidden states, concatenated in the drafter's tap order
    length: jax.Array  # [B] int32 real tokens per row (0 for an all-padding row)


def _shard_damage(arrays: dict[str, np.ndarray], taps: int, hidden_size: int) -> str | None:
    """What makes a shard's arrays disagree with each other or with the manifest, or None."""
    tokens, mask, offsets, feats = (arrays[k] for k in ("tokens", "loss_mask", "offsets", "features"))
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        return f"tokens.npy holds {tokens.dtype} {tokens.shape}, not [T] integer token ids"
    n = tokens.shape[0]
    if mask.shape != (n,):
        return f"loss_mask.npy has shape {mask.shape}, tokens.npy {(n,)}"
    if feats.shape != (n, taps, hidden_size) or feats.dtype != np.uint16:
        return (f"features.npy holds {feats.dtype} {feats.shape}, not the bfloat16 bits (uint16) of "
                f"{(n, taps, hidden_size)} (tokens, the manifest's {taps} taps, hidden size {hidden_size})")
    off = np.asarray(offsets)
    if off.ndim != 1 or not off.size or not np.issubdtype(off.dtype, np.integer) or off[0] != 0 or off[-1] != n \
            or (np.diff(off) <= 0).any():
        return f"offsets.npy does not split its {n} tokens into records (it must rise from 0 to {n})"
    return None


class TrainData:
    """The records of one split ("train" or "heldout") of a data directory, memory-mapped."""

    def __init__(self, data_dir: str | os.PathLike, split: str = "train", shards: list[str] | None = None):
        """`shards` names the shards to read (default: every complete shard of `split`): a training
        run records its list, so a resume reads the same records while `tevjax data` adds more."""
        self.dir = Path(data_dir)
        self.manifest = read_manifest(self.dir)
        self.taps = tuple(self.manifest["rollout"]["taps"])
        self.hidden_size = int(self.manifest["target_config"]["hidden_size"])
        if shards is None:
            # The plan's names only: a copy beside a shard would otherwise be read, its records twice.
            shards = sorted(p for p in (self.dir / SHARDS).glob(f"{split}-*")
                            if p.is_dir() and is_shard_name(p.name, split))
            if not shards:
                raise FileNotFoundError(f"{self.dir}: no {split!r} shards yet (is `tevjax data` still running?)")
        else:
            shards = [self.dir / SHARDS / name for name in shards]
            missing = [p.name for p in shards if not p.is_dir()]
            if missing:
                raise FileNotFoundError(f"{self.dir}: shard(s) {', '.join(missing)} are missing")
        self.shard_names = [p.name for p in shards]
        self._shards = []
        index = []
        for s, path in enumerate(shards):
            try:
                arrays = {name: np.load(path / f"{name}.npy", mmap_mode="r")
                          for name in ("tokens", "loss_mask", "offsets", "features")}
            except (OSError, ValueError, EOFError) as e:  # EOFError: an empty (0-byte) .npy file
                raise ValueError(f"{path}: unreadable shard ({e or type(e).__name__})") from None
            # Checked here, from the headers and the offsets: arrays that disagree would otherwise
            # fail (or crop records in silence) only when a batch first reads the record, mid-run.
            damage = _shard_damage(arrays, len(self.taps), self.hidden_size)
            if damage:
                raise ValueError(f"{path}: damaged shard: {damage}")
            self._shards.append(arrays)
            tokens = np.asarray(arrays["tokens"])
            vocab = int(self.manifest["target_config"]["vocab_size"])
            # An id outside the vocabulary would not fail: the embedding gather clamps it.
            if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
                raise ValueError(f"{path}: damaged shard: token ids {int(tokens.min())}..{int(tokens.max())} "
                                 f"are not all in the target's vocabulary [0, {vocab})")
            offsets = np.asarray(arrays["offsets"])
            index += [(s, int(offsets[r]), int(offsets[r + 1])) for r in range(len(offsets) - 1)]
        self.index = index  # (shard, start, end) per record

    def __len__(self) -> int:
        return len(self.index)

    @property
    def response_tokens(self) -> int:
        return int(sum(int(np.asarray(sh["loss_mask"]).sum()) for sh in self._shards))

    def first_supervised(self, start: int = 0) -> np.ndarray:
        """[records] int64: each record's first supervised (response) position at or after `start`,
        counted from the record's start (so, with start 0, its prompt's length), or -1 where it has
        none. Training crops records to seq_len and draws anchors where the next token is
        supervised, so a record whose first one is at seq_len or beyond adds nothing."""
        parts = []
        for sh in self._shards:  # per shard, without a loop over its records
            offsets = np.asarray(sh["offsets"], np.int64)
            starts, ends = offsets[:-1], offsets[1:]
            hits = np.append(np.flatnonzero(np.asarray(sh["loss_mask"])), offsets[-1])  # + a sentinel
            first = hits[np.searchsorted(hits, starts + start)]  # the first supervised token from there on
            parts.append(np.where(first < ends, first - starts, -1))
        return np.concatenate(parts).astype(np.int64)

    def cropped(self, seq_len: int) -> np.ndarray:
        """[records] bool: the records that training, cropping them to seq_len, draws no anchor
        from (no supervised token at positions 1 .. seq_len - 1). Position 0 has no anchor before
        it, so a record whose response starts it counts by its later tokens."""
        first = self.first_supervised(1)  # -1 (none) or a position >= 1
        return (first < 0) | (first >= seq_len)

    def token_counts(self, vocab_size: int) -> np.ndarray:
        """[V] int64 how often each token id is a supervised (response) token: the statistics a
        reduced draft vocabulary is chosen from."""
        counts = np.zeros(vocab_size, np.int64)
        for sh in self._shards:
            tokens = np.asarray(sh["tokens"])[np.asarray(sh["loss_mask"]).astype(bool)]
            counts += np.bincount(tokens, minlength=vocab_size)[:vocab_size]
        return counts

    def tap_columns(self, layer_ids: tuple[int, ...]) -> list[int]:
        """Positions of the drafter's tapped layers among the stored taps."""
        missing = [t for t in layer_ids if t not in self.taps]
        if missing:
            raise ValueError(f"{self.dir} stores target layers {self.taps}; the drafter taps {missing}, which are "
                             f"not stored (regenerate with `tevjax data --taps ...`)")
        return [self.taps.index(t) for t in layer_ids]

    def record(self, i: int, columns: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens [T], loss_mask [T], features [T, F] float32) of record i (T: its length;
        F = len(columns) * D)."""
        s, a, b = self.index[i]
        sh = self._shards[s]
        feats = np.asarray(sh["features"][a:b][:, columns])  # uint16 bfloat16 bits
        feats = (feats.astype(np.uint32) << 16).view(np.float32).reshape(b - a, -1)
        return np.asarray(sh["tokens"][a:b]), np.asarray(sh["loss_mask"][a:b]).astype(bool), feats

    def order(self, seed: int, step: int, batch_size: int) -> np.ndarray:
        """Record indices of global batch `step` (see the module docstring)."""
        flat = step * batch_size + np.arange(batch_size)
        epochs, pos = np.divmod(flat, len(self))
        out = np.empty(batch_size, np.int64)
        for e in np.unique(epochs):
            perm = np.random.default_rng([seed, int(e)]).permutation(len(self))
            out[epochs == e] = perm[pos[epochs == e]]
        return out

    def batch(self, records, columns: list[int], seq_len: int) -> dict[str, np.ndarray]:
        """Host arrays of a `Batch` for the given record indices (cropped to seq_len)."""
        n = len(records)
        width = len(columns) * self.hidden_size
        tokens = np.zeros((n, seq_len), np.int32)
        mask = np.zeros((n, seq_len), bool)
        feats = np.zeros((n, seq_len, width), np.float32)
        length = np.zeros((n,), np.int32)
        for j, i in enumerate(records):
            t, m, f = self.record(int(i), columns)
            q = min(len(t), seq_len)
            tokens[j, :q], mask[j, :q], feats[j, :q], length[j] = t[:q], m[:q], f[:q], q
        return {"tokens": tokens, "loss_mask": mask, "features": feats, "length": length}
