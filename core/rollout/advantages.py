"""Group scoring: reward summing across sources, group-standardised advantages, duplicates.

A rollout's total reward is the sum over every source that scored it: each reward function,
the environment's ``get_reward`` and ``Rollout.reward``. A source returning ``None`` is left
out; a rollout no source scored has reward NaN, gets advantage 0 and is left out of the group's
mean and standard deviation. A group is dropped (it teaches nothing) when fewer than two of its
rollouts are scored or when all scored rewards are equal; the decision uses the rewards, never
the advantages, so a custom ``compute_advantages`` cannot keep a zero-signal group.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import attrs
import numpy as np

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


def has_signal(rewards: np.ndarray) -> bool:
    """Whether a group teaches anything: at least two scored rollouts with unequal rewards.

    Example:
        >>> has_signal(np.array([1.0, 1.0, np.nan])), has_signal(np.array([0.0, 1.0]))
        (False, True)
    """
    scored = rewards[~np.isnan(rewards)]
    return scored.size >= 2 and bool(np.any(scored != scored[0]))


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

    rewards: np.ndarray = attrs.field(eq=attrs.cmp_using(eq=np.array_equal))
    advantages: np.ndarray = attrs.field(eq=attrs.cmp_using(eq=np.array_equal))
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
