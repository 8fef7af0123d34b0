"""The rollout loop's prompts: which dataset row a prompt position reads, and its messages.

Positions count prompts over epochs (:mod:`asyncgrpo.core.cursor`); without a dataset (an
environment makes its own prompts) every position is a fresh, empty row of epoch 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from asyncgrpo.core import cursor


def check_conversational(prompt: Any, row_index: int) -> None:
    """Raise a ``ValueError`` unless ``prompt`` is a list of ``{'role', 'content'}`` messages.

    Example:
        >>> check_conversational("What is 2 + 2?", 0)
        Traceback (most recent call last):
        ...
        ValueError: dataset row 0: 'prompt' must be conversational, a list of {'role': ..., \
'content': ...} messages, got str: 'What is 2 + 2?'
    """
    if isinstance(prompt, (str, bytes, Mapping)) or not all(
        isinstance(m, Mapping) and "role" in m for m in prompt
    ):
        raise ValueError(
            f"dataset row {row_index}: 'prompt' must be conversational, a list of "
            f"{{'role': ..., 'content': ...}} messages, got {type(prompt).__name__}: "
            f"{str(prompt)[:200]!r}"
        )


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
                raise ValueError(
                    f"dataset row {row_index} has no 'prompt' column; prompts "
                    "must be conversational (a list of role/content messages)"
                )
            return []
        check_conversational(prompt, row_index)
        return [dict(m) for m in prompt]
