"""Rank 0's intake of samples: the rollout process's messages into the step queue.

Each group that arrives enters the step queue (:mod:`asyncgrpo.core.run.step_queue`), which
drops samples more than ``max_staleness`` versions old or longer than ``token_budget``; the
prompt cursor (:mod:`asyncgrpo.core.rollout.cursor`) records each group's outcome and each
sample consumed (trained or dropped); the rollout process learns which tokens are done with,
for its pacing; and the prompt positions done with are noted by outcome for
``positions.jsonl``. The decisions are the core's; this object holds their state between
messages and carries out what they say.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import structlog

from asyncgrpo.core import metrics
from asyncgrpo.core.records import TrainingSample
from asyncgrpo.core.rollout import cursor
from asyncgrpo.core.rollout.metrics import stale_drops_by_length
from asyncgrpo.core.rollout.sample_wait import OVERSIZE, SPLIT_BY_RESUME, STALE, ZERO_SPREAD
from asyncgrpo.core.run import step_queue
from asyncgrpo.core.run.divergence import NONFINITE
from asyncgrpo.shell.rollout import EvalOutcome, GroupOutcome, RolloutProcess
from asyncgrpo.shell.run.metrics_log import TRAINED
from asyncgrpo.shell.run.spread_guard import SpreadGuard

log = structlog.get_logger("asyncgrpo.trainer")


class SampleIntake:
    """The step queue, the prompt cursor and the positions done with, fed by the rollout
    process (rank 0).

    Args:
        start: the prompt cursor to start from (a checkpoint's, or a new one).
        step: the trainer's step now (a sample's staleness counts from it).
        observe: records metrics in the run's window.
        spread: the run's spread guard, shown each group that arrives.
        evaluated: the observations of an evaluation that arrived (the run's evaluations).

    Attributes:
        cursor: the prompt cursor.
        queue: the step queue; None until the run starts (its token budget is the server's).
        process: the rollout process; None until the run starts.
        completions: ``(prompt, completion, reward)`` of the groups since the last logged
            window.
        waited_s: seconds the current step has waited for messages.
    """

    def __init__(
        self,
        start: cursor.PromptCursor,
        step: Callable[[], int],
        observe: Callable[..., None],
        spread: SpreadGuard,
        evaluated: Callable[[EvalOutcome], Sequence[metrics.Observation]],
        max_completion_length: int,
    ) -> None:
        self.cursor = start
        self.queue: step_queue.StepQueue | None = None
        self.process: RolloutProcess | None = None
        self.completions: list[tuple[str, str, float]] = []
        self.waited_s = 0.0
        self._step = step
        self._observe = observe
        self._spread = spread
        self._evaluated = evaluated
        self._max_completion_length = max_completion_length  # stale drops by length
        # tokens of samples a resumed checkpoint kept, which the rollout process never counted
        self._restored_tokens = 0
        self._done: dict[str, list[int]] = {}  # positions done with since the last row, by outcome
        self._warned_split = False  # a group larger than a step was seen (warned once)

    def drain(self, wait_s: float) -> None:
        """Take the rollout process's messages: the first within ``wait_s`` seconds (counted in
        :attr:`waited_s`), then every one already there."""
        assert self.process is not None and self.queue is not None
        asked = time.monotonic()
        message = self.process.get(wait_s)
        self.waited_s += time.monotonic() - asked
        while message is not None:
            if isinstance(message, GroupOutcome):
                self._spread.group_seen(message.observations)
                self.cursor = cursor.group_outcome(
                    self.cursor, message.position, len(message.samples)
                )
                if not message.samples:
                    self._note(message.dropped or ZERO_SPREAD, [message.position])
                self.completions.extend(message.completions)
                self._check_fits_a_step(message.samples)
                self.apply(step_queue.arrive(self.queue, message.samples, self._step()))
            if isinstance(message, EvalOutcome):
                self._observe(*self._evaluated(message))
            else:
                self._observe(*message.observations)
            message = self.process.get(0.0)

    def _check_fits_a_step(self, group: Sequence[TrainingSample]) -> None:
        """Warn, once a run, of a group larger than a step
        (:func:`~asyncgrpo.core.run.step_queue.splits_across_steps`): its last samples are
        trained a step later and, at ``max_staleness``, dropped as stale."""
        assert self.queue is not None
        if self._warned_split or not step_queue.splits_across_steps(self.queue.settings, group):
            return
        self._warned_split = True
        settings = self.queue.settings
        log.warning(
            "a group does not fit one step: its last samples are trained a step later, and "
            "dropped as stale where the group's policy was max_staleness versions behind, so "
            "the longest groups lose samples (sample/length_q4/dropped_stale_count); raise "
            "token_budget or gradient_accumulation_steps until a step holds the longest group",
            samples=len(group),
            tokens=sum(len(s.sequence) for s in group),
            token_budget=settings.token_budget,
            rows_per_step=settings.rows_per_step,
            max_staleness=settings.max_staleness,
        )

    def restore(self, samples: Sequence[TrainingSample]) -> None:
        """Put back on the queue the samples a resumed checkpoint kept (rank 0, before the
        rollout process starts), group by group, within the staleness rule: a sample counts
        the version that generated it, so one too stale for the resumed run is dropped as
        stale. Their positions are pending in the cursor already, so the rollout process does
        not generate them again; it never counted their tokens, so their release is not
        reported to it."""
        assert self.queue is not None
        groups: dict[int, list[TrainingSample]] = {}
        for sample in samples:
            groups.setdefault(sample.prompt_position, []).append(sample)
        for group in groups.values():
            self._record(step_queue.arrive(self.queue, group, self._step()))
        self._restored_tokens = self.queue.buffered_tokens
        log.info(
            "resumed with the checkpoint's queued samples",
            samples=len(samples),
            kept=len(self.queue.buffer),
            groups=len(groups),
        )

    def apply(self, decided: step_queue.Arrival) -> None:
        """Act on the queue's decisions: dropped samples are consumed prompts, counted in the
        metrics and released to the rollout process's pacing.

        Raises:
            ValueError: ``token_budget`` is too small for any sample (names the fix).
        """
        assert self.process is not None
        if self._record(decided):
            self._release(decided.released_tokens)
            self.process.samples_dropped(STALE, len(decided.stale))  # told if the wait grows
            self.process.samples_dropped(OVERSIZE, len(decided.oversize))

    def _release(self, tokens: int) -> None:
        """Report ``tokens`` taken off the queue to the rollout process, less those of the
        restored samples (which are the oldest, so taken first)."""
        assert self.process is not None
        restored = min(tokens, self._restored_tokens)
        self._restored_tokens -= restored
        self.process.samples_taken(tokens - restored)

    def _record(self, decided: step_queue.Arrival) -> bool:
        """Take the queue's decisions into the books: dropped samples are consumed prompts,
        counted in the metrics; whether any was dropped.

        Raises:
            ValueError: ``token_budget`` is too small for any sample (names the fix).
        """
        self.queue = decided.queue
        dropped = (*decided.stale, *decided.oversize)
        if not dropped:
            return False
        self.cursor = cursor.samples_consumed(self.cursor, [s.prompt_position for s in dropped])
        self._note(STALE, [s.prompt_position for s in decided.stale])
        self._note(OVERSIZE, [s.prompt_position for s in decided.oversize])
        if decided.stale:
            self._observe(
                metrics.total("sample/dropped_stale_count", len(decided.stale)),
                *stale_drops_by_length(decided.stale, self._max_completion_length),
            )
        if decided.oversize:
            self._observe(metrics.total("batch/dropped_oversize_count", len(decided.oversize)))
            budget = self.queue.settings.token_budget
            log.warning(
                "dropped samples longer than token_budget",
                count=len(decided.oversize),
                token_budget=budget,
                longest=max(len(s.sequence) for s in decided.oversize),
            )
            if self.queue.budget_too_small:
                raise ValueError(
                    f"token_budget={budget} is too small: the last "
                    f"{self.queue.oversize_in_a_row} samples were all longer (the longest "
                    f"{max(len(s.sequence) for s in decided.oversize)} tokens), so no step "
                    "can be filled; raise token_budget to at least the prompt length plus "
                    "max_completion_length"
                )
        return True

    def take_step(self) -> step_queue.TakenStep:
        """Take the queue's planned step. The rollout process learns of the step before its
        tokens are released, so it never sees room freed without the version it costs
        (:mod:`asyncgrpo.core.rollout.pacing`)."""
        assert self.process is not None and self.queue is not None
        step = step_queue.take_step(self.queue)
        self.queue = step.queue
        self._release(step.released_tokens)
        assert step.queue.tokens_per_step is not None
        self.process.step_consumed(step.queue.tokens_per_step)
        return step

    def trained(self, samples: Sequence[TrainingSample]) -> None:
        """The samples of the step about to train: their prompts are consumed."""
        positions = [s.prompt_position for s in samples]
        self.cursor = cursor.samples_consumed(self.cursor, positions)
        self._note(TRAINED, positions)

    def step_skipped(self) -> None:
        """The step just trained was skipped (its loss or gradient norm was not finite): its
        samples' positions stay consumed, noted as :data:`~asyncgrpo.core.run.divergence.
        NONFINITE` instead of trained."""
        self._note(NONFINITE, self._done.pop(TRAINED, []))

    def drop_split_groups(self, left: dict[int, int]) -> None:
        """Count the samples left of the groups the resumed checkpoint split: they were queued
        when it was written and are gone; the rest of each group was trained, so it is not
        generated again."""
        if not left:
            return
        dropped = [p for p, n in sorted(left.items()) for _ in range(n)]
        self._note(SPLIT_BY_RESUME, dropped)
        self._observe(metrics.total("sample/dropped_split_by_resume_count", len(dropped)))
        log.info(
            "resumed with groups the checkpoint split: their samples left are dropped, "
            "the part trained is not generated again",
            groups=len(left),
            samples=len(dropped),
        )

    def take_done(self) -> dict[str, list[int]]:
        """The prompt positions done with since the last call, by outcome (a row of
        ``positions.jsonl``)."""
        done, self._done = self._done, {}
        return done

    def _note(self, outcome: str, positions: list[int]) -> None:
        if positions:
            self._done.setdefault(outcome, []).extend(positions)
