"""The trainer's arguments checked at the door (reward functions, the training dataset and the
evaluation datasets), and what a run takes of its trainer (:class:`RunInputs`).

Each check raises with the argument, what is wrong and the fix, before any process starts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import attrs
from transformers import PreTrainedModel

from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.rollout import PROMPT_FIX, AsyncRolloutLoop, check_row

if TYPE_CHECKING:
    from asyncgrpo.core.servers.cpu_plan import CpuPlan
    from asyncgrpo.shell.run.callbacks import Callbacks


REWARD_MODEL_REFUSAL = (
    "reward models given as a model id, a path or a PreTrainedModel are not supported (as in "
    "TRL's AsyncGRPOTrainer): pass a Python callable, e.g. a picklable reward function that "
    "scores with the model (see docs/rollouts.md)"
)


def reward_function_list(reward_funcs: Any, argument: str) -> list[Callable[..., Any]]:
    """``reward_funcs`` (or ``eval_reward_funcs``, named by ``argument``) as a list: ``None``
    is none, one reward function or one string is one entry (a string is not split into its
    characters), a list or tuple is its entries.

    Raises:
        TypeError: an entry is a reward model given by id, path or as a ``PreTrainedModel``, or
            is not callable (naming ``argument`` and the entry).
    """
    if reward_funcs is None:
        return []
    one = isinstance(reward_funcs, (str, bytes)) or not isinstance(reward_funcs, Sequence)
    funcs = [reward_funcs] if one else list(reward_funcs)
    for fn in funcs:
        if isinstance(fn, (str, bytes, PreTrainedModel)):
            raise TypeError(f"{argument} entry {fn!r}: {REWARD_MODEL_REFUSAL}")
        if not callable(fn):
            raise TypeError(
                f"{argument} entry {fn!r} is not a Python callable: pass functions called "
                "with the prompts and completions that return a list of rewards, None where one "
                "does not apply (see docs/rollouts.md)"
            )
    return funcs


def eval_datasets_of(
    eval_dataset: Any, environment_factory: Any, config: AsyncGRPOConfig
) -> dict[str, Any]:
    """The evaluation datasets by name: one dataset is ``{"eval": dataset}``, a dict (as
    transformers' ``Trainer`` takes) keeps its names; every row checked as a training row is.

    Raises:
        ValueError: an empty or bad dataset (naming it, the row and the column), a bad name,
            or ``eval_strategy="steps"`` without an evaluation dataset.
    """
    if eval_dataset is None:
        if config.eval_strategy == "steps" or config.eval_on_start:
            raise ValueError(
                "eval_strategy='steps' and eval_on_start need an eval_dataset: give "
                "AsyncGRPOTrainer(eval_dataset=...) (one dataset, or a dict of named ones)"
            )
        return {}
    named = dict(eval_dataset) if isinstance(eval_dataset, Mapping) else {"eval": eval_dataset}
    if not named:
        raise ValueError("eval_dataset is an empty dict; give at least one named dataset")
    for name, dataset in named.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(
                f"eval_dataset names must be non-empty strings without '/' (they name the "
                f"metrics eval/<name>/...), got {name!r}"
            )
        label = "eval_dataset" if len(named) == 1 and name == "eval" else f"eval_dataset[{name!r}]"
        if dataset is None or len(dataset) == 0:
            raise ValueError(f"{label} is empty; give at least one prompt row")
        columns = getattr(dataset, "column_names", None)
        if columns is None:
            columns = list(dataset[0])
        if "prompt" not in (columns or []):
            raise ValueError(
                f"{label} has no 'prompt' column (columns: {columns}); prompts must be "
                "conversational lists of {'role', 'content'} messages"
            )
        check_rows(dataset, environment_factory, columns, label)
    return named


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


def check_rows(
    dataset: Any, environment_factory: Any, columns: list[str], label: str = "train_dataset"
) -> None:
    """Check every row (:func:`~asyncgrpo.shell.rollout.check_row`): its prompt and, with a
    dict of environment factories, its ``environment`` column; the message names the row, the
    column, the value's type and, for a ``datasets.Dataset``, the column's schema."""
    checked: list[str] = [c for c in ("prompt", "environment") if c in columns]
    if not checked:
        return
    for index, row in enumerate(_rows(dataset, checked)):
        if not isinstance(row, Mapping):
            raise ValueError(
                f"{label}: row {index} is a {type(row).__name__}, not a dict of columns"
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
            raise ValueError(f"{label}: {error}{schema}{fix}") from None


@attrs.frozen
class RunInputs:
    """What a run needs of its trainer: the config, the model's name and config, and the user's
    rollout code and data (all pickled into the rollout process).

    Attributes:
        after_checkpoint: called with ``(step, rank0)`` after each checkpoint (hub pushes).
        cpu_plan: the cores the trainer and a local server share, or None.
        eval_datasets: the evaluation datasets by name (:mod:`.evaluations`).
        eval_reward_funcs: the reward functions that score evaluations (empty: the
            ``reward_funcs``).
        loop_options: keywords of ``loop_cls`` beyond the loop's own (a harness's session
            factory, adapter and limits).
    """

    args: AsyncGRPOConfig
    model_name: str
    model_config: Any
    processing_class: Any
    dataset: Any
    reward_funcs: tuple[Callable[..., Any], ...]
    tools: tuple[Callable[..., Any], ...]
    environment_factory: Any
    loop_cls: type[AsyncRolloutLoop]
    callbacks: Callbacks
    after_checkpoint: Callable[[int, bool], None]
    cpu_plan: CpuPlan | None = None
    eval_datasets: Mapping[str, Any] = attrs.field(factory=dict)
    eval_reward_funcs: tuple[Callable[..., Any], ...] = ()
    loop_options: Mapping[str, Any] = attrs.field(factory=dict)
