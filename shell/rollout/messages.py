"""What the rollout loop and the trainer tell each other.

The loop publishes a :class:`GroupOutcome` per prompt position (a scored group, or nothing for
a filtered or skipped prompt), a :class:`LoopReport` every few seconds and an
:class:`EvalOutcome` per evaluation the trainer asked for (an :class:`EvalRequest`); it reads the
policy version, the pacing figures, the evaluation asked for and the stop request through
:class:`Channels`. In production the channels cross the process boundary
(:mod:`asyncgrpo.shell.rollout.process`).
"""

from __future__ import annotations

from typing import Protocol

import attrs

from asyncgrpo.core.experiments.evaluation import Evaluation
from asyncgrpo.core.metrics import Observation
from asyncgrpo.core.records import TrainingSample
from asyncgrpo.core.run.step_queue import InFlight
from asyncgrpo.shell.servers import EvalRequest


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


@attrs.frozen
class EvalOutcome:
    """An evaluation's result: one :class:`~asyncgrpo.core.experiments.evaluation.Evaluation`
    per dataset, or none and ``error`` saying why it failed."""

    request: EvalRequest
    evaluations: tuple[Evaluation, ...]
    error: str = ""


class Channels(Protocol):
    """How the loop talks to the trainer (a process boundary in production)."""

    def publish(self, message: GroupOutcome | LoopReport | EvalOutcome) -> None: ...

    def model_version(self) -> int: ...

    def tokens_per_step(self) -> float | None: ...

    def tokens_taken(self) -> int: ...

    def steps_taken(self) -> int: ...

    def report_in_flight(self, in_flight: InFlight) -> None: ...

    def beat(self, activity: str = "") -> None:
        """Alive; ``activity`` says what the loop is doing (the calls in flight)."""

    def stop_requested(self) -> bool: ...

    def eval_request(self) -> EvalRequest | None:
        """The evaluation the trainer asks for now (the same one until it has finished), or
        None."""
        return None

    def eval_finished(self, request_id: int) -> None:
        """The evaluation ``request_id`` has finished (its outcome published): pushes the
        trainer held for it may go."""

    async def wait_for_trainer(self) -> None:
        """Return when the trainer may have changed what the loop reads (the policy version,
        tokens taken, steps taken, the stop request); one task waits at a time."""
