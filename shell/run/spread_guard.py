"""Rank 0's guard against a run with no reward spread left: it feeds the groups that arrive and
the steps that close to :mod:`asyncgrpo.core.run.collapse`, logs the warning when a collapse
shows, and says when the run must stop (``stop_after_spreadless_steps``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import structlog

from asyncgrpo.core import metrics
from asyncgrpo.core.run import collapse

log = structlog.get_logger("asyncgrpo.trainer")
SPREADLESS_SHARE = 0.9  # a step is spreadless when this share of its groups had zero spread
WARN_AFTER_SPREADLESS = 3  # spreadless steps in a row before the warning


class SpreadGuard:
    """The spread watch of one run (rank 0).

    Args:
        stop_after: ``stop_after_spreadless_steps``: spreadless steps in a row that end the
            run; None never ends it (as TRL).
        num_generations: samples per group (the rollouts a group stands for in the log).
    """

    def __init__(self, stop_after: int | None, num_generations: int) -> None:
        self.watch = collapse.SpreadWatch()
        self.settings = collapse.SpreadSettings(SPREADLESS_SHARE, WARN_AFTER_SPREADLESS, stop_after)
        self.num_generations = num_generations
        self.groups_per_step = 0  # groups whose samples filled the last step
        self.rollouts_since_step = 0
        self.warned_at: int | None = None  # the trainer step of the last warning

    def group_seen(self, observations: Sequence[metrics.Observation]) -> None:
        """A group arrived with its loop's observations (its zero-spread flag among them)."""
        zero_spread = collapse.zero_spread_of(observations)
        if zero_spread is not None:
            self.watch = collapse.group_seen(self.watch, zero_spread)
            self.rollouts_since_step += self.num_generations

    def step_due(self) -> bool:
        """While the trainer waits: whether a step's worth of groups arrived, so the watch
        closes a step without one trained."""
        return collapse.step_due(self.watch, self.groups_per_step)

    def close_step(self, step: int, entropy: float) -> bool:
        """Close the watch's step (a trained step, or a step's worth of groups while waiting):
        warn once a collapse shows (at most once per trainer step: the watch may close several
        of its steps while the trainer waits for one), and say whether the run must stop.

        Args:
            step: the trainer's step, for the log.
            entropy: the last trained step's mean entropy (NaN before the first), for the log.
        """
        rollouts, self.rollouts_since_step = self.rollouts_since_step, 0
        self.watch, verdict = collapse.close_step(self.watch, self.settings)
        if verdict is collapse.Verdict.NONE:
            return False
        figures = dict(
            step=step,
            spreadless_steps=self.watch.spreadless_in_a_row,
            spreadless_steps_in_all=self.watch.spreadless_total,
            zero_spread_share=round(self.watch.last_share, 3),
            rollouts_for_the_step=rollouts,
        )
        if math.isfinite(entropy):  # none before the first trained step
            figures["entropy"] = round(entropy, 4)
        if verdict is collapse.Verdict.WARN:
            if self.warned_at == step:
                return False
            self.warned_at = step
            log.warning(
                "no reward spread left: almost every group's rewards are all equal, so GRPO has "
                "nothing to learn from and the trainer generates and drops group after group. "
                "The policy may have collapsed (low entropy) or solved the task. Make the task "
                "harder, sample more diversely (temperature), or stop the run "
                "(stop_after_spreadless_steps ends it with a checkpoint)",
                next_warning_at=collapse.warning_due_at(self.watch.warnings, self.settings),
                **figures,
            )
            return False
        log.warning(
            "stopping: no reward spread for stop_after_spreadless_steps="
            f"{self.settings.stop_after} steps in a row",
            **figures,
        )
        return True
