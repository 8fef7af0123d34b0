"""Waiting for samples: is the rollout side hung, or producing groups that are all dropped?

While the trainer waits for a step's samples, what reaches it from the rollout process is
tallied: groups that arrive with samples end the wait; groups that arrive without (dropped for
zero reward spread, skipped as too long for the server, rejected by ``filter_prompt``) and
samples the trainer drops (stale, longer than ``token_budget``) are counted by reason. A rollout
process that produces nothing at all for ``rollout_worker_timeout`` seconds is hung; one that
keeps producing groups that are all dropped is not, and the trainer says so with the counts
(:func:`judge_wait`, :func:`describe_drops`).

Example:
    >>> tally = outcome_arrived(WaitTally(), samples=0, dropped=ZERO_SPREAD)
    >>> tally = samples_dropped(tally, STALE, 3)
    >>> describe_drops(tally).split("; ")
    ['1 group arrived, none with a sample to train: 1 dropped for zero reward spread', \
'3 samples dropped as stale']
    >>> judge_wait(waited_s=400, silent_s=2, timeout_s=300, tally=tally)
    <WaitVerdict.DROPPING: 'dropping'>
    >>> judge_wait(waited_s=400, silent_s=400, timeout_s=300, tally=WaitTally())
    <WaitVerdict.HUNG: 'hung'>
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

import attrs

from asyncgrpo.core.frozen import FrozenMap

# why a group arrived without samples (GroupOutcome.dropped), or why the trainer dropped samples
ZERO_SPREAD = "zero_reward_spread"
PROMPT_TOO_LONG = "prompt_too_long"
FILTERED = "filtered"
STALE = "stale"
OVERSIZE = "oversize"
SPLIT_BY_RESUME = "split_by_resume"
GROUP_REASONS = {
    ZERO_SPREAD: "dropped for zero reward spread",
    PROMPT_TOO_LONG: "skipped as too long for the server",
    FILTERED: "rejected by filter_prompt",
}
SAMPLE_REASONS = {
    STALE: "dropped as stale",
    OVERSIZE: "dropped as longer than token_budget",
    SPLIT_BY_RESUME: "dropped on resume: part of its group was trained before the checkpoint",
}


def _counts(values: Mapping[str, int]) -> Mapping[str, int]:
    return FrozenMap(values)


@attrs.frozen
class WaitTally:
    """What reached the trainer during one wait for samples.

    Attributes:
        groups: group outcomes that arrived (with or without samples).
        groups_dropped: groups without samples, by reason (:data:`GROUP_REASONS`).
        samples_dropped: samples the trainer dropped, by reason (:data:`SAMPLE_REASONS`).
    """

    groups: int = 0
    groups_dropped: Mapping[str, int] = attrs.field(factory=dict, converter=_counts)
    samples_dropped: Mapping[str, int] = attrs.field(factory=dict, converter=_counts)

    @property
    def dropped(self) -> int:
        """Groups and samples dropped, all reasons."""
        return sum(self.groups_dropped.values()) + sum(self.samples_dropped.values())


def _add(counts: Mapping[str, int], reason: str, count: int) -> dict[str, int]:
    return {**counts, reason: counts.get(reason, 0) + count}


def outcome_arrived(tally: WaitTally, samples: int, dropped: str = "") -> WaitTally:
    """One group's outcome arrived with ``samples`` samples; without any, ``dropped`` says why
    (empty: no reason given, counted as zero reward spread, the scoring's only drop)."""
    if samples:
        return attrs.evolve(tally, groups=tally.groups + 1)
    reason = dropped or ZERO_SPREAD
    return attrs.evolve(
        tally, groups=tally.groups + 1, groups_dropped=_add(tally.groups_dropped, reason, 1)
    )


def samples_dropped(tally: WaitTally, reason: str, count: int) -> WaitTally:
    """The trainer dropped ``count`` samples for ``reason`` (:data:`SAMPLE_REASONS`)."""
    if count <= 0:
        return tally
    return attrs.evolve(tally, samples_dropped=_add(tally.samples_dropped, reason, count))


def describe_drops(tally: WaitTally) -> str:
    """One line: how many groups arrived and why nothing could be trained."""
    parts = []
    if tally.groups:
        word = "group" if tally.groups == 1 else "groups"
        reasons = ", ".join(
            f"{n} {GROUP_REASONS.get(r, r)}" for r, n in sorted(tally.groups_dropped.items())
        )
        parts.append(f"{tally.groups} {word} arrived, none with a sample to train: {reasons}")
    else:
        parts.append("no group arrived")
    for reason, count in sorted(tally.samples_dropped.items()):
        word = "sample" if count == 1 else "samples"
        parts.append(f"{count} {word} {SAMPLE_REASONS.get(reason, reason)}")
    return "; ".join(parts)


class WaitVerdict(enum.Enum):
    """What a long wait for samples is."""

    WAITING = "waiting"  # within the timeout, nothing to say yet
    DROPPING = "dropping"  # groups keep arriving, all dropped: not a hang
    HUNG = "hung"  # nothing at all arrived for the timeout: a call never returns


def judge_wait(waited_s: float, silent_s: float, timeout_s: float, tally: WaitTally) -> WaitVerdict:
    """Judge a wait for samples.

    Args:
        waited_s: seconds the trainer has waited with no sample to train.
        silent_s: seconds since anything last arrived from the rollout process (a group with
            or without samples), counted within the wait.
        timeout_s: ``rollout_worker_timeout``.
        tally: what arrived during the wait.

    Returns:
        :attr:`WaitVerdict.HUNG` when nothing at all arrived for ``timeout_s``;
        :attr:`WaitVerdict.DROPPING` when the wait is past ``timeout_s`` but groups arrive,
        all dropped; :attr:`WaitVerdict.WAITING` otherwise.
    """
    if silent_s > timeout_s:
        return WaitVerdict.HUNG
    if waited_s > timeout_s and (tally.groups or tally.dropped):
        return WaitVerdict.DROPPING
    return WaitVerdict.WAITING
