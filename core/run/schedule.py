"""When to log, save and evaluate: transformers' interval strategies over optimizer steps and
epochs counted in prompts, and the weight versions an evaluation reads.

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


def evaluation_due(
    version: int, every: int | None, last: int | None, *, at_start: bool, on_start: bool
) -> bool:
    """Whether the weights of ``version``, just landed on the servers, are evaluated.

    Args:
        version: the landed weights' version (the trainer's step that made them).
        every: ``eval_steps`` (None: ``eval_strategy="no"``, never).
        last: the last version evaluated (a resumed run's checkpoint says; None: none).
        at_start: the push at the start of ``train()``.
        on_start: ``eval_on_start``.

    A version is due when it reaches a multiple of ``every`` the last evaluated one had not
    (with ``weight_sync_steps`` > 1 a due step's own weights may never land: the next pushed
    version stands in); at the start with ``eval_on_start``, unless it was evaluated already.
    A resumed run whose last evaluation was lost with the process evaluates at the start.

    Example:
        >>> last, evaluated = None, []
        >>> for version in range(1, 11):
        ...     if evaluation_due(version, 4, last, at_start=False, on_start=False):
        ...         evaluated.append(version)
        ...         last = version
        >>> evaluated
        [4, 8]
        >>> evaluation_due(0, 4, None, at_start=True, on_start=True)
        True
        >>> evaluation_due(10, 5, 10, at_start=True, on_start=True)  # resumed: done already
        False
        >>> evaluation_due(10, 5, 5, at_start=True, on_start=False)  # resumed: lost, so again
        True
    """
    if every is None:
        return False
    if at_start and on_start:
        return version != last
    reference = 0 if last is None else last
    return version // every > reference // every
