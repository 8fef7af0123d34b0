"""Group scoring: reward summing across sources, group-standardised advantages, duplicates.

A rollout's total reward is the sum over every source that scored it: each reward function,
the environment's ``get_reward`` and ``Rollout.reward``. A source returning ``None`` is left
out; a rollout no source scored has reward NaN, gets advantage 0 and is left out of the group's
mean and standard deviation. A group is dropped (it teaches nothing) when fewer than two of its
rollouts are scored or when all scored rewards are equal up to float rounding (see
:func:`has_signal`); the decision uses the rewards, never the advantages, so a custom
``compute_advantages`` cannot keep a zero-signal group.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import attrs
import numpy as np

from asyncgrpo.core.frozen import ARRAY_EQ

RewardColumn = Sequence[float | None]


def sum_rewards(sources: Sequence[RewardColumn], num_rollouts: int) -> np.ndarray:
    """Sum per-rollout rewards over sources, ignoring ``None``; NaN where no source scored.

    Args:
        sources: one column per reward source, each holding one reward (or ``None``) per
            rollout.
        num_rollouts: G, the number of rollouts; every column must have this length.

    Returns:
        float64 [G] total rewards.

    Example:
        >>> sum_rewards([[1.0, None, None], [0.5, 2.0, None]], 3).tolist()
        [1.5, 2.0, nan]
    """
    total = np.zeros(num_rollouts, dtype=np.float64)
    scored = np.zeros(num_rollouts, dtype=bool)
    for index, column in enumerate(sources):
        if len(column) != num_rollouts:
            raise ValueError(
                f"reward source {index} returned {len(column)} rewards for {num_rollouts} "
                "rollouts; return one reward (or None) per completion"
            )
        for rollout, value in enumerate(column):
            if value is None:
                continue
            value = float(value)
            if np.isnan(value):
                raise ValueError(
                    f"reward source {index} returned NaN for rollout {rollout}; "
                    "return None to leave a rollout unscored"
                )
            total[rollout] += value
            scored[rollout] = True
    total[~scored] = np.nan
    return total


SPREAD_RTOL = 1e-9
"""Relative tolerance of :func:`has_signal`: a group whose scored rewards spread by at most this
share of their largest magnitude (plus :data:`SPREAD_ATOL`) is spreadless."""

SPREAD_ATOL = 1e-12
"""Absolute tolerance of :func:`has_signal`, for rewards that round to about zero (a sum like
``0.1 + 0.2 - 0.3`` is 5.6e-17, not 0)."""


def reward_spread_tolerance(scored: np.ndarray) -> float:
    """The largest spread of scored rewards that :func:`has_signal` calls rounding noise.

    ``SPREAD_RTOL * max(|r|) + SPREAD_ATOL``. A float64 sum of k parts of magnitude up to m is
    off by at most about ``k * m * 2.2e-16``; with k up to a few hundred and parts up to 1e4
    times the total, that stays below 1e-9 of the total. So sums of the same parts in another
    order, or ``0.1 + 0.2`` against ``0.3`` (5.6e-17 apart), count as equal. Real reward
    differences are far larger: 1e-6 on scale-1 rewards is 1,000 times the tolerance and keeps
    its signal. The tolerance grows with the rewards' magnitude, so scaling every reward keeps
    the decision (above the absolute floor of 1e-12, which only rewards within about 1e-12 of
    zero reach).

    Args:
        scored: float64 [n] scored rewards (no NaN).

    Returns:
        The tolerance, in reward units.

    Example:
        >>> f"{reward_spread_tolerance(np.array([1.0, -3.0])):.4g}"
        '3.001e-09'
    """
    scale = float(np.max(np.abs(scored))) if scored.size else 0.0
    return SPREAD_RTOL * scale + SPREAD_ATOL


def has_signal(rewards: np.ndarray) -> bool:
    """Whether a group teaches anything: at least two scored rollouts whose rewards differ by
    more than float rounding.

    The rewards' spread (``max - min`` over the scored rollouts) must exceed
    :func:`reward_spread_tolerance`: ``SPREAD_RTOL * max(|r|) + SPREAD_ATOL`` (1e-9 relative
    plus 1e-12). Exact equality would train on rounding noise: ``[1, 1, 1, 1 + 1e-12]``
    standardises to ``[-0.5, -0.5, -0.5, 1.5]``, as would a reward summed from float parts
    (``0.1 + 0.2``) against an equal one (``0.3``).

    Args:
        rewards: float64 [G] total rewards, NaN where unscored.

    Example:
        >>> has_signal(np.array([1.0, 1.0, np.nan])), has_signal(np.array([0.0, 1.0]))
        (False, True)
        >>> has_signal(np.array([0.1 + 0.2, 0.3])), has_signal(np.array([1.0, 1.0 + 1e-6]))
        (False, True)
    """
    scored = rewards[~np.isnan(rewards)]
    if scored.size < 2:
        return False
    spread = float(np.max(scored) - np.min(scored))
    return spread > reward_spread_tolerance(scored)


def standardize_rewards(rewards: np.ndarray) -> np.ndarray:
    """Group-standardised advantages ``(r - mean) / std`` over the scored rollouts.

    ``std`` is the sample standard deviation (``ddof=1``) of the scored rewards. NaN rewards
    get advantage 0. A group without signal (see :func:`has_signal`) gets all zeros.

    Args:
        rewards: float64 [G] total rewards, NaN where unscored.

    Returns:
        float64 [G] advantages, dimensionless.

    Example:
        >>> standardize_rewards(np.array([0.0, 1.0, np.nan, 2.0])).tolist()
        [-1.0, 0.0, 0.0, 1.0]
    """
    advantages = np.zeros_like(rewards, dtype=np.float64)
    if not has_signal(rewards):
        return advantages
    scored = ~np.isnan(rewards)
    values = rewards[scored]
    advantages[scored] = (values - values.mean()) / values.std(ddof=1)
    return advantages


@attrs.frozen
class GroupScore:
    """The outcome of scoring one group.

    Attributes:
        rewards: float64 [G] total rewards, NaN where unscored.
        advantages: float64 [G], one per rollout (all zeros for a dropped group).
        kept: whether the group goes to the learner.
        group_std: sample std of the scored rewards (NaN with fewer than two scored).
    """

    rewards: np.ndarray = attrs.field(eq=ARRAY_EQ)
    advantages: np.ndarray = attrs.field(eq=ARRAY_EQ)
    kept: bool
    group_std: float


def score_group(
    rewards: np.ndarray,
    compute_advantages: Callable[[np.ndarray], np.ndarray] = standardize_rewards,
) -> GroupScore:
    """Score a group: advantages from ``compute_advantages``, kept iff the rewards have signal.

    Args:
        rewards: float64 [G] total rewards, NaN where unscored.
        compute_advantages: maps rewards to one advantage per rollout; called for every group,
            dropped ones included.

    Example:
        >>> score = score_group(np.array([1.0, 1.0, 1.0]))
        >>> score.kept, score.advantages.tolist()
        (False, [0.0, 0.0, 0.0])
    """
    advantages = np.asarray(compute_advantages(rewards), dtype=np.float64)
    if advantages.shape != rewards.shape:
        raise ValueError(
            f"compute_advantages returned shape {advantages.shape} for {rewards.shape[0]} "
            "rollouts; return one advantage per rollout"
        )
    kept = has_signal(rewards)
    if kept and not np.all(np.isfinite(advantages)):
        raise ValueError("compute_advantages returned a non-finite advantage for a kept group")
    scored = rewards[~np.isnan(rewards)]
    group_std = float(scored.std(ddof=1)) if scored.size >= 2 else float("nan")
    return GroupScore(
        rewards=rewards,
        advantages=advantages if kept else np.zeros_like(advantages),
        kept=kept,
        group_std=group_std,
    )


def duplicate_frac(rollout_keys: Sequence[Hashable]) -> float:
    """Fraction of rollouts identical to an earlier rollout of the same group.

    Args:
        rollout_keys: one hashable per rollout, e.g. the tuple of each turn's output ids.

    Example:
        >>> duplicate_frac([(1, 2), (1, 2), (3,), (1, 2)])
        0.5
    """
    if not rollout_keys:
        return 0.0
    return (len(rollout_keys) - len(set(rollout_keys))) / len(rollout_keys)
