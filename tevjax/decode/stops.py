"""Stop strings: a row stops once its generated text contains one of them.

A speculative round emits a block of several tokens, and a stop string can end inside any of them,
or in the middle of a token ("\\n\\n" inside ".\\n\\n"), or span several rounds. Checking the text on
the host would cost a host sync per round and let rows run past their stop. Instead the text is
matched on the device by an automaton over tokens: the stop strings' Aho-Corasick automaton over
bytes, with each token's transition precomputed from the bytes it spells.

* Q states: the trie nodes of the stop strings' UTF-8 bytes (state 0 is the empty match), plus
  one absorbing state, `StopTable.matched`, entered by the token whose bytes complete a stop string
  the row watches.
* `next[q, t]` [Q, V]: the state after token t's bytes are read from state q. A state is the
  longest suffix of the text so far that is a prefix of some stop string, so the automaton matches
  at every position, across token and round boundaries.
* `hits[q, t]` [Q, V]: the stop strings (bit i: string i) that end inside token t's bytes read from
  state q. Rows may watch different subsets of the strings (`DecodeState.stop_mask`, a bit mask;
  all of them by default): a row enters `matched` when `hits & mask` is not 0, and otherwise reads
  on to `next`, so one table serves every subset.
* Each row carries one int32 state (`DecodeState.stop_at`), from 0 at its first generated token:
  the prompt is not searched, as in other servers. A block is cut after the token that enters
  `matched`, like an end-of-sequence token; that token is kept (the tokens are a prefix of what the
  target generated), and `cut_text` removes the stop string and what follows from the text.

Matching is on the tokens' bytes (`tevjax.convert.tokenizer.token_bytes`): special tokens spell
nothing, so they are invisible to it, as to `decode(..., skip_special_tokens=True)`.

Worked example: stops ("ab",) give the trie 0 -a-> 1 -b-> 2 and `matched` = 3 (Q = 4). For tokens
"xa" (id 0), "b" (1), "cab" (2): next[0, 0] = 1 (the text ends in "a"); from state 1, "b" completes
"ab" (hits[1, 1] = 1), so a row watching it enters 3, and next[1, 1] = 2; "cab" completes it from
state 0 or 1 (hits 1, next 2); next[0, 1] = 0 with no hit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["MAX_STOPS", "StopTable", "StopText", "advance", "check_stops", "cut_text", "stop_table"]

# The stop strings of one table: one bit each in an int32 mask.
MAX_STOPS = 32


def check_stops(stops) -> tuple[str, ...]:
    """`stops` as a tuple of non-empty strings, or a TypeError / ValueError naming the bad entry."""
    if isinstance(stops, (str, bytes)):
        raise TypeError(f"stop strings must be a sequence of strings, got the single string {stops!r}: "
                        f"write ({stops!r},)")
    try:
        stops = tuple(stops)
    except TypeError:
        raise TypeError(f"stop strings must be a sequence of strings, got {type(stops).__name__}") from None
    for i, s in enumerate(stops):
        if not isinstance(s, str):
            raise TypeError(f"stop string {i} must be a str, got {s!r} ({type(s).__name__})")
        if not s:
            raise ValueError(f"stop string {i} is empty: it would match before the first token")
        try:
            s.encode()  # the automaton matches UTF-8 bytes; a lone surrogate has none
        except UnicodeEncodeError as e:
            raise ValueError(f"stop string {i} ({s!r}) is not valid Unicode: {e.reason} at position {e.start} (half of "
                             "a surrogate pair?)") from None
    return stops


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StopTable:
    """The stop strings' automaton over tokens (module docstring)."""

    next: jax.Array  # [Q, V] int32 state after a token's bytes; row `matched` is all `matched`
    hits: jax.Array  # [Q, V] int32 bit i: stop string i ends inside the token; row `matched` is 0

    @property
    def matched(self) -> int:
        """The absorbing state a token enters when it completes a stop string (the last one)."""
        return self.next.shape[0] - 1


def _byte_automaton(stops: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Aho-Corasick over bytes -> (delta [Q, 256] int32 next state, final [Q] int32: bit i set
    where stop string i ends, directly or through a suffix). Q = trie nodes, state 0 the root."""
    children: list[dict[int, int]] = [{}]
    final = [0]
    for i, s in enumerate(stops):
        q = 0
        for b in s:
            if b not in children[q]:
                children.append({})
                final.append(0)
                children[q][b] = len(children) - 1
            q = children[q][b]
        final[q] |= 1 << i
    delta = np.zeros((len(children), 256), np.int32)
    fail = [0] * len(children)
    order = [0]  # breadth first, so a state's failure state is complete before it is read
    for q in order:
        if q != 0:
            delta[q] = delta[fail[q]]
            final[q] |= final[fail[q]]
        for b, r in children[q].items():
            fail[r] = delta[fail[q], b] if q != 0 else 0
            delta[q, b] = r
            order.append(r)
    return delta, np.asarray(final, np.int64).astype(np.uint32).view(np.int32)  # bit 31 as int32's sign


def stop_table(stops: Sequence[str], spellings: Sequence[bytes], vocab_size: int) -> StopTable:
    """The automaton of `stops` over a vocabulary of `vocab_size` tokens whose first
    len(spellings) spell those bytes (`tevjax.convert.tokenizer.token_bytes`); ids past them (a
    model's spare embedding rows) spell nothing. Built on the host in numpy (a fraction of a second
    for SmolLM2's 49,152 tokens)."""
    stops = check_stops(stops)
    if not stops:
        raise ValueError("no stop strings given")
    if len(stops) > MAX_STOPS:
        raise ValueError(f"{len(stops)} stop strings: a table holds at most {MAX_STOPS} (one bit of a row's mask each)")
    # A str spelling failed in np.frombuffer, a bytes object (its items are ints) in len().
    if isinstance(spellings, (str, bytes)) or any(not isinstance(b, bytes) for b in spellings):
        raise TypeError("spellings must be a list of each token's bytes (tevjax.convert.tokenizer.token_bytes), got "
                        f"{type(spellings).__name__} of {type(next(iter(spellings), None)).__name__}")
    if len(spellings) > vocab_size:
        raise ValueError(f"{len(spellings)} token spellings for a vocabulary of {vocab_size}: the tokenizer does not "
                         "belong to this model")
    delta, final = _byte_automaton([s.encode() for s in stops])
    q = delta.shape[0]
    lengths = np.zeros(vocab_size, np.int64)
    lengths[: len(spellings)] = [len(b) for b in spellings]
    width = int(lengths.max(initial=0))
    spelt = np.zeros((vocab_size, max(width, 1)), np.uint8)  # [V, M] the bytes, zero-padded
    for t, b in enumerate(spellings):
        spelt[t, : len(b)] = np.frombuffer(b, np.uint8)
    # Every (state, token) pair reads all of the token's bytes in step (a row that does not watch a
    # string ending inside the token reads on), collecting the strings that end on the way.
    state = np.broadcast_to(np.arange(q, dtype=np.int32)[:, None], (q, vocab_size)).copy()
    hit = np.zeros((q, vocab_size), np.int32)
    for m in range(width):
        live = (m < lengths)[None, :]
        moved = delta[state, spelt[:, m][None, :]]
        state = np.where(live, moved, state)
        hit |= np.where(live, final[moved], 0)
    matched = q  # one state past the trie
    table = np.full((q + 1, vocab_size), matched, np.int32)
    table[:q] = state
    hits = np.zeros((q + 1, vocab_size), np.int32)
    hits[:q] = hit
    return StopTable(next=table, hits=hits)


def advance(table: StopTable, state: jax.Array, tokens: jax.Array, valid: jax.Array, mask: jax.Array | int = -1
            ) -> jax.Array:
    """One row's automaton over a block: the state after each of `tokens` [n] (the ones not
    `valid` [n] leave it as it is), from `state` (an int32 scalar) -> [n] int32; `matched` once a
    token completes a stop string in the row's `mask` (bit i: string i; -1, the default: all)."""
    table_next, table_hits = jnp.asarray(table.next), jnp.asarray(table.hits)  # a host-built table works too

    def step(q, tv):
        t, v = tv
        t = jnp.maximum(t, 0)
        moved = jnp.where((table_hits[q, t] & mask) != 0, table.matched, table_next[q, t])
        q = jnp.where(v, moved, q)
        return q, q

    return jax.lax.scan(step, state, (tokens, valid))[1]


def cut_text(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """(`text` before the stop string that ends first in it, whether one does): the text a stopped
    row reports. Decoding stops where a stop string is first complete, so that one is cut out
    (with stops "\n" and "a\na", "aa\na" gives "aa"); of two ending at once, the longer."""
    stops = check_stops(stops)  # a bare string would be taken as its characters
    found = [(i + len(s), -len(s)) for s, i in ((s, text.find(s)) for s in stops) if i >= 0]
    if not found:
        return text, False
    end, minus_length = min(found)
    return text[: end + minus_length], True


class StopText:
    """Streamed text with the stop strings cut out: `feed` returns what may be shown now. It holds
    back the longest tail that could still begin a stop string, and once one is complete returns
    the text before it and nothing more. The pieces join to `cut_text(whole text, stops)[0]`."""

    def __init__(self, stops: Sequence[str]):
        self.stops = check_stops(stops)
        self._held = ""
        self.stopped = False

    def feed(self, piece: str) -> str:
        if self.stopped:
            return ""
        text = self._held + piece
        cut, self.stopped = cut_text(text, self.stops)
        if self.stopped:
            self._held = ""
            return cut
        keep = max((k for s in self.stops for k in range(1, min(len(s), len(text) + 1))
                    if text.endswith(s[:k])), default=0)
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The held-back tail, once the stream ended without a stop string."""
        rest, self._held = self._held, ""
        return rest
