"""Verifiable tasks of adjustable difficulty, with a held-out split: arithmetic, plain or as word
problems, and an exact reward for them.

    >>> from asyncgrpo.tasks import arithmetic, answer_reward
    >>> train = arithmetic(200, digits=1, split="train")
    >>> test = arithmetic(20, digits=1, split="test")
    >>> train[0]["prompt"][0]["content"]
    'What is 0 + 2? Answer with just the number.'
    >>> answer_reward([[{"role": "assistant", "content": "1 + 8 = 9"}]], answer=["9"])
    [1.0]

A problem is its operands and operators; every problem belongs to one split for good (a hash
of the problem picks it: about 1 in 5 is held out), so a ``test`` set never holds a problem the
``train`` set can show, whatever their sizes and seeds. The difficulty is the operands' digits
(``digits``), how many there are (``operands``) and the ``operations``; pick it by the base
model's measured pass rate, so that a group's rewards differ (a task all of whose answers are
wrong, or all right, teaches nothing): docs/real_model.md has SmolLM2-135M-Instruct's.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import re
from collections.abc import Sequence
from typing import Any

HELD_OUT_EVERY = 5  # about one problem in 5 is in the test split
OPERATIONS = ("+", "-", "*")
FORMS = ("plain", "word")
SPLITS = ("train", "test")
_INSTRUCTION = "Answer with just the number."
_NAMES = ("Sam", "Ana", "Li", "Omar", "Eva", "Raj", "Mia", "Tom")
_THINGS = ("apples", "books", "coins", "stamps", "pencils", "marbles", "cards", "shells")
_LAST_INTEGER = re.compile(r"-?\d+")


ENUMERATED = 100_000  # a difficulty with more problems than this is sampled, not listed


def _value(problem: tuple[Any, ...]) -> int:
    """As written: products first, then sums and differences left to right.

    >>> _value((2, "+", 3, "*", 4)), _value((9, "-", 2, "-", 3))
    (14, 4)
    """
    terms: list[int] = [problem[0]]
    signs: list[int] = [1]
    for op, number in zip(problem[1::2], problem[2::2], strict=True):
        if op == "*":
            terms[-1] *= number
        else:
            terms.append(number)
            signs.append(1 if op == "+" else -1)
    return sum(sign * term for sign, term in zip(signs, terms, strict=True))


def _split_of(problem: tuple[Any, ...]) -> str:
    digest = hashlib.sha256(repr(problem).encode()).digest()
    return "test" if digest[0] % HELD_OUT_EVERY == 0 else "train"


def _valid(problem: tuple[Any, ...], split: str) -> bool:
    return _value(problem) >= 0 and _split_of(problem) == split


def _draw(
    rng: random.Random, numbers: range, operations: Sequence[str], operands: int
) -> tuple[Any, ...]:
    values = [rng.choice(numbers) for _ in range(operands)]
    ops = [rng.choice(operations) for _ in range(operands - 1)]
    return tuple(
        x for pair in zip(values, (*ops, None), strict=True) for x in pair if x is not None
    )


def _problems(
    count: int | None,
    digits: int,
    operations: Sequence[str],
    operands: int,
    split: str,
    rng: random.Random,
) -> list[tuple[Any, ...]]:
    """``count`` problems of the split: drawn in a seeded order from all of them (repeating
    when there are fewer; all of them once for ``None``), or drawn at random from a space too
    large to list."""
    numbers = range(0 if digits == 1 else 10 ** (digits - 1), 10**digits)
    space = len(numbers) ** operands * len(operations) ** (operands - 1)
    if space > ENUMERATED:
        if count is None:
            raise ValueError(
                f"count=None lists the whole split, but this difficulty has {space} "
                f"problems (over {ENUMERATED}): give a count"
            )
        found: list[tuple[Any, ...]] = []
        while len(found) < count:
            problem = _draw(rng, numbers, operations, operands)
            if _valid(problem, split):
                found.append(problem)
        return found
    pool = []
    for values in itertools.product(numbers, repeat=operands):
        for ops in itertools.product(operations, repeat=operands - 1):
            problem = tuple(
                x for pair in zip(values, (*ops, None), strict=True) for x in pair if x is not None
            )
            if _valid(problem, split):
                pool.append(problem)
    if not pool:
        raise ValueError(f"the {split} split of this difficulty is empty")
    if count is None:
        count = len(pool)
    rows: list[tuple[Any, ...]] = []
    while len(rows) < count:
        rng.shuffle(pool)
        rows.extend(pool[: count - len(rows)])
    return rows


def _words(problem: tuple[Any, ...], rng: random.Random) -> str:
    """A word problem for a two-operand problem."""
    a, op, b = problem
    name, thing = rng.choice(_NAMES), rng.choice(_THINGS)
    if op == "+":
        return f"{name} has {a} {thing} and gets {b} more. How many {thing} does {name} have now?"
    if op == "-":
        return f"{name} has {a} {thing} and gives away {b}. How many {thing} are left?"
    return f"{name} has {a} boxes with {b} {thing} in each. How many {thing} are there in all?"


def arithmetic(
    count: int | None,
    *,
    digits: int = 1,
    operations: Sequence[str] = ("+",),
    operands: int = 2,
    form: str = "plain",
    split: str = "train",
    seed: int = 0,
) -> Any:
    """``count`` arithmetic problems as a ``datasets.Dataset`` with columns ``prompt`` (one user
    message), ``answer`` (the integer, as text) and ``problem`` (as written).

    Args:
        count: rows; problems repeat (in another order) when the split has fewer. ``None``:
            every problem of the split once (a held-out set to evaluate on).
        digits: digits of every operand (1: 0-9, 2: 10-99, ...).
        operations: the operators drawn from (``+``, ``-``, ``*``).
        operands: numbers per problem (word problems: 2).
        form: ``plain`` ("What is 3 + 5?") or ``word`` (a short story).
        split: ``train`` or ``test`` (held out: disjoint from train).
        seed: the order and the draw.

    Raises:
        ValueError: a setting outside these.
    """
    from datasets import Dataset

    if (count is not None and count < 1) or digits < 1 or operands < 2:
        raise ValueError(f"count, digits >= 1 and operands >= 2, got {count}, {digits}, {operands}")
    if not operations or set(operations) - set(OPERATIONS):
        raise ValueError(f"operations must be some of {OPERATIONS}, got {operations!r}")
    if form not in FORMS or split not in SPLITS:
        raise ValueError(f"form must be one of {FORMS} and split one of {SPLITS}")
    if form == "word" and operands != 2:
        raise ValueError("word problems have 2 operands")
    rng = random.Random(seed)
    rows = _problems(count, digits, tuple(operations), operands, split, rng)
    prompts, answers, written = [], [], []
    for problem in rows:
        text = " ".join(map(str, problem))
        question = _words(problem, rng) if form == "word" else f"What is {text}?"
        prompts.append([{"role": "user", "content": f"{question} {_INSTRUCTION}"}])
        answers.append(str(_value(problem)))
        written.append(text)
    return Dataset.from_dict({"prompt": prompts, "answer": answers, "problem": written})


def answer_reward(
    completions: Sequence[Sequence[dict[str, Any]]], answer: Sequence[str], **kwargs: Any
) -> list[float]:
    """1.0 when the reply's last integer is ``answer``, else 0.0 (an exact parser: no
    math-verify needed for integers).

    Example:
        >>> answer_reward([[{"role": "assistant", "content": "It is 12."}],
        ...                [{"role": "assistant", "content": "12 + 1 = 14"}]], answer=["12", "13"])
        [1.0, 0.0]
    """
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        text = str(completion[-1].get("content") or "") if completion else ""
        found = _LAST_INTEGER.findall(text.replace(",", ""))
        rewards.append(1.0 if found and int(found[-1]) == int(expected) else 0.0)
    return rewards
