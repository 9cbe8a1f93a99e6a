"""The jitted speculative decoding engine: DFlash draft -> DDTree -> one target pass -> verify -> commit.

One round for every row of the batch at once (B rows, N = budget + 1 tree slots, G = block_size - 1
draft rows per block, the maximum tree depth)::

    block  = [root, MASK x G] at positions cache_len .. cache_len + G
    q      = drafter(block | context K/V)                   [B, G, Vd]  per-depth draft marginals
    tree   = build_ddtree(log q, root, budget)               [B, N]      best-first DDTree (ids via
                                                                         the draft vocabulary, Vd <= V)
    tree   = merge_chain(tree, context_chain(history))      [B, N]      cfg.lookup > 0: the best N - 1
                                                                         nodes of the tree and a chain
                                                                         copied from the committed text
    tree   = merge_chain(tree, corpus_chain(history, ngrams)) [B, N]    cfg.corpus > 0: likewise, a chain
                                                                         that follows an n-gram table of
                                                                         the target's answers
    target(tree.tokens @ cache_len + depth, mask = prefix + tree.ancestors)  -> logits [B, N, V]
    out    = verify(key, tree, logits, temperature, method)  accepted path + bonus token
    commit : K/V of the accepted path moved to contiguous slots after the root, the target
             hidden states of root + path appended to the drafter context, the block emitted,
             the bonus becomes the next root.

Invariants of `DecodeState` between rounds, per row: the target cache slots [0, cache_len) hold
exactly the committed tokens except the last one (`root`), whose K/V the next tree pass writes at
slot cache_len; a hybrid target's linear-attention state (`KVCache.linear`) has run over the same
cache_len tokens (the commit runs the root and the accepted path into it: `KVCache.advance`); the
drafter context cache holds the features of the same cache_len tokens. Every
write of a round lands at slots >= cache_len, so a finished row's committed state is never
touched and finished rows simply stop changing.

The rounds run in a `lax.while_loop` inside one jit with the state donated, which stops when every
row is done or after a traced number of rounds: `Decoder.run` calls it repeatedly, sizing each call
to take about `CALL_SECONDS`, so that Ctrl-C is answered between calls (`Interrupted`, carrying the
rows already finished) while a long generation still makes few host round-trips. One compiled
program serves every call: the round count is an argument, not a shape. `Decoder.stream` is the
Python-loop twin over the same jitted round (one host sync per round) for streaming.
`Decoder.generate_continuous` keeps a batch busy over many prompts: its loop also stops when a row
finishes, and the next prompts are prefilled and placed into the free rows of the live state
(`Decoder.continuous` yields each prompt's result as it finishes).

Prefill writes prompt[:-1] into the caches in chunks of `DecodeConfig.prefill_chunk` tokens, each a
causal run that attends to the cache so far (`Transformer` with `block_mask=None`): memory per
chunk is bounded by the chunk, not the prompt, and one compiled chunk serves every prompt length.
`Decoder.prefill(..., reuse=(state, earlier_prompts))` starts from an earlier state instead: each
row keeps the slots its new prompt shares with its earlier prompt and output (the invariant above
says what they hold) and prefills the rest, so a chat's next turn prefills its new messages only.
Autoregressive decoding is a `Decoder` without a drafter (`Decoder(target, None, cfg)`): the
same rounds with a root-only tree (N = 1), so its speed is measured with the same model code,
cache and sampler. Whether a round drafts is static: the drafter's graphdef is None or not.
With `DecodeConfig.fallback_below` it is also decided per round, by a `lax.cond` over the whole
batch: rows whose recent expected block (1 + C_p, the exit law's coverage, of their verified trees)
is below the threshold wait some rounds, and when every active row waits, the round is a plain
one (no drafter, a root-only tree pass), so a drafter that does not pay costs little.

On a device mesh (`Decoder(..., mesh=mesh)`) the weights carry the shardings of
`tevjax.sharding`'s tables (heads, key/value heads, MLP width and vocabulary over `model`), the
state carries `STATE_AXES` (rows over `data`, the caches' key/value heads over `model`), and the
prefill and the loop are jitted with those shardings as inputs and outputs, so the state keeps its
layout from round to round. Rows are independent (each has its own PRNG stream, `DecodeState.keys`,
derived from the seed and the row index), so a row's output does not depend on how rows are
split over `data`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import math
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tevjax.builder import (LOOKUP_SURVIVAL, NgramTable, build_ddtree_from_top, chain_log_reach, check_survival,
                             context_chain, corpus_chain, merge_chain)
from tevjax.checks import is_int, is_real
from tevjax.law import exit_law, is_greedy, samples
from tevjax.models.cache import KVCache, scatter_rows
from tevjax.models.dflash import DFlashDrafter, DrafterCache, features_from_hidden, tapped_hidden
from tevjax.models.transformer import Transformer
from tevjax.multihost import every_process
from tevjax.sampling import check_truncation, truncate_logits
from tevjax.decode.stops import StopTable, advance, check_stops, stop_table
from tevjax.seeding import seed_key
from tevjax.sharding import (CACHE_AXES, check_batch, frozen, host_array, linear_shardings, logical_sharding,
                             mesh_axes, param_shardings, put, thawed, traced_on)
from tevjax.tree import DraftTree, valid_temperature
from tevjax.verifiers import VERIFIERS, verify

__all__ = ["CALL_SECONDS", "DecodeConfig", "DecodeState", "Decoder", "Generation", "Interrupted", "STATE_AXES",
           "block_logprobs", "commit", "draft", "draft_trees", "emit", "merge_lookups", "root_trees", "scatter_block",
           "state_shardings", "target_logits", "tree_pass"]

# Wall time one call of the jitted round loop aims at (`Decoder.run`): Ctrl-C is seen between calls,
# so this bounds how late it is answered; each call costs one host sync (~0.1 ms), so a quarter
# second keeps that overhead far below 1%.
CALL_SECONDS = 0.25


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecodeConfig:
    """Static decoding settings (one compile per distinct config and shape bucket)."""

    budget: int = 16  # non-root tree nodes per round (unused without a drafter)
    # Length of a context-lookup chain offered to the tree each round (`tevjax.builder.
    # merge_chain`): the continuation of the latest earlier occurrence of the last few committed
    # tokens, whose nodes take tree slots where their estimated reach beats the drafter's nodes.
    # 0: the drafter's tree alone. Exact either way: any fixed tree is.
    lookup: int = 0
    # How often a chain of match order n holds d tokens (`tevjax.builder.LOOKUP_SURVIVAL`'s layout:
    # one row per order 1..5, one column per depth). The chain's nodes are ranked against the
    # drafter's by these estimates, so a table measured on another target's text, or at T > 0,
    # can replace SmolLM2's greedy one. None: LOOKUP_SURVIVAL.
    lookup_survival: tuple[tuple[float, ...], ...] | None = None
    # Length of a corpus-lookup chain offered to the tree each round (`tevjax.builder.corpus_chain`):
    # the greedy continuation of the last committed tokens in an n-gram table of the target's own
    # answers to other prompts, given to `Decoder(..., ngrams=table)`. Merged after the context
    # chain, by the same rule. 0: none.
    corpus: int = 0
    verifier: str = "tev"  # a name in tevjax.verifiers.VERIFIERS: "tev" | "predraw" | "sequential"
    temperature: float = 0.0  # below 1e-5 (tevjax.law.GREEDY_BELOW) = greedy
    # Rows of one batch may sample with different settings: `Decoder.generate(..., temperature=[...],
    # top_k=[...], top_p=[...], min_p=[...])` (and `prefill`, `continuous`, `stream`) set each
    # row's, the fields here being the defaults. Every row then runs the greedy and the sampling
    # verifier and keeps its own (a select per row, as `verify` does for a traced temperature),
    # and a batch in which some row truncates cuts every row's logits by its own settings: 4-10%
    # of a batch's time on SmolLM2 (experiments/results/per_row_sampling.md). Off, every row
    # decodes with the fields above.
    sampling_per_row: bool = False
    # Truncated sampling (`tevjax.sampling.truncate_logits`): the target law becomes top-k, then
    # top-p, then min-p of softmax(logits / temperature), for the autoregressive baseline and every
    # verifier alike, so speculative decoding stays exact for it. 0 / 1.0 / 0.0: off. No effect
    # when greedy (the most probable token is always kept).
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_new_tokens: int = 128
    eos_ids: tuple[int, ...] = ()
    # A row also stops once its generated text contains one of these strings (`tevjax.decode.stops`:
    # matched on the device, on the bytes the tokens spell, so the Decoder needs the tokenizer's
    # `spellings`). The block is cut after the token that completes one; `cut_text` removes it
    # from the text. (): none.
    stop: tuple[str, ...] = ()
    prompt_bucket: int = 64  # prompt lengths are rounded up to a multiple of this (cache capacity, prefill chunk)
    # Prefill runs in causal chunks of at most this many tokens (shorter prompts: one chunk sized
    # to them, `Decoder.chunk_size`), so its memory is set by the chunk and not by the prompt
    # length. 1024: on 2 CPU cores a 2,048-token prefill ran at 183 / 238 / 279 tok/s with chunks
    # of 256 / 512 / 1024 and 282 with one chunk of 2048 (the projections and MLP are matmuls of
    # chunk rows); a larger chunk would pad more of a prompt's last chunk.
    prefill_chunk: int = 1024
    capacity_bucket: int = 128  # cache capacities are rounded up to a multiple of this
    capacity: int | None = None  # force a cache capacity (must fit prompt + max_new + N)
    # Target layers whose hidden states (as a drafter taps them, `tapped_hidden`) are kept for every
    # committed token, prompt included: `Generation.hidden`. Regeneration then yields a drafter's
    # training features with no second pass over the text.
    hidden_layers: tuple[int, ...] = ()
    # Keep the target's log-probability of every generated token: log softmax of its logits at the
    # token's prefix, before temperature and truncation (the model's own distribution, as servers
    # report it), read from the tree pass that verified the token (`Generation.logprobs`).
    logprobs: bool = False
    # Fallback to plain target steps where speculation does not pay: a row whose recent expected
    # block (a running mean of 1 + the exit law's coverage C_p of its verified trees) is below this
    # skips the drafter for `fallback_rounds` rounds, twice as many each time it stays below (at
    # most FALLBACK_MAX_WAIT), in which the target steps on the root alone (one-node trees, exact
    # as any tree); then it drafts again to see whether speculation pays now. Set it to a round's
    # cost in target steps. 0: always speculate. On SmolLM2 (2 CPU cores, budget 8, 1.8;
    # experiments/results/fallback.md) it took an untrained drafter from 0.68x of AR to 0.93x
    # (greedy) and 0.54x to 0.92x (temperature 1), and the shipped one at temperature 1 from 0.82x
    # to 0.98x, but greedy decoding with the shipped drafter from 1.38x to 1.30x.
    fallback_below: float = 0.0
    fallback_rounds: int = 4

    def __post_init__(self):
        if self.verifier == "ar":
            raise ValueError("verifier 'ar' is not a verifier: for autoregressive decoding pass no drafter, "
                             "Decoder(target, None, cfg)")
        if not isinstance(self.verifier, str) or self.verifier not in VERIFIERS:
            raise ValueError(f"unknown verifier {self.verifier!r}; choose one of {sorted(VERIFIERS)}")
        for name in ("budget", "lookup", "corpus", "max_new_tokens", "prompt_bucket", "capacity_bucket",
                     "prefill_chunk", "fallback_rounds"):
            value = getattr(self, name)
            if not is_int(value):
                raise TypeError(f"DecodeConfig.{name} must be an int, got {value!r} ({type(value).__name__})")
            # A NumPy int would make the shape arithmetic NumPy's (np.int16 buckets overflow).
            object.__setattr__(self, name, int(value))
        if self.capacity is not None and not is_int(self.capacity):
            raise TypeError(f"DecodeConfig.capacity must be an int or None, got {self.capacity!r}")
        if self.capacity is not None:
            if self.capacity < 1:
                raise ValueError(f"DecodeConfig.capacity must be >= 1 or None, got {self.capacity}")
            object.__setattr__(self, "capacity", int(self.capacity))
        if not is_real(self.temperature):
            raise TypeError(f"DecodeConfig.temperature must be a number, got {self.temperature!r} "
                            f"({type(self.temperature).__name__})")
        eos = self.eos_ids
        if not isinstance(eos, (tuple, list)) or not all(is_int(e) and e >= 0 for e in eos):
            raise TypeError(f"DecodeConfig.eos_ids must be a tuple of token ids >= 0, got {eos!r}")
        object.__setattr__(self, "eos_ids", tuple(int(e) for e in eos))  # hashable: a static argument
        t = float(self.temperature)
        if not valid_temperature(t):
            raise ValueError(f"temperature must be a finite float32 number >= 0, got {self.temperature!r}")
        top_k, top_p, min_p = check_truncation(self.top_k, self.top_p, self.min_p)
        object.__setattr__(self, "top_k", top_k)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "min_p", min_p)
        if self.budget < 1:
            raise ValueError(f"budget must be >= 1, got {self.budget}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.lookup <= self.budget:
            raise ValueError(f"lookup must be between 0 and the budget ({self.budget}), got {self.lookup}")
        if not 0 <= self.corpus <= self.budget:
            raise ValueError(f"corpus must be between 0 and the budget ({self.budget}), got {self.corpus}")
        if self.lookup_survival is not None:
            object.__setattr__(self, "lookup_survival", check_survival(self.lookup_survival))
        for name in ("prompt_bucket", "capacity_bucket", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"DecodeConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not is_real(self.fallback_below) or not 0 <= float(self.fallback_below) < math.inf:
            raise ValueError(f"fallback_below must be a finite number >= 0 (a round's cost in target steps; 0: off), "
                             f"got {self.fallback_below!r}")
        object.__setattr__(self, "fallback_below", float(self.fallback_below))
        if self.fallback_rounds < 1:
            raise ValueError(f"fallback_rounds must be >= 1, got {self.fallback_rounds}")
        layers = self.hidden_layers
        # int() would read 1.7 as layer 1 and True as layer 1, and "12" as layers 1 and 2.
        if not isinstance(layers, (tuple, list)) or any(not is_int(i) for i in layers):
            raise TypeError(f"DecodeConfig.hidden_layers must be a tuple of layer indices, got {layers!r}")
        layers = tuple(int(i) for i in layers)
        if any(i < 0 for i in layers) or len(set(layers)) != len(layers):
            raise ValueError(f"hidden_layers must be distinct layer indices >= 0, got {self.hidden_layers!r}")
        object.__setattr__(self, "hidden_layers", layers)
        object.__setattr__(self, "stop", check_stops(self.stop))
        for name in ("logprobs", "sampling_per_row"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise TypeError(f"DecodeConfig.{name} must be a bool, got {getattr(self, name)!r}")
            object.__setattr__(self, name, bool(getattr(self, name)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything a round reads and writes (B rows, S cache slots; the output buffer holds max_new_tokens)."""

    target_cache: KVCache  # [L, B, K, S, Dh]
    drafter_cache: DrafterCache | None  # [L, B, K, S, Dh] context K/V (L drafter layers); None without a drafter
    cache_len: jax.Array  # [B] int32 committed tokens in the caches (all but the root)
    root: jax.Array  # [B] int32 last committed token (next tree root)
    out: jax.Array  # [B, max_new_tokens] int32 generated tokens, -1 beyond num_out
    num_out: jax.Array  # [B] int32
    limit: jax.Array  # [B] int32 the row's most new tokens (`Decoder.prefill(max_new_tokens=...)`), <= the buffer's
    done: jax.Array  # [B] bool
    keys: jax.Array  # [B] PRNG keys, one stream per row
    rounds: jax.Array  # [B] int32 rounds while the row was active
    block_total: jax.Array  # [B] int32 sum of output-block lengths (bonus included) before EOS/length cuts
    hidden: jax.Array | None  # [B, S, R, D] kept hidden states by cache slot (R = len(hidden_layers)); or None
    nonfinite: jax.Array  # [B] bool the target gave this row a non-finite logit: stopped, that round unemitted
    # [Vd, D] the target's LM-head rows of a reduced draft vocabulary, gathered once at prefill:
    # re-gathering them in every round cost about a fifth of a target step. None: no drafter, or
    # a drafter over the whole vocabulary (which reads the head in place).
    draft_head: jax.Array | None = None
    # [B, S] int32 the committed tokens by cache slot, the root at slot cache_len (slots above it are
    # stale): the context `cfg.lookup` searches. None without lookup.
    history: jax.Array | None = None
    # With `cfg.fallback_below` > 0 and a drafter (else None), per row: the running expected block
    # [B] float32, the plain rounds left before it drafts again [B] int32, the length of its last
    # wait [B] int32 (0 after a drafted round that paid) and the plain rounds it ran [B] int32
    # (counted in `rounds` too).
    expected_block: jax.Array | None = None
    skip: jax.Array | None = None
    wait: jax.Array | None = None
    plain_rounds: jax.Array | None = None
    # [B] int32 each row's state in the stop strings' automaton (`tevjax.decode.stops`) over its
    # generated text; `StopTable.matched` once a stop string completed. None without `cfg.stop`.
    stop_at: jax.Array | None = None
    # [B] int32 the stop strings each row watches: bit i for cfg.stop[i] (`Decoder.prefill(...,
    # stop=...)`); -1, all of them, by default. None without `cfg.stop`.
    stop_mask: jax.Array | None = None
    # [B, max_new_tokens] float32 the target's log-probability of each generated token (0 beyond
    # num_out). None without `cfg.logprobs`.
    logprobs: jax.Array | None = None
    # [B, 4] float32 each row's temperature, top-k, top-p and min-p (`SAMPLING_COLUMNS`). None
    # without `cfg.sampling_per_row` (every row then decodes with the config's, static values).
    sampling: jax.Array | None = None
    # [B] int32 a 32-bit fingerprint of each row's prompt (`prompt_fingerprint`), set by every
    # prefill: `prefill(reuse=)` checks its earlier prompts against it, since the caches cannot say
    # what text they hold. None only in states made by hand.
    prompt_hash: jax.Array | None = None


# Logical axes of every `DecodeState` field (`tevjax.sharding.LOGICAL_RULES` maps them to mesh axes).
STATE_AXES: dict[str, tuple[str | None, ...]] = {
    "target_cache": CACHE_AXES,
    "drafter_cache": CACHE_AXES,
    "cache_len": ("batch",),
    "root": ("batch",),
    "out": ("batch", None),
    "num_out": ("batch",),
    "limit": ("batch",),
    "done": ("batch",),
    "keys": ("batch",),
    "rounds": ("batch",),
    "block_total": ("batch",),
    "hidden": ("batch", "cache_slots", None, "embed"),
    "nonfinite": ("batch",),
    # Every device's rows draft with all Vd rows. Replicated: it is only kept where the mesh does
    # not split the vocabulary (a split one selects the columns after the head instead: `draft`).
    "draft_head": (None, None),
    "history": ("batch", "cache_slots"),
    "expected_block": ("batch",),
    "skip": ("batch",),
    "wait": ("batch",),
    "plain_rounds": ("batch",),
    "stop_at": ("batch",),
    "stop_mask": ("batch",),
    "logprobs": ("batch", None),
    "sampling": ("batch", None),
    "prompt_hash": ("batch",),
}

# The columns of `DecodeState.sampling`.
SAMPLING_COLUMNS = ("temperature", "top_k", "top_p", "min_p")


FALLBACK_FIELDS = ("expected_block", "skip", "wait", "plain_rounds")
# Weight of a row's earlier estimate in its running expected block (`_after_speculative`).
FALLBACK_DECAY = 0.5
# The longest wait between drafted rounds (`_after_speculative` doubles it from
# cfg.fallback_rounds while a row stays below): an untrained drafter then costs a drafted round
# in about 65 rather than one in 5.
FALLBACK_MAX_WAIT = 64


def state_shardings(mesh, *, drafter: bool, hidden: bool, head: bool = False, history: bool = False,
                    fallback: bool = False, stop: bool = False, logprobs: bool = False,
                    sampling: bool = False, linear: bool = False) -> DecodeState:
    """A `DecodeState` of NamedShardings (from `STATE_AXES`) for a decoder with or without a
    drafter, kept hidden states, a pre-gathered draft head, a token history, the fallback's
    bookkeeping, stop strings, log-probabilities, per-row sampling settings and a hybrid target's
    linear state (`linear`, `LINEAR_CACHE_AXES`). The specs do not
    depend on the sizes; the sizes are checked where they are known (`Decoder.prefill`: rows;
    `param_shardings`: heads)."""
    named = {f.name: logical_sharding(mesh, STATE_AXES[f.name]) for f in dataclasses.fields(DecodeState)}
    cache = KVCache(k=named["target_cache"], v=named["target_cache"])
    target_cache = dataclasses.replace(cache, linear=linear_shardings(mesh) if linear else None)
    return DecodeState(**{**named, "target_cache": target_cache, "drafter_cache": cache if drafter else None,
                          "hidden": named["hidden"] if hidden else None,
                          "draft_head": named["draft_head"] if head else None,
                          "history": named["history"] if history else None,
                          "stop_at": named["stop_at"] if stop else None,
                          "stop_mask": named["stop_mask"] if stop else None,
                          "logprobs": named["logprobs"] if logprobs else None,
                          "sampling": named["sampling"] if sampling else None,
                          **{name: named[name] if fallback else None for name in FALLBACK_FIELDS}})


@dataclasses.dataclass
class Generation:
    """One row's result."""

    tokens: list[int]
    rounds: int
    tau: float  # mean output-block length per round (plain ones included), bonus token included
    # "eos" | "stop" (the text holds one of cfg.stop: `stops.cut_text` gives the text before it) |
    # "length" | "nonfinite" (the target's logits were NaN/inf: damaged weights or overflow)
    stop: str
    # [T - 1, R, D] hidden states of prompt + tokens at cfg.hidden_layers (T = their total length;
    # the last token's are never computed: no pass has read it yet); None unless requested.
    hidden: np.ndarray | None = None
    plain_rounds: int = 0  # rounds that stepped on the root alone (`DecodeConfig.fallback_below`); in `rounds`
    # The target's log-probability of each of `tokens` (`DecodeConfig.logprobs`); None unless requested.
    logprobs: list[float] | None = None


# The smallest prefill chunk (`Decoder.chunk_size`): chunks are sized to the tokens they prefill,
# as powers of two from this one, so that few sizes ever compile. On 2 CPU cores a chunk call has
# a fixed cost of ~70 ms (it reads every weight once), so smaller chunks would save little.
MIN_CHUNK = 32


def _fitted(n: int) -> int:
    """The power of two that holds n tokens, at least MIN_CHUNK."""
    return max(MIN_CHUNK, 1 << max(n - 1, 0).bit_length())


def _bucket(n: int, size: int) -> int:
    return max(size, -(-n // size) * size)


# ------------------------------------------------------------------------------------- pure steps


def _vocab_split(mesh) -> bool:
    """Whether `mesh` splits the vocabulary axis (then a reduced draft vocabulary selects its
    columns after the head: `draft`)."""
    return mesh is not None and math.prod(mesh.shape[a] for a in mesh_axes(mesh, "vocab")) > 1


def prompt_fingerprint(prompt: Sequence[int]) -> int:
    """A 32-bit fingerprint (int32) of a prompt's token ids, as `DecodeState.prompt_hash` keeps it:
    another prompt matches by chance with probability 2**-32."""
    try:
        ids = np.asarray(prompt, "<i8").tobytes()
    except OverflowError:  # an id past int64 is no vocabulary's: hash its digits instead
        ids = repr([int(t) for t in prompt]).encode()
    digest = hashlib.blake2b(ids, digest_size=4).digest()
    return int.from_bytes(digest, "little", signed=True)


def _empty_state(tstate, dstate, roots, lengths, limits, sampling, stop_masks, key_data, first_row, prompt_hash, *,
                 tgd, dgd, cfg: DecodeConfig, capacity: int, mesh=None) -> DecodeState:
    """The state before prefill: zero caches of `capacity` slots, each row's root (its last prompt
    token, roots [B]), cache_len = lengths - 1 (lengths [B] prompt lengths >= 1), its most new
    tokens (limits [B], each in [1, cfg.max_new_tokens]), its sampling settings (sampling [B, 4],
    kept with `cfg.sampling_per_row`) and the stop strings it watches (stop_masks [B], kept with
    `cfg.stop`); the prefill chunks then fill slots [0, cache_len). key_data: the seed's key data;
    row r samples with fold_in(seed key, first_row + r) (first_row: a traced int32 scalar, the
    batch's first prompt's index in a list decoded batch by batch), whatever the batch and its
    split over devices. prompt_hash [B]: each row's `prompt_fingerprint`."""
    target: Transformer = nnx.merge(tgd, tstate)
    base = jax.random.wrap_key_data(key_data)
    keys = jax.vmap(lambda r: jax.random.fold_in(base, r))(first_row + jnp.arange(roots.shape[0]))
    drafter = nnx.merge(dgd, dstate) if dgd is not None else None
    b = roots.shape[0]
    zeros = jnp.zeros((b,), jnp.int32)
    hidden = None
    if cfg.hidden_layers:
        hidden = jnp.zeros((b, capacity, len(cfg.hidden_layers), target.cfg.hidden_size), jnp.dtype(target.cfg.dtype))
    return DecodeState(
        target_cache=KVCache.init(target.cfg, b, capacity, tree_slots=cfg.budget + 1 if drafter is not None else 1),
        drafter_cache=DrafterCache.init(drafter.cfg, b, capacity) if drafter is not None else None,
        cache_len=(lengths - 1).astype(jnp.int32),
        root=roots.astype(jnp.int32),
        out=jnp.full((b, cfg.max_new_tokens), -1, jnp.int32),
        num_out=zeros,
        limit=limits.astype(jnp.int32),
        done=jnp.zeros((b,), bool),
        keys=keys,
        rounds=zeros,
        block_total=zeros,
        hidden=hidden,
        nonfinite=jnp.zeros((b,), bool),
        draft_head=drafter.head_rows(target) if drafter is not None and not _vocab_split(mesh) else None,
        history=_history_init(roots, lengths, capacity) if _uses_lookup(drafter, cfg) else None,
        stop_at=zeros if cfg.stop else None,
        stop_mask=stop_masks.astype(jnp.int32) if cfg.stop else None,
        logprobs=jnp.zeros((b, cfg.max_new_tokens), jnp.float32) if cfg.logprobs else None,
        sampling=sampling.astype(jnp.float32) if cfg.sampling_per_row else None,
        prompt_hash=prompt_hash.astype(jnp.int32),
        # Every row starts drafting, from an optimistic estimate: a first tree that pays keeps it.
        **(dict(expected_block=jnp.full((b,), float(drafter.cfg.block_size), jnp.float32), skip=zeros,
                wait=zeros, plain_rounds=zeros) if _falls_back(drafter, cfg) else {}),
    )


def _rebase(tstate, dstate, state: DecodeState, roots, lengths, limits, sampling, stop_masks, key_data, first_row,
            prompt_hash, *, tgd, dgd, cfg: DecodeConfig, capacity: int, mesh=None) -> DecodeState:
    """`state`'s caches (target K/V, drafter context, kept hidden states, history below each row's
    new cache_len) under a fresh start for prompts of `lengths` with `roots`: what `_empty_state`
    gives, but with the cache slots an earlier decoding filled kept, for `Decoder.prefill(...,
    reuse=...)` to prefill only from where a row's new prompt leaves its earlier text. Slots the
    new prompt does not share are rewritten by the chunks or lie at or above cache_len, where
    nothing reads them. Another `capacity` than `state`'s appends empty slots or drops the top
    ones (the kept prefix lies below the new cache_len, so below any capacity that fits it)."""
    fresh = _empty_state(tstate, dstate, roots, lengths, limits, sampling, stop_masks, key_data, first_row,
                         prompt_hash, tgd=tgd, dgd=dgd, cfg=cfg, capacity=capacity, mesh=mesh)

    kept = _fit_capacity(state, capacity=capacity)
    history = fresh.history
    if history is not None:  # the new root at slot lengths - 1, the earlier tokens below it
        below = jnp.arange(capacity, dtype=jnp.int32)[None, :] < (lengths - 1)[:, None]
        history = jnp.where(below, kept.history, history)
    return dataclasses.replace(fresh, target_cache=kept.target_cache, drafter_cache=kept.drafter_cache,
                               hidden=kept.hidden, history=history, draft_head=state.draft_head)


def _fit_slots(x: jax.Array | None, axis: int, capacity: int) -> jax.Array | None:
    """`x`'s cache slots (along `axis`) in `capacity` slots: zeros appended, or the top ones cut."""
    if x is None or x.shape[axis] == capacity:
        return x
    if x.shape[axis] > capacity:
        return jax.lax.slice_in_dim(x, 0, capacity, axis=axis)
    return jnp.pad(x, [(0, capacity - x.shape[axis]) if a == axis else (0, 0) for a in range(x.ndim)])


def _fit_capacity(state: DecodeState, *, capacity: int) -> DecodeState:
    """`state` with `capacity` cache slots: every row's caches, kept hidden states and history with
    empty slots appended, or the top ones cut (`_rebase`; continuous batching grows them when a
    prompt needs more room than the rows so far)."""
    fit = functools.partial(_fit_slots, capacity=capacity)
    slots = CACHE_AXES.index("cache_slots")
    caches = [None if c is None else dataclasses.replace(c, k=fit(c.k, slots), v=fit(c.v, slots))
              for c in (state.target_cache, state.drafter_cache)]
    return dataclasses.replace(state, target_cache=caches[0], drafter_cache=caches[1], hidden=fit(state.hidden, 1),
                               history=fit(state.history, 1))


def _falls_back(drafter, cfg: DecodeConfig) -> bool:
    """Whether rounds may step on the root alone where speculation does not pay (static)."""
    return drafter is not None and cfg.fallback_below > 0


def _uses_lookup(drafter, cfg: DecodeConfig) -> bool:
    """Whether rounds merge a lookup chain (context or corpus) into their trees, and so keep the
    committed text (static): it needs a drafted tree."""
    return drafter is not None and (cfg.lookup > 0 or cfg.corpus > 0)


def _history_init(roots: jax.Array, lengths: jax.Array, capacity: int) -> jax.Array:
    """[B, S] zeros with each row's root at slot lengths - 1; prefill writes the slots below."""
    rows = jnp.zeros((roots.shape[0], capacity), jnp.int32)
    return scatter_rows(rows, (lengths - 1)[:, None].astype(jnp.int32), roots[:, None])


def _prefill_chunk(tstate, dstate, state: DecodeState, tokens: jax.Array, start: jax.Array, *, tgd, dgd,
                   cfg: DecodeConfig) -> DecodeState:
    """Prefills one chunk: tokens [B, C] of every row's prompt at positions start .. start + C - 1
    (start a traced scalar), a causal run over the caches so far. Writes the target K/V, the
    drafter's context features and the kept hidden states at those slots.

    Rows whose prompt ends inside or before the chunk carry padding there: it lands at slots >= the
    row's cache_len, which no query sees and the rounds overwrite (as after any prefill with
    padding). Slots past the capacity are dropped.
    """
    target: Transformer = nnx.merge(tgd, tstate)
    drafter = nnx.merge(dgd, dstate) if dgd is not None else None
    b, c = tokens.shape
    positions = start + jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (b, c))
    write_pos = jnp.full((b,), start, jnp.int32)
    taps = _taps(drafter, cfg)
    # Padding past a row's prompt[:-1] stays out of a linear layer's state (`valid`).
    out = target(tokens, positions, state.target_cache, write_pos, None, hidden_layers=taps, compute_logits=False,
                 valid=positions < state.cache_len[:, None])
    feats, kept = _split_hidden(out, taps, drafter, cfg, target.cfg)
    dcache, hidden, history = state.drafter_cache, state.hidden, state.history
    if drafter is not None:
        dcache = drafter.append_context(dcache, feats, positions, write_pos)
    if history is not None:
        # Padding past a row's prompt[:-1] is dropped here: slot cache_len holds the root.
        history = scatter_rows(history, jnp.where(positions < state.cache_len[:, None], positions, history.shape[1]),
                               tokens)
    if kept is not None:
        slots = jnp.where(positions < hidden.shape[1], positions, hidden.shape[1])  # S: dropped
        hidden = hidden.at[jnp.arange(b)[:, None], slots].set(kept.astype(hidden.dtype), mode="drop")
    return dataclasses.replace(state, target_cache=out.cache, drafter_cache=dcache, hidden=hidden, history=history)


def target_logits(logits: jax.Array, cfg: DecodeConfig, sampling: jax.Array | None = None) -> jax.Array:
    """The logits the verifiers sample from: `logits` [B, ...] truncated by the config's top-k /
    top-p / min-p, or as they are when none is set or decoding is greedy (which no truncation
    changes). `sampling`: each row's settings [B, 4] (`DecodeState.sampling`); None: the config's."""
    if sampling is None:
        if is_greedy(cfg.temperature):
            return logits
        return truncate_logits(logits, cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p)
    b = logits.shape[0]
    rows = (b,) + (1,) * (logits.ndim - 2)  # one setting per row, over logits.shape[:-1]
    temperature, top_k, top_p, min_p = (sampling[:, i] for i in range(4))
    cuts = samples(temperature) & ((top_k > 0) | (top_p < 1) | (min_p > 0))

    def cut():
        return truncate_logits(logits, temperature.reshape(rows + (1,)), top_k=top_k.astype(jnp.int32).reshape(rows),
                               top_p=top_p.reshape(rows), min_p=min_p.reshape(rows))

    # The cuts' bisections cost a few passes over the logits: skipped when no row truncates.
    return jax.lax.cond(jnp.any(cuts), cut, lambda: logits)


def _taps(drafter: DFlashDrafter | None, cfg: DecodeConfig) -> tuple[int, ...]:
    """Target layers a pass must return: the drafter's taps and the kept ones (static, sorted)."""
    return tuple(sorted(set(drafter.cfg.target_layer_ids if drafter is not None else ()) | set(cfg.hidden_layers)))


def _split_hidden(out, taps, drafter, cfg: DecodeConfig, target_cfg):
    """(drafter context features [B, T, F] or None, kept hidden states [B, T, R, D] or None) of a
    pass that returned `taps`."""
    if not taps:
        return None, None
    hidden = tapped_hidden(out, taps, target_cfg.num_layers)
    pick = lambda layers: hidden[..., [taps.index(i) for i in layers], :]  # noqa: E731 - static gather
    feats = features_from_hidden(pick(drafter.cfg.target_layer_ids)) if drafter is not None else None
    return feats, (pick(cfg.hidden_layers) if cfg.hidden_layers else None)


# ------------------------------------------------------------------------------- round stages
# One round is draft -> tree -> tree pass -> verify -> commit -> emit. Each stage is a pure
# function of arrays and (merged) models, shared by the engine, the benchmarks (which time them
# one by one) and training (which builds its ExitTrain trees with `draft_trees`).


def draft(drafter: DFlashDrafter, target: Transformer, root: jax.Array, cache_len: jax.Array,
          drafter_cache: DrafterCache, head: jax.Array | None = None, mesh=None) -> jax.Array:
    """Draft logits [B, G, Vd] (G = block_size - 1, Vd the draft vocabulary) of the block
    [root, MASK x G] at positions cache_len + 0..G. `head`: `drafter.head_rows(target)`, gathered
    once (`DecodeState.draft_head`); None gathers the rows in this call. On a mesh whose
    vocabulary axis is split, a reduced draft vocabulary's columns are taken from whole-vocabulary
    logits instead (`DFlashDrafter.logits(select_after=True)`), so no slice of the LM head moves
    per round."""
    positions = cache_len[:, None] + jnp.arange(drafter.cfg.block_size, dtype=jnp.int32)
    hidden = drafter.hidden(target, drafter.block_tokens(root), positions, drafter_cache, cache_len)
    return drafter.logits(target, hidden, head, select_after=_vocab_split(mesh))


def _top_marginals(draft_logits: jax.Array, budget: int, vocab_axis: str | tuple[str, ...] | None = None):
    """The top k = min(budget, Vd) draft log-probabilities [B, G, k] of every depth and their
    indices, from draft logits [B, G, Vd].

    With `vocab_axis` (inside `shard_map`) the last axis holds this device's contiguous slice of
    the vocabulary: the log-softmax combines per-device maxima and sums ([B, G] each), and every
    device's own top k are merged (an all-gather of [B, G, k] per device) instead of gathering the
    [B, G, Vd] logits. The merged top k equal the global top k, ties included (lower index first),
    while the normaliser rounds differently from one device's sum (so tensor-parallel trees may
    break near-ties of the beam differently; greedy outputs cannot change).
    """
    x = draft_logits.astype(jnp.float32)
    if vocab_axis is None:
        log_q = jax.nn.log_softmax(x, axis=-1)
        return jax.lax.top_k(log_q, min(budget, x.shape[-1]))
    local = x.shape[-1]
    shifted = x - jax.lax.pmax(jnp.max(x, axis=-1, keepdims=True), vocab_axis)
    log_q = shifted - jnp.log(jax.lax.psum(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True), vocab_axis))
    k = min(budget, local * jax.lax.axis_size(vocab_axis))
    vals, ids = jax.lax.top_k(log_q, min(k, local))
    ids = ids + jax.lax.axis_index(vocab_axis) * local
    vals = jax.lax.all_gather(vals, vocab_axis, axis=2, tiled=True)  # [B, G, devices x k], by device
    ids = jax.lax.all_gather(ids, vocab_axis, axis=2, tiled=True)
    vals, pick = jax.lax.top_k(vals, k)
    return vals, jnp.take_along_axis(ids, pick, axis=-1)


def draft_trees(draft_logits: jax.Array, root: jax.Array, budget: int, vocab: jax.Array | None = None,
                mesh=None, *, with_scores: bool = False) -> DraftTree | tuple[DraftTree, jax.Array]:
    """DDTree trees [B, N] from draft logits [B, G, Vd]: per-depth log-marginals, then the builder.
    `with_scores`: also return the nodes' scores [B, N] (`build_ddtree_from_top`'s).

    `vocab` [Vd] maps a drafter's reduced vocabulary to token ids (`DFlashDrafter.vocab_ids()`;
    None: logits index token ids). The root is a token id already. Training calls this same
    function on detached logits, so its trees are the decoder's trees.

    With a `mesh` the builder runs under `shard_map`: each device builds its own rows (`data`) from
    its own slice of the vocabulary (`model`; see `_top_marginals`). XLA cannot split a top-k
    itself, so without this it would all-gather the whole [B, G, Vd] draft logits onto every device.
    """
    if mesh is None:
        vals, ids = _top_marginals(draft_logits, budget)
        trees, scores = jax.vmap(build_ddtree_from_top, in_axes=(0, 0, 0, None))(vals, ids, root, budget)
    else:
        vocab_axis = mesh_axes(mesh, "vocab")  # (model,), or (expert, model) under expert parallelism
        devices = math.prod(mesh.shape[a] for a in vocab_axis)
        split = devices > 1 and draft_logits.shape[-1] % devices == 0

        def local(logits, roots):
            vals, ids = _top_marginals(logits, budget, vocab_axis if split else None)
            return jax.vmap(build_ddtree_from_top, in_axes=(0, 0, 0, None))(vals, ids, roots, budget)

        rows = logical_sharding(mesh, ("batch",), root.shape).spec
        spec = logical_sharding(mesh, ("batch", None, "vocab" if split else None), draft_logits.shape).spec
        # check_vma=False: the builder's scans start from constants that then vary by row, which
        # the varying-axes type check rejects; the trees are per row (`data`) and the same on every
        # `model` device (each merges the same top k), as out_specs says.
        trees, scores = jax.shard_map(local, mesh=mesh, in_specs=(spec, rows), out_specs=(rows, rows),
                                      check_vma=False)(draft_logits, root)
    if vocab is not None:
        drafted = trees.valid & (trees.parents >= 0)
        trees = dataclasses.replace(trees, tokens=jnp.where(drafted, jnp.take(vocab, jnp.maximum(trees.tokens, 0)),
                                                            trees.tokens))
    return (trees, scores) if with_scores else trees


def root_trees(root: jax.Array) -> DraftTree:
    """Root-only trees [B, 1]: the autoregressive step as a degenerate tree pass."""
    return jax.vmap(DraftTree.from_parents)(root[:, None], jnp.full((root.shape[0], 1), -1, jnp.int32))


def tree_pass(target: Transformer, trees: DraftTree, cache_len: jax.Array, cache: KVCache,
              taps: tuple[int, ...] = ()):
    """One target pass over every row's tree at slots cache_len + node, positions cache_len + depth,
    attending to the committed prefix and the node's ancestors -> `ForwardOutput` (logits [B, N, V])."""
    return target(trees.tokens, cache_len[:, None] + trees.depth, cache, cache_len, trees.ancestors,
                  hidden_layers=taps)


def commit(out, ver, state: DecodeState, drafter: DFlashDrafter | None, cfg: DecodeConfig,
           target_cfg, active: jax.Array | None = None) -> tuple[KVCache, DrafterCache | None, jax.Array | None]:
    """Caches after accepting `ver`'s path: the path's target K/V moved to contiguous slots after
    the root; with a drafter, its context extended by the root + path features; with
    `cfg.hidden_layers`, the kept hidden states of the root + path written at the same slots."""
    # The root already sits at slot cache_len; path node i moves from cache_len + node to
    # cache_len + i (i = 1..num_accepted). move_slots reads before it writes, so overlaps are safe.
    src = jnp.where(ver.path >= 0, state.cache_len[:, None] + ver.path, -1)
    b = state.root.shape[0]
    # Root + accepted path (unused tail entries repeat the root: they land above the new
    # context length, where they are invisible and overwritten next round).
    nodes = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.maximum(ver.path, 0)], axis=1)
    # Linear-attention layers (Qwen3-Next) run the root and the accepted nodes into their state; the
    # rows not `active` (done, or whose logits were not finite) keep theirs, which has run over exactly
    # their cache_len tokens, as their slots do (a chat's next turn can go on from it: `prefill(reuse=)`).
    count = 1 + jnp.sum(ver.path >= 0, axis=1, dtype=jnp.int32)
    target_cache = out.cache.move_slots(src, state.cache_len + 1).advance(
        nodes, count if active is None else jnp.where(active, count, 0))
    taps = _taps(drafter, cfg)
    if not taps:
        return target_cache, state.drafter_cache, state.hidden
    feats, kept = _split_hidden(out, taps, drafter, cfg, target_cfg)  # [B, N, F], [B, N, R, D]
    slots = state.cache_len[:, None] + jnp.arange(nodes.shape[1], dtype=jnp.int32)
    drafter_cache, hidden = state.drafter_cache, state.hidden
    if drafter is not None:
        ctx = jnp.take_along_axis(feats, nodes[..., None], axis=1)
        drafter_cache = drafter.append_context(state.drafter_cache, ctx, slots, state.cache_len)
    if kept is not None:
        hidden = scatter_rows(hidden, slots, jnp.take_along_axis(kept, nodes[..., None, None], axis=1))
    return target_cache, drafter_cache, hidden


def emit(ver, state: DecodeState, cfg: DecodeConfig, active: jax.Array | None = None,
         stops: StopTable | None = None) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """Writes the block (accepted tokens + bonus) of the `active` rows (default: not done), cut at
    the first EOS, after the token that completes a stop string (`stops`, with `cfg.stop`) and at
    the row's `limit` of new tokens, into the output buffer -> (out [B, max_new_tokens], num_out [B], finished
    [B], stop_at [B] each row's stop automaton state after its kept tokens, or None)."""
    active = ~state.done if active is None else active
    block_tokens, count = ver.tokens, ver.num_tokens
    j = jnp.arange(block_tokens.shape[1], dtype=jnp.int32)
    valid = j < count[:, None]
    ends = jnp.isin(block_tokens, jnp.asarray(cfg.eos_ids or (-2,), jnp.int32)) & valid
    after = None
    if cfg.stop:
        after = jax.vmap(advance, in_axes=(None, 0, 0, 0, 0))(stops, state.stop_at, block_tokens, valid,
                                                             state.stop_mask)  # [B, n]
        ends = ends | (after == stops.matched)
    has_end = jnp.any(ends, axis=1)
    count = jnp.where(has_end, jnp.argmax(ends, axis=1).astype(jnp.int32) + 1, count)
    count = jnp.minimum(count, state.limit - state.num_out)
    count = jnp.where(active, count, 0)
    num_out = state.num_out + count
    out_buf = scatter_block(state.out, state.num_out, num_out, block_tokens)
    finished = active & (has_end | (num_out >= state.limit))
    stop_at = None
    if after is not None:  # the state after the last kept token (a row that kept none keeps its own)
        last = jnp.take_along_axis(after, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
        stop_at = jnp.where(count > 0, last, state.stop_at)
    return out_buf, num_out, finished, stop_at


def scatter_block(buf: jax.Array, start: jax.Array, end: jax.Array, block: jax.Array) -> jax.Array:
    """`buf` [B, T] with each row's block [B, n] entries 0 .. end - start - 1 written at columns
    start .. end - 1 (start, end [B]); the rest of the block is dropped."""
    j = jnp.arange(block.shape[1], dtype=jnp.int32)[None, :]
    cols = jnp.where(j < (end - start)[:, None], start[:, None] + j, buf.shape[1])
    return scatter_rows(buf, cols, block.astype(buf.dtype))


def block_logprobs(logits: jax.Array, ver) -> jax.Array:
    """[B, N] float32 the target's log-probability of each token of the output blocks `ver`
    verified on the tree-pass `logits` [B, N, V]: block token i was predicted at the root (i = 0)
    or at accepted node path[i - 1], the bonus at the deepest accepted node. Entries past a
    block's length are garbage, for the caller to drop."""
    root = jnp.zeros((ver.path.shape[0], 1), jnp.int32)  # (path[:, :1] is empty for a root-only tree)
    predictor = jnp.concatenate([root, jnp.maximum(ver.path, 0)], axis=1)  # [B, N]
    lse = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)  # [B, N]
    b = jnp.arange(logits.shape[0])[:, None]
    chosen = logits[b, predictor, jnp.maximum(ver.tokens, 0)].astype(jnp.float32)  # [B, N], no [B, N, V] copy
    return chosen - lse[b, predictor]


def merge_lookups(trees: DraftTree, scores: jax.Array, history: jax.Array | None, cache_len: jax.Array,
                  ngrams: NgramTable | None, cfg: DecodeConfig, *, with_scores: bool = False
                  ) -> DraftTree | tuple[DraftTree, jax.Array]:
    """The drafter's trees [B, N] (with their builder scores [B, N]) with the context-lookup chain
    (`cfg.lookup` > 0) and then the corpus-lookup chain (`cfg.corpus` > 0) merged in; `history`
    [B, S] holds each row's committed tokens, `cache_len + 1` of them. `with_scores`: also the
    merged trees' log reach estimates [B, N] (`merge_chain`'s)."""
    merge = jax.vmap(functools.partial(merge_chain, with_scores=True))
    if cfg.lookup > 0:
        chain, order = jax.vmap(context_chain, in_axes=(0, 0, None))(history, cache_len + 1, cfg.lookup)
        survival = cfg.lookup_survival or LOOKUP_SURVIVAL
        chain_scores = jax.vmap(chain_log_reach, in_axes=(0, None, None))(order, cfg.lookup, survival)
        trees, scores = merge(trees, scores, chain, chain_scores)
    if cfg.corpus > 0:
        chain, chain_scores = jax.vmap(corpus_chain, in_axes=(0, 0, None, None))(history, cache_len + 1, cfg.corpus,
                                                                                ngrams)
        trees, scores = merge(trees, scores, chain, chain_scores)
    return (trees, scores) if with_scores else trees


def _round(tstate, dstate, state: DecodeState, ngrams: NgramTable | None = None, stops: StopTable | None = None, *,
           tgd, dgd, cfg: DecodeConfig, mesh=None) -> DecodeState:
    """One draft -> build -> tree pass -> verify -> commit -> emit round for every row; with
    `cfg.fallback_below`, a plain round (the root alone) when no active row's speculation pays."""
    target: Transformer = nnx.merge(tgd, tstate)
    drafter = nnx.merge(dgd, dstate) if dgd is not None else None
    split = jax.vmap(jax.random.split)(state.keys)  # [B, 2]
    keys, sub = split[:, 0], split[:, 1]

    def speculative(state):
        logits = draft(drafter, target, state.root, state.cache_len, state.drafter_cache, state.draft_head, mesh)
        # The scores are only read by the lookup merge; without it XLA drops them.
        trees, scores = draft_trees(logits, state.root, cfg.budget, drafter.vocab_ids(), mesh, with_scores=True)
        trees = merge_lookups(trees, scores, state.history, state.cache_len, ngrams, cfg)
        new, target_law = _settle(target, drafter, state, trees, cfg.verifier, keys, sub, cfg, stops)
        if not _falls_back(drafter, cfg):
            return new
        return _after_speculative(state, new, trees, target_law, cfg)

    if drafter is None:
        # On a root-only tree every verifier is plain sampling; fixing "tev" there keeps the
        # autoregressive random stream independent of cfg.verifier.
        return _settle(target, None, state, root_trees(state.root), "tev", keys, sub, cfg, stops)[0]
    if not _falls_back(drafter, cfg):
        return speculative(state)

    def plain(state):
        new, _ = _settle(target, drafter, state, root_trees(state.root), "tev", keys, sub, cfg, stops)
        active = ~state.done
        return dataclasses.replace(new, skip=jnp.where(active, jnp.maximum(state.skip - 1, 0), state.skip),
                                   plain_rounds=state.plain_rounds + active.astype(jnp.int32))

    # One kind of round for the whole batch (a cond, not a select, so a plain round runs no
    # drafter): it drafts when any active row is due to. Rows still waiting get the tree too,
    # which measures their speculation again at no cost to them.
    return jax.lax.cond(jnp.any(~state.done & (state.skip == 0)), speculative, plain, state)


def _after_speculative(state: DecodeState, new: DecodeState, trees: DraftTree, target_law: jax.Array,
                       cfg: DecodeConfig) -> DecodeState:
    """The fallback's bookkeeping after a drafted round: each active row's expected block moves
    towards this tree's, 1 + C_p under the target law it was verified against (its mean block:
    the realised block, which varies far more, is a draw of it), and a row whose estimate is below
    `cfg.fallback_below` waits: `cfg.fallback_rounds` plain rounds, or twice its last wait if it
    was waiting already."""
    active = ~state.done
    realised = (new.block_total - state.block_total).astype(jnp.float32)  # the greedy law is a point mass
    if state.sampling is not None:
        temperature = state.sampling[:, 0]
        law = jax.vmap(exit_law)(trees, target_law, temperature)
        this = jnp.where(samples(temperature), 1.0 + law.coverage, realised)
    elif is_greedy(cfg.temperature):
        this = realised
    else:
        law = jax.vmap(lambda t, l: exit_law(t, l, cfg.temperature))(trees, target_law)
        this = 1.0 + law.coverage
    expected = jnp.where(active, FALLBACK_DECAY * state.expected_block + (1 - FALLBACK_DECAY) * this,
                         state.expected_block)
    low = active & (expected < cfg.fallback_below)
    # A row that stays below waits twice as long each time (up to FALLBACK_MAX_WAIT rounds).
    longest = max(FALLBACK_MAX_WAIT, cfg.fallback_rounds)
    wait = jnp.where(low, jnp.clip(2 * state.wait, cfg.fallback_rounds, longest),
                     jnp.where(active, 0, state.wait)).astype(jnp.int32)
    return dataclasses.replace(new, expected_block=expected, skip=jnp.where(low, wait, 0), wait=wait)


def _settle(target: Transformer, drafter: DFlashDrafter | None, state: DecodeState, trees: DraftTree, method: str,
            keys: jax.Array, sub: jax.Array, cfg: DecodeConfig, stops: StopTable | None = None
            ) -> tuple[DecodeState, jax.Array]:
    """The rest of a round on given trees: tree pass -> verify -> commit -> emit -> (the new
    state, the target logits [B, N, V] verified against)."""
    active = ~state.done
    out = tree_pass(target, trees, state.cache_len, state.target_cache, _taps(drafter, cfg))
    law = target_logits(out.logits, cfg, state.sampling)
    if state.sampling is None:
        ver = jax.vmap(lambda k, t, l: verify(k, t, l, cfg.temperature, method))(sub, trees, law)
    else:  # each row's own: `verify` selects its greedy or sampling result by the traced value
        ver = jax.vmap(lambda k, t, l, temp: verify(k, t, l, temp, method))(sub, trees, law, state.sampling[:, 0])
    # A NaN/inf logit (damaged weights, overflow) would be verified into garbage tokens: that row
    # stops here, emits nothing from this round and reports it (one read of the logits).
    finite = jnp.all(jnp.isfinite(out.logits) | ~trees.valid[..., None], axis=(1, 2))
    bad = active & ~finite
    active = active & finite
    target_cache, drafter_cache, hidden = commit(out, ver, state, drafter, cfg, target.cfg, active)
    out_buf, num_out, finished, stop_at = emit(ver, state, cfg, active, stops)
    logprobs = state.logprobs
    if cfg.logprobs:
        logprobs = scatter_block(logprobs, state.num_out, num_out, block_logprobs(out.logits, ver))

    return dataclasses.replace(
        state,
        target_cache=target_cache,
        drafter_cache=drafter_cache,
        cache_len=jnp.where(active, state.cache_len + ver.num_tokens, state.cache_len),
        root=jnp.where(active, ver.bonus_token, state.root),
        out=out_buf,
        num_out=num_out,
        done=state.done | finished | bad,
        keys=keys,
        rounds=state.rounds + active.astype(jnp.int32),
        block_total=state.block_total + jnp.where(active, ver.num_tokens, 0),
        hidden=hidden,
        nonfinite=state.nonfinite | bad,
        history=_history_after(state, ver) if state.history is not None else None,
        stop_at=stop_at,
        logprobs=logprobs,
    ), law


def _history_after(state: DecodeState, ver) -> jax.Array:
    """The history after a round: the block (accepted tokens, then the bonus, the next root) at
    slots cache_len + 1 on. A done row's writes land above its final cache_len, which nothing reads."""
    n = ver.tokens.shape[1]
    slots = state.cache_len[:, None] + 1 + jnp.arange(n, dtype=jnp.int32)
    return scatter_rows(state.history, jnp.where(ver.tokens >= 0, slots, state.history.shape[1]), ver.tokens)


def _rounds(tstate, dstate, state: DecodeState, max_rounds: jax.Array, ngrams: NgramTable | None = None,
            stops: StopTable | None = None, *, tgd, dgd, cfg: DecodeConfig, mesh=None,
            until_one: bool = False) -> DecodeState:
    """Rounds in one `lax.while_loop` (no host round-trip per round) until every row is done or
    `max_rounds` (a traced int32 scalar, so every count shares one compiled program) have run;
    `until_one` (static): or until one more row is done, for continuous batching to refill it.
    Running it again on its result continues exactly where it stopped: the loop carries nothing
    but the state."""
    body = functools.partial(_round, tstate, dstate, ngrams=ngrams, stops=stops, tgd=tgd, dgd=dgd, cfg=cfg,
                             mesh=mesh)
    done_before = state.done

    def cond(carry):
        s, i = carry
        going = (i < max_rounds) & jnp.any(~s.done)
        return going & ~jnp.any(s.done & ~done_before) if until_one else going

    state, _ = jax.lax.while_loop(cond, lambda carry: (body(carry[0]), carry[1] + 1), (state, jnp.int32(0)))
    return state


def _place_rows(state: DecodeState, fresh: DecodeState, rows: jax.Array, prompt_ids: jax.Array,
                key_data: jax.Array) -> DecodeState:
    """`state` with its rows `rows` [k] replaced by the k rows of `fresh`, a state of the same
    capacity (an index past the batch drops that row of `fresh`); each placed row then samples
    with fold_in(seed key, its prompt index `prompt_ids` [k]), the stream row prompt_ids of one
    batch holding every prompt would have. Fields without a batch axis (`draft_head`) stay."""
    def put(name, live, new):
        if live is None:
            return None
        axes = CACHE_AXES if name in ("target_cache", "drafter_cache") else STATE_AXES[name]
        if "batch" not in axes:
            return live
        where = (slice(None),) * axes.index("batch") + (rows,)
        return live.at[where].set(new, mode="drop")

    base = jax.random.wrap_key_data(key_data)
    keys = jax.vmap(lambda r: jax.random.fold_in(base, r))(prompt_ids)
    fresh = dataclasses.replace(fresh, keys=keys)
    return dataclasses.replace(state, **{
        f.name: jax.tree.map(functools.partial(put, f.name), getattr(state, f.name), getattr(fresh, f.name))
        for f in dataclasses.fields(DecodeState)})


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during `Decoder.run` (or `generate`), raised once the loop call in flight returned.

    `state` is the state after that call: its rows with `done` set are complete. `results`, set by
    `Decoder.generate`, holds one `Generation` per row, None for the rows that had not finished.
    A KeyboardInterrupt, so code that does not look at the partial results behaves as before.
    """

    def __init__(self, state: DecodeState, results: list[Generation | None] | None = None):
        super().__init__("generation interrupted")
        self.state = state
        self.results = results


class _SigintFlag:
    hit = False


@contextlib.contextmanager
def _deferred_sigint() -> Iterator[_SigintFlag]:
    """Within the block a first SIGINT only sets `flag.hit` (the caller stops at its next check);
    a second raises KeyboardInterrupt at once. Raising inside the loop could lose the donated state,
    and with it the finished rows, so the first only asks. Installed only in the main thread and
    over Python's default handler: a caller's own handler (e.g. the training loop's) is left alone."""
    flag = _SigintFlag()
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield flag
        return

    def on_sigint(_signum, _frame):
        if flag.hit:
            raise KeyboardInterrupt
        flag.hit = True

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)


def _next_rounds(rounds: int, seconds: float, most: int) -> int:
    """Rounds for the next loop call after one of `rounds` rounds took `seconds`: proportional to
    CALL_SECONDS, growing at most 2x per call (a fast first call may be an outlier), in [1, most]."""
    scaled = int(rounds * CALL_SECONDS / max(seconds, 1e-6))
    return max(1, min(2 * rounds, scaled, most))


# ------------------------------------------------------------------------------------- the engine


def _check_prompt_types(prompts) -> None:
    """TypeError unless `prompts` is a sequence of sequences of integer token ids (a flat list of
    ids, text or float ids would otherwise be misread or silently truncated)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (Sequence, np.ndarray)):
        raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    for i, p in enumerate(prompts):
        if isinstance(p, (str, bytes)) or not isinstance(p, (Sequence, np.ndarray)):
            hint = " (for one prompt pass [ids], a list holding one list)" if isinstance(p, (int, np.integer)) else ""
            raise TypeError(f"prompt {i} must be a list of token ids, got {type(p).__name__}{hint}")
        for t in p:
            if not is_int(t):
                raise TypeError(f"prompt {i} holds {t!r} ({type(t).__name__}): token ids must be integers")


@functools.lru_cache(maxsize=64)
def _program(fn, statics: tuple, donate: tuple[int, ...], shardings: tuple | None):
    """`fn` with its static arguments (`statics`: sorted (name, value) pairs: graph definitions,
    config, mesh, capacity), jitted with `donate` and the `frozen` in/out shardings (None: one
    device). Cached, so Decoders with equal statics share their traces and compilations: a second
    Decoder for the same models and config (a new request, an evaluation's repeat, a test) compiles
    nothing. Graph definitions compare by structure, not identity."""
    shard = {} if shardings is None else dict(zip(("in_shardings", "out_shardings"), thawed(shardings)))
    mesh = next((s.mesh for s in jax.tree.leaves(shard) if isinstance(s, jax.sharding.NamedSharding)), None)
    return jax.jit(traced_on(functools.partial(fn, **dict(statics)), mesh), donate_argnums=donate, **shard)


def _jit(fn, statics: dict, donate: tuple[int, ...] = (), shardings: dict | None = None):
    """`_program` for keyword statics and a {"in_shardings", "out_shardings"} dict (empty or None
    without a mesh)."""
    key = frozen((shardings["in_shardings"], shardings["out_shardings"])) if shardings else None
    return _program(fn, tuple(sorted(statics.items())), donate, key)


def _check_state(state, caller: str) -> None:
    """TypeError / ValueError unless `state` is a DecodeState whose buffers are still alive. `run`,
    `step` and `prefill(reuse=)` donate the state they are given (its caches are reused in place),
    so reading it afterwards would give XLA's "Array has been deleted" from deep inside the call."""
    if not isinstance(state, DecodeState):
        raise TypeError(f"{caller}: expected a DecodeState (from Decoder.prefill), got {type(state).__name__}")
    if any(getattr(leaf, "is_deleted", lambda: False)() for leaf in jax.tree.leaves(state)):
        raise ValueError(f"{caller}: this DecodeState was consumed by an earlier run, step or prefill(reuse=) "
                         "(its buffers were donated): use the state that call returned")


class Decoder:
    """Speculative (or autoregressive) generation with a target and, optionally, a DFlash drafter.

    The models are split once into graphdef + state; the states travel as jit arguments (never as
    closure constants). Compiled functions are cached per (batch, prompt bucket, capacity) and shared
    by Decoders whose models have the same structure and whose config and mesh are equal.

    With a `mesh` (`tevjax.sharding.make_mesh`) the weights are placed with their shardings (no
    copy if they already are), and prefill, round and loop run over the mesh with the state's
    rows over `data` and its heads over `model`. `prefill` needs a row count the `data` axis
    divides; `generate` and `stream` pad the batch with copies of the last prompt and drop them.

    `spellings`: the bytes each token id spells (`tevjax.convert.tokenizer.token_bytes`), which
    `cfg.stop` needs: the stop strings' automaton is built from them once, here.
    """

    def __init__(self, target: Transformer, drafter: DFlashDrafter | None, cfg: DecodeConfig, mesh=None, *,
                 ngrams: NgramTable | None = None, spellings: Sequence[bytes] | None = None):
        for name, value, kind in (("target", target, Transformer), ("cfg", cfg, DecodeConfig),
                                  ("drafter", drafter, (DFlashDrafter, type(None))),
                                  ("ngrams", ngrams, (NgramTable, type(None)))):
            if not isinstance(value, kind):
                want = kind.__name__ if isinstance(kind, type) else f"{kind[0].__name__} or None"
                raise TypeError(f"Decoder: {name} must be a {want}, got {type(value).__name__}")
        if drafter is not None:
            drafter.cfg.check_target(target.cfg)
        # An end-of-sequence id past the vocabulary is never sampled: the rows would run to
        # max_new_tokens in silence.
        if any(e >= target.cfg.vocab_size for e in cfg.eos_ids):
            raise ValueError(f"DecodeConfig.eos_ids {cfg.eos_ids} holds ids outside the target's vocabulary "
                             f"[0, {target.cfg.vocab_size})")
        if cfg.stop and spellings is None:
            raise ValueError(f"DecodeConfig.stop = {cfg.stop!r} needs the tokens' bytes: Decoder(..., spellings="
                             "tevjax.convert.tokenizer.token_bytes(tokenizer))")
        # A small table every row reads each round: a jit argument, like the n-gram table.
        self.stops = stop_table(cfg.stop, spellings, target.cfg.vocab_size) if cfg.stop else None
        if drafter is not None and cfg.corpus > 0 and ngrams is None:
            raise ValueError(f"DecodeConfig.corpus = {cfg.corpus} needs an n-gram table: Decoder(..., ngrams=table) "
                             "(tevjax.builder.ngram_table, or load_models(...).ngrams)")
        # Only a round that merges a corpus chain reads the table; otherwise it does not travel.
        self.ngrams = ngrams if drafter is not None and cfg.corpus > 0 else None
        if self.ngrams is not None:  # another target's table would embed ids past the vocabulary
            proposed = jnp.where(jnp.isfinite(self.ngrams.log_reach), self.ngrams.tokens, 0)  # padding: 0
            low, high = int(proposed.min()), int(proposed.max())
            if low < 0 or high >= target.cfg.vocab_size:
                raise ValueError(f"the n-gram table proposes token {high if high >= target.cfg.vocab_size else low}, "
                                 f"outside the target's vocabulary [0, {target.cfg.vocab_size}): is it another "
                                 "target's corpus?")
        self.cfg = cfg
        self.target_cfg = target.cfg
        self.mesh = mesh
        self.tgd, self.tstate = nnx.split(target)
        # dgd is None <=> no drafter: the static switch the jitted rounds and prefill branch on.
        self.dgd, self.dstate = nnx.split(drafter) if drafter is not None else (None, None)
        statics = dict(tgd=self.tgd, dgd=self.dgd, cfg=cfg, mesh=mesh)
        shard: dict[str, Any] = {}
        self._chunk_shardings: dict[str, Any] = {}
        self._empty_shardings: dict[str, Any] = {}
        self._rebase_shardings: dict[str, Any] = {}
        self._loop_shardings: dict[str, Any] = {}
        self._place_shardings: dict[str, Any] = {}
        if mesh is not None:
            tshard = param_shardings(target, mesh, self.tstate)
            dshard = param_shardings(drafter, mesh, self.dstate) if drafter is not None else None
            self.tstate = jax.device_put(self.tstate, tshard)
            self.dstate = jax.device_put(self.dstate, dshard) if drafter is not None else None
            head = drafter is not None and drafter.vocab_ids() is not None and not _vocab_split(mesh)
            sshard = state_shardings(mesh, drafter=drafter is not None, hidden=bool(cfg.hidden_layers), head=head,
                                     history=_uses_lookup(drafter, cfg), fallback=_falls_back(drafter, cfg),
                                     stop=bool(cfg.stop), logprobs=cfg.logprobs,
                                     sampling=cfg.sampling_per_row, linear=bool(target.cfg.linear_layers))
            scalar = logical_sharding(mesh, ())
            rows = logical_sharding(mesh, ("batch",))
            # The n-gram table is small and read by every row: a copy on each device.
            nshard = None if self.ngrams is None else jax.tree.map(lambda _: logical_sharding(mesh, ()), self.ngrams)
            if self.ngrams is not None:
                self.ngrams = jax.device_put(self.ngrams, nshard)
            stshard = None if self.stops is None else jax.tree.map(lambda _: logical_sharding(mesh, ()), self.stops)
            shard = dict(in_shardings=(tshard, dshard, sshard, nshard, stshard), out_shardings=sshard)
            self._loop_shardings = dict(in_shardings=(tshard, dshard, sshard, scalar, nshard, stshard),
                                        out_shardings=sshard)
            self._chunk_shardings = dict(in_shardings=(tshard, dshard, sshard, logical_sharding(mesh, ("batch", None)),
                                                       scalar), out_shardings=sshard)
            self._empty_shardings = dict(in_shardings=(tshard, dshard, rows, rows, rows, rows, rows,
                                                       logical_sharding(mesh, (None,)), scalar, rows),
                                         out_shardings=sshard)
            vector = logical_sharding(mesh, (None,))  # a small host vector, on every device
            self._place_shardings = dict(in_shardings=(sshard, sshard, vector, vector, vector), out_shardings=sshard)
            self._rebase_shardings = dict(in_shardings=(tshard, dshard, sshard, rows, rows, rows, rows, rows,
                                                        logical_sharding(mesh, (None,)), scalar, rows),
                                          out_shardings=sshard)
        # Donating the state is safe: each call's output state replaces its input and nothing
        # else holds a reference, so XLA can update the caches in place instead of copying them.
        self._round = _jit(_round, statics, (2,), shard)
        self._loop = _jit(_rounds, statics, (2,), self._loop_shardings)
        self._loop_until_one = _jit(_rounds, dict(statics, until_one=True), (2,), self._loop_shardings)
        # Continuous batching's refill: the live state is donated (updated in place), the fresh rows not.
        self._place = _jit(_place_rows, {}, (0,), self._place_shardings)
        self._prefill_chunk = _jit(_prefill_chunk, dict(tgd=self.tgd, dgd=self.dgd, cfg=cfg), (2,),
                                   self._chunk_shardings)
        if self.stops is not None:
            self.stops = jax.device_put(self.stops, stshard) if mesh is not None else jax.device_put(self.stops)
        # This Decoder's programs per capacity (shared with equal Decoders through `_program`).
        self._empty_fns: dict[int, Any] = {}
        self._rebase_fns: dict[tuple[int, bool], Any] = {}
        self._grow_fns: dict[int, Any] = {}

    # -- shapes
    @property
    def speculative(self) -> bool:
        """Whether rounds draft a tree (a drafter was given) or take one autoregressive step."""
        return self.dgd is not None

    @property
    def tree_slots(self) -> int:
        """N = budget + 1 with a drafter; 1 (the root) without."""
        return self.cfg.budget + 1 if self.speculative else 1

    def shapes(self, prompt_lengths: Sequence[int]) -> tuple[int, int]:
        """(prefill bucket Tp, cache capacity S) for a batch of prompts."""
        longest = max(prompt_lengths)
        tp = _bucket(longest - 1, self.cfg.prompt_bucket) if longest > 1 else self.cfg.prompt_bucket
        need = tp + 1 + self.cfg.max_new_tokens + self.tree_slots
        if self.cfg.capacity is not None:
            if self.cfg.capacity < need:
                raise ValueError(
                    f"capacity {self.cfg.capacity} is too small: prompt bucket {tp} + 1 + max_new_tokens "
                    f"{self.cfg.max_new_tokens} + tree slots {self.tree_slots} = {need}")
            capacity = self.cfg.capacity
        else:
            capacity = _bucket(need, self.cfg.capacity_bucket)
        limit = self.target_cfg.max_position_embeddings
        if longest + self.cfg.max_new_tokens + self.tree_slots > limit:
            slots = (f"{self.tree_slots} tree slots (budget {self.cfg.budget} + root)" if self.speculative
                     else "1 slot for the next token")
            raise ValueError(
                f"prompt of {longest} tokens + max_new_tokens {self.cfg.max_new_tokens} + {slots} = "
                f"{longest + self.cfg.max_new_tokens + self.tree_slots} exceeds the model's {limit} positions")
        return tp, capacity

    def chunk_size(self, prompt_lengths: Sequence[int], prefilled: int = 0) -> int:
        """Prefill chunk C for prompts whose first `prefilled` tokens are cached already:
        `cfg.prefill_chunk`, or the prompt bucket, or the power of two (at least MIN_CHUNK) that
        holds what is left of the longest prompt[:-1], whichever is smallest. A short prompt is one
        chunk, as long prompts are several of `prefill_chunk`; a large bucket (a chat's, which
        keeps the cache capacities few) does not make a short prompt pay for a long chunk: on 2
        CPU cores a 40-token prompt took 424 ms in a chunk of 256 and 152 ms in one of 64."""
        left = max(prompt_lengths) - 1 - prefilled
        return min(self.cfg.prefill_chunk, self.shapes(prompt_lengths)[0], _fitted(left))

    def _empty_fn(self, capacity: int):
        if capacity not in self._empty_fns:
            self._empty_fns[capacity] = _jit(_empty_state, dict(tgd=self.tgd, dgd=self.dgd, cfg=self.cfg,
                                                                capacity=capacity, mesh=self.mesh),
                                             (), self._empty_shardings)
        return self._empty_fns[capacity]

    def _rebase_fn(self, capacity: int, earlier: int):
        """`_rebase` to `capacity` slots from a state of `earlier` slots. The state is donated when
        the capacity stays (its caches are updated in place); caches of another size cannot take
        the result, so then it is not."""
        key = (capacity, earlier == capacity)
        if key not in self._rebase_fns:
            self._rebase_fns[key] = _jit(_rebase, dict(tgd=self.tgd, dgd=self.dgd, cfg=self.cfg, capacity=capacity,
                                                       mesh=self.mesh),
                                         (2,) if key[1] else (), self._rebase_shardings)
        return self._rebase_fns[key]

    def _grow_fn(self, capacity: int):
        """`_fit_capacity` to `capacity` slots (more than the state's)."""
        if capacity not in self._grow_fns:
            shard = {} if self.mesh is None else dict(in_shardings=self._place_shardings["in_shardings"][:1],
                                                      out_shardings=self._place_shardings["out_shardings"])
            self._grow_fns[capacity] = _jit(_fit_capacity, dict(capacity=capacity), (), shard)
        return self._grow_fns[capacity]

    def _rows(self, x: np.ndarray, sharding_index: int, shardings: dict) -> jax.Array:
        """A host array as a jit argument: on a mesh each device receives its own rows only
        (multi-host safe); without one, a plain device array."""
        return put(x, shardings["in_shardings"][sharding_index]) if self.mesh is not None else jnp.asarray(x)

    @property
    def row_multiple(self) -> int:
        """The batch sizes `prefill` takes are multiples of this (the mesh's `data` axis, or 1)."""
        return 1 if self.mesh is None else dict(self.mesh.shape).get("data", 1)

    def _padded(self, prompts: Sequence[Sequence[int]]) -> list[Sequence[int]]:
        """`prompts` plus copies of the last one up to a multiple of `row_multiple`; the copies'
        rows come after every real row, so the real rows' PRNG streams (by row index) are unchanged."""
        _check_prompt_types(prompts)
        prompts = list(prompts)
        return prompts + [prompts[-1]] * (-len(prompts) % self.row_multiple) if prompts else prompts

    def prefill(self, prompts: Sequence[Sequence[int]], seed: int = 0, *,
                reuse: tuple[DecodeState, Sequence[Sequence[int]]] | None = None,
                max_new_tokens: int | Sequence[int] | None = None,
                temperature: float | Sequence[float] | None = None, top_k: int | Sequence[int] | None = None,
                top_p: float | Sequence[float] | None = None, min_p: float | Sequence[float] | None = None,
                stop: Sequence[Sequence[str]] | None = None, first_row: int = 0) -> DecodeState:
        """Initial state for a batch of token-id prompts (each of length >= 1).

        `max_new_tokens`: the most new tokens of every row (an int) or of each (one per prompt;
        padding rows after them take the last one), each at most `cfg.max_new_tokens`, which sizes
        the buffers: rows of one batch can ask for different lengths without a compile. None:
        `cfg.max_new_tokens`.

        `temperature`, `top_k`, `top_p`, `min_p`: every row's (a number) or each row's (one per
        prompt; padding rows take the last), with `cfg.sampling_per_row`: greedy, sampled and
        truncated rows share the batch without a compile. None: the config's. Without
        `cfg.sampling_per_row` only the config's values are accepted.

        `stop`: the stop strings each row watches, one list per prompt (padding rows take the
        last), each a subset of `cfg.stop`, which builds the one automaton every row reads: rows
        stop at different strings without a compile. None: all of `cfg.stop`.

        `first_row`: the index of the batch's first prompt in a longer list decoded batch by batch
        (the CLI's and `evaluate`'s --batch-size). Row r samples with PRNG stream first_row + r,
        the stream it would have in one batch of the whole list (as `continuous` gives prompt i
        stream i): batches do not repeat each other's random numbers, and a prompt's sample does
        not depend on the batch size. A traced argument: no compile per value.

        prompt[:-1] goes into the caches chunk by chunk (the last prompt token is the root): one
        jitted call per chunk, as many as the longest prompt needs, each waited for, so Ctrl-C
        during a long prompt is answered after the chunk in flight.

        `reuse=(state, earlier_prompts)`: a state of this decoder after `earlier_prompts` (one per
        row, as prefilled, padding rows included), run or not; it is consumed. Each row keeps the
        cache slots of the longest common prefix of its earlier prompt + output and its new prompt,
        and only the rest is prefilled, in chunks sized to it: the next turn of a chat prefills the
        new messages, not the whole conversation. When the new prompts need another cache capacity,
        the kept slots move to caches of that capacity. The kept K/V were written by the earlier
        rounds' tree passes, not by a prefill, so logits can differ from a fresh prefill's in the
        last bits: every output is still exactly verified against the target, and greedy outputs
        differ only at near-ties. The state keeps a 32-bit fingerprint of each row's prompt, so
        earlier prompts other than the ones it was prefilled with, or in another row order, are
        refused (ValueError), as are another decoder's state and a state already consumed.
        """
        self._check_prompts(prompts)
        _, capacity = self.shapes([len(p) for p in prompts])
        limits = self._limits(max_new_tokens, len(prompts))
        sampling = self._sampling(len(prompts), temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        stop_masks = self._stop_masks(stop, len(prompts))
        top = np.iinfo(np.int32).max - len(prompts)  # the streams are int32
        if not is_int(first_row) or not 0 <= first_row <= top:
            raise ValueError(f"first_row must be an int from 0 to {top}, got {first_row!r}")
        if self.mesh is not None:
            check_batch(self.mesh, len(prompts), f"a batch of {len(prompts)} prompts (Decoder.generate pads it)")
        return self._prefill(prompts, seed, reuse, limits, sampling, stop_masks, capacity, first_row=int(first_row))

    def _check_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        """ValueError / TypeError naming the first prompt that is not a non-empty list of token ids
        in the vocabulary."""
        _check_prompt_types(prompts)
        if not prompts:
            raise ValueError("no prompts given")
        vocab = self.target_cfg.vocab_size
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in p if not 0 <= int(t) < vocab]
            if bad:
                raise ValueError(f"prompt {i} holds token id {bad[0]} outside the vocabulary [0, {vocab})")

    def _prefill(self, prompts: Sequence[Sequence[int]], seed: int, reuse, limits: np.ndarray,
                 sampling: np.ndarray, stop_masks: np.ndarray, capacity: int, first_row: int = 0) -> DecodeState:
        """`prefill` of checked prompts into caches of `capacity` slots (at least what they need)."""
        lengths = [len(p) for p in prompts]
        key_data = np.asarray(jax.random.key_data(seed_key(seed)))
        first = np.int32(first_row)
        roots = np.asarray([p[-1] for p in prompts], np.int32)
        hashes = np.asarray([prompt_fingerprint(p) for p in prompts], np.int32)
        if reuse is None:
            start, es = 0, self._empty_shardings
            state = self._empty_fn(capacity)(self.tstate, self.dstate, self._rows(roots, 2, es),
                                             self._rows(np.asarray(lengths, np.int32), 3, es),
                                             self._rows(limits, 4, es), self._rows(sampling, 5, es),
                                             self._rows(stop_masks, 6, es), self._rows(key_data, 7, es),
                                             self._rows(first, 8, es), self._rows(hashes, 9, es))
            c = self.chunk_size(lengths)
        else:
            start, rs = self._reused_prefix(prompts, reuse), self._rebase_shardings
            rebase = self._rebase_fn(capacity, reuse[0].target_cache.capacity)
            state = rebase(self.tstate, self.dstate, reuse[0], self._rows(roots, 3, rs),
                           self._rows(np.asarray(lengths, np.int32), 4, rs), self._rows(limits, 5, rs),
                           self._rows(sampling, 6, rs), self._rows(stop_masks, 7, rs),
                           self._rows(key_data, 8, rs), self._rows(first, 9, rs), self._rows(hashes, 10, rs))
            c = self.chunk_size(lengths, start)  # sized to what is left: a few messages, not the conversation
        chunks = -(-(max(lengths) - 1 - start) // c)  # covers prompt[start:-1]; 0 when nothing is left
        tokens = np.zeros((len(prompts), chunks * c), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : max(len(p) - 1 - start, 0)] = p[start:-1]
        for i in range(chunks):
            chunk = self._rows(tokens[:, i * c: (i + 1) * c], 3, self._chunk_shardings)
            state = self._prefill_chunk(self.tstate, self.dstate, state, chunk, np.int32(start + i * c))
            jax.block_until_ready(state)
        return state

    def _per_row(self, value, rows: int, name: str, scalar: tuple[type, ...] | None, kind: str, kinds: str) -> list:
        """`value` as one entry per row: a scalar for every row, or a sequence of one per prompt
        (padding rows after the prompts take the last, as `_padded` pads the prompts). `scalar`:
        the types of an entry (checked), or None when entries are sequences (checked by the caller)
        and there is no scalar form."""
        if scalar is not None and isinstance(value, scalar) and not isinstance(value, bool):
            return [value] * rows
        if isinstance(value, (Sequence, np.ndarray)) and not isinstance(value, (str, bytes)):
            values = list(value)
            if 0 < len(values) < rows:
                values += values[-1:] * (-len(values) % self.row_multiple)
            if len(values) != rows:
                raise ValueError(f"{name}: {len(value)} values for {rows} prompts (one per prompt)")
            for i, v in enumerate(values):
                if scalar is not None and (not isinstance(v, scalar) or isinstance(v, bool)):
                    raise TypeError(f"{name}[{i}] must be {kind}, got {v!r}")
            return values
        if scalar is None:
            raise TypeError(f"{name} must be {kind} or None, got {type(value).__name__}")
        raise TypeError(f"{name} must be {kind}, a list of {kinds} or None, got {type(value).__name__}")

    def _limits(self, max_new_tokens: int | Sequence[int] | None, rows: int) -> np.ndarray:
        """[rows] int32 each row's most new tokens (`prefill`'s `max_new_tokens`), checked."""
        most = self.cfg.max_new_tokens
        if max_new_tokens is None:
            return np.full(rows, most, np.int32)
        limits = self._per_row(max_new_tokens, rows, "max_new_tokens", (int, np.integer), "an int", "ints")
        for i, n in enumerate(limits):
            if not 1 <= n <= most:
                raise ValueError(f"max_new_tokens[{i}] = {n} is outside [1, {most}] (DecodeConfig.max_new_tokens sizes "
                                 "the buffers)")
        return np.asarray(limits, np.int32)

    def _sampling(self, rows: int, **given) -> np.ndarray:
        """[rows, 4] float32 each row's temperature, top-k, top-p and min-p (`prefill`'s settings of
        those names; None: the config's), checked."""
        cfg = self.cfg
        kinds = {"temperature": ((int, float, np.integer, np.floating), "a number", "numbers"),
                 "top_k": ((int, np.integer), "an int", "ints"),
                 "top_p": ((int, float, np.integer, np.floating), "a number", "numbers"),
                 "min_p": ((int, float, np.integer, np.floating), "a number", "numbers")}
        columns = {}
        for name in SAMPLING_COLUMNS:
            default = getattr(cfg, name)
            value = given.get(name)
            values = [default] * rows if value is None else self._per_row(value, rows, name, *kinds[name])
            if value is not None and not cfg.sampling_per_row and any(v != default for v in values):
                raise ValueError(f"{name} {value!r} is not DecodeConfig.{name} ({default}): rows take sampling "
                                 "settings of their own with DecodeConfig(sampling_per_row=True)")
            columns[name] = values
        for i, row in enumerate(zip(*columns.values())):
            temperature, top_k, top_p, min_p = row
            if not valid_temperature(float(temperature)):
                raise ValueError(f"temperature[{i}] = {temperature!r} is not a finite float32 number >= 0")
            try:
                check_truncation(top_k, top_p, min_p)
            except (TypeError, ValueError) as e:
                raise type(e)(f"row {i}: {e}") from None
        return np.asarray(list(zip(*columns.values())), np.float32).reshape(rows, len(SAMPLING_COLUMNS))

    def _stop_masks(self, stop: Sequence[Sequence[str]] | None, rows: int) -> np.ndarray:
        """[rows] int32 the stop strings each row watches (`prefill`'s `stop`), as bit masks over
        `cfg.stop`, checked."""
        if stop is None:
            return np.full(rows, -1, np.int32)
        if not self.cfg.stop:
            raise ValueError("stop= picks each row's stop strings among DecodeConfig.stop, which is empty: the "
                             "strings build the automaton, so give them there")
        lists = self._per_row(stop, rows, "stop", None, "one list of stop strings per prompt", "")
        masks = []
        for i, strings in enumerate(lists):
            try:
                strings = check_stops(strings)
            except (TypeError, ValueError) as e:
                raise type(e)(f"stop[{i}]: {e}") from None
            unknown = [s for s in strings if s not in self.cfg.stop]
            if unknown:
                raise ValueError(f"stop[{i}]: {unknown[0]!r} is not one of DecodeConfig.stop {self.cfg.stop!r} (the "
                                 "strings the automaton was built from)")
            bits = sum(1 << self.cfg.stop.index(s) for s in set(strings))
            masks.append(bits - (1 << 32) if bits >= 1 << 31 else bits)  # bit 31 as int32's sign
        return np.asarray(masks, np.int32)

    def _reused_prefix(self, prompts: Sequence[Sequence[int]], reuse) -> int:
        """The first slot `prefill(prompts, reuse=reuse)` must prefill: the smallest over rows of the
        slots a row keeps (its new prompt's common prefix with its earlier prompt + output, within
        the slots its caches hold and below its new root)."""
        try:
            state, earlier = reuse
        except (TypeError, ValueError):
            raise TypeError("reuse must be a (state, earlier_prompts) pair") from None
        _check_prompt_types(earlier)
        if len(earlier) != len(prompts) and earlier:
            earlier = self._padded(earlier)  # as `stream` and `generate` pad the prompts
        if len(earlier) != len(prompts):
            raise ValueError(f"reuse: {len(earlier)} earlier prompts for {len(prompts)} prompts (one per row, "
                             "padding rows included)")
        _check_state(state, "prefill(reuse=)")
        cache = state.target_cache
        if not isinstance(cache, KVCache):
            raise TypeError(f"reuse: expected a DecodeState of this decoder, got one with a {type(cache).__name__} cache")
        want = self._abstract_state(len(prompts), cache.capacity)
        if jax.tree.structure(state) != jax.tree.structure(want) or any(
                a.shape != b.shape for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(want))):
            raise ValueError("reuse: the state is not one of this decoder's for this batch (another decoder's "
                             "settings, or another number of rows)")
        if state.prompt_hash is not None:
            kept = host_array(state.prompt_hash)
            for i, old in enumerate(earlier):
                if prompt_fingerprint(old) != int(kept[i]):
                    raise ValueError(f"reuse: earlier prompt {i} is not the prompt row {i} of the state was prefilled "
                                     "with (pass the prompts of the prefill that made the state, padding rows "
                                     "included, in its row order)")
        cache_len, out, num_out = host_array(state.cache_len), host_array(state.out), host_array(state.num_out)
        nonfinite = host_array(state.nonfinite)
        keep = []
        for i, (new, old) in enumerate(zip(prompts, earlier)):
            if nonfinite[i]:  # that row's last round was not committed: trust nothing it wrote
                keep.append(0)
                continue
            text = np.concatenate([np.asarray(old, np.int64), out[i, : num_out[i]]])
            n = min(len(text), len(new) - 1, int(cache_len[i]))
            same = text[:n] == np.asarray(new[:n], np.int64)
            keep.append(n if same.all() else int(np.argmin(same)))
        if self.target_cfg.linear_layers and (len(set(keep)) > 1 or any(k != int(c) for k, c in zip(keep, cache_len))):
            # A linear layer's recurrent state has run over each row's whole earlier text (cache_len
            # tokens) and cannot be cut back to a shorter shared prefix, and the chunks start at one slot
            # for every row: a hybrid target (Qwen3-Next) goes on from its state only where every row's
            # new prompt extends its whole earlier text, at the same length; otherwise it prefills the
            # prompts again (a run at slot 0 starts from an empty state).
            return 0
        return min(keep)

    def _key_data_shape(self) -> jax.ShapeDtypeStruct:
        return jax.eval_shape(lambda: jax.random.key_data(seed_key(0)))

    def _abstract_state(self, batch: int, capacity: int) -> DecodeState:
        """The shapes and dtypes of a `prefill` result, computed without running anything."""
        i32, f32 = jax.ShapeDtypeStruct((batch,), jnp.int32), jax.ShapeDtypeStruct((batch, 4), jnp.float32)
        return jax.eval_shape(self._empty_fn(capacity), self.tstate, self.dstate, i32, i32, i32, f32, i32,
                              self._key_data_shape(), jax.ShapeDtypeStruct((), jnp.int32), i32)

    def compile(self, prompts: Sequence[Sequence[int]], *, streaming: bool = False, reuse: bool = False,
                continuous: bool = False) -> float:
        """Compiles prefill and the generation loop (or, for `stream`, the single round) for this
        batch shape ahead of time, from the shapes alone (nothing runs), so that timed runs
        exclude compilation; returns seconds spent. `reuse`: also a prefill that reuses a state
        of these shapes (`prefill(reuse=...)`: its rebase and its smallest chunk). `continuous`:
        the loop `continuous` runs (to a row's end) for these prompts as its first rows; its
        refills compile their shapes on first use."""
        t0 = time.perf_counter()
        prompts = self._padded(prompts)
        lengths = [len(p) for p in prompts]
        _, capacity = self.shapes(lengths)
        b = len(prompts)
        state = self._abstract_state(b, capacity)
        i32 = jax.ShapeDtypeStruct((), jnp.int32)
        i32_b, f32_b = jax.ShapeDtypeStruct((b,), jnp.int32), jax.ShapeDtypeStruct((b, 4), jnp.float32)
        self._empty_fn(capacity).lower(self.tstate, self.dstate, i32_b, i32_b, i32_b, f32_b, i32_b,
                                       self._key_data_shape(), i32, i32_b).compile()
        tokens = jax.ShapeDtypeStruct((b, self.chunk_size(lengths)), jnp.int32)
        self._prefill_chunk.lower(self.tstate, self.dstate, state, tokens, i32).compile()
        if reuse:
            self._rebase_fn(capacity, capacity).lower(self.tstate, self.dstate, state, i32_b, i32_b, i32_b, f32_b,
                                                      i32_b, self._key_data_shape(), i32, i32_b).compile()
            small = jax.ShapeDtypeStruct((b, min(self.chunk_size(lengths), MIN_CHUNK)), jnp.int32)
            self._prefill_chunk.lower(self.tstate, self.dstate, state, small, i32).compile()
        if streaming:
            self._round.lower(self.tstate, self.dstate, state, self.ngrams, self.stops).compile()
        else:
            loop = self._loop_until_one if continuous else self._loop
            loop.lower(self.tstate, self.dstate, state, i32, self.ngrams, self.stops).compile()
        return time.perf_counter() - t0

    def compiled_loop(self, state: DecodeState):
        """The ahead-of-time compiled round loop for `state`'s shapes (e.g. for `.memory_analysis()`);
        compiling again for known shapes hits jax's cache."""
        return self._loop.lower(self.tstate, self.dstate, state, jax.ShapeDtypeStruct((), jnp.int32),
                                self.ngrams, self.stops).compile()

    def run(self, state: DecodeState, *, rounds_per_call: int | None = None) -> DecodeState:
        """Runs rounds until every row is done (consumes `state`).

        The jitted loop is called repeatedly, each call stopping after at most `rounds_per_call`
        rounds (default: adapted from the last call's time so that a call takes about
        CALL_SECONDS, on the slowest host of a multi-host job). The results do not depend on the
        split: a call continues exactly where the last one stopped. Ctrl-C (in the main thread, on
        any host) is answered after the call in flight: `Interrupted` then carries the state, whose
        finished rows are complete.
        """
        _check_state(state, "run")
        if rounds_per_call is not None and not is_int(rounds_per_call):  # 1.5 and True ran as 1
            raise TypeError(f"rounds_per_call must be an int or None, got {rounds_per_call!r}")
        if rounds_per_call is not None and rounds_per_call < 1:
            raise ValueError(f"rounds_per_call must be >= 1, got {rounds_per_call}")
        rounds = rounds_per_call or 1
        with _deferred_sigint() as sigint:
            while True:
                t0 = time.perf_counter()
                state = self._loop(self.tstate, self.dstate, state, np.int32(rounds), self.ngrams, self.stops)
                done = host_array(state.done)  # waits for the call: the bound on how late Ctrl-C is seen
                want = rounds if rounds_per_call is not None else \
                    _next_rounds(rounds, time.perf_counter() - t0, self.cfg.max_new_tokens)
                # The hosts of a multi-host job must make the same calls (their loops' collectives
                # pair up), but each has its own clock and Ctrl-C: all take the smallest round
                # count and stop if any was interrupted.
                hit, want = every_process([sigint.hit, want]).T
                if hit.any():
                    raise Interrupted(state)
                if done.all():
                    return state
                rounds = int(want.min())

    def step(self, state: DecodeState) -> DecodeState:
        """One jitted round (consumes `state`); the building block of `stream`."""
        _check_state(state, "step")
        return self._round(self.tstate, self.dstate, state, self.ngrams, self.stops)

    def results(self, state: DecodeState, prompt_lengths: Sequence[int] | None = None) -> list[Generation]:
        """Per-row results; `Generation.hidden` needs `cfg.hidden_layers` and the prompt lengths."""
        _check_state(state, "results")
        out, num_out = host_array(state.out), host_array(state.num_out)
        if prompt_lengths is not None and len(prompt_lengths) > out.shape[0]:
            raise ValueError(f"results: {len(prompt_lengths)} prompt lengths for a state of {out.shape[0]} rows")
        rounds, total = host_array(state.rounds), host_array(state.block_total)
        nonfinite = host_array(state.nonfinite)
        plain = host_array(state.plain_rounds) if state.plain_rounds is not None else np.zeros_like(rounds)
        stopped = host_array(state.stop_at) == self.stops.matched if self.stops is not None \
            else np.zeros(len(nonfinite), bool)
        hidden = host_array(state.hidden) if state.hidden is not None and prompt_lengths is not None else None
        logprobs = host_array(state.logprobs) if state.logprobs is not None else None
        gens = []
        rows = out.shape[0] if prompt_lengths is None else len(prompt_lengths)  # padding rows dropped
        for i in range(rows):
            toks = out[i, : num_out[i]].tolist()
            stop = ("nonfinite" if nonfinite[i] else "eos" if toks and toks[-1] in self.cfg.eos_ids
                    else "stop" if stopped[i] else "length")
            # Slots [0, prompt + tokens - 1) were all written: every token but the last was a root
            # or an accepted node of some pass, and later rounds only write at higher slots.
            kept = hidden[i, : prompt_lengths[i] + len(toks) - 1] if hidden is not None else None
            gens.append(Generation(tokens=toks, rounds=int(rounds[i]),
                                   tau=float(total[i] / max(rounds[i], 1)), stop=stop, hidden=kept,
                                   plain_rounds=int(plain[i]),
                                   logprobs=logprobs[i, : num_out[i]].tolist() if logprobs is not None else None))
        return gens

    def generate(self, prompts: Sequence[Sequence[int]], seed: int = 0, *, rounds_per_call: int | None = None,
                 max_new_tokens: int | Sequence[int] | None = None,
                 temperature: float | Sequence[float] | None = None, top_k: int | Sequence[int] | None = None,
                 top_p: float | Sequence[float] | None = None, min_p: float | Sequence[float] | None = None,
                 stop: Sequence[Sequence[str]] | None = None, first_row: int = 0) -> list[Generation]:
        """Generates for a batch of prompts (`run` over `prefill`, which takes `max_new_tokens`, the
        sampling settings, `stop` and `first_row`).
        On Ctrl-C raises `Interrupted` with `results`: the `Generation` of every row that had
        finished, None for the others. On a mesh the batch is padded to a multiple of
        `row_multiple` and the padding dropped."""
        state = self.prefill(self._padded(prompts), seed, max_new_tokens=max_new_tokens,  # checks the prompts first
                             temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, stop=stop,
                             first_row=first_row)
        lengths = [len(p) for p in prompts]
        try:
            state = self.run(state, rounds_per_call=rounds_per_call)
        except Interrupted as e:
            done = host_array(e.state.done)
            e.results = [g if d else None for g, d in zip(self.results(e.state, lengths), done)]
            raise
        return self.results(state, lengths)

    def generate_continuous(self, prompts: Sequence[Sequence[int]], batch_size: int, seed: int = 0, *,
                            max_new_tokens: int | Sequence[int] | None = None,
                            temperature: float | Sequence[float] | None = None,
                            top_k: int | Sequence[int] | None = None, top_p: float | Sequence[float] | None = None,
                            min_p: float | Sequence[float] | None = None,
                            stop: Sequence[Sequence[str]] | None = None) -> list[Generation]:
        """Generates for any number of prompts with `batch_size` rows kept busy (continuous
        batching): the loop runs until a row finishes, its result is read, and the next prompts
        are prefilled into the free rows (in groups of a power of two, so that few shapes compile)
        while the other rows keep their state. A batch of fixed rows instead runs until its
        slowest row is done, with finished rows idle. `continuous` yields each result as it is
        read; this returns them all, in prompt order.

        Prompt i samples with the stream row i of `generate(prompts, seed)` would have (its key
        and its own rounds decide it), so the results equal `generate`'s for every prompt, greedy
        or sampled, in any schedule; only `cfg.fallback_below`, whose plain rounds are batch-wide,
        makes sampled outputs depend on the schedule. `max_new_tokens`, the sampling settings and
        `stop`: as `prefill` takes them, one per prompt. Ctrl-C is answered after the loop call in
        flight (`Interrupted`, with `results` holding the prompts finished so far, None for the
        others).
        """
        results: list[Generation | None] = [None] * len(prompts)
        for i, gen in self.continuous(prompts, batch_size, seed, max_new_tokens=max_new_tokens,
                                      temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                      stop=stop):
            results[i] = gen
        return results

    def continuous(self, prompts: Sequence[Sequence[int]], batch_size: int, seed: int = 0, *,
                   max_new_tokens: int | Sequence[int] | None = None,
                   temperature: float | Sequence[float] | None = None, top_k: int | Sequence[int] | None = None,
                   top_p: float | Sequence[float] | None = None, min_p: float | Sequence[float] | None = None,
                   stop: Sequence[Sequence[str]] | None = None) -> Iterator[tuple[int, Generation]]:
        """`generate_continuous` as it goes: yields (prompt index, Generation) as each prompt
        finishes, in the order they finish, so a caller (a server, a batch job writing results)
        has each one a row's lifetime after it started instead of after the last prompt. The rows
        wait while the caller holds a result: the next loop call starts when the generator is
        resumed. Ctrl-C: `Interrupted`, as `generate_continuous` raises it. Bad arguments raise
        here, before the first result is asked for."""
        self._check_prompts(prompts)
        if not is_int(batch_size) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if batch_size % self.row_multiple:
            raise ValueError(f"batch_size {batch_size} must be a multiple of the mesh's data axis "
                             f"({self.row_multiple})")
        limits = self._limits(max_new_tokens, len(prompts))
        sampling = self._sampling(len(prompts), temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        stop_masks = self._stop_masks(stop, len(prompts))
        self.shapes([len(p) for p in prompts])  # every prompt fits the positions, checked up front
        return self._continuous(prompts, int(batch_size), seed, limits, sampling, stop_masks)

    def _continuous(self, prompts: Sequence[Sequence[int]], batch_size: int, seed: int, limits: np.ndarray,
                    sampling: np.ndarray, stop_masks: np.ndarray) -> Iterator[tuple[int, Generation]]:
        key_data = np.asarray(jax.random.key_data(seed_key(seed)))
        n = len(prompts)

        def group(k: int) -> int:  # the rows prefilled for k prompts: a power-of-two multiple of row_multiple
            g = self.row_multiple
            while g < k:
                g *= 2
            return min(g, batch_size)

        def prefill(ids: list[int], rows: int) -> DecodeState:  # prompts `ids`, padded with copies of the last
            pad = [ids[-1]] * (rows - len(ids))
            return self._prefill([prompts[i] for i in ids + pad], seed, None, limits[ids + pad],
                                 sampling[ids + pad], stop_masks[ids + pad], capacity)

        b = min(batch_size, -(-n // self.row_multiple) * self.row_multiple)  # no idle rows for a few prompts
        first = list(range(min(b, n)))
        # The caches hold what the prompts so far need, and grow when a later one needs more: one
        # capacity for all would make every round attend over the longest prompt's slots (on 2 CPU
        # cores a SmolLM2 round at 4 rows cost 8-12% more at 512 slots than at 384).
        capacity = self.shapes([len(prompts[i]) for i in first])[1]
        state = prefill(first, b)  # row i samples with prompt i's stream: fold_in(seed key, i)
        owner = np.asarray(first + [-1] * (b - len(first)))  # the prompt each row decodes; -1: none (padding)
        waiting = len(first)
        results: list[Generation | None] = [None] * n
        rounds = 1
        while (owner >= 0).any():
            # Ctrl-C is deferred over a call and the refill after it (the state is donated through
            # both), not while the caller holds a result.
            with _deferred_sigint() as sigint:
                # Each call ends when a row finishes, or after about CALL_SECONDS (as in `run`).
                t0 = time.perf_counter()
                state = self._loop_until_one(self.tstate, self.dstate, state, np.int32(rounds), self.ngrams,
                                             self.stops)
                finished = np.flatnonzero(host_array(state.done) & (owner >= 0))
                want = _next_rounds(rounds, time.perf_counter() - t0, self.cfg.max_new_tokens)
                read: list[tuple[int, Generation]] = []
                if len(finished):
                    # (the prompt lengths place `Generation.hidden`, with cfg.hidden_layers)
                    gens = self.results(state, [len(prompts[o]) if o >= 0 else 1 for o in owner])
                    read = [(int(owner[r]), gens[r]) for r in finished]
                    for i, gen in read:
                        results[i] = gen
                    owner[finished] = -1
                hit, want = every_process([sigint.hit, want]).T
                if hit.any():
                    raise Interrupted(state, results)
                rounds = int(want.min())
                free = np.flatnonzero(owner < 0)  # finished rows, and padding rows (running or not)
                k = min(len(free), n - waiting)
                if k > 0:
                    ids, g = list(range(waiting, waiting + k)), group(k)
                    need = self.shapes([len(prompts[i]) for i in ids])[1]
                    if need > capacity:
                        capacity = need
                        state = self._grow_fn(capacity)(state)
                    rows = np.concatenate([free[:k], np.full(g - k, b)]).astype(np.int32)  # b: dropped
                    prompt_ids = np.asarray(ids + [ids[-1]] * (g - k), np.int32)
                    state = self._place(state, prefill(ids, g), rows, prompt_ids, key_data)
                    owner[free[:k]] = ids
                    waiting += k
            yield from read

    def stream(self, prompts: Sequence[Sequence[int]], seed: int = 0, *,
               reuse: tuple[DecodeState, Sequence[Sequence[int]]] | None = None,
               max_new_tokens: int | Sequence[int] | None = None,
               temperature: float | Sequence[float] | None = None, top_k: int | Sequence[int] | None = None,
               top_p: float | Sequence[float] | None = None, min_p: float | Sequence[float] | None = None,
               stop: Sequence[Sequence[str]] | None = None,
               first_row: int = 0) -> Iterator[tuple[list[list[int]], DecodeState]]:
        """Python-loop twin: yields (new tokens per row, state) after every round (the state may hold
        padding rows after the prompts' rows on a mesh: see `row_multiple`). `reuse`: the last
        state of an earlier stream of this decoder and that stream's prompts; `max_new_tokens`, the
        sampling settings, `stop` and `first_row`: as `prefill` takes them."""
        state = self.prefill(self._padded(prompts), seed, reuse=reuse, max_new_tokens=max_new_tokens,
                             temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, stop=stop,
                             first_row=first_row)
        seen = np.zeros(len(prompts), int)
        while True:
            state = self.step(state)
            num_out, out = host_array(state.num_out), host_array(state.out)
            yield [out[i, seen[i]: num_out[i]].tolist() for i in range(len(prompts))], state
            seen = num_out[: len(prompts)]
            if bool(np.all(host_array(state.done))):
                return
