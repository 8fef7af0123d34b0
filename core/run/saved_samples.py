"""The samples a checkpoint keeps: those generated and queued, not trained yet, as named arrays
and one small record per sample, so that a resumed run trains them instead of generating them
again.

:func:`samples_to_arrays` flattens each sample's tables into arrays named ``"<i>.<field>"``
(:data:`ARRAY_FIELDS`) and its scalars into a record (:data:`RECORD_FIELDS`), which a tensor
file stores as they are; :func:`samples_from_arrays` builds the samples back, equal to those
saved, with ``queued_at`` set to the resumed run's clock. A sample keeps its
``model_version``: the resumed run counts its staleness as the run it continues would.

Example:
    >>> from asyncgrpo.core.records import TrainingSample, TrainingSequence
    >>> sequence = TrainingSequence([1, 2, 3], [0, 1, 1], [0.0, -0.5, -1.0])
    >>> saved = [TrainingSample(sequence, 0.5, 3, 7, 2, 11, "r-7-0", queued_at=42.0)]
    >>> arrays, records = samples_to_arrays(saved)
    >>> sorted(arrays), records
    (['0.input_ids', '0.sampler_logprobs', '0.trained_mask'], [{'advantage': 0.5, \
'model_version': 3, 'group_id': 7, 'row_index': 2, 'prompt_position': 11, 'rollout_id': 'r-7-0'}])
    >>> (back,) = samples_from_arrays(arrays, records, queued_at=42.0)
    >>> back == saved[0]
    True
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from asyncgrpo.core.records import TrainingSample, TrainingSequence
from asyncgrpo.core.sampler_tables import CandidateSets, TopLogprobs

RECORD_FIELDS = (
    "advantage",
    "model_version",
    "group_id",
    "row_index",
    "prompt_position",
    "rollout_id",
)
"""A sample's scalars, saved in its record (``queued_at`` is a clock of the run that saved it,
not saved)."""
ARRAY_FIELDS = (
    "input_ids",
    "trained_mask",
    "sampler_logprobs",
    "sampling_masks.ids",
    "sampling_masks.counts",
    "sampler_top_logprobs.ids",
    "sampler_top_logprobs.logprobs",
    "sampler_top_logprobs.counts",
)
"""A sample's arrays, each named ``"<i>.<field>"``; the tables' only where the sample has them."""


def samples_to_arrays(
    samples: Sequence[TrainingSample],
) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
    """The arrays of ``samples`` by name, and a record of each one's scalars, in order."""
    arrays: dict[str, np.ndarray] = {}
    records: list[dict[str, Any]] = []
    for i, sample in enumerate(samples):
        for field in ARRAY_FIELDS:
            value: Any = sample.sequence
            for part in field.split("."):  # "sampling_masks.ids": a table's array
                value = getattr(value, part) if value is not None else None
            if value is not None:
                arrays[f"{i}.{field}"] = value
        records.append({field: getattr(sample, field) for field in RECORD_FIELDS})
    return arrays, records


def samples_from_arrays(
    arrays: Mapping[str, np.ndarray], records: Sequence[Mapping[str, Any]], queued_at: float
) -> tuple[TrainingSample, ...]:
    """The samples :func:`samples_to_arrays` gave ``arrays`` and ``records`` for, queued at
    ``queued_at`` (``time.monotonic()`` of the run that restores them).

    Raises:
        ValueError: an array or a record field is missing or does not fit its sample (names
            the sample and the field).
    """
    samples = []
    for i, record in enumerate(records):
        missing = [f for f in RECORD_FIELDS if f not in record]
        missing += [f for f in ARRAY_FIELDS[:3] if f"{i}.{f}" not in arrays]
        if missing:
            raise ValueError(f"saved sample {i}: missing {missing}")
        try:
            sequence = TrainingSequence(
                arrays[f"{i}.input_ids"],
                arrays[f"{i}.trained_mask"],
                arrays[f"{i}.sampler_logprobs"],
                sampling_masks=_table(arrays, f"{i}.sampling_masks", CandidateSets, "ids"),
                sampler_top_logprobs=_table(
                    arrays, f"{i}.sampler_top_logprobs", TopLogprobs, "ids", "logprobs"
                ),
            )
            fields = {f: record[f] for f in RECORD_FIELDS}
            samples.append(TrainingSample(sequence, **fields, queued_at=queued_at))
        except (ValueError, TypeError) as error:
            raise ValueError(f"saved sample {i} does not load: {error}") from error
    return tuple(samples)


def check_queued(samples: Sequence[TrainingSample], queued: Mapping[int, int], source: str) -> None:
    """Check that ``samples`` (read from ``source``, for the error) are those a cursor has
    ``queued`` (samples by prompt position).

    Raises:
        ValueError: they are not, naming both counts.

    Example:
        >>> check_queued([], {3: 1}, "the file")
        Traceback (most recent call last):
        ...
        ValueError: the file holds samples of positions {}, the cursor has {3: 1} queued
    """
    by_position = Counter(s.prompt_position for s in samples)
    if by_position != Counter(dict(queued)):
        raise ValueError(
            f"{source} holds samples of positions {dict(by_position)}, the cursor has "
            f"{dict(queued)} queued"
        )


def _table(arrays: Mapping[str, np.ndarray], prefix: str, kind: Any, *names: str) -> Any:
    """The table of ``kind`` saved under ``prefix`` (its ``names`` and ``counts``), or None."""
    if f"{prefix}.counts" not in arrays:
        return None
    return kind(*(arrays[f"{prefix}.{name}"] for name in names), arrays[f"{prefix}.counts"])
