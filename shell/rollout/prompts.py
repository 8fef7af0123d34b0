"""The rollout loop's prompts: which dataset row a prompt position reads, and its messages.

Positions count prompts over epochs (:mod:`asyncgrpo.core.rollout.cursor`); without a dataset (an
environment makes its own prompts) every position is a fresh, empty row of epoch 0.

Every row is checked where the trainer is built (:func:`check_row`, called by
:mod:`asyncgrpo.shell.run.inputs` for each row), and again as the loop reads it, so a bad row
fails naming the row, the column and the value's type before any step is trained.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from asyncgrpo.core.rollout import cursor

PROMPT_FIX = 'Write each prompt as [{"role": "user", "content": "..."}]'


def _shown(value: Any) -> str:
    return f"{type(value).__name__}: {str(value)[:200]!r}"


def check_conversational(prompt: Any, row_index: int) -> None:
    """Raise a ``ValueError`` unless ``prompt`` is a list of ``{'role', 'content'}`` messages
    whose roles and contents are strings (an assistant message with ``tool_calls`` may have no
    content), naming the row, the column, the message and the value's type.

    TRL's AsyncGRPOTrainer documentation asks for conversational prompts; a plain string is
    refused (an environment's ``reset`` may return one, a dataset row may not).

    Example:
        >>> check_conversational("What is 2 + 2?", 0)
        Traceback (most recent call last):
        ...
        ValueError: dataset row 0, column 'prompt': must be conversational, a list of \
{'role': ..., 'content': ...} messages, got str: 'What is 2 + 2?'
        >>> check_conversational([{"role": "user", "content": 4}], 3)
        Traceback (most recent call last):
        ...
        ValueError: dataset row 3, column 'prompt', message 0: 'content' must be a string, \
got int: '4'
    """
    where = f"dataset row {row_index}, column 'prompt'"
    if isinstance(prompt, (str, bytes, Mapping)) or not isinstance(prompt, (list, tuple)):
        raise ValueError(
            f"{where}: must be conversational, a list of {{'role': ..., 'content': ...}} "
            f"messages, got {_shown(prompt)}"
        )
    if not prompt:
        raise ValueError(f"{where}: is an empty list; give at least one message")
    for index, message in enumerate(prompt):
        at = f"{where}, message {index}"
        if not isinstance(message, Mapping):
            raise ValueError(
                f"{at}: must be a {{'role': ..., 'content': ...}} dict, got {_shown(message)}"
            )
        if not isinstance(message.get("role"), str):
            missing = "role" not in message
            got = "no 'role' key" if missing else _shown(message.get("role"))
            raise ValueError(f"{at}: 'role' must be a string, got {got}")
        content = message.get("content")
        if content is None and message.get("tool_calls"):
            continue  # an assistant turn that only calls tools
        if not isinstance(content, str):
            got = "no 'content' key" if "content" not in message else _shown(content)
            raise ValueError(f"{at}: 'content' must be a string, got {got}")


def check_environment_name(name: Any, row_index: int, names: Collection[str]) -> None:
    """Raise a ``ValueError`` unless ``name`` (a row's ``environment`` column) names one of
    the factories ``names``.

    Example:
        >>> check_environment_name(None, 4, ["game"])
        Traceback (most recent call last):
        ...
        ValueError: dataset row 4, column 'environment': must name one of ['game'] \
(environment_factory is a dict), got NoneType: 'None'
    """
    if not isinstance(name, str) or name not in names:
        raise ValueError(
            f"dataset row {row_index}, column 'environment': must name one of "
            f"{sorted(names)} (environment_factory is a dict), got {_shown(name)}"
        )


def check_row(row: Mapping[str, Any], row_index: int, environment_factory: Any) -> None:
    """Check one dataset row: its ``prompt`` (None or absent only when an environment makes
    the prompt) and, with a dict of environment factories, its ``environment`` column.

    Raises:
        ValueError: naming the row, the column and the value's type.
    """
    prompt = row.get("prompt")
    if prompt is None:
        if environment_factory is None:
            got = "None" if "prompt" in row else "no 'prompt' column"
            raise ValueError(
                f"dataset row {row_index}, column 'prompt': got {got}; without an "
                "environment_factory every row needs a conversational prompt"
            )
    else:
        check_conversational(prompt, row_index)
    if isinstance(environment_factory, Mapping):
        check_environment_name(row.get("environment"), row_index, list(environment_factory))


class PromptRows:
    """The rows of ``dataset`` (None: no dataset) in the order of ``prompt_order_seed``.

    Args:
        dataset: indexable rows (a ``datasets.Dataset`` or a list of dicts), or None.
        prompt_order_seed: the config's seed of each epoch's shuffled order.
        prompt_optional: whether a row may lack ``prompt`` (an environment's ``reset``
            makes it).
    """

    def __init__(self, dataset: Any, prompt_order_seed: int, prompt_optional: bool) -> None:
        self.dataset = dataset
        self.prompt_order_seed = prompt_order_seed
        self.prompt_optional = prompt_optional

    @property
    def size(self) -> int | None:
        """Rows in the dataset, or None without one."""
        if self.dataset is None:
            return None
        return len(self.dataset)

    def at(self, position: int, size: int | None) -> tuple[int, int]:
        """``(epoch, row index)`` of prompt ``position`` in a dataset of ``size`` rows."""
        if size is None:
            return 0, position
        return cursor.row_at(position, size, self.prompt_order_seed)

    def row(self, row_index: int) -> dict[str, Any]:
        """A copy of row ``row_index`` (empty without a dataset)."""
        if self.dataset is None:
            return {}
        return dict(self.dataset[row_index])

    def prompt_of(self, row: Mapping[str, Any], row_index: int) -> list[dict[str, Any]]:
        """Copies of the row's prompt messages ([] when an environment makes the prompt).

        Raises:
            ValueError: the prompt is missing (and may not be) or is not conversational.
        """
        prompt = row.get("prompt")
        if prompt is None:
            if not self.prompt_optional:
                got = "None" if "prompt" in row else "no 'prompt' column"
                raise ValueError(
                    f"dataset row {row_index}, column 'prompt': got {got}; prompts must be "
                    "conversational (a list of role/content messages)"
                )
            return []
        check_conversational(prompt, row_index)
        return [dict(m) for m in prompt]
