"""The rollout loop's heartbeat: what it is doing, told to the trainer every ``HEARTBEAT_S``.

Each call that may take long (a generation request, a reward function, a tool, an environment
method) runs inside :meth:`Heartbeat.doing`; each group's outcome goes to the trainer through
:meth:`Heartbeat.publish`, which counts it. The trainer's watchdog shows the last beat's line
when the rollout process stalls (:func:`~asyncgrpo.core.rollout.activity.describe_activities`
picks the longest-running calls).
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Iterator

import anyio

from asyncgrpo.core.rollout import sample_wait
from asyncgrpo.core.rollout.activity import Activity, describe_activities
from asyncgrpo.shell.rollout import context
from asyncgrpo.shell.rollout.messages import Channels, GroupOutcome

HEARTBEAT_S = 1.0


class Heartbeat:
    """The calls in flight and the groups published, as one line for the trainer.

    Args:
        channels: where beats and outcomes go.
        in_flight: the rollouts in flight now.
    """

    def __init__(self, channels: Channels, in_flight: Callable[[], int]) -> None:
        self.channels = channels
        self.in_flight = in_flight
        self._activities: dict[int, Activity] = {}
        self._keys = itertools.count()
        self._published = sample_wait.WaitTally()

    @contextlib.contextmanager
    def doing(self, what: str, group: tuple[int, int] | None = None) -> Iterator[None]:
        """Record a call in flight (for the current task's group unless ``group`` is given)."""
        group_id, row_index = group or context.GROUP.get()
        key = next(self._keys)
        self._activities[key] = Activity(what, group_id, row_index, time.monotonic())
        try:
            yield
        finally:
            del self._activities[key]

    def publish(self, outcome: GroupOutcome) -> None:
        """Send a group's outcome to the trainer, counted for the report."""
        self._published = sample_wait.outcome_arrived(
            self._published, len(outcome.samples), outcome.dropped
        )
        self.channels.publish(outcome)

    def describe(self) -> str:
        """One line: rollouts in flight and the longest-running calls, with their groups, and
        the groups published (those dropped by reason)."""
        calls = describe_activities(self._activities.values(), time.monotonic())
        published = self._published
        dropped = ", ".join(
            f"{n} {sample_wait.GROUP_REASONS.get(r, r)}"
            for r, n in sorted(published.groups_dropped.items())
        )
        groups = f"; {published.groups} groups published" if published.groups else ""
        groups += f" ({dropped})" if dropped else ""
        return f"{self.in_flight()} rollouts in flight; {calls}{groups}"

    async def beat_forever(self) -> None:
        while True:
            self.channels.beat(self.describe())
            await anyio.sleep(HEARTBEAT_S)
