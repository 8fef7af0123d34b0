"""Reward functions ready to pass as ``reward_funcs``.

Each takes the trainer's keyword arguments (``completions`` in conversational form plus the
dataset's columns) and returns one float, or ``None`` for a completion it cannot judge.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Sequence
from typing import Any

_THINK_ANSWER = re.compile(r"^<think>.*?</think>\s*<answer>.*?</answer>\s*$", re.S)


def _last_content(completion: Sequence[dict[str, Any]]) -> str:
    return str(completion[-1].get("content") or "") if completion else ""


def format_reward(completions: Sequence[Sequence[dict[str, Any]]], **kwargs: Any) -> list[float]:
    """1.0 when the reply is ``<think>...</think><answer>...</answer>``, else 0.0.

    Example:
        >>> format_reward([[{"role": "assistant", "content": "<think>a</think><answer>4</answer>"}],
        ...                [{"role": "assistant", "content": "4"}]])
        [1.0, 0.0]
    """
    return [1.0 if _THINK_ANSWER.match(_last_content(c)) else 0.0 for c in completions]


def accuracy_reward(
    completions: Sequence[Sequence[dict[str, Any]]], solution: Sequence[str], **kwargs: Any
) -> list[float | None]:
    """1.0 when the reply's final answer is mathematically equal to ``solution``, else 0.0.

    Parsing and comparison use ``math-verify`` (``pip install asyncgrpo[math]``). A solution
    that cannot be parsed gives ``None``: the completion is left unscored instead of being
    punished for a bad reference. math-verify's 5 s timeouts use ``signal.alarm``, which works
    only in a main thread; the rollout worker calls synchronous reward functions in a thread
    pool, where they run without a timeout.
    """
    try:
        from math_verify import LatexExtractionConfig, parse, verify
    except ImportError as error:
        raise ImportError(
            "accuracy_reward needs math-verify: pip install 'asyncgrpo[math]'"
        ) from error
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    rewards: list[float | None] = []
    for completion, reference in zip(completions, solution, strict=True):
        gold = parse(reference, extraction_mode="first_match", parsing_timeout=timeout)
        if not gold:
            rewards.append(None)
            continue
        answer = parse(
            _last_content(completion),
            extraction_config=[LatexExtractionConfig()],
            parsing_timeout=timeout,
        )
        rewards.append(float(verify(gold, answer, timeout_seconds=timeout)))
    return rewards
