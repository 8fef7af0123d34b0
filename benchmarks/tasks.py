"""Tasks of the benchmark sweeps: prompts, rewards and a rollout loop, named in the sweep files
as ``benchmarks.tasks:<name>`` (run from the repository's root).

- ``digits``: the demo's task, the fraction of the reply's characters that are digits, on the
  demo's prompts (16-token replies in the demo's settings);
- ``vowels``: the fraction of the reply's letters that are vowels (a task the demo does not
  train for; a reply without letters scores 0);
- ``VariedLengthLoop``: each request's ``max_tokens`` drawn from 4 to 128, so completion lengths
  vary 32-fold and a step waits on its longest samples (the "varied" task);
- ``PromptLengthLoop``: ``max_tokens`` from 4 to 128 set by the prompt, so every completion of
  a group is about as long (as a hard problem draws long answers) and groups differ 32-fold;
- ``LongTailPromptLoop`` on ``numbered_prompts``: the same with a long tail of lengths, half the
  groups 4 tokens and one in sixteen 128 (the check of the simulator's pacing,
  ``benchmarks/pacing_check.py``).
"""

from __future__ import annotations

import random
import zlib
from collections import Counter
from collections.abc import Sequence
from typing import Any

import attrs
from datasets import Dataset

from asyncgrpo.core.experiments.lengths import Lengths, from_histogram
from asyncgrpo.core.records import TurnRecord
from asyncgrpo.shell.commands.demo import demo_dataset, digit_fraction_reward
from asyncgrpo.shell.rollout import AsyncRolloutLoop

LENGTHS = (4, 8, 16, 32, 64, 128)
LONG_TAIL = (4,) * 8 + (8,) * 4 + (16,) * 2 + (64, 128)
"""``max_tokens`` of :class:`LongTailPromptLoop`, one per sixteenth of the prompts: half of them
4 tokens, one in sixteen 128 (the mean 18, the longest 7 times it), as a reasoning task's hard
problems draw answers many times the mean."""
VOWELS = frozenset("aeiouAEIOU")


def prompts() -> Dataset:
    """The demo's 64 conversational prompts."""
    return demo_dataset()


def digits(completions: Sequence[Sequence[dict[str, Any]]], **kwargs: Any) -> list[float]:
    """The demo's reward: the fraction of the reply's non-space characters that are digits."""
    return digit_fraction_reward(completions, **kwargs)


def vowels(completions: Sequence[Sequence[dict[str, Any]]], **kwargs: Any) -> list[float]:
    """The fraction of the reply's letters that are vowels (0.0 without letters).

    Example:
        >>> vowels([[{"role": "assistant", "content": "aeb1"}]])
        [0.6666666666666666]
    """
    rewards = []
    for completion in completions:
        letters = [ch for ch in str(completion[-1].get("content") or "") if ch.isalpha()]
        rewards.append(sum(ch in VOWELS for ch in letters) / len(letters) if letters else 0.0)
    return rewards


class VariedLengthLoop(AsyncRolloutLoop):
    """Each request's ``max_tokens`` drawn from :data:`LENGTHS` (a sequence seeded by the run's
    seed). Only ``max_tokens`` differs between requests, so concurrent requests that swap
    ``self.sampling`` around their call leave every other setting as it was."""

    async def generate_one_turn(self, prompt_ids: list[int]) -> TurnRecord:
        draw = self.__dict__.setdefault("_lengths", random.Random(self.config.seed))
        base = self.sampling
        self.sampling = attrs.evolve(base, max_tokens=draw.choice(LENGTHS))
        try:
            return await super().generate_one_turn(prompt_ids)
        finally:
            self.sampling = base


class PromptLengthLoop(AsyncRolloutLoop):
    """``max_tokens`` one of :attr:`lengths` (:data:`LENGTHS`), chosen by the prompt's tokens
    (CRC-32), so the requests of a group share it and long groups are long as a whole."""

    lengths: tuple[int, ...] = LENGTHS

    async def generate_one_turn(self, prompt_ids: list[int]) -> TurnRecord:
        length = self.lengths[zlib.crc32(str(prompt_ids).encode()) % len(self.lengths)]
        base = self.sampling
        self.sampling = attrs.evolve(base, max_tokens=length)
        try:
            return await super().generate_one_turn(prompt_ids)
        finally:
            self.sampling = base


class LongTailPromptLoop(PromptLengthLoop):
    """:class:`PromptLengthLoop` with :data:`LONG_TAIL`: most groups short, one in sixteen
    128 tokens (on :func:`numbered_prompts`, whose prompts all differ)."""

    lengths = LONG_TAIL


def numbered_prompts() -> Dataset:
    """64 conversational prompts that all differ (``Number 0?`` to ``Number 63?``), so a loop
    that sets lengths by the prompt draws 64 of them."""
    return Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"Number {i}?"}] for i in range(64)]}
    )


def long_tail_lengths() -> Lengths:
    """:data:`LONG_TAIL` as the simulator's distribution: a point mass at each length.

    Example:
        >>> lengths = long_tail_lengths()
        >>> lengths.mean, lengths.maximum, lengths.truncated_fraction
        (18.0, 128.0, 0.0625)
    """
    counts = sorted(Counter(LONG_TAIL).items())
    edges = [edge for length, _ in counts for edge in (length, length)]
    weights = [weight for _, count in counts for weight in (count, 0)][:-1]
    return from_histogram(edges, weights)
