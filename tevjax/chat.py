"""`tevjax chat`: a conversation in the terminal, every reply decoded speculatively and exactly.

Each turn renders the whole conversation with the target's chat template and decodes the reply
from the last turn's caches: `Decoder.prefill(..., reuse=...)` keeps the slots of the conversation
so far (up to where the new rendering departs from the last prompt and reply) and prefills only
the new messages, in chunks sized to them. A prefill runs a few hundred tokens a second on a CPU,
so a long conversation would otherwise wait seconds before each reply. The kept K/V come from the
last reply's tree passes rather than a prefill, so a reply can differ from what `tevjax generate`
gives for the same conversation where two tokens tie to the last bits; it is exact for the target
either way. Replies stream as they are committed.

When the conversation no longer fits the target's positions (the rendered prompt, the reply's
`max_new_tokens` and a round's tree slots), the oldest exchanges are dropped, the system message
kept, and the user is told; a single message too long for the target is refused and the
conversation stays as it was.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

__all__ = ["COMMANDS", "Conversation", "run_chat"]

COMMANDS = {
    "/reset": "forget the conversation (the system message stays)",
    "/exit": "leave (so do /quit and end of input, Ctrl-D)",
    "/help": "list these commands",
}


@dataclasses.dataclass
class Conversation:
    """The messages of one chat, rendered to prompt ids that fit `limit` positions with `reserve`
    more (the reply and a round's tree slots)."""

    tokenizer: object
    limit: int
    reserve: int
    system: str | None = None
    messages: list[dict[str, str]] = dataclasses.field(default_factory=list)
    _before_ask: list[dict[str, str]] | None = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.system:  # a system message that leaves no room would refuse every turn instead
            ids = self._render([{"role": "user", "content": "."}])
            if len(ids) + self.reserve > self.limit:
                raise ValueError(f"the system message makes a {len(ids)}-token prompt before any message: with the "
                                 f"reply's {self.reserve} positions it exceeds the target's {self.limit} positions")

    def _render(self, messages: list[dict[str, str]]) -> list[int]:
        from tevjax.convert.tokenizer import chat_prompt_ids

        head = [{"role": "system", "content": self.system}] if self.system else []
        return chat_prompt_ids(self.tokenizer, head + messages)

    def ask(self, text: str) -> tuple[list[int], int]:
        """Adds the user's `text` and returns (prompt ids, exchanges dropped to fit them). A
        message that does not fit even alone raises ValueError and leaves the conversation as
        it was."""
        messages = [*self.messages, {"role": "user", "content": text}]
        dropped = 0
        while True:
            ids = self._render(messages)
            if len(ids) + self.reserve <= self.limit:
                break
            if len(messages) == 1:
                raise ValueError(f"this message makes a {len(ids)}-token prompt: with the reply's {self.reserve} "
                                 f"positions (--max-new-tokens and the tree) it exceeds the target's "
                                 f"{self.limit} positions")
            messages = messages[2:]  # the oldest exchange: a user message and its reply
            dropped += 1
        self._before_ask, self.messages = self.messages, messages
        return ids, dropped

    def answer(self, text: str) -> None:
        """Records the reply to the last `ask`."""
        self.messages.append({"role": "assistant", "content": text})
        self._before_ask = None

    def retract(self) -> None:
        """Undoes the last `ask` (its reply failed or was interrupted), exchanges it dropped included."""
        if self._before_ask is not None:
            self.messages, self._before_ask = self._before_ask, None

    def reset(self) -> None:
        self.messages, self._before_ask = [], None


def run_chat(decoder, conversation: Conversation, *, read: Callable[[], str | None],
             write: Callable[[str], None], log: Callable[[str], None], seed: int = 0,
             label: str = "") -> int:
    """The conversation loop; returns the number of replies given.

    `read` returns the next user line, or None at the end of input; `write` prints reply text
    (flushed); `log` prints a status line (stderr). Reply k samples with seed `seed + k` (mod
    2**64), so a sampled conversation replays exactly. Ctrl-C during a reply drops that turn and goes on;
    at the prompt it propagates (the caller exits).
    """
    from tevjax.convert.tokenizer import StreamDetokenizer

    replies, shapes = 0, None
    cached = None  # (the last reply's final state, its prompt ids): the caches the next turn keeps
    while True:
        line = read()
        if line is None:
            return replies
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            command = text.split()[0].lower()
            if command in ("/exit", "/quit"):
                return replies
            if command == "/reset":
                conversation.reset()
                log("tevjax: conversation reset")
            elif command == "/help":
                log("\n".join(f"  {name:8s} {what}" for name, what in COMMANDS.items()))
            else:
                log(f"tevjax: error: unknown command {command!r} (/help lists them)")
            continue
        try:
            ids, dropped = conversation.ask(text)
        except ValueError as e:
            log(f"tevjax: error: {e}")
            continue
        if dropped:
            log(f"tevjax: note: dropped the {dropped} oldest exchange{'s' if dropped > 1 else ''} to fit the "
                f"target's {conversation.limit} positions")
        compiled = ""
        detok = StreamDetokenizer(conversation.tokenizer)
        # The stream consumes the kept state; an interrupted or failed turn leaves none to keep.
        reuse, cached = cached, None
        try:
            if decoder.shapes([len(ids)]) != shapes:  # a longer conversation can need a larger cache
                compiled = f", compiled in {decoder.compile([ids], streaming=True, reuse=True):.1f} s"
                shapes = decoder.shapes([len(ids)])
            write(label)
            t0 = time.perf_counter()
            # Seeds are uint64.
            for new, state in decoder.stream([ids], seed=(seed + replies) % 2**64, reuse=reuse):
                write(detok.feed(new[0]))
        except KeyboardInterrupt:
            write("\n")
            conversation.retract()
            log("tevjax: reply interrupted; the turn is forgotten")
            continue
        seconds = time.perf_counter() - t0
        gen = decoder.results(state)[0]
        write(detok.flush() + "\n")
        if gen.stop == "nonfinite":
            conversation.retract()
            log("tevjax: error: the target produced non-finite logits (damaged weights, or an overflow in this "
                "dtype); the turn is forgotten")
            continue
        conversation.answer(detok.text)
        cached = (state, [ids])
        replies += 1
        ended = " (cut at --max-new-tokens)" if gen.stop == "length" else ""
        plain = f", {gen.plain_rounds} of them plain" if gen.plain_rounds else ""
        log(f"[tevjax] {len(gen.tokens)} tokens in {seconds:.2f} s ({len(gen.tokens) / max(seconds, 1e-9):.1f} "
            f"tok/s), {gen.rounds} rounds{plain}, tau {gen.tau:.2f}{compiled}{ended}")
