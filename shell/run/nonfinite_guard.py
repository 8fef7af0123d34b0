"""Every process's guard against diverged weights: it counts the steps the learner skipped for a
non-finite loss or gradient norm (:mod:`asyncgrpo.core.run.divergence`) and says when the run
must stop (``stop_after_nonfinite_steps`` in a row). Every process sees the same skips (the
learner decides from values alike on all), so every process stops at the same step.
"""

from __future__ import annotations

from pathlib import Path

import structlog

from asyncgrpo.core.run import divergence
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.learner import DivergedError, StepOutput
from asyncgrpo.shell.run.checkpoints import CHECKPOINT_PREFIX
from asyncgrpo.shell.run.intake import SampleIntake

log = structlog.get_logger("asyncgrpo.trainer")


class NonfiniteGuard:
    """The skipped steps of one run.

    Args:
        config: the run's (``stop_after_nonfinite_steps``, and the ``learning_rate`` and
            ``max_grad_norm`` the error names).
        start_step: the learner's step when the run starts (a resumed checkpoint's).
    """

    def __init__(self, config: AsyncGRPOConfig, start_step: int) -> None:
        self.config = config
        self.steps = divergence.NonfiniteSteps(last_finite_step=start_step)

    def after_step(self, out: StepOutput, intake: SampleIntake) -> bool:
        """Count the step the learner just took (skipped: its samples' positions were consumed,
        not trained, ``intake`` notes); whether the run must stop now."""
        if out.skipped:
            intake.step_skipped()
        self.steps = divergence.after_step(self.steps, finite=not out.skipped)
        return divergence.must_stop(self.steps, self.config.stop_after_nonfinite_steps)

    def error(self, out: StepOutput, output_dir: Path, step: int) -> DivergedError:
        """The error that stops the run at ``step``, its checkpoint (in ``output_dir``) just
        saved with the last finite weights."""
        checkpoint = output_dir / f"{CHECKPOINT_PREFIX}{step}"
        message = divergence.diverged_message(
            self.steps,
            self.config.stop_after_nonfinite_steps,
            out.metrics["loss"],
            out.metrics["grad_norm"],
            self.config.learning_rate,
            self.config.max_grad_norm,
            str(checkpoint),
        )
        return DivergedError(message)
