"""The trainer's sample queue as a pure state machine: arrival, staleness, planning, steps.

Samples arrive group by group (:func:`arrive`). Each one is, exactly once,

* dropped as **oversize** on arrival when longer than ``token_budget`` (it fits no row);
* dropped as **stale** when more than ``max_staleness`` weight updates behind the trainer's
  version, on arrival or when the version advances (:func:`advance`);
* or **trained**: it waits in the buffer (oldest policy first, so a group that finished late
  does not queue behind a newer policy's), is offered to the incremental planner
  (:class:`~asyncgrpo.core.run.planner.PlanState`) and leaves with the step that placed it
  (:func:`take_step`).

The plan is kept up to date as samples arrive: adding a sample looks at the open micro-batch
only, and once the step is full later samples wait unplanned. So the planning work per step
grows with the samples that step takes, not with the buffer. The plan always equals
:func:`~asyncgrpo.core.run.planner.plan_step` of the buffer.

**Pacing.** The generator (:mod:`asyncgrpo.core.rollout.pacing`) counts a sample's tokens from the
moment its group finishes until the queue *releases* them (trained or dropped): queued,
buffered and in flight together stay within ``steps_left x tokens_per_step``. The
queue owns ``tokens_per_step``: the unpacked tokens a full step holds, measured on each step (a
step that did not fill up counts as holding as many more samples of its mean size as would
fit whole into its rows' room left); the allowance uses ``STEP_MARGIN`` of the
smallest of the last ``RECENT_STEPS``, so that what the generator may hold fits the next steps
despite the packing's variation from step to step, and fewer steps of it while the server's
policy lags the steps taken (:func:`~asyncgrpo.core.rollout.pacing.steps_left`). A step is
taken when the plan is full, or when the generator can add no group (nothing in flight, and
the buffer plus the largest group seen exceed the allowance it has now), so the two sides
never wait on each other and a step does not leave behind a group about to arrive.

Nothing here reads a clock or talks to a process: the trainer and ``asyncgrpo simulate`` feed
arrivals in and act on the decisions that come out.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence

import attrs

from asyncgrpo.core.records import TrainingSample
from asyncgrpo.core.rollout import pacing
from asyncgrpo.core.run.planner import PlanState, add_sample, plan_step

OVERSIZE_IN_A_ROW_LIMIT = 64
STEP_MARGIN = 0.9
RECENT_STEPS = 4


@attrs.frozen
class QueueSettings:
    """The config values the queue decides with.

    Attributes:
        token_budget: forwarded tokens per row.
        num_processes: rows per micro-batch (trainer processes).
        gradient_accumulation_steps: micro-batches per step.
        max_staleness: weight updates a sample may lag behind and still be trained.
    """

    token_budget: int
    num_processes: int
    gradient_accumulation_steps: int
    max_staleness: int

    @property
    def rows_per_step(self) -> int:
        return self.num_processes * self.gradient_accumulation_steps

    def empty_plan(self) -> PlanState:
        return PlanState(self.token_budget, self.num_processes, self.gradient_accumulation_steps)


@attrs.frozen(eq=False)
class StepQueue:
    """The queue's state.

    Attributes:
        settings: see :class:`QueueSettings`.
        buffer: samples waiting, oldest policy first (arrival order within a policy version);
            the plan's samples are its first ones.
        plan: the next step's plan over ``buffer`` (the first ``plan.placed`` samples).
        offered: buffer samples the plan has looked at (the rest arrived after it filled).
        buffered_tokens: unpacked tokens in ``buffer``.
        version: the trainer's version the buffer was last checked against for staleness.
        tokens_per_step: the generator's step size (module docstring); None before a step.
        recent_steps: the measured sizes of the last ``RECENT_STEPS`` steps.
        largest_group_tokens: the most tokens one arriving group brought.
        oversize_in_a_row: samples dropped as oversize since the last one that fit.
    """

    settings: QueueSettings
    buffer: tuple[TrainingSample, ...] = ()
    plan: PlanState = attrs.field(default=None)
    offered: int = 0
    buffered_tokens: int = 0
    version: int = 0
    tokens_per_step: float | None = None
    recent_steps: tuple[float, ...] = ()
    largest_group_tokens: int = 0
    oversize_in_a_row: int = 0

    def __attrs_post_init__(self) -> None:
        if self.plan is None:
            object.__setattr__(self, "plan", self.settings.empty_plan())

    def allowance_behind(self, behind: int) -> float:
        """Tokens the generator may hold queued, buffered and in flight while the server's
        policy is ``behind`` versions behind the steps taken
        (:func:`~asyncgrpo.core.rollout.pacing.steps_left`)."""
        s = self.settings
        return pacing.token_allowance(
            self.tokens_per_step, s.max_staleness, s.token_budget, s.rows_per_step, behind
        )

    @property
    def budget_too_small(self) -> bool:
        """True once ``OVERSIZE_IN_A_ROW_LIMIT`` samples in a row were longer than
        ``token_budget``: no step can be filled, so the run must stop with an error."""
        return self.oversize_in_a_row >= OVERSIZE_IN_A_ROW_LIMIT


@attrs.frozen
class Arrival:
    """What :func:`arrive` decided.

    Attributes:
        queue: the new state.
        stale: samples dropped as stale (arrivals and buffered ones).
        oversize: arrivals dropped as longer than ``token_budget``.
    """

    queue: StepQueue
    stale: tuple[TrainingSample, ...] = ()
    oversize: tuple[TrainingSample, ...] = ()

    @property
    def released_tokens(self) -> int:
        """Tokens the generator may count as consumed (the dropped samples')."""
        return _tokens(self.stale) + _tokens(self.oversize)


@attrs.frozen
class TakenStep:
    """One step's samples, as planned.

    Attributes:
        queue: the state after the step left.
        micro_batches: per micro-batch, one tuple of samples per process (maybe empty).
        forwarded_tokens: the step's tokens with shared prefixes counted once.
        full: whether the step filled up (else the generator could add no group).
    """

    queue: StepQueue
    micro_batches: tuple[tuple[tuple[TrainingSample, ...], ...], ...]
    forwarded_tokens: int
    full: bool

    @property
    def samples(self) -> tuple[TrainingSample, ...]:
        """The step's samples, row by row."""
        return tuple(s for mb in self.micro_batches for row in mb for s in row)

    @property
    def released_tokens(self) -> int:
        """Unpacked tokens of the step's samples (the generator counts them consumed)."""
        return _tokens(self.samples)


def _tokens(samples: Sequence[TrainingSample]) -> int:
    return sum(len(s.sequence) for s in samples)


def _offer(queue: StepQueue) -> StepQueue:
    """Offer buffered samples to the plan until it is full or has seen them all."""
    plan, offered = queue.plan, queue.offered
    while offered < len(queue.buffer) and not plan.full:
        plan = add_sample(plan, queue.buffer[offered])
        offered += 1
    return attrs.evolve(queue, plan=plan, offered=offered)


def _replanned(queue: StepQueue, buffer: tuple[TrainingSample, ...], tokens: int) -> StepQueue:
    """``queue`` with ``buffer`` (holding ``tokens``) planned afresh."""
    fresh = attrs.evolve(
        queue, buffer=buffer, plan=queue.settings.empty_plan(), offered=0, buffered_tokens=tokens
    )
    return _offer(fresh)


def advance(queue: StepQueue, version: int) -> Arrival:
    """Move to the trainer's ``version``; buffered samples now too stale are dropped.

    Example:
        >>> from asyncgrpo.core.records import TrainingSample, TrainingSequence
        >>> seq = TrainingSequence([1, 2, 3], [0, 1, 1], [0.0, -1.0, -1.0])
        >>> q = arrive(StepQueue(QueueSettings(8, 1, 1, 1)),
        ...            [TrainingSample(seq, 1.0, 0, 0, 0, 0, "r")], version=0).queue
        >>> len(advance(q, 1).stale), len(advance(q, 2).stale)
        (0, 1)
    """
    if version == queue.version:
        return Arrival(queue)
    limit = queue.settings.max_staleness
    stale = tuple(s for s in queue.buffer if s.staleness(version) > limit)
    queue = attrs.evolve(queue, version=version)
    if not stale:
        return Arrival(queue)
    fresh = tuple(s for s in queue.buffer if s.staleness(version) <= limit)
    return Arrival(_replanned(queue, fresh, _tokens(fresh)), stale=stale)


def arrive(queue: StepQueue, group: Sequence[TrainingSample], version: int) -> Arrival:
    """One group's samples arrive while the trainer is at ``version``.

    Oversize and stale samples are dropped; the rest join the buffer and the plan. A group
    may be empty (filtered, or dropped for zero reward spread).
    """
    moved = advance(queue, version)
    queue = moved.queue
    limit = queue.settings.max_staleness
    oversize = tuple(s for s in group if len(s.sequence) > queue.settings.token_budget)
    fitting = [s for s in group if len(s.sequence) <= queue.settings.token_budget]
    stale = tuple(s for s in fitting if s.staleness(version) > limit)
    kept = tuple(s for s in fitting if s.staleness(version) <= limit)
    in_a_row = queue.oversize_in_a_row
    for s in group:
        in_a_row = in_a_row + 1 if len(s.sequence) > queue.settings.token_budget else 0
    buffer, first_moved = _in_policy_order(queue.buffer, kept)
    queue = attrs.evolve(
        queue,
        buffer=buffer,
        buffered_tokens=queue.buffered_tokens + _tokens(kept),
        largest_group_tokens=max(queue.largest_group_tokens, _tokens(group)),
        oversize_in_a_row=in_a_row,
    )
    if first_moved < queue.offered:  # an older policy's samples go ahead of planned ones
        queue = _replanned(queue, queue.buffer, queue.buffered_tokens)
    return Arrival(_offer(queue), stale=moved.stale + stale, oversize=oversize)


def _in_policy_order(
    buffer: tuple[TrainingSample, ...], kept: tuple[TrainingSample, ...]
) -> tuple[tuple[TrainingSample, ...], int]:
    """``buffer`` with ``kept`` added in policy order (oldest ``model_version`` first, arrival
    order within a version), and the first index whose sample changed (``len(buffer)`` when
    ``kept`` only extends it).

    Groups finish out of order: one started under an older policy can arrive after groups of a
    newer one. The generator admitted the newer groups counting the older one as ahead of them,
    with the newer policy's later deadline, so queued behind them it could miss its own."""
    versions = [s.model_version for s in (*buffer[-1:], *kept)]
    if all(a <= b for a, b in itertools.pairwise(versions)):
        return buffer + kept, len(buffer)
    merged = tuple(sorted(buffer + kept, key=lambda s: s.model_version))  # stable
    moved = (i for i, (a, b) in enumerate(zip(buffer, merged, strict=False)) if a is not b)
    return merged, next(moved, len(buffer))


@attrs.frozen
class InFlight:
    """The groups the generator has started and not yet delivered, as the trainer sees them.

    Attributes:
        groups: groups in flight.
        oldest_version: the policy version of the oldest group in flight; ``None`` when none.
        at_oldest: groups in flight under that version.
    """

    groups: int = 0
    oldest_version: int | None = None
    at_oldest: int = 0

    @classmethod
    def of(cls, versions: Iterable[int]) -> InFlight:
        """The groups in flight under these policy versions (one per group).

        Example:
            >>> InFlight.of([3, 2, 4, 2])
            InFlight(groups=4, oldest_version=2, at_oldest=2)
        """
        versions = list(versions)
        if not versions:
            return cls()
        oldest = min(versions)
        return cls(len(versions), oldest, versions.count(oldest))


NONE_IN_FLIGHT = InFlight()


def splits_across_steps(settings: QueueSettings, group: Sequence[TrainingSample]) -> bool:
    """Whether ``group``'s samples (those within ``token_budget``) cannot all go into one
    step, even an empty one: then every such group is split, its last samples trained a step
    after the others, one version staler, and dropped as stale when the step before took the
    group at ``max_staleness``. A task whose long groups are larger than a step loses their
    samples most (``sample/length_q4/dropped_stale_count``); a step that holds them
    (``token_budget`` or ``gradient_accumulation_steps`` raised) does not.

    Example:
        >>> from asyncgrpo.core.records import TrainingSequence
        >>> def sample(first):  # the group's prompt [1, 2], then 4 tokens of its own
        ...     seq = TrainingSequence([1, 2, first, 5, 5, 5], [0, 0, 1, 1, 1, 1], [0.0] * 6)
        ...     return TrainingSample(seq, 1.0, 0, 0, 0, 0, "r")
        >>> group = [sample(first) for first in (3, 4, 6)]  # 1 + 3 x 5 = 16 tokens packed
        >>> [splits_across_steps(QueueSettings(b, 1, 1, 1), group) for b in (15, 16)]
        [True, False]
        >>> splits_across_steps(QueueSettings(15, 1, 2, 1), group)  # two rows a step
        False
    """
    # a micro-batch closes only once each of its rows holds a sample, so a group of no more
    # samples than a step has rows fits: no planning (a large run's step has many rows)
    if sum(len(s.sequence) <= settings.token_budget for s in group) <= settings.rows_per_step:
        return False
    plan = plan_step(
        group, settings.token_budget, settings.num_processes, settings.gradient_accumulation_steps
    )
    return bool(plan.leftover)


def ready(queue: StepQueue, in_flight: InFlight, *, behind: int) -> bool:
    """Whether a step should be taken now: the plan is full, or the generator can start no
    group (no group in flight, and buffered tokens plus the largest group exceed the
    allowance it has while the server's policy is ``behind`` versions behind the steps taken,
    :meth:`StepQueue.allowance_behind`) and the buffer holds something to train. Judged with
    the generator's own allowance, neither side waits on the other: with a smaller one the
    generator could be stopped while the trainer waits for more. Not while older groups in
    flight need this step's room (:func:`waits_for_older_groups`)."""
    if waits_for_older_groups(queue, in_flight):
        return False
    if queue.plan.full:
        return True
    return (
        bool(queue.buffer)
        and in_flight.groups == 0
        and queue.buffered_tokens + queue.largest_group_tokens > queue.allowance_behind(behind)
    )


def waits_for_older_groups(queue: StepQueue, in_flight: InFlight) -> bool:
    """Whether the step about to be taken (at the queue's ``version``) should wait for the
    oldest groups in flight: its plan holds samples of a newer policy (or room left), and
    the steps left before those groups are too stale cannot hold them.

    Groups finish out of order: ones started under an older policy can still be generating
    while newer groups fill a step. The buffer keeps the oldest policy first, so once they
    arrive they go ahead of newer samples; but a step taken before they arrive trains the
    newer samples in their place, and the ``max_staleness`` versions they may lag end
    before the steps after it can take them all (each step holds ``tokens_per_step``, a
    group in flight is counted as the largest seen). Waiting costs the time they have left.
    A step whose plan holds no sample newer than them does not wait: those would still be
    ahead of them.

    Example:
        >>> from asyncgrpo.core.records import TrainingSample, TrainingSequence
        >>> def new(token):  # a 3-token sample of policy 1
        ...     seq = TrainingSequence([1, 2, token], [0, 1, 1], [0.0, -1.0, -1.0])
        ...     return TrainingSample(seq, 1.0, 1, 0, 0, 0, "r")
        >>> q = arrive(StepQueue(QueueSettings(3, 1, 1, 1)), [new(3), new(4)], version=1).queue
        >>> q.plan.full, [waits_for_older_groups(q, InFlight(1, v, 1)) for v in (0, 1)]
        (True, [True, False])
        >>> waits_for_older_groups(q, NONE_IN_FLIGHT)
        False
    """
    version = in_flight.oldest_version
    if version is None:
        return False
    steps_after = version + queue.settings.max_staleness - queue.version
    if steps_after < 0:  # too stale whenever they come
        return False
    plan = queue.plan
    if not plan.full:
        return True
    if queue.buffer[plan.placed - 1].model_version <= version:
        return False
    step = queue.tokens_per_step
    if step is None:
        step = float(queue.settings.token_budget * queue.settings.rows_per_step)
    return in_flight.at_oldest * queue.largest_group_tokens > steps_after * step


def take_step(queue: StepQueue) -> TakenStep:
    """Take the planned step out of the queue (call when :func:`ready`); the rest is planned
    afresh for the next step, which looks only at the samples that step can take."""
    plan = queue.plan
    if plan.placed == 0:
        raise ValueError("take_step: the queue holds no sample to train")
    micro_batches = tuple(
        tuple(tuple(queue.buffer[i] for i in row.samples) for row in mb)
        for mb in plan.micro_batches
    )
    forwarded = sum(row.tokens for mb in plan.micro_batches for row in mb)
    unpacked = _tokens(queue.buffer[: plan.placed])
    measured = float(unpacked) if plan.full else _full_size(plan, unpacked, forwarded)
    recent = (*queue.recent_steps, measured)[-RECENT_STEPS:]
    rest = _replanned(queue, queue.buffer[plan.placed :], queue.buffered_tokens - unpacked)
    rest = attrs.evolve(rest, tokens_per_step=STEP_MARGIN * min(recent), recent_steps=recent)
    return TakenStep(rest, micro_batches, forwarded, plan.full)


def _full_size(plan: PlanState, unpacked: int, forwarded: int) -> float:
    """Unpacked tokens a step that did not fill up would have held full: its samples and as
    many more of their mean forwarded size as fit whole into the room left (each open row's
    free tokens and the micro-batches not opened yet; a closed micro-batch takes no more)."""
    mean = forwarded / plan.placed
    budget = plan.token_budget
    unopened = plan.gradient_accumulation_steps - len(plan.closed) - 1
    more = sum(math.floor((budget - row.tokens) / mean) for row in plan.rows)
    more += unopened * plan.num_processes * math.floor(budget / mean)
    return unpacked * (plan.placed + more) / plan.placed
