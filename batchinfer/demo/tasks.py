"""Synthetic tasks with exact answers: the demo model's training data and its accuracy yardstick.

Every task draws a short prompt and its one correct answer from a `random.Random`. A prompt belongs
to the train or the held-out split by a hash of its text, so no held-out prompt can ever appear in
training, whatever seeds or sizes are used. Letter tasks write one letter per word ("q w e") so a
byte-level BPE keeps one letter per token and a tiny model can learn them. Not here: tokenization,
training, evaluation runs.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass

SPLITS = ("train", "heldout")
HELDOUT_FRACTION = 0.1  # share of each task's prompt space reserved for evaluation
_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_COUNT_LETTERS = "abcde"  # few distinct letters, so counts are mostly above 0
# (unit, smaller unit, factor); conversions go both ways and always give integers
_UNITS = (
    ("km", "m", 1000),
    ("m", "cm", 100),
    ("cm", "mm", 10),
    ("kg", "g", 1000),
    ("g", "mg", 1000),
    ("l", "ml", 1000),
)


@dataclass(frozen=True, slots=True)
class Task:
    name: str
    description: str
    generate: Callable[[random.Random], tuple[str, str]]  # rng -> (prompt, answer)


@dataclass(frozen=True, slots=True)
class Example:
    task: str
    prompt: str
    answer: str


def _add(rng: random.Random) -> tuple[str, str]:
    a, b = rng.randint(10, 999), rng.randint(10, 999)
    return f"What is {a} + {b}?", str(a + b)


def _reverse(rng: random.Random) -> tuple[str, str]:
    letters = rng.choices(_LETTERS, k=rng.randint(3, 7))
    return f"Reverse: {' '.join(letters)}", " ".join(reversed(letters))


def _sort(rng: random.Random) -> tuple[str, str]:
    numbers = [rng.randint(0, 99) for _ in range(rng.randint(3, 6))]
    return f"Sort: {' '.join(map(str, numbers))}", " ".join(map(str, sorted(numbers)))


def _count(rng: random.Random) -> tuple[str, str]:
    letters = rng.choices(_COUNT_LETTERS, k=rng.randint(5, 12))
    target = rng.choice(_COUNT_LETTERS)
    return f"Count {target} in: {' '.join(letters)}", str(letters.count(target))


def _convert(rng: random.Random) -> tuple[str, str]:
    big, small, factor = rng.choice(_UNITS)
    value = rng.randint(1, 9999)
    if rng.random() < 0.5:
        return f"Convert {value} {big} to {small}", str(value * factor)
    return f"Convert {value * factor} {small} to {big}", str(value)


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("add", "add two numbers of 2-3 digits", _add),
        Task("reverse", "reverse 3-7 letters", _reverse),
        Task("sort", "sort 3-6 numbers below 100 ascending", _sort),
        Task("count", "count one letter among 5-12 letters", _count),
        Task("convert", "convert between metric units (integer results)", _convert),
    )
}


def get_task(task: str | Task) -> Task:
    """Look a task up by name (a Task passes through)."""
    if isinstance(task, Task):
        return task
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known tasks: {', '.join(TASKS)}")
    return TASKS[task]


def split_of(task: str, prompt: str) -> str:
    """The split a prompt belongs to: a fixed function of the task name and prompt text."""
    digest = hashlib.sha256(f"{task}\n{prompt}".encode()).digest()
    return "heldout" if int.from_bytes(digest[:8], "big") < HELDOUT_FRACTION * 2**64 else "train"


def make_examples(task: str | Task, n: int, seed: int, split: str) -> list[Example]:
    """`n` examples of one task with distinct prompts, all from `split`; same arguments -> same list.

    Raises ValueError when the task's prompt space cannot supply `n` distinct prompts in the split.
    """
    t = get_task(task)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    key = hashlib.sha256(f"{seed}\n{t.name}\n{split}".encode()).digest()
    rng = random.Random(int.from_bytes(key[:8], "big"))
    seen: set[str] = set()
    examples: list[Example] = []
    for _ in range(50 * n + 1000):
        if len(examples) == n:
            break
        prompt, answer = t.generate(rng)
        if prompt in seen or split_of(t.name, prompt) != split:
            continue
        seen.add(prompt)
        examples.append(Example(t.name, prompt, answer))
    if len(examples) < n:
        raise ValueError(
            f"task {t.name!r}: found only {len(examples)} distinct {split} prompts, {n} were asked for"
        )
    return examples


def make_mixture(n_per_task: int, seed: int, split: str, tasks: list[str] | None = None) -> list[Example]:
    """`n_per_task` examples of each task (all tasks by default), interleaved in a seeded order."""
    names = list(TASKS) if tasks is None else [get_task(t).name for t in tasks]
    examples = [e for name in names for e in make_examples(name, n_per_task, seed, split)]
    random.Random(seed).shuffle(examples)
    return examples


def score(task: str | Task, prediction: str, answer: str) -> bool:
    """Exact match after stripping surrounding whitespace (the same rule for every task)."""
    get_task(task)
    return prediction.strip() == answer.strip()
