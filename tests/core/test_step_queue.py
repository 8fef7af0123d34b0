from collections import Counter

import attrs
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from packing_strategies import make_sample

from asyncgrpo.core.rollout import pacing
from asyncgrpo.core.run.planner import plan_step
from asyncgrpo.core.run.step_queue import (
    NONE_IN_FLIGHT,
    OVERSIZE_IN_A_ROW_LIMIT,
    STEP_MARGIN,
    InFlight,
    QueueSettings,
    StepQueue,
    advance,
    arrive,
    ready,
    splits_across_steps,
    take_step,
)

queue_settings = st.builds(
    QueueSettings,
    token_budget=st.integers(4, 40),
    num_processes=st.integers(1, 3),
    gradient_accumulation_steps=st.integers(1, 3),
    max_staleness=st.integers(0, 3),
)


@st.composite
def groups(draw, group_id: int, version: int, max_size: int = 5, max_len: int = 24):
    """One group: a shared prompt, completions from a small vocabulary (prefixes collide)."""
    prompt = draw(st.lists(st.integers(0, 3), min_size=1, max_size=8))
    members = []
    for member in range(draw(st.integers(0, max_size))):
        completion = draw(st.lists(st.integers(0, 3), max_size=max_len - len(prompt)))
        tokens = prompt + completion
        sample = make_sample(
            tokens,
            [0] * len(prompt) + [1] * len(completion),
            group_id,
            rollout=f"{group_id}-{member}",
        )
        members.append(attrs.evolve(sample, model_version=version, prompt_position=group_id))
    return members


@st.composite
def runs(draw):
    """A queue's settings and a script: each entry is a group arriving (its samples started
    at a version at most 4 behind) or ``None``, a step taken if anything is planned."""
    config = draw(queue_settings)
    script, version = [], 0
    for group_id in range(draw(st.integers(1, 25))):
        if draw(st.booleans()):
            script.append(None)
            version += 1
        lag = draw(st.integers(0, 4))
        script.append(draw(groups(group_id, max(0, version - lag))))
    return config, script


def _play(config, script):
    """Drive the queue through the script; returns (queue, trained, stale, oversize)."""
    queue, version = StepQueue(config), 0
    trained, stale, oversize = [], [], []
    for entry in script:
        if entry is None:
            if queue.plan.placed:
                step = take_step(queue)
                queue = step.queue
                trained += step.samples
                version += 1
            continue
        decided = arrive(queue, entry, version)
        queue = decided.queue
        stale += decided.stale
        oversize += decided.oversize
    return queue, trained, stale, oversize, version


@given(runs())
def test_every_sample_is_trained_dropped_stale_or_oversize_or_waits_exactly_once(run) -> None:
    config, script = run
    queue, trained, stale, oversize, version = _play(config, script)
    arrived = [s.rollout_id for group in script if group is not None for s in group]
    outcomes = [s.rollout_id for s in (*trained, *stale, *oversize, *queue.buffer)]
    assert Counter(outcomes) == Counter(arrived)
    assert all(len(s.sequence) > config.token_budget for s in oversize)
    assert all(len(s.sequence) <= config.token_budget for s in (*trained, *queue.buffer))
    assert all(s.staleness(version) <= config.max_staleness for s in queue.buffer)
    assert queue.buffered_tokens == sum(len(s.sequence) for s in queue.buffer)


@given(runs())
def test_the_incremental_plan_equals_a_fresh_plan_of_the_buffer(run) -> None:
    config, script = run
    queue = _play(config, script)[0]
    fresh = plan_step(
        queue.buffer, config.token_budget, config.num_processes, config.gradient_accumulation_steps
    )
    assert queue.plan.micro_batches == fresh.micro_batches
    assert queue.plan.full == fresh.complete
    assert queue.plan.placed == len(fresh.placed)


@given(runs())
def test_a_step_trains_what_a_fresh_plan_of_the_buffer_places(run) -> None:
    config, script = run
    queue = _play(config, script)[0]
    if not queue.plan.placed:
        with pytest.raises(ValueError, match="no sample"):
            take_step(queue)
        return
    fresh = plan_step(
        queue.buffer, config.token_budget, config.num_processes, config.gradient_accumulation_steps
    )
    step = take_step(queue)
    expected = [
        [[queue.buffer[i] for i in row.samples] for row in mb] for mb in fresh.micro_batches
    ]
    assert [[list(row) for row in mb] for mb in step.micro_batches] == expected
    assert step.forwarded_tokens == sum(row.tokens for mb in fresh.micro_batches for row in mb)
    assert step.queue.buffer == tuple(queue.buffer[i] for i in fresh.leftover)


def test_advancing_the_version_drops_buffered_samples_that_became_stale() -> None:
    config = QueueSettings(64, 1, 1, max_staleness=1)
    old = [attrs.evolve(make_sample([1, 2, 3], [0, 1, 1], 0), model_version=0)]
    new = [attrs.evolve(make_sample([1, 2, 4], [0, 1, 1], 1), model_version=1)]
    queue = arrive(arrive(StepQueue(config), old, 1).queue, new, 1).queue
    assert len(queue.buffer) == 2
    moved = advance(queue, 2)
    assert moved.stale == tuple(old) and moved.queue.buffer == tuple(new)
    assert moved.released_tokens == 3 and moved.queue.buffered_tokens == 3


def test_a_budget_no_sample_fits_is_decided_after_a_run_of_oversize_samples() -> None:
    queue = StepQueue(QueueSettings(4, 1, 1, 1))
    long = [make_sample(range(8), [0] + [1] * 7, g) for g in range(OVERSIZE_IN_A_ROW_LIMIT)]
    for sample in long[:-1]:
        queue = arrive(queue, [sample], 0).queue
    assert not queue.budget_too_small
    assert arrive(queue, [make_sample([1, 2], [0, 1])], 0).queue.oversize_in_a_row == 0
    assert arrive(queue, long[-1:], 0).queue.budget_too_small


@given(queue_settings, st.integers(1, 40), st.data())
def test_a_step_that_did_not_fill_up_measures_the_full_step_of_its_samples(config, length, data):
    """Samples of one length sharing nothing: a step that took some of them counts as the full
    step of such samples would (each row holds ``token_budget // length``), not as rows filled
    to the last token, which samples that do not tile a row never reach."""
    length = min(length, config.token_budget)

    def sample(n: int):
        return make_sample(
            [n + 1000 * k for k in range(length)], [0] + [1] * (length - 1), n, rollout=str(n)
        )

    full = plan_step(
        [sample(n) for n in range(1_000)],
        config.token_budget,
        config.num_processes,
        config.gradient_accumulation_steps,
    )
    count = data.draw(st.integers(1, len(full.placed)))
    queue = arrive(StepQueue(config), [sample(n) for n in range(count)], 0).queue
    step = take_step(queue)
    assert step.full == (count > len(full.placed))
    measured = step.queue.tokens_per_step / STEP_MARGIN
    assert measured == pytest.approx(len(full.placed) * length)


@st.composite
def pipelines(draw, max_staleness: int | None = None, uniform: bool = False):
    """Settings, group shapes and a random interleaving of the two sides' actions (groups
    finish oldest first or, with ``finish_newest``, out of order). With ``uniform`` every
    group has the same shape and fits one row (a steady state)."""
    config = draw(queue_settings.filter(lambda c: c.token_budget >= 12))
    if max_staleness is not None:
        config = attrs.evolve(config, max_staleness=max_staleness)
    if uniform:
        length = draw(st.integers(2, 12))
        sizes = [draw(st.integers(1, config.token_budget // length))]
        lengths = [length]
    else:
        sizes = draw(st.lists(st.integers(0, 6), min_size=1, max_size=40))
        lengths = draw(st.lists(st.integers(2, 12), min_size=1, max_size=40))
    actions = ["start", "finish", "finish_newest", "train", "publish"]
    choices = draw(st.lists(st.sampled_from(actions), min_size=50, max_size=400))
    return config, sizes, lengths, choices


@attrs.define
class _Sides:
    """Generation (the pacing ledger) and the trainer's queue. The trainer takes a step
    (``steps`` counts them), and only after training it publishes the weights: new groups
    get ``version`` (the policy the server holds). By default it publishes before it takes the
    next step. With ``late_pushes`` the push runs beside the next steps, as the trainer's
    overlapped push does: a step does not wait for it, one push is in flight at a time, a
    step taken meanwhile replaces the snapshot waiting to go next, a push lands whenever
    ``publish`` comes, and pushes follow every ``sync_every``-th step (weight_sync_steps); the
    queue checks staleness against the steps taken, as the trainer does."""

    config: QueueSettings
    sizes: list
    lengths: list
    ledger: pacing.GenerationLedger = attrs.field(factory=pacing.GenerationLedger)
    queue: StepQueue = None
    in_flight: list = attrs.field(factory=list)  # (policy version, samples) per group
    version: int = 0
    steps: int = 0
    started: int = 0
    stale: list = attrs.field(factory=list)
    distinct: bool = False
    late_pushes: bool = False
    sync_every: int = 1
    guessed: set = attrs.field(factory=set)
    pushing: int | None = None
    waiting: int | None = None

    def __attrs_post_init__(self) -> None:
        self.queue = StepQueue(self.config)

    def may_start(self) -> bool:
        return pacing.may_start_group(
            self.ledger,
            self.queue.allowance_behind(self.behind),
            behind=self.behind,
            max_staleness=self.config.max_staleness,
        )

    def group(self) -> list:
        """The next group. Its samples share one prompt token; with ``distinct`` nothing else
        is shared (every step packs alike), else prompts and completions collide."""
        n, size = self.started, self.sizes[self.started % len(self.sizes)]
        length = self.lengths[n % len(self.lengths)]
        members = []
        for m in range(size):
            completion = (
                range(100 * (m + 1), 100 * (m + 1) + length - 1)
                if self.distinct
                else range(1, length)
            )
            prompt = 1000 + n if self.distinct else n % 7
            sample = make_sample(
                [prompt, *completion], [0] + [1] * (length - 1), n, rollout=f"{n}-{m}"
            )
            members.append(attrs.evolve(sample, model_version=self.version))
        return members

    def act(self, choice: str) -> None:
        if choice == "start" and self.may_start():
            outstanding = self.ledger.queued_tokens + self.ledger.in_flight_tokens()
            if self.ledger.groups_completed and outstanding:
                allowance = self.queue.allowance_behind(self.behind)
                assert outstanding + self.ledger.largest_group_tokens <= allowance
            self.ledger = pacing.group_started(self.ledger)
            self.in_flight.append((self.version, self.group()))
            if self.queue.tokens_per_step is None:  # admitted on the first step's guess
                self.guessed.add(self.started)
            self.started += 1
        elif choice in ("finish", "finish_newest") and self.in_flight:
            _, samples = self.in_flight.pop(0 if choice == "finish" else -1)
            self.ledger = pacing.group_finished(self.ledger, sum(len(s.sequence) for s in samples))
            self.apply(arrive(self.queue, samples, self.checked_at))
        elif (
            choice == "train" and (self.late_pushes or self.steps == self.version) and self.ready()
        ):
            self.apply(advance(self.queue, self.steps))
            if not self.ready():
                return
            step = take_step(self.queue)
            self.queue, self.steps = step.queue, self.steps + 1
            self.ledger = pacing.samples_taken(self.ledger, step.released_tokens)
            if self.steps % self.sync_every:
                return
            if self.pushing is None:
                self.pushing = self.steps
            else:
                self.waiting = self.steps
        elif choice == "publish" and self.late_pushes and self.pushing is not None:
            self.version, self.pushing, self.waiting = self.pushing, self.waiting, None
        elif choice == "publish" and not self.late_pushes and self.steps > self.version:
            self.version = self.steps
            self.apply(advance(self.queue, self.version))

    def ready(self) -> bool:
        in_flight = InFlight.of(version for version, _ in self.in_flight)
        return ready(self.queue, in_flight, behind=self.behind)

    @property
    def behind(self) -> int:
        return self.steps - self.version

    @property
    def checked_at(self) -> int:
        """The version arrivals are checked against: the steps taken, or with pushes in
        step, the version published (the same once published)."""
        return self.steps if self.late_pushes else self.version

    def apply(self, decided) -> None:
        self.queue = decided.queue
        self.stale += decided.stale
        self.ledger = pacing.samples_taken(self.ledger, decided.released_tokens)


@settings(max_examples=150)
@given(pipelines())
def test_generator_and_queue_never_wait_on_each_other_and_stay_within_the_allowance(case):
    """Generation and the trainer's queue, interleaved at random: the ledger's outstanding
    tokens equal what the queue holds once nothing is in transit, an admitted group keeps the
    expected total within the allowance, and whenever nothing is in flight, the weights are
    published and no group may start, the queue is ready to take a step (no deadlock)."""
    config, sizes, lengths, choices = case
    sides = _Sides(config, sizes, lengths)
    for choice in [*choices, *["finish"] * 50]:
        sides.act(choice)
        if not sides.in_flight:
            assert sides.ledger.queued_tokens == sides.queue.buffered_tokens
            if sides.steps == sides.version and not sides.may_start():
                assert ready(sides.queue, NONE_IN_FLIGHT, behind=0)


@settings(max_examples=150)
@given(pipelines(max_staleness=0, uniform=True))
def test_at_staleness_0_no_sample_is_dropped_stale_in_steady_state(case):
    """``max_staleness=0``, every group the same shape (fitting one row, sharing only its
    prompt), the two sides interleaved at random: while a step trains and until its weights
    are published no group starts, and once the step size is measured (after the first step,
    whose size is a guess) no more is generated than the next step takes, so no sample is
    dropped as stale."""
    config, sizes, lengths, choices = case
    sides = _Sides(config, sizes, lengths, distinct=True)
    for choice in [*choices, *["finish"] * 50]:
        first_step = sides.steps <= 1
        dropped = len(sides.stale)
        sides.act(choice)
        if not first_step:
            assert len(sides.stale) == dropped, f"stale at step {sides.steps}: {sides.stale}"


def _choices(*runs: tuple[str, int]) -> list[str]:
    return [choice for choice, times in runs for _ in range(times)]


# falsifying examples hypothesis found, each with one part of the queue taken away: groups
# that finish late queued behind a newer policy's; a step taken with a newer policy's samples
# while the oldest group in flight could only be trained in it; and one taken while the steps
# left before the oldest groups go stale could not hold them all
_BEHIND_A_NEWER_POLICY = (
    (
        QueueSettings(28, 1, 3, 0),
        [7],
        [4],
        _choices(
            ("start", 19),
            ("finish", 1),
            ("start", 8),
            ("finish", 8),
            ("train", 2),
            ("start", 2),
            ("publish", 1),
            ("start", 3),
            ("finish", 1),
            ("finish_newest", 2),
            ("train", 1),
            ("finish", 1),
            ("train", 1),
        ),
    ),
    3,
)
_LAST_CHANCE_IN_FLIGHT = (
    (
        QueueSettings(12, 1, 1, 0),
        [1],
        [4],
        _choices(
            ("start", 19),
            ("finish", 1),
            ("start", 8),
            ("finish", 5),
            ("train", 1),
            ("start", 2),
            ("finish", 2),
            ("train", 1),
            ("publish", 1),
            ("start", 3),
            ("finish", 2),
            ("finish_newest", 3),
            ("train", 2),
        ),
    ),
    3,
)
_OLDER_GROUPS_NEED_THE_ROOM = (
    (
        QueueSettings(20, 1, 2, 0),
        [4],
        [4],
        _choices(
            ("start", 2),
            ("finish", 1),
            ("start", 6),
            ("finish", 5),
            ("train", 2),
            ("start", 2),
            ("finish", 2),
            ("train", 1),
            ("publish", 2),
            ("start", 5),
            ("finish", 3),
            ("train", 1),
            ("start", 2),
            ("finish", 2),
            ("train", 1),
            ("publish", 1),
            ("start", 3),
            ("finish_newest", 3),
            ("train", 1),
            ("finish", 3),
            ("train", 2),
        ),
    ),
    3,
)


@settings(max_examples=300)
@given(pipelines(uniform=True), st.integers(0, 4))
@example(*_BEHIND_A_NEWER_POLICY)
@example(*_LAST_CHANCE_IN_FLIGHT)
@example(*_OLDER_GROUPS_NEED_THE_ROOM)
def test_with_pushes_landing_late_no_sample_is_dropped_stale_in_steady_state(case, staleness):
    """The push beside the step (it lands while later steps are taken, snapshots replaced),
    groups finishing in any order, every group the same shape, any ``max_staleness`` from 0
    to 4: a group starts only if its samples and every one ahead of them fit the steps left
    before they would be too stale (fewer while the server is further behind); the buffer
    keeps the oldest policy first; and a step waits for older groups in flight that need its
    room. So no sample is dropped as stale once the step size is measured. (Before the first
    step every row counts as full: samples that pack worse than that and were admitted on
    that guess may go stale.)"""
    config, sizes, lengths, choices = case
    config = attrs.evolve(config, max_staleness=staleness)
    sides = _Sides(config, sizes, lengths, distinct=True, late_pushes=True)
    for choice in [*choices, *["finish", "publish"] * 50]:
        sides.act(choice)
    stale = [s for s in sides.stale if s.group_id not in sides.guessed]
    assert not stale, f"stale by step {sides.steps}: {stale}"


@settings(max_examples=200)
@given(pipelines(), st.integers(1, 3), st.integers(0, 3), st.data())
def test_with_pushes_landing_late_the_two_sides_never_wait_on_each_other(
    case, sync_every, extra_staleness, data
):
    """Pushes beside the steps, every ``sync_every`` steps (``max_staleness`` at least
    ``sync_every - 1``, as the config requires): whenever no group and no push is in flight
    and no group may start, the queue is ready to take a step, judged with the allowance the
    generator has at that lag (the server may hold weights several steps old with no push
    coming)."""
    config, sizes, lengths, choices = case
    config = attrs.evolve(config, max_staleness=sync_every - 1 + extra_staleness)
    sides = _Sides(config, sizes, lengths, late_pushes=True, sync_every=sync_every)
    for choice in [*choices, *["finish", "publish"] * 50]:
        sides.act(choice)
        if not sides.in_flight and sides.pushing is None and not sides.may_start():
            assert ready(sides.queue, NONE_IN_FLIGHT, behind=sides.behind)


TWO_LONG = [make_sample([1, first, *[2] * 7], [0] + [1] * 8) for first in (3, 4)]


@given(queue_settings, groups(0, 0, max_size=10))
@example(QueueSettings(10, 1, 1, 0), TWO_LONG)  # 1 + 2 x 8 tokens packed: two rows needed
@example(QueueSettings(10, 2, 1, 0), TWO_LONG)
def test_a_group_splits_across_steps_where_one_planned_step_leaves_some_over(settings, group):
    """Against the planner on the group alone: split where an empty step's plan leaves some
    of the group's samples (those within the budget) for the next step."""
    plan = plan_step(
        group, settings.token_budget, settings.num_processes, settings.gradient_accumulation_steps
    )
    assert splits_across_steps(settings, group) == bool(plan.leftover)
