"""Epoch and resume cursors over the stream of prompts.

The rollout worker walks an endless stream of prompt *positions*: position ``p`` is prompt
``order(epoch)[p % N]`` of epoch ``p // N``, where ``order`` is a seeded permutation of the
``N`` dataset rows (:func:`row_at`). The trainer accounts for each position once its outcome
is known: filtered by ``filter_prompt``, dropped for zero reward std, or every one of its samples
taken off the queue (trained or dropped as stale). A position accounted for is *consumed*.

* Epochs count distinct prompts consumed (:func:`epochs_consumed`): filtered and dropped
  prompts count, forks do not, so ``num_train_epochs=N`` is always N passes over the data.
* ``rollout_state.json`` holds the :class:`PromptCursor`: the first position not yet consumed
  and the consumed positions past it (groups finish out of order). Resuming starts at that
  position and skips the consumed ones, so nothing trained is replayed and nothing untrained is
  skipped. A group the checkpoint split (some of its samples trained, the rest still queued)
  is not generated again either: its samples left are dropped, counted by
  :func:`split_by_checkpoint` (a group is generated whole, so the rest cannot be).
* A sampling request's seed is a function of the prompt's position (:func:`request_seed`), so
  a resumed run asks the server for the same samples as the run it continues.

Example:
    >>> cursor = PromptCursor()
    >>> cursor = group_outcome(cursor, position=1, num_samples=2)   # two samples queued
    >>> cursor = group_outcome(cursor, position=0, num_samples=0)   # filtered or dropped
    >>> cursor.next_untrained, sorted(cursor.pending)
    (1, [1])
    >>> cursor = samples_consumed(cursor, [1, 1])
    >>> cursor.next_untrained, epochs_consumed(cursor, dataset_size=4)
    (2, 0.5)
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import numpy as np

from asyncgrpo.core.frozen import FrozenMap, read_only
from asyncgrpo.core.rollout.sample_wait import GROUP_REASONS


def _frozen_counts(values: Mapping[int, int]) -> Mapping[int, int]:
    return FrozenMap(values)


def _positions(values: Iterable[int]) -> frozenset[int]:
    return frozenset(values)


@attrs.frozen
class PromptCursor:
    """Which prompt positions the trainer has consumed.

    Attributes:
        next_untrained: the first position not yet consumed; every position below it is.
        consumed_after: consumed positions above ``next_untrained``.
        pending: samples still expected on the queue, per position whose group was kept.
        taken: samples already taken off the queue, per pending position that has some.
    """

    next_untrained: int = 0
    consumed_after: frozenset[int] = attrs.field(default=frozenset(), converter=_positions)
    pending: Mapping[int, int] = attrs.field(factory=dict, converter=_frozen_counts)
    taken: Mapping[int, int] = attrs.field(factory=dict, converter=_frozen_counts)

    def __attrs_post_init__(self) -> None:
        if self.next_untrained < 0:
            raise ValueError("PromptCursor.next_untrained: must be >= 0")
        if any(p <= self.next_untrained for p in self.consumed_after):
            raise ValueError("PromptCursor.consumed_after: positions must be > next_untrained")

    def is_consumed(self, position: int) -> bool:
        """Whether ``position`` was consumed (a resumed worker skips it)."""
        return position < self.next_untrained or position in self.consumed_after

    def to_json(self) -> dict[str, Any]:
        """The fields ``rollout_state.json`` stores: pending positions are not consumed, and
        ``split_by_checkpoint`` gives the samples left of each one the checkpoint split."""
        return {
            "next_untrained": self.next_untrained,
            "consumed_after": sorted(self.consumed_after),
            "split_by_checkpoint": {str(p): self.pending[p] for p in sorted(self.taken)},
            "queued": {str(p): n for p, n in sorted(self.pending.items())},
            "taken": {str(p): n for p, n in sorted(self.taken.items())},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PromptCursor:
        """Read back :meth:`to_json` for a resumed run: the positions a checkpoint split are
        consumed (their samples left are dropped, :func:`split_by_checkpoint`); a missing key
        is an error naming it.

        Example:
            >>> cursor = group_outcome(PromptCursor(), position=0, num_samples=4)
            >>> cursor = samples_consumed(cursor, [0])  # 1 of 4 trained, then a checkpoint
            >>> saved = cursor.to_json()
            >>> saved["split_by_checkpoint"], PromptCursor.from_json(saved).next_untrained
            ({'0': 3}, 1)
        """
        for key in ("next_untrained", "consumed_after"):
            if key not in data:
                raise ValueError(f"rollout_state.json: missing key {key!r}")
        cursor = cls(int(data["next_untrained"]), frozenset(int(p) for p in data["consumed_after"]))
        for position in sorted(split_by_checkpoint(data)):
            cursor = _consume(cursor, position, {})
        return cursor

    @classmethod
    def with_queue_restored(cls, data: Mapping[str, Any]) -> PromptCursor:
        """Read back :meth:`to_json` for a resumed run that restores the checkpoint's queued
        samples: the positions with samples queued stay pending, a split group with what it
        had taken, so their samples are trained, not generated again nor dropped.

        Example:
            >>> cursor = group_outcome(PromptCursor(), position=0, num_samples=4)
            >>> cursor = samples_consumed(cursor, [0])  # 1 of 4 trained, then a checkpoint
            >>> restored = PromptCursor.with_queue_restored(cursor.to_json())
            >>> restored == cursor, list(positions_from(restart_cursor(restored), stop=3))
            (True, [1, 2])
        """
        for key in ("next_untrained", "consumed_after", "queued", "taken"):
            if key not in data:
                raise ValueError(f"rollout_state.json: missing key {key!r}")
        return cls(
            int(data["next_untrained"]),
            frozenset(int(p) for p in data["consumed_after"]),
            {int(p): int(n) for p, n in data["queued"].items()},
            {int(p): int(n) for p, n in data["taken"].items()},
        )


def split_by_checkpoint(data: Mapping[str, Any]) -> dict[int, int]:
    """The samples left of each group a checkpoint split, from its saved cursor
    (:meth:`PromptCursor.to_json`; none in a checkpoint written before this was saved)."""
    return {int(p): int(left) for p, left in data.get("split_by_checkpoint", {}).items()}


def _consume(cursor: PromptCursor, position: int, pending: dict[int, int]) -> PromptCursor:
    if cursor.is_consumed(position):
        raise ValueError(f"prompt position {position} was already consumed")
    pending.pop(position, None)
    done = set(cursor.consumed_after) | {position}
    nxt = cursor.next_untrained
    while nxt in done:
        done.discard(nxt)
        nxt += 1
    taken = {p: n for p, n in cursor.taken.items() if p != position}
    return PromptCursor(nxt, frozenset(done), pending, taken)


def group_outcome(cursor: PromptCursor, position: int, num_samples: int) -> PromptCursor:
    """Record a group's outcome: ``num_samples`` samples put on the queue (0 = none).

    A group with no samples (filtered, zero reward std, nothing trainable) is consumed at once.
    """
    if num_samples < 0:
        raise ValueError(f"num_samples must be >= 0, got {num_samples}")
    if position in cursor.pending or cursor.is_consumed(position):
        raise ValueError(f"prompt position {position} already has an outcome")
    pending = dict(cursor.pending)
    if num_samples == 0:
        return _consume(cursor, position, pending)
    pending[position] = num_samples
    return attrs.evolve(cursor, pending=pending)


def samples_consumed(cursor: PromptCursor, positions: Iterable[int]) -> PromptCursor:
    """Record samples taken off the queue (trained or dropped as stale), one position each."""
    pending, taken = dict(cursor.pending), dict(cursor.taken)
    for position in positions:
        left = pending.get(position)
        if left is None:
            raise ValueError(f"sample of prompt position {position} has no pending group")
        if left > 1:
            pending[position] = left - 1
            taken[position] = taken.get(position, 0) + 1
        else:
            taken.pop(position, None)
            cursor = _consume(cursor, position, pending)
    return attrs.evolve(cursor, pending=pending, taken=taken)


def prompts_consumed(cursor: PromptCursor) -> int:
    """Distinct prompt positions consumed so far."""
    return cursor.next_untrained + len(cursor.consumed_after)


def epochs_consumed(cursor: PromptCursor, dataset_size: int) -> float:
    """Passes over the dataset consumed, counted in distinct prompts."""
    if dataset_size <= 0:
        raise ValueError("dataset_size must be > 0")
    return prompts_consumed(cursor) / dataset_size


@functools.lru_cache(maxsize=4)
def epoch_order(dataset_size: int, epoch: int, seed: int) -> np.ndarray:
    """The row order of ``epoch``: a permutation of ``range(dataset_size)`` fixed by ``seed``
    (read-only; the last few are kept, since every group of an epoch looks its row up)."""
    rng = np.random.default_rng([seed, epoch])
    return read_only(rng.permutation(dataset_size))


def row_at(position: int, dataset_size: int, seed: int) -> tuple[int, int]:
    """``(epoch, row_index)`` of prompt ``position`` in the stream.

    Example:
        >>> epoch, row = row_at(7, dataset_size=5, seed=0)
        >>> epoch, 0 <= row < 5
        (1, True)
    """
    epoch, offset = divmod(position, dataset_size)
    return epoch, int(epoch_order(dataset_size, epoch, seed)[offset])


def positions_from(cursor: PromptCursor, stop: int | None = None) -> Iterable[int]:
    """Positions a (resumed) worker generates, in order: unconsumed ones from the cursor on."""
    position = cursor.next_untrained
    while stop is None or position < stop:
        if position not in cursor.consumed_after:
            yield position
        position += 1


def restart_cursor(cursor: PromptCursor) -> PromptCursor:
    """Where a restarted generator starts: the trainer's ``cursor`` with its queued positions
    (``pending``: samples on the trainer's queue) counted as done, so the generator skips the
    positions consumed or queued and regenerates only those whose outcome never reached the
    trainer (the groups that were in flight).

    Example:
        >>> queued = group_outcome(PromptCursor(), position=0, num_samples=2)
        >>> queued = group_outcome(queued, position=2, num_samples=0)  # filtered: consumed
        >>> list(positions_from(restart_cursor(queued), stop=5))
        [1, 3, 4]
    """
    restarted = PromptCursor(cursor.next_untrained, cursor.consumed_after)
    for position in sorted(cursor.pending):
        restarted = _consume(restarted, position, {})
    return restarted


def request_seed(seed: int, position: int, rollout_index: int, turn: int) -> int:
    """The sampling seed of one vLLM request, in ``[0, 2**63)``.

    A pure function of the config's ``seed``, the prompt's ``position`` in the stream, the
    rollout's index within its group (``0 .. num_generations - 1``) and the turn within the
    rollout (0 for the first request), so a resumed run, or the same run again, sends every
    request the same seed as before; distinct requests get unrelated seeds (a hash, not a sum).

    Example:
        >>> request_seed(0, 5, 1, 0) == request_seed(0, 5, 1, 0)
        True
        >>> len({request_seed(0, 5, i, t) for i in range(8) for t in range(3)})
        24
    """
    digest = hashlib.blake2b(struct.pack("<4q", seed, position, rollout_index, turn), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


# --- auditing a run's record of positions -------------------------------------------------------

GROUP_DROPS = frozenset(GROUP_REASONS)
"""Outcomes of ``positions.jsonl`` given once per group (every other outcome, ``trained``,
``stale``, ``oversize``, is given once per sample)."""


@attrs.frozen
class PositionAudit:
    """What a run's record of positions (``positions.jsonl``) says against a checkpoint's
    cursor.

    Attributes:
        consumed: positions the cursor has consumed.
        split: groups the checkpoint split (part trained, the rest queued).
        trained_samples: samples trained.
        dropped: positions (a group drop) or samples dropped, per outcome.
        missing: consumed by the cursor (or split), with fewer entries in the record than
            its group's outcome (lost).
        repeated: in the record more often than one group's outcome allows (trained twice).
        unconsumed: in the record but neither consumed nor split by the cursor.
    """

    consumed: int
    split: int
    trained_samples: int
    dropped: Mapping[str, int]
    missing: tuple[int, ...]
    repeated: tuple[int, ...]
    unconsumed: tuple[int, ...]

    @property
    def exact(self) -> bool:
        """Every consumed position is in the record once, and nothing else is."""
        return not (self.missing or self.repeated or self.unconsumed)


def audit_positions(
    rows: Iterable[Mapping[str, Any]], saved: Mapping[str, Any], samples_per_group: int
) -> PositionAudit:
    """Check that each position a checkpoint's cursor consumed was trained or dropped exactly
    once, and that each group it split has exactly its part trained.

    Args:
        rows: the rows of ``positions.jsonl`` up to the checkpoint's step:
            ``{"step": int, outcome: [positions]}``.
        saved: the checkpoint's cursor as saved (``rollout_state.json``'s ``"cursor"``,
            :meth:`PromptCursor.to_json`).
        samples_per_group: samples a kept group gives (``num_generations`` without forks;
            a position with more is counted as repeated).

    A consumed position is accounted for once when it appears under one group-drop outcome
    (:data:`GROUP_DROPS`) once, or under the per-sample outcomes ``samples_per_group`` times
    in all (a kept group whose samples were trained or dropped); a split one, when its
    samples appear ``samples_per_group`` less its samples left.

    Example:
        >>> rows = [{"step": 1, "trained": [0, 0], "zero_reward_spread": [1]},
        ...         {"step": 2, "trained": [2], "stale": [2, 3]}]
        >>> saved = {"next_untrained": 3, "consumed_after": [], "split_by_checkpoint": {"3": 1}}
        >>> audit = audit_positions(rows, saved, samples_per_group=2)
        >>> audit.exact, audit.trained_samples, dict(audit.dropped)
        (True, 3, {'zero_reward_spread': 1, 'stale': 2})
        >>> audit_positions(rows[:1], saved, 2).missing
        (2, 3)
    """
    samples: dict[int, int] = {}
    groups: dict[int, int] = {}
    dropped: dict[str, int] = {}
    trained = 0
    for row in rows:
        for outcome, positions in row.items():
            if outcome == "step":
                continue
            into = groups if outcome in GROUP_DROPS else samples
            for position in positions:
                into[position] = into.get(position, 0) + 1
            if outcome == "trained":
                trained += len(positions)
            else:
                dropped[outcome] = dropped.get(outcome, 0) + len(positions)
    consumed = set(range(int(saved["next_untrained"]))) | {int(p) for p in saved["consumed_after"]}
    expected = {p: samples_per_group for p in consumed}
    expected.update({p: samples_per_group - left for p, left in split_by_checkpoint(saved).items()})
    seen = samples.keys() | groups.keys()
    missing, repeated = [], []
    for position in sorted(seen | expected.keys()):
        group_drops, count = groups.get(position, 0), samples.get(position, 0)
        if group_drops > 1 or (group_drops and count) or count > expected.get(position, 0):
            repeated.append(position)
        elif position in expected and not group_drops and count < expected[position]:
            missing.append(position)
    return PositionAudit(
        consumed=len(consumed),
        split=len(expected) - len(consumed),
        trained_samples=trained,
        dropped=FrozenMap(dropped),
        missing=tuple(missing),
        repeated=tuple(repeated),
        unconsumed=tuple(sorted(seen - expected.keys())),
    )
