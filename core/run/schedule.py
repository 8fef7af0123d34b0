"""When to log and when to save: transformers' interval strategies over optimizer steps and
epochs counted in prompts.

    >>> due("steps", step=10, every=5, epochs_before=0.4, epochs_after=0.6)
    True
    >>> due("epoch", step=7, every=5, epochs_before=0.9, epochs_after=1.1)
    True
    >>> due("no", step=10, every=5, epochs_before=0.9, epochs_after=1.1)
    False
"""

from __future__ import annotations

import math

STRATEGIES = ("steps", "epoch", "no")


def due(strategy: str, step: int, every: int, epochs_before: float, epochs_after: float) -> bool:
    """Whether the optimizer step ``step`` (1-based) ends an interval.

    Args:
        strategy: ``"steps"`` (every ``every`` steps; ``every <= 0`` never), ``"epoch"`` (when
            the step crosses a whole number of passes over the prompts) or ``"no"``.
        epochs_before, epochs_after: passes over the prompts consumed before and after the
            step (fractional; counted in distinct prompts).
    """
    if strategy == "steps":
        return every > 0 and step % every == 0
    if strategy == "epoch":
        return math.floor(epochs_after) > math.floor(epochs_before)
    if strategy == "no":
        return False
    raise ValueError(f"unknown interval strategy {strategy!r}; use one of {STRATEGIES}")


def interval_steps(setting: float, max_steps: int) -> int:
    """``logging_steps``/``save_steps``: a count, or a fraction of ``max_steps`` when < 1.

    Example:
        >>> interval_steps(50, max_steps=0), interval_steps(0.25, max_steps=10)
        (50, 3)
    """
    if 0 < setting < 1:
        if max_steps <= 0:
            raise ValueError("a fractional logging_steps/save_steps needs max_steps > 0")
        return max(1, math.ceil(setting * max_steps))
    return int(setting)
