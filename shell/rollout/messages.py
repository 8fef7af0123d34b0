"""What the rollout loop and the trainer tell each other.

The loop publishes a :class:`GroupOutcome` per prompt position (a scored group, or nothing for
a filtered or skipped prompt) and a :class:`LoopReport` every few seconds; it reads the policy
version, the pacing figures and the stop request through :class:`Channels`. In production
the channels cross the process boundary (:mod:`asyncgrpo.shell.rollout.process`).
"""

from __future__ import annotations

from typing import Protocol

import attrs

from asyncgrpo.core.metrics import Observation
from asyncgrpo.core.records import TrainingSample


@attrs.frozen
class GroupOutcome:
    """A group's result for the trainer: its samples (none if filtered or dropped) and, with
    ``log_completions``, its ``(prompt, completion, reward)`` texts; without samples,
    ``dropped`` says why (a reason of :mod:`asyncgrpo.core.rollout.sample_wait`: zero reward spread,
    a prompt too long for the server, rejected by ``filter_prompt``)."""

    position: int
    row_index: int
    samples: tuple[TrainingSample, ...]
    observations: tuple[Observation, ...]
    completions: tuple[tuple[str, str, float], ...] = ()
    dropped: str = ""

    @property
    def forwarded_tokens(self) -> int:
        return sum(len(s.sequence) for s in self.samples)


@attrs.frozen
class LoopReport:
    """Loop-level observations (load, throughput, tools), sent every few seconds."""

    observations: tuple[Observation, ...]


class Channels(Protocol):
    """How the loop talks to the trainer (a process boundary in production)."""

    def publish(self, message: GroupOutcome | LoopReport) -> None: ...

    def model_version(self) -> int: ...

    def tokens_per_step(self) -> float | None: ...

    def tokens_taken(self) -> int: ...

    def steps_taken(self) -> int: ...

    def report_in_flight(self, groups: int) -> None: ...

    def beat(self, activity: str = "") -> None:
        """Alive; ``activity`` says what the loop is doing (the calls in flight)."""

    def stop_requested(self) -> bool: ...

    async def wait_for_trainer(self) -> None:
        """Return when the trainer may have changed what the loop reads (the policy version,
        tokens taken, steps taken, the stop request); one task waits at a time."""
