"""Which checkpoint a run resumes from, and which ones ``save_total_limit`` deletes.

The shell describes each checkpoint directory of a run by a :class:`SavedCheckpoint`: its step,
whether its save finished (``checkpoint-N/`` rather than ``checkpoint-N.partial/``), and what is
wrong with its files, if anything (the shell's checks name the file). A checkpoint is *complete*
when its save finished and nothing is wrong with it. Only complete checkpoints are resumed from
and only they count toward ``save_total_limit``, so a damaged checkpoint is never the one kept
while the last complete one is deleted.

Example:
    >>> saved = [SavedCheckpoint(1), SavedCheckpoint(2),
    ...          SavedCheckpoint(3, problem="checkpoint-3/dcp/.metadata: missing")]
    >>> choice = choose_resume(saved)
    >>> choice.checkpoint.step, [s.step for s in choice.skipped]
    (2, [3])
    >>> [s.step for s in to_rotate(saved, keep=1)]
    [1]
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

UNFINISHED = "a save that did not finish (.partial)"


@attrs.frozen
class SavedCheckpoint:
    """One checkpoint directory of a run, as the shell found it.

    Attributes:
        step: the optimizer step it was saved after (``checkpoint-<step>``).
        finished: False for a ``.partial`` directory (a save that did not finish).
        problem: what is wrong with its files (naming the file), or None when every check
            passed; None is also given for a ``.partial`` directory, which is never checked.
    """

    step: int = attrs.field(validator=attrs.validators.ge(0))
    finished: bool = True
    problem: str | None = None

    @property
    def complete(self) -> bool:
        """Whether it can be resumed from: its save finished and its files check."""
        return self.finished and self.problem is None

    @property
    def why_not_complete(self) -> str | None:
        """Why it cannot be resumed from, or None when it is complete."""
        return UNFINISHED if not self.finished else self.problem


@attrs.frozen
class ResumeChoice:
    """The checkpoint to resume from and the newer ones passed over.

    Attributes:
        checkpoint: the newest complete checkpoint; None when there is none.
        skipped: the checkpoints newer than it (all of them when there is none), which are
            not complete, newest first.
    """

    checkpoint: SavedCheckpoint | None
    skipped: tuple[SavedCheckpoint, ...]


def newest_first(saved: Sequence[SavedCheckpoint]) -> list[SavedCheckpoint]:
    """``saved`` from the newest: by step, and for one step the ``.partial`` directory (a
    later save of that step that did not finish) before the finished one."""
    return sorted(saved, key=lambda s: (s.step, not s.finished), reverse=True)


def choose_resume(saved: Sequence[SavedCheckpoint]) -> ResumeChoice:
    """The newest complete checkpoint of ``saved`` and the ones newer than it.

    Only the checkpoints at or above the chosen one matter, so a caller that checks the
    checkpoints newest first may stop at the first complete one and pass those it checked.
    """
    skipped: list[SavedCheckpoint] = []
    for checkpoint in newest_first(saved):
        if checkpoint.complete:
            return ResumeChoice(checkpoint, tuple(skipped))
        skipped.append(checkpoint)
    return ResumeChoice(None, tuple(skipped))


def to_rotate(saved: Sequence[SavedCheckpoint], keep: int | None) -> tuple[SavedCheckpoint, ...]:
    """The checkpoints ``save_total_limit=keep`` deletes, oldest first.

    The newest ``keep`` complete checkpoints stay; every finished one older than the newest
    complete one and not among them goes, complete or not. Checkpoints newer than the newest
    complete one stay (a damaged one is left for a person to look at; the next save of its
    step replaces it), and so do ``.partial`` directories (the run removes those when it
    starts). Without a complete checkpoint nothing goes. ``keep`` None or 0: no limit.

    Raises:
        ValueError: ``keep`` is negative, or two finished checkpoints share a step.
    """
    if keep is not None and keep < 0:
        raise ValueError(f"save_total_limit must be None or >= 0, got {keep}")
    if not keep:
        return ()
    finished = sorted((s for s in saved if s.finished), key=lambda s: s.step)
    steps = [s.step for s in finished]
    if len(set(steps)) != len(steps):
        raise ValueError(f"two finished checkpoints share a step: {steps}")
    complete = [s for s in finished if s.complete]
    if not complete:
        return ()
    kept = {s.step for s in complete[-keep:]}
    newest = complete[-1].step
    return tuple(s for s in finished if s.step not in kept and s.step <= newest)
