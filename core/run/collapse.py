"""A policy with no reward spread left: telling it from one that learns, step by step.

GRPO learns only from groups whose rewards differ (zero-spread groups are dropped). When the
policy has collapsed (every reply of a group the same) or the task is solved, almost no group
has spread: the trainer keeps generating and dropping, and a step takes ever longer to fill.
:class:`SpreadWatch` counts the groups each step saw; a step closes when the trainer trains it,
or, while the trainer waits, once a step's worth of groups arrived (so a run where no group has
spread at all is still seen). A closed step whose share of zero-spread groups is at least
``SpreadSettings.share`` is *spreadless*; :func:`close_step` says when to warn and when to stop
(``stop_after``, the config's ``stop_after_spreadless_steps``; ``None`` never stops, as TRL).

The warning comes after ``warn_after`` spreadless steps in a row, and again less and less often:
a run whose spread comes and goes (a share of zero-spread groups near ``share``) is warned
when its spreadless steps in all reach ``warn_after``, then 2, 4, 8... times that, each
warning with the count so far, rather than at every new run of ``warn_after`` in a row.

Example:
    >>> settings = SpreadSettings(share=0.9, warn_after=2, stop_after=3)
    >>> watch = SpreadWatch()
    >>> verdicts = []
    >>> for _ in range(3):
    ...     for _ in range(4):
    ...         watch = group_seen(watch, zero_spread=True)
    ...     watch, verdict = close_step(watch, settings)
    ...     verdicts.append(verdict.name)
    >>> verdicts
    ['NONE', 'WARN', 'STOP']
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs

from asyncgrpo.core.metrics import Observation

ZERO_SPREAD_METRIC = "frac_reward_zero_std"


class Verdict(enum.Enum):
    NONE = "none"
    WARN = "warn"
    STOP = "stop"


@attrs.frozen
class SpreadSettings:
    """When steps without reward spread are reported and end the run.

    Attributes:
        share: a closed step is spreadless when at least this share of its groups had zero
            reward spread (in (0, 1]).
        warn_after: spreadless steps in a row before the warning (>= 1).
        stop_after: spreadless steps in a row that end the run; ``None`` never ends it.
    """

    share: float
    warn_after: int
    stop_after: int | None

    def __attrs_post_init__(self) -> None:
        if not 0.0 < self.share <= 1.0:
            raise ValueError(f"SpreadSettings.share must be in (0, 1], got {self.share}")
        if self.warn_after < 1:
            raise ValueError(f"SpreadSettings.warn_after must be >= 1, got {self.warn_after}")
        if self.stop_after is not None and self.stop_after < 1:
            raise ValueError(
                f"stop_after_spreadless_steps must be >= 1 or None, got {self.stop_after}"
            )


@attrs.frozen
class SpreadWatch:
    """What the steps so far saw.

    Attributes:
        groups: scored groups since the step last closed.
        zero_spread: of which had zero reward spread.
        spreadless_in_a_row: closed spreadless steps in a row.
        spreadless_total: closed spreadless steps in the whole run.
        warnings: the warnings given so far.
        last_share: the share of zero-spread groups of the step that closed last (NaN before).
    """

    groups: int = 0
    zero_spread: int = 0
    spreadless_in_a_row: int = 0
    spreadless_total: int = 0
    warnings: int = 0
    last_share: float = float("nan")


def group_seen(watch: SpreadWatch, zero_spread: bool) -> SpreadWatch:
    """Count one scored group."""
    return attrs.evolve(
        watch, groups=watch.groups + 1, zero_spread=watch.zero_spread + int(zero_spread)
    )


def step_due(watch: SpreadWatch, groups_per_step: int) -> bool:
    """Whether, while the trainer waits, a step's worth of groups arrived without making a
    step (then the shell closes a step without training one).

    Example:
        >>> step_due(SpreadWatch(groups=8, zero_spread=8), groups_per_step=8)
        True
    """
    return watch.zero_spread >= max(1, groups_per_step)


def close_step(watch: SpreadWatch, settings: SpreadSettings) -> tuple[SpreadWatch, Verdict]:
    """Close the current step: count it spreadless or not, and say what to do.

    A step that saw no group is not judged (nothing changes)."""
    if watch.groups == 0:
        return watch, Verdict.NONE
    share = watch.zero_spread / watch.groups
    kept = dict(spreadless_total=watch.spreadless_total, warnings=watch.warnings)
    if share < settings.share:
        return SpreadWatch(last_share=share, **kept), Verdict.NONE
    in_a_row, total = watch.spreadless_in_a_row + 1, watch.spreadless_total + 1
    closed = SpreadWatch(
        spreadless_in_a_row=in_a_row,
        spreadless_total=total,
        warnings=watch.warnings,
        last_share=share,
    )
    if settings.stop_after is not None and in_a_row >= settings.stop_after:
        return closed, Verdict.STOP
    if in_a_row >= settings.warn_after and total >= warning_due_at(watch.warnings, settings):
        return attrs.evolve(closed, warnings=watch.warnings + 1), Verdict.WARN
    return closed, Verdict.NONE


def warning_due_at(warnings: int, settings: SpreadSettings) -> int:
    """The spreadless steps in all at which the next warning is due, after ``warnings`` given.

    Example:
        >>> [warning_due_at(n, SpreadSettings(0.9, warn_after=3, stop_after=None))
        ...  for n in range(4)]
        [3, 6, 12, 24]
    """
    return settings.warn_after * 2**warnings


def zero_spread_of(observations: Sequence[Observation]) -> bool | None:
    """Whether a group's observations say it had zero reward spread (its
    ``frac_reward_zero_std`` is 1); ``None`` for a group that was not scored (filtered).

    Example:
        >>> from asyncgrpo.core.metrics import mean
        >>> zero_spread_of((mean("frac_reward_zero_std", 1.0),))
        True
    """
    for observation in observations:
        if observation.name == ZERO_SPREAD_METRIC:
            return observation.amount >= 1.0
    return None
