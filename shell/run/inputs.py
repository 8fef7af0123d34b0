"""The trainer's arguments checked at the door: reward functions and the training dataset.

Each check raises with the argument, what is wrong and the fix, before any process starts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedModel

from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.rollout import check_conversational


def reject_reward_models(reward_funcs: Sequence[Any]) -> None:
    """Raise a ``TypeError`` for a reward model given by id or as a model: only callables."""
    for fn in reward_funcs:
        if isinstance(fn, (str, PreTrainedModel)) or not callable(fn):
            raise TypeError(
                f"reward_funcs entry {fn!r} is not a Python callable; reward models given as a "
                "model id or PreTrainedModel are not supported: wrap the model in a picklable "
                "reward function (see docs/rollouts.md)"
            )


def check_dataset(dataset: Any, environment_factory: Any, config: AsyncGRPOConfig) -> None:
    """Raise a ``ValueError`` naming the fix for a dataset the run cannot use: missing or
    empty, without a ``prompt`` column (unless an environment makes the prompts), prompts
    that are not conversational, or no ``environment`` column for a dict of factories."""
    if dataset is None:
        if environment_factory is None:
            raise ValueError("train_dataset is required unless environment_factory is given")
        if config.max_steps <= 0:
            raise ValueError(
                "without a train_dataset the environment owns the data: set max_steps to "
                "define the length of training"
            )
        if "epoch" in (config.save_strategy, config.logging_strategy):
            raise ValueError(
                "save_strategy/logging_strategy='epoch' counts passes over the train_dataset; "
                "without one use 'steps'"
            )
        return
    if len(dataset) == 0:
        raise ValueError(
            "train_dataset is empty (0 rows); give at least one prompt row (or, with an "
            "environment_factory that makes its own prompts, train_dataset=None and max_steps)"
        )
    columns = getattr(dataset, "column_names", None)
    if columns is None:
        columns = list(dataset[0])
    if "prompt" not in (columns or []) and environment_factory is None:
        raise ValueError(
            f"train_dataset has no 'prompt' column (columns: {columns}); prompts must be "
            "conversational lists of {'role', 'content'} messages"
        )
    if "prompt" in columns:
        check_prompts_conversational(dataset)
    if isinstance(environment_factory, Mapping) and "environment" not in (columns or []):
        raise ValueError(
            "environment_factory is a dict, so every row needs an 'environment' "
            "column naming its environment"
        )


def check_prompts_conversational(dataset: Any, rows: int = 8) -> None:
    """The first ``rows`` prompts are lists of messages (the rest is checked as they are
    used); the message shows the column's schema when the dataset has one."""
    for index in range(min(rows, len(dataset))):
        prompt = dataset[index].get("prompt")
        if prompt is None:
            continue  # an environment's reset() makes it
        try:
            check_conversational(prompt, index)
        except ValueError as error:
            features = getattr(dataset, "features", None)
            schema = f" (the column's schema: {features['prompt']})" if features else ""
            raise ValueError(
                f"train_dataset: {error}{schema}. Write each prompt as "
                '[{"role": "user", "content": "..."}]'
            ) from None
