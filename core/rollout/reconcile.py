"""Turn reconciliation: a rollout's sampling requests -> training sequences.

Each turn re-renders the whole conversation through the chat template, and a template does not
always render a growing conversation the same way (it may drop earlier reasoning), so a turn's
prompt can differ from the tokens held so far. Walking the turns in order:

* a turn whose ``prompt_ids`` start with the held tokens *appends*: the new prompt tail is
  context (untrained), its output tokens are trained (per ``output_mask``);
* any other turn *forks*: the held sequence is closed and a new one starts from this turn's
  prompt, which is all context.

Every generated token is thus trained in exactly one sequence; a fork costs forwarded tokens,
never extra training signal. Sequences without any trained token are dropped.

Example (turn 2 re-renders the held ``5`` as ``6``, so it forks):

    >>> from asyncgrpo.core.records import TurnRecord
    >>> turns = [
    ...     TurnRecord([1, 2], [3], [-0.1]),
    ...     TurnRecord([1, 2, 3, 4], [5], [-0.2]),
    ...     TurnRecord([1, 2, 3, 4, 6, 7], [8], [-0.3]),
    ... ]
    >>> result = reconcile_turns(turns)
    >>> [s.input_ids.tolist() for s in result.sequences]
    [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6, 7, 8]]
    >>> result.forks, result.transitions, result.drift_tokens
    (1, 2, (0, 1))
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from asyncgrpo.core.records import TrainingSequence, TurnRecord
from asyncgrpo.core.sampler_tables import CandidateSets, TopLogprobs


@attrs.frozen
class Reconciled:
    """The training sequences of one rollout and how its turns were reconciled.

    Attributes:
        sequences: the sequences with at least one trained token, in turn order.
        transitions: turn-to-turn transitions (``len(turns) - 1``, 0 for no turns).
        forks: transitions whose prompt did not start with the held tokens.
        drift_tokens: per transition, the held tokens a fork re-rendered (held length minus
            the common prefix with the new prompt); 0 for an append.
    """

    sequences: tuple[TrainingSequence, ...]
    transitions: int
    forks: int
    drift_tokens: tuple[int, ...]


class _Builder:
    """Accumulates one sequence's per-token columns (local to :func:`reconcile_turns`).

    A part without a sampler table (context, or a turn without one) is kept as its token
    count, and padded with missing tables only when some other part has one."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.sampling: list[CandidateSets | int] = []
        self.top: list[TopLogprobs | int] = []
        self.has_sampling = False
        self.has_top = False

    def add_context(self, ids: Sequence[int]) -> None:
        self.ids.extend(ids)
        self.mask.extend([0] * len(ids))
        self.logprobs.extend([0.0] * len(ids))
        self.sampling.append(len(ids))
        self.top.append(len(ids))

    def add_output(self, turn: TurnRecord) -> None:
        n = len(turn.output_ids)
        mask = turn.trained_mask()
        kept = np.array(mask, dtype=np.int8)
        self.mask.extend(mask)
        if turn.output_log_probs:  # one per output token (TurnRecord checks it)
            logprobs = np.where(kept == 1, turn.output_log_probs, 0.0)
            self.logprobs.extend(logprobs.tolist())
        else:
            self.logprobs.extend([0.0] * n)
        sampling, top = turn.output_sampling_mask, turn.output_sampler_logprobs
        self.sampling.append(n if sampling is None else sampling.drop(kept))
        self.top.append(n if top is None else top.drop(kept))
        self.ids.extend(turn.output_ids)
        self.has_sampling |= sampling is not None
        self.has_top |= top is not None

    def build(self) -> TrainingSequence | None:
        if not any(self.mask):
            return None
        sampling = top = None
        if self.has_sampling:
            sampling = CandidateSets.concatenate(
                [CandidateSets.missing(p) if isinstance(p, int) else p for p in self.sampling]
            )
        if self.has_top:
            top = TopLogprobs.concatenate(
                [TopLogprobs.missing(p) if isinstance(p, int) else p for p in self.top]
            )
        return TrainingSequence(
            input_ids=np.array(self.ids, dtype=np.int64),
            trained_mask=np.array(self.mask, dtype=np.int8),
            sampler_logprobs=np.array(self.logprobs, dtype=np.float64),
            sampling_masks=sampling,
            sampler_top_logprobs=top,
        )


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences.

    Example:
        >>> common_prefix_length([1, 2, 3], [1, 2, 4, 5])
        2
    """
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def reconcile_turns(turns: Sequence[TurnRecord]) -> Reconciled:
    """Reconcile a rollout's turns into training sequences (append or fork, see module doc).

    Args:
        turns: the rollout's sampling requests, in order.

    Returns:
        The sequences (each generated token trained in exactly one of them, per its
        ``output_mask``) and the fork statistics behind ``rollout/fork_frac`` and
        ``rollout/drift_tokens_*``.
    """
    sequences: list[TrainingSequence] = []
    drift: list[int] = []
    builder: _Builder | None = None
    for turn in turns:
        if builder is not None:
            shared = common_prefix_length(builder.ids, turn.prompt_ids)
            if shared == len(builder.ids):
                drift.append(0)
                builder.add_context(turn.prompt_ids[shared:])
                builder.add_output(turn)
                continue
            drift.append(len(builder.ids) - shared)
            finished = builder.build()
            if finished is not None:
                sequences.append(finished)
        builder = _Builder()
        builder.add_context(turn.prompt_ids)
        builder.add_output(turn)
    if builder is not None:
        finished = builder.build()
        if finished is not None:
            sequences.append(finished)
    return Reconciled(
        sequences=tuple(sequences),
        transitions=len(drift),
        forks=sum(1 for d in drift if d > 0),
        drift_tokens=tuple(drift),
    )
