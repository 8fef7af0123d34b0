"""A finished group's reward values checked, and its training samples built.

A reward that is NaN or infinite counts as unscored (None), as TRL's AsyncGRPOTrainer
(documentation) treats NaN: :func:`check_reward_values` lists where it happened, for the
caller's warning and ``rewards/<name>/nonfinite_count``.

Both the rollout loop (:mod:`asyncgrpo.shell.rollout.loop`) and the simulator
(:mod:`asyncgrpo.shell.experiments.simulate`) score a group with these functions, so what the
simulator predicts is built the same way as what the trainer receives.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from asyncgrpo.core.records import TrainingSample, TrainingSequence
from asyncgrpo.core.rollout.advantages import GroupScore


@attrs.frozen
class RewardValues:
    """What one reward source returned for a group, checked.

    Attributes:
        values: per completion, its reward (float) or None when unscored. A NaN or infinite
            reward is None: as TRL's AsyncGRPOTrainer (documentation) treats NaN, it leaves the
            completion unscored by this source rather than ending the run.
        nonfinite: indices of the completions whose reward was NaN or infinite (their
            ``values`` entry is None), in order.
    """

    values: tuple[float | None, ...]
    nonfinite: tuple[int, ...] = ()


def check_reward_values(name: str, result: Any, num_rollouts: int) -> RewardValues:
    """What reward function ``name`` returned for a group of ``num_rollouts`` completions, as
    one float (or None: unscored) per completion; a NaN or infinite value counts as None and is
    listed in ``nonfinite``.

    Raises:
        ValueError: ``result`` is not a list, tuple or numpy array of ``num_rollouts`` values,
            or holds a value that is not a number or None (the message names the function and
            the completion, and says what to return instead).

    Example:
        >>> check_reward_values("accuracy", [1, None, 0.5, float("nan")], 4)
        RewardValues(values=(1.0, None, 0.5, None), nonfinite=(3,))
        >>> check_reward_values("accuracy", [1.0], 3)
        Traceback (most recent call last):
        ...
        ValueError: reward function 'accuracy' returned 1 values for 3 completions; return a \
list with one float (or None) per completion
    """
    if not isinstance(result, (list, tuple, np.ndarray)) or len(result) != num_rollouts:
        got = f"{len(result)} values" if hasattr(result, "__len__") else repr(result)
        raise ValueError(
            f"reward function {name!r} returned {got} for {num_rollouts} completions; return a "
            "list with one float (or None) per completion"
        )
    rewards: list[float | None] = []
    nonfinite: list[int] = []
    for index, item in enumerate(result):
        if item is None:
            rewards.append(None)
            continue
        try:
            number = float(item)
        except (TypeError, ValueError):
            raise ValueError(
                f"reward function {name!r} returned {item!r} for completion "
                f"{index}; return a float or None"
            ) from None
        if math.isfinite(number):
            rewards.append(number)
        else:
            rewards.append(None)
            nonfinite.append(index)
    return RewardValues(tuple(rewards), tuple(nonfinite))


def group_samples(
    sequences: Sequence[Sequence[TrainingSequence]],
    score: GroupScore,
    rollout_ids: Sequence[str],
    *,
    model_version: int,
    group_id: int,
    row_index: int,
    prompt_position: int,
    queued_at: float,
) -> tuple[TrainingSample, ...]:
    """The training samples of a scored group: every sequence of rollout ``i`` (in rollout,
    then sequence order) with advantage ``score.advantages[i]`` and the group's provenance;
    none when the group is dropped (``score.kept`` is False).

    Args:
        sequences: per rollout, its reconciled sequences
            (:func:`asyncgrpo.core.rollout.reconcile.reconcile_turns`).
        score: the group's score (:func:`asyncgrpo.core.rollout.advantages.score_group`).
        rollout_ids: per rollout, its id.
        model_version: the policy version the group started under.
        group_id, row_index, prompt_position: where the group came from.
        queued_at: when the samples are put on the queue (``time.monotonic()`` seconds).

    Raises:
        ValueError: ``sequences``, ``rollout_ids`` and ``score.advantages`` differ in length.

    Example:
        >>> import numpy as np
        >>> from asyncgrpo.core.rollout.advantages import score_group
        >>> seq = TrainingSequence([5, 6, 7], [0, 1, 1], [0.0, -0.5, -0.7])
        >>> score = score_group(np.array([1.0, 0.0]))
        >>> samples = group_samples([[seq], [seq]], score, ["a", "b"], model_version=3,
        ...                         group_id=0, row_index=4, prompt_position=9, queued_at=0.0)
        >>> [(s.rollout_id, round(s.advantage, 3), s.model_version) for s in samples]
        [('a', 0.707, 3), ('b', -0.707, 3)]
    """
    counts = {len(sequences), len(rollout_ids), len(score.advantages)}
    if len(counts) != 1:
        raise ValueError(
            f"group_samples got {len(sequences)} rollouts' sequences, {len(rollout_ids)} "
            f"rollout ids and {len(score.advantages)} advantages; pass one of each per rollout"
        )
    if not score.kept:
        return ()
    return tuple(
        TrainingSample(
            sequence,
            score.advantages[i],
            model_version,
            group_id,
            row_index,
            prompt_position,
            rollout_id,
            queued_at=queued_at,
        )
        for i, (rollout_sequences, rollout_id) in enumerate(
            zip(sequences, rollout_ids, strict=True)
        )
        for sequence in rollout_sequences
    )
