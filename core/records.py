"""Immutable records that flow from the rollout process to the learner.

The user-facing records keep TRL's AsyncGRPOTrainer names and field names: :class:`TurnRecord`
(one sampling request), :class:`Rollout` (one whole conversation) and :class:`RolloutGroup` (the
``num_generations`` rollouts of one prompt, scored together). Their token fields are tuples; the
sampler's per-token tables (candidate sets, top log-probs) are the dense arrays of
:mod:`asyncgrpo.core.sampler_tables`.

The learner-facing records are the project's own: :class:`TrainingSequence` (one reconciled
sequence of a rollout, see :mod:`asyncgrpo.core.rollout.reconcile`) and :class:`TrainingSample` (a
sequence with its advantage and provenance). Their per-token arrays are read-only numpy arrays,
aligned with ``input_ids``.

Every record validates itself when built: lengths agree, masks are 0/1, sampled log-probs are
finite. A bad value raises :class:`ValueError` naming the record and the field, where it enters,
instead of surfacing as a NaN inside a loss.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterable, Mapping, Sequence, Sized
from typing import Any

import attrs
import numpy as np

from asyncgrpo.core.frozen import ARRAY_EQ, read_only
from asyncgrpo.core.sampler_tables import CandidateSets, TopLogprobs


def _fail(record: str, field: str, problem: str) -> ValueError:
    return ValueError(f"{record}.{field}: {problem}")


def _int_tuple(values: Sequence[int]) -> tuple[int, ...]:
    return tuple(map(int, values))


def _optional_int_tuple(values: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if values is None else _int_tuple(values)


def _float_tuple(values: Sequence[float]) -> tuple[float, ...]:
    return tuple(map(float, values))


def _any_tuple(values: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(values)


def _messages(values: Iterable[Mapping[str, Any]]) -> tuple[Mapping[str, Any], ...]:
    return tuple(values)


def _optional_float_tuple(values: Iterable[float | None]) -> tuple[float | None, ...]:
    return tuple(values)


def _sampling_masks(
    values: Sequence[Sequence[int] | None] | CandidateSets | None,
) -> CandidateSets | None:
    if values is None or isinstance(values, CandidateSets):
        return values
    return CandidateSets.from_sets(values)


def _top_logprobs(
    values: Sequence[Mapping[int, float] | None] | TopLogprobs | None,
) -> TopLogprobs | None:
    if values is None or isinstance(values, TopLogprobs):
        return values
    return TopLogprobs.from_tables(values)


def _check_binary(record: str, field: str, values: Sequence[int] | np.ndarray) -> None:
    array = np.asarray(values)
    binary = (array == 0) | (array == 1)
    if not binary.all():
        found = array[int(np.argmin(binary))].item()
        raise _fail(record, field, f"must hold only 0 and 1, found {found!r}")


def _check_same_length(record: str, field: str, values: Sized | None, n: int) -> None:
    if values is not None and len(values) != n:
        raise _fail(record, field, f"has {len(values)} entries but output_ids has {n}")


def _check_top_logprobs(record: str, field: str, top: TopLogprobs) -> None:
    bad = np.argwhere(top.valid() & ~(top.logprobs <= 0.0))
    if len(bad):
        position, entry = (int(i) for i in bad[0])
        raise _fail(
            record,
            field,
            f"position {position} token {int(top.ids[position, entry])} has log-prob "
            f"{float(top.logprobs[position, entry])}; log-probs must be <= 0 (use -inf for "
            "probability zero)",
        )


@attrs.frozen
class TurnRecord:
    """One sampling request: the prompt sent to the sampler and what it generated.

    Attributes:
        prompt_ids: token ids of the whole prompt of this turn, earlier turns included.
        output_ids: token ids the sampler generated.
        output_log_probs: sampler log-prob (nats, <= 0) of each output token; required (one per
            token) when any output token is trained, may be empty otherwise.
        output_mask: one 0/1 per output token, 1 = trained, 0 = kept as context only. ``None``
            trains every output token.
        output_sampling_mask: per output token, the candidate token ids the sampler could pick
            under top-k/top-p truncation. ``None`` means the full vocabulary. Given as
            ``list[list[int]]`` or :class:`~asyncgrpo.core.sampler_tables.CandidateSets`; kept
            as the latter (indexing it gives one position's ids).
        output_sampler_logprobs: per output token, the sampler's top log-probs keyed by token id
            (used by score centering). Given as ``list[dict[int, float]]`` or
            :class:`~asyncgrpo.core.sampler_tables.TopLogprobs`; kept as the latter (float32,
            sorted; indexing it gives one position's dict).

    Example:
        >>> turn = TurnRecord(prompt_ids=[1, 2], output_ids=[7, 8], output_log_probs=[-0.5, -1.0])
        >>> turn.trained_mask()
        (1, 1)
    """

    prompt_ids: tuple[int, ...] = attrs.field(converter=_int_tuple)
    output_ids: tuple[int, ...] = attrs.field(converter=_int_tuple)
    output_log_probs: tuple[float, ...] = attrs.field(default=(), converter=_float_tuple)
    output_mask: tuple[int, ...] | None = attrs.field(default=None, converter=_optional_int_tuple)
    output_sampling_mask: CandidateSets | None = attrs.field(
        default=None, converter=_sampling_masks
    )
    output_sampler_logprobs: TopLogprobs | None = attrs.field(
        default=None, converter=_top_logprobs, eq=False
    )

    def __attrs_post_init__(self) -> None:
        name, n = "TurnRecord", len(self.output_ids)
        if not self.prompt_ids:
            raise _fail(name, "prompt_ids", "is empty; a sampling request needs a prompt")
        if self.output_mask is not None:
            _check_same_length(name, "output_mask", self.output_mask, n)
            _check_binary(name, "output_mask", self.output_mask)
        _check_same_length(name, "output_sampling_mask", self.output_sampling_mask, n)
        _check_same_length(name, "output_sampler_logprobs", self.output_sampler_logprobs, n)
        if self.output_log_probs:
            _check_same_length(name, "output_log_probs", self.output_log_probs, n)
        elif any(self.trained_mask()):
            raise _fail(
                name,
                "output_log_probs",
                f"is empty but {sum(self.trained_mask())} output tokens are trained; "
                "give the sampler's log-prob of every output token, or set output_mask to 0",
            )
        logprobs = np.array(self.output_log_probs, dtype=np.float64)
        wrong = np.flatnonzero(~np.isfinite(logprobs) | (logprobs > 0.0))
        if len(wrong):
            position = int(wrong[0])
            raise _fail(
                name,
                "output_log_probs",
                f"position {position} is {self.output_log_probs[position]}; a sampled token's "
                "log-prob is finite and <= 0",
            )
        if self.output_sampling_mask is not None:
            outside = np.flatnonzero(~self.output_sampling_mask.contains(np.array(self.output_ids)))
            if len(outside):
                position = int(outside[0])
                raise _fail(
                    name,
                    "output_sampling_mask",
                    f"position {position}: sampled token {self.output_ids[position]} is not in "
                    "its candidate set",
                )
        if self.output_sampler_logprobs is not None:
            _check_top_logprobs(name, "output_sampler_logprobs", self.output_sampler_logprobs)

    def trained_mask(self) -> tuple[int, ...]:
        """The 0/1 training mask of the output tokens (all ones when ``output_mask`` is None)."""
        return self.output_mask if self.output_mask is not None else (1,) * len(self.output_ids)


def _new_rollout_id() -> str:
    return uuid.uuid4().hex


def _turns(values: Iterable[TurnRecord]) -> tuple[TurnRecord, ...]:
    return tuple(values)


@attrs.frozen
class Rollout:
    """One completed rollout, as returned by ``AsyncRolloutLoop.generate_one``.

    Attributes:
        completion: messages generated after the prompt (conversational format); passed to
            reward functions as ``completions``.
        completion_ids: token ids of the generated completion; passed as ``completion_ids``.
        turns: the sampling requests of the rollout, in order. Training sequences are built
            from them (:func:`asyncgrpo.core.rollout.reconcile.reconcile_turns`).
        tool_call_count: tool calls made during the rollout.
        tool_failure_count: failed tool calls (unknown name or exception).
        reward: a reward computed during generation; added to the other sources. ``None``
            means this source did not score the rollout.
        rollout_id: identifies the rollout in training rows, for debugging.
    """

    completion: tuple[Mapping[str, Any], ...] = attrs.field(converter=_messages, eq=False)
    completion_ids: tuple[int, ...] = attrs.field(converter=_int_tuple)
    turns: tuple[TurnRecord, ...] = attrs.field(converter=_turns)
    tool_call_count: int = 0
    tool_failure_count: int = 0
    reward: float | None = None
    rollout_id: str = attrs.field(factory=_new_rollout_id)

    def __attrs_post_init__(self) -> None:
        for index, turn in enumerate(self.turns):
            if not isinstance(turn, TurnRecord):
                raise _fail(
                    "Rollout",
                    "turns",
                    f"entry {index} is {type(turn).__name__}, expected TurnRecord",
                )
        if self.tool_call_count < 0 or self.tool_failure_count < 0:
            raise _fail("Rollout", "tool_call_count", "counts must be >= 0")
        if self.tool_failure_count > self.tool_call_count:
            raise _fail(
                "Rollout",
                "tool_failure_count",
                f"{self.tool_failure_count} failures exceed {self.tool_call_count} calls",
            )
        if self.reward is not None and math.isnan(self.reward):
            raise _fail("Rollout", "reward", "is NaN; use None when the rollout is not scored")


def _int_array(values: Sequence[int] | np.ndarray) -> np.ndarray:
    return read_only(np.array(values, dtype=np.int64).reshape(-1))


def _mask_array(values: Sequence[int] | np.ndarray) -> np.ndarray:
    return read_only(np.array(values, dtype=np.int8).reshape(-1))


def _f64_array(values: Sequence[float] | np.ndarray) -> np.ndarray:
    return read_only(np.array(values, dtype=np.float64).reshape(-1))


@attrs.frozen
class TrainingSequence:
    """One training sequence reconciled from a rollout's turns; no advantage yet.

    All per-token fields are aligned with ``input_ids`` (length ``T``).

    Attributes:
        input_ids: int64 [T], the forwarded tokens (prompt, tool results and outputs).
        trained_mask: int8 [T], 1 where the token is trained (its log-prob enters the loss).
        sampler_logprobs: float64 [T], the sampler's log-prob (nats) at trained positions;
            0.0 at untrained positions.
        sampling_masks: [T] candidate sets, the sampler's candidate ids at trained positions
            under top-k/top-p (no set, i.e. the full vocabulary, elsewhere); ``None`` for the
            whole field = full vocabulary everywhere. Per-position id lists are accepted.
        sampler_top_logprobs: [T] tables, the sampler's top log-probs at trained positions
            (no table elsewhere); ``None`` for the whole field when not requested.
            Per-position dicts are accepted.
    """

    input_ids: np.ndarray = attrs.field(converter=_int_array, eq=ARRAY_EQ)
    trained_mask: np.ndarray = attrs.field(converter=_mask_array, eq=ARRAY_EQ)
    sampler_logprobs: np.ndarray = attrs.field(converter=_f64_array, eq=ARRAY_EQ)
    sampling_masks: CandidateSets | None = attrs.field(default=None, converter=_sampling_masks)
    sampler_top_logprobs: TopLogprobs | None = attrs.field(
        default=None, converter=_top_logprobs, eq=False
    )

    def __attrs_post_init__(self) -> None:
        name, n = "TrainingSequence", len(self.input_ids)
        for field in ("trained_mask", "sampler_logprobs"):
            if len(getattr(self, field)) != n:
                raise _fail(
                    name, field, f"has {len(getattr(self, field))} entries, input_ids has {n}"
                )
        _check_binary(name, "trained_mask", self.trained_mask)
        if n == 0:
            raise _fail(name, "input_ids", "is empty")
        if self.trained_mask[0]:
            raise _fail(
                name,
                "trained_mask",
                "the first token is trained, but no position predicts it; start the sequence "
                "with at least one context token",
            )
        trained = self.trained_mask.astype(bool)
        if not np.all(np.isfinite(self.sampler_logprobs[trained])):
            raise _fail(name, "sampler_logprobs", "must be finite at trained positions")
        if np.any(self.sampler_logprobs > 0.0):
            raise _fail(name, "sampler_logprobs", "log-probs must be <= 0")
        for field in ("sampling_masks", "sampler_top_logprobs"):
            values = getattr(self, field)
            if values is not None and len(values) != n:
                raise _fail(name, field, f"has {len(values)} entries, input_ids has {n}")

    @property
    def num_trained(self) -> int:
        """Number of trained tokens."""
        return int(self.trained_mask.sum())

    def __len__(self) -> int:
        return len(self.input_ids)


@attrs.frozen
class TrainingSample:
    """A training sequence with its advantage and provenance: what the learner trains on.

    Attributes:
        sequence: the tokens and their per-token sampler data.
        advantage: the rollout's advantage (dimensionless), the same for every trained token.
        model_version: policy version (weight syncs so far) the group started under.
        group_id: the group, counted from 0 by the rollout loop.
        row_index: the prompt's row in the training dataset.
        prompt_position: the prompt's position in the stream of prompts
            (``epoch * len(dataset) + order index``; see :mod:`asyncgrpo.core.rollout.cursor`).
        rollout_id: the rollout this sequence came from.
        queued_at: ``time.monotonic()`` when the sample was put on the rollout queue.
    """

    sequence: TrainingSequence
    advantage: float = attrs.field(converter=float)
    model_version: int
    group_id: int
    row_index: int
    prompt_position: int
    rollout_id: str
    queued_at: float = 0.0

    def __attrs_post_init__(self) -> None:
        if not math.isfinite(self.advantage):
            raise _fail("TrainingSample", "advantage", f"is {self.advantage}; must be finite")
        if self.model_version < 0:
            raise _fail("TrainingSample", "model_version", "must be >= 0")

    def staleness(self, current_version: int) -> int:
        """Weight updates between the policy that generated this sample and ``current_version``."""
        return current_version - self.model_version


def _nested_int_tuples(values: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(_int_tuple(v) for v in values)


def _nested_tuples(values: Sequence[Sequence[Any]]) -> tuple[tuple[Any, ...], ...]:
    return tuple(tuple(v) for v in values)


def _env_rewards(
    values: Iterable[tuple[type, float] | None],
) -> tuple[tuple[type, float] | None, ...]:
    return tuple(values)


def _rewards_array(values: Sequence[float] | np.ndarray | None) -> np.ndarray | None:
    return None if values is None else _f64_array(values)


@attrs.frozen
class RolloutGroup:
    """The ``num_generations`` rollouts of one prompt, scored together (the fields of TRL's
    AsyncGRPOTrainer documentation).

    Each list holds one entry per rollout. ``rewards`` is the total reward of each rollout
    summed over all sources (NaN when no source scored it); the loop sets it
    (``attrs.evolve``) before calling ``compute_advantages``.
    """

    prompts: tuple[Any, ...] = attrs.field(converter=_any_tuple, eq=False)
    reward_kwargs: Mapping[str, Sequence[Any]] = attrs.field(eq=False)
    completions: tuple[Any, ...] = attrs.field(converter=_any_tuple, eq=False)
    completions_ids: tuple[tuple[int, ...], ...] = attrs.field(converter=_nested_int_tuples)
    completions_sequences: tuple[tuple[TrainingSequence, ...], ...] = attrs.field(
        converter=_nested_tuples
    )
    tool_call_counts: tuple[int, ...] = attrs.field(converter=_int_tuple)
    tool_failure_counts: tuple[int, ...] = attrs.field(converter=_int_tuple)
    model_version: int
    group_id: int
    row_index: int
    env_rewards: tuple[tuple[type, float] | None, ...] = attrs.field(converter=_env_rewards)
    rollout_rewards: tuple[float | None, ...] = attrs.field(converter=_optional_float_tuple)
    queued_at: float = 0.0
    rewards: np.ndarray | None = attrs.field(default=None, converter=_rewards_array, eq=ARRAY_EQ)

    def __attrs_post_init__(self) -> None:
        n = len(self.completions_ids)
        for field in (
            "prompts",
            "completions",
            "completions_sequences",
            "tool_call_counts",
            "tool_failure_counts",
            "env_rewards",
            "rollout_rewards",
        ):
            if len(getattr(self, field)) != n:
                raise _fail(
                    "RolloutGroup",
                    field,
                    f"has {len(getattr(self, field))} entries, completions_ids has {n}",
                )
        for key, column in self.reward_kwargs.items():
            if len(column) != n:
                raise _fail(
                    "RolloutGroup",
                    f"reward_kwargs[{key!r}]",
                    f"has {len(column)} entries, expected {n}",
                )
        if self.rewards is not None and len(self.rewards) != n:
            raise _fail("RolloutGroup", "rewards", f"has {len(self.rewards)} entries, expected {n}")

    def __len__(self) -> int:
        return len(self.completions_ids)
