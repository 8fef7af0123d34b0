"""The metrics of one scored group, as observations for a metric window.

Everything TRL's AsyncGRPOTrainer logs per rollout or per group at scoring time: ``reward*``,
``rewards/{name}/*`` (with ``rewards/{name}/nonfinite_count``, the NaN or infinite rewards a
source returned, which count as unscored), ``frac_reward_zero_std``, ``completions/*``,
``rollout/turns_*``, ``rollout/samples_per_rollout``, ``rollout/fork_frac``,
``rollout/drift_tokens_*`` and, when the trainer has tools, ``tools/call_frequency``,
``tools/failure_frequency`` and ``tools/loop_exhausted_frac``; and the ``sample/*`` metrics
of the samples a trainer step takes (:func:`sample_observations`), with their staleness and
stale drops by completion length (:func:`staleness_by_length`, :func:`stale_drops_by_length`).
Values measured per rollout or sample carry their weight, so a window averages over items
(:mod:`asyncgrpo.core.metrics`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import attrs
import numpy as np

from asyncgrpo.core.metrics import (
    LENGTH_QUARTERS,
    Observation,
    length_quarter,
    maximum,
    mean,
    minimum,
    ratio,
    total,
)
from asyncgrpo.core.records import Rollout, TrainingSample
from asyncgrpo.core.rollout.advantages import GroupScore, duplicate_frac
from asyncgrpo.core.rollout.reconcile import Reconciled


@attrs.frozen
class GroupFacts:
    """What the metrics of a group are computed from.

    Attributes:
        rollouts: the group's rollouts.
        reconciled: each rollout's reconciliation.
        score: rewards, advantages and the keep decision.
        reward_columns: per named source (reward function name, or environment class name),
            one reward or ``None`` per rollout.
        eos_token_ids: tokens that end a completion (a rollout whose last turn ends with one
            terminated; otherwise it was clipped).
        has_tools: whether the trainer exposes tools (tool metrics are logged only then).
        loop_exhausted: per rollout, whether the tool loop stopped at
            ``max_tool_calling_iterations`` while still calling tools.
        nonfinite_rewards: per named source of ``reward_columns``, how many of its rewards
            were NaN or infinite (they are ``None`` in its column); a source not named had none.
    """

    rollouts: Sequence[Rollout]
    reconciled: Sequence[Reconciled]
    score: GroupScore
    reward_columns: Mapping[str, Sequence[float | None]]
    eos_token_ids: Collection[int]
    has_tools: bool = False
    loop_exhausted: Sequence[bool] = ()
    nonfinite_rewards: Mapping[str, int] = attrs.field(factory=dict)


def _terminated(rollout: Rollout, eos: Collection[int]) -> bool:
    last = next((t for t in reversed(rollout.turns) if t.output_ids), None)
    return last is not None and last.output_ids[-1] in eos


def _length_observations(facts: GroupFacts) -> list[Observation]:
    lengths = [len(r.completion_ids) for r in facts.rollouts]
    terminated = [
        n
        for r, n in zip(facts.rollouts, lengths, strict=True)
        if _terminated(r, facts.eos_token_ids)
    ]
    obs = [
        mean("completions/mean_length", float(np.mean(lengths)), weight=len(lengths)),
        minimum("completions/min_length", float(min(lengths))),
        maximum("completions/max_length", float(max(lengths))),
        ratio("completions/clipped_ratio", len(lengths) - len(terminated), len(lengths)),
    ]
    if terminated:
        obs += [
            mean(
                "completions/mean_terminated_length",
                float(np.mean(terminated)),
                weight=len(terminated),
            ),
            minimum("completions/min_terminated_length", float(min(terminated))),
            maximum("completions/max_terminated_length", float(max(terminated))),
        ]
    return obs


def _reward_observations(facts: GroupFacts) -> list[Observation]:
    score = facts.score
    rewards = score.rewards
    scored = rewards[~np.isnan(rewards)]
    kept_samples = sum(len(r.sequences) for r in facts.reconciled) if score.kept else 0
    obs = [mean("frac_reward_zero_std", 0.0 if score.kept else 1.0)]
    if scored.size:
        obs.append(mean("reward", float(scored.mean()), weight=scored.size))
        name = "reward_kept" if score.kept else "reward_dropped"
        obs.append(mean(name, float(scored.mean()), weight=scored.size))
    if kept_samples:
        obs.append(mean("reward_group_std", score.group_std, weight=kept_samples))
    for source, column in facts.reward_columns.items():
        values = np.array([v for v in column if v is not None], dtype=np.float64)
        nonfinite = facts.nonfinite_rewards.get(source, 0)
        obs.append(total(f"rewards/{source}/nonfinite_count", nonfinite))
        if values.size:
            obs.append(mean(f"rewards/{source}/mean", float(values.mean()), weight=values.size))
        if kept_samples and values.size >= 2:
            obs.append(
                mean(f"rewards/{source}/group_std", float(values.std(ddof=1)), weight=kept_samples)
            )
    return obs


def _turn_observations(facts: GroupFacts) -> list[Observation]:
    turns = [len(r.turns) for r in facts.rollouts]
    drift = [d for r in facts.reconciled for d in r.drift_tokens]
    obs = [
        mean("rollout/turns_mean", float(np.mean(turns)), weight=len(turns)),
        maximum("rollout/turns_max", float(max(turns))),
        mean(
            "rollout/samples_per_rollout",
            float(np.mean([len(r.sequences) for r in facts.reconciled])),
            weight=len(facts.reconciled),
        ),
        ratio(
            "rollout/fork_frac",
            sum(r.forks for r in facts.reconciled),
            sum(r.transitions for r in facts.reconciled),
        ),
        mean(
            "completions/duplicate_frac",
            duplicate_frac([tuple(t.output_ids for t in r.turns) for r in facts.rollouts]),
        ),
        mean(
            "completions/distinct_per_group",
            float(len({tuple(t.output_ids for t in r.turns) for r in facts.rollouts})),
        ),
    ]
    if drift:
        obs += [
            mean("rollout/drift_tokens_mean", float(np.mean(drift)), weight=len(drift)),
            maximum("rollout/drift_tokens_max", float(max(drift))),
        ]
    return obs


def _tool_observations(facts: GroupFacts) -> list[Observation]:
    calls = sum(r.tool_call_count for r in facts.rollouts)
    failures = sum(r.tool_failure_count for r in facts.rollouts)
    exhausted = list(facts.loop_exhausted) or [False] * len(facts.rollouts)
    return [
        ratio("tools/call_frequency", calls, len(facts.rollouts)),
        ratio("tools/failure_frequency", failures, calls),
        ratio("tools/loop_exhausted_frac", sum(exhausted), len(exhausted)),
    ]


def group_observations(facts: GroupFacts) -> list[Observation]:
    """Observations of one scored group (dropped groups included, as TRL's AsyncGRPOTrainer
    counts them).

    Example:
        >>> from asyncgrpo.core.rollout.advantages import score_group
        >>> from asyncgrpo.core.rollout.reconcile import reconcile_turns
        >>> from asyncgrpo.core.records import TurnRecord
        >>> rollouts = [Rollout([], [7, 2], [TurnRecord([1], [7, 2], [-1.0, -1.0])]),
        ...             Rollout([], [8], [TurnRecord([1], [8], [-1.0])])]
        >>> facts = GroupFacts(rollouts, [reconcile_turns(r.turns) for r in rollouts],
        ...                    score_group(np.array([1.0, 0.0])), {"f": [1.0, 0.0]}, {2})
        >>> obs = {o.name: o for o in group_observations(facts)}
        >>> obs["reward"].amount, obs["completions/clipped_ratio"].amount
        (0.5, 1.0)
    """
    if not facts.rollouts:
        raise ValueError("group_observations needs at least one rollout")
    obs = _reward_observations(facts) + _length_observations(facts) + _turn_observations(facts)
    if facts.has_tools:
        obs += _tool_observations(facts)
    return obs


def sample_observations(
    samples: Sequence[TrainingSample], current_version: int, now: float
) -> list[Observation]:
    """The ``sample/*`` metrics of the samples a trainer step takes off the queue.

    Args:
        samples: the samples taken (stale ones already dropped).
        current_version: the policy version being trained.
        now: ``time.monotonic()`` when they were taken (``queued_at`` uses the same clock).

    Example:
        >>> from asyncgrpo.core.records import TrainingSequence
        >>> seq = TrainingSequence([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0])
        >>> taken = [TrainingSample(seq, 1.0, 3, 0, 0, 0, "r", queued_at=10.0)]
        >>> observed = {o.name: o.amount for o in sample_observations(taken, 5, now=12.5)}
        >>> observed["sample/staleness_max"], observed["sample/time_in_queue_s"]
        (2.0, 2.5)
    """
    if not samples:
        return []
    n = len(samples)
    forwarded = [len(s.sequence) for s in samples]
    staleness = [s.staleness(current_version) for s in samples]
    return [
        mean("sample/forwarded_tokens_mean", float(np.mean(forwarded)), weight=n),
        maximum("sample/forwarded_tokens_max", float(max(forwarded))),
        mean(
            "sample/trained_tokens_mean",
            float(np.mean([s.sequence.num_trained for s in samples])),
            weight=n,
        ),
        mean(
            "sample/time_in_queue_s", float(np.mean([now - s.queued_at for s in samples])), weight=n
        ),
        mean("sample/staleness_mean", float(np.mean(staleness)), weight=n),
        maximum("sample/staleness_max", float(max(staleness))),
    ]


def token_length_quarters(
    sample_index: np.ndarray, samples: Sequence[TrainingSample], max_completion_length: int
) -> np.ndarray:
    """int8 [N]: for each trained token, the :func:`length_quarter` of the sample it belongs
    to (``sample_index`` [N] indexes ``samples``).

    Example:
        >>> from types import SimpleNamespace
        >>> def sample(n):  # what the quarter reads of a TrainingSample
        ...     return SimpleNamespace(sequence=SimpleNamespace(num_trained=n))
        >>> token_length_quarters(np.array([0, 1, 1]), [sample(10), sample(100)], 100).tolist()
        [1, 4, 4]
    """
    quarters = np.asarray(
        [length_quarter(s.sequence.num_trained, max_completion_length) for s in samples],
        dtype=np.int8,
    )
    return quarters[np.asarray(sample_index, dtype=np.int64)] if len(sample_index) else quarters[:0]


def staleness_by_length(
    samples: Sequence[TrainingSample], current_version: int, max_completion_length: int
) -> list[Observation]:
    """The staleness of the samples a step trains, by :func:`length_quarter`:
    ``sample/length_q{1-4}/staleness_mean``, and their part of
    ``sample/length_q{1-4}/dropped_stale_frac`` (trained: the denominator only).

    A sample is as stale as the version its rollout started on, so a long rollout, which
    spans more weight updates, is staler and more often dropped than a short one of the same
    group: these show whether the run trains long answers less than short ones.

    Example:
        >>> from asyncgrpo.core.records import TrainingSequence
        >>> def sample(trained, version):
        ...     ids, mask = [0] * (trained + 1), [0] + [1] * trained
        ...     sequence = TrainingSequence(ids, mask, [0.0] * len(ids))
        ...     return TrainingSample(sequence, 1.0, version, 0, 0, 0, "r")
        >>> taken = [sample(10, 5), sample(200, 3), sample(250, 2)]
        >>> observed = {o.name: o.amount for o in staleness_by_length(taken, 5, 256)}
        >>> observed["sample/length_q1/staleness_mean"], observed["sample/length_q4/staleness_mean"]
        (0.0, 2.5)
    """
    by_quarter: dict[int, list[int]] = {}
    for sample in samples:
        quarter = length_quarter(sample.sequence.num_trained, max_completion_length)
        by_quarter.setdefault(quarter, []).append(sample.staleness(current_version))
    observations = []
    for quarter, staleness in sorted(by_quarter.items()):
        n = len(staleness)
        observations += [
            mean(f"sample/length_q{quarter}/staleness_mean", float(np.mean(staleness)), weight=n),
            ratio(f"sample/length_q{quarter}/dropped_stale_frac", 0.0, n),
        ]
    return observations


def stale_drops_by_length(
    dropped: Sequence[TrainingSample], max_completion_length: int
) -> list[Observation]:
    """Samples dropped as stale, by :func:`length_quarter`:
    ``sample/length_q{1-4}/dropped_stale_count`` (every quarter, 0 where none was dropped) and
    their part of ``sample/length_q{1-4}/dropped_stale_frac``, the share of a quarter's
    samples dropped (a window's drops over its drops and trained samples).

    Example:
        >>> from asyncgrpo.core.records import TrainingSequence
        >>> seq = TrainingSequence([0] * 201, [0] + [1] * 200, [0.0] * 201)
        >>> dropped = [TrainingSample(seq, 1.0, 0, 0, 0, 0, "r")]
        >>> for observation in stale_drops_by_length(dropped, 256)[-2:]:
        ...     print(observation.name, observation.amount)
        sample/length_q4/dropped_stale_count 1.0
        sample/length_q4/dropped_stale_frac 1.0
    """
    counts = dict.fromkeys(range(1, LENGTH_QUARTERS + 1), 0)
    for sample in dropped:
        counts[length_quarter(sample.sequence.num_trained, max_completion_length)] += 1
    observations = []
    for quarter, n in counts.items():
        observations.append(total(f"sample/length_q{quarter}/dropped_stale_count", n))
        if n:
            observations.append(ratio(f"sample/length_q{quarter}/dropped_stale_frac", n, n))
    return observations


def tool_call_observations(name: str, latency_s: float, failed: int) -> tuple[Observation, ...]:
    """The ``tools/*`` metrics of one call of the tool ``name`` that took ``latency_s``
    seconds; ``failed`` is 1 when it raised or returned an error, else 0.

    Example:
        >>> for observation in tool_call_observations("search", 0.25, 1):
        ...     print(observation.name, observation.amount)
        tools/latency_s 0.25
        tools/search/latency_s 0.25
        tools/search/call_count 1.0
        tools/search/failure_count 1.0
    """
    return (
        mean("tools/latency_s", latency_s),
        mean(f"tools/{name}/latency_s", latency_s),
        total(f"tools/{name}/call_count", 1),
        total(f"tools/{name}/failure_count", failed),
    )


UNKNOWN_TOOL_CALL = total("tools/unknown_name_count", 1)
"""The metric of one call that names no tool the rollout has."""


def unknown_tool_feedback(name: str, known: Collection[str]) -> str:
    """What the model reads back when it calls ``name``, which is not among ``known``.

    Example:
        >>> unknown_tool_feedback("serch", ["search"])
        "Error: unknown tool 'serch'; available tools: ['search']"
    """
    return f"Error: unknown tool {name!r}; available tools: {sorted(known)}"


def tool_error_feedback(error: BaseException) -> str:
    """What the model reads back when a tool raised ``error`` (a tool's failure is the model's
    feedback, not a crash).

    Example:
        >>> tool_error_feedback(ValueError("no such city"))
        'Error: ValueError: no such city'
    """
    return f"Error: {type(error).__name__}: {error}"
