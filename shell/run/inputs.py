"""The trainer's arguments checked at the door: reward functions and the training dataset.

Each check raises with the argument, what is wrong and the fix, before any process starts.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from transformers import PreTrainedModel

from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.rollout import PROMPT_FIX, check_row


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
    if isinstance(environment_factory, Mapping) and "environment" not in (columns or []):
        raise ValueError(
            "environment_factory is a dict, so every row needs an 'environment' "
            "column naming its environment"
        )
    check_rows(dataset, environment_factory, columns)


def _rows(dataset: Any, columns: list[str]) -> Iterator[dict[str, Any]]:
    """The rows of ``dataset`` with only ``columns`` (batched for a ``datasets.Dataset``)."""
    if hasattr(dataset, "select_columns") and hasattr(dataset, "iter"):
        for batch in dataset.select_columns(columns).iter(batch_size=1024):
            names, columns_ = list(batch), list(batch.values())
            for values in zip(*columns_, strict=True):
                yield dict(zip(names, values, strict=True))
        return
    for index in range(len(dataset)):
        row = dataset[index]
        yield {c: row[c] for c in columns if c in row} if isinstance(row, Mapping) else row


def check_rows(dataset: Any, environment_factory: Any, columns: list[str]) -> None:
    """Check every row (:func:`~asyncgrpo.shell.rollout.check_row`): its prompt and, with a
    dict of environment factories, its ``environment`` column; the message names the row, the
    column, the value's type and, for a ``datasets.Dataset``, the column's schema."""
    checked = [c for c in ("prompt", "environment") if c in columns]
    if not checked:
        return
    for index, row in enumerate(_rows(dataset, checked)):
        if not isinstance(row, Mapping):
            raise ValueError(
                f"train_dataset: row {index} is a {type(row).__name__}, not a dict of columns"
            )
        try:
            check_row(row, index, environment_factory)
        except ValueError as error:
            features = getattr(dataset, "features", None)
            column = "environment" if "column 'environment'" in str(error) else "prompt"
            schema = (
                f" (the column's schema: {features[column]})"
                if features and column in features
                else ""
            )
            fix = f". {PROMPT_FIX}" if column == "prompt" else ""
            raise ValueError(f"train_dataset: {error}{schema}{fix}") from None
