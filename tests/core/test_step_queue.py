from collections import Counter

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from packing_strategies import make_sample

from asyncgrpo.core import pacing
from asyncgrpo.core.planner import plan_step
from asyncgrpo.core.step_queue import (
    OVERSIZE_IN_A_ROW_LIMIT,
    QueueSettings,
    StepQueue,
    advance,
    arrive,
    ready,
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
        sample = make_sample(tokens, [0] * len(prompt) + [1] * len(completion), group_id,
                             rollout=f"{group_id}-{member}")  # fmt: skip
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
    fresh = plan_step(queue.buffer, config.token_budget, config.num_processes,
                      config.gradient_accumulation_steps)  # fmt: skip
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
    fresh = plan_step(queue.buffer, config.token_budget, config.num_processes,
                      config.gradient_accumulation_steps)  # fmt: skip
    step = take_step(queue)
    expected = [
        [[queue.buffer[i] for i in row.samples] for row in mb] for mb in fresh.micro_batches
    ]
    assert [[list(row) for row in mb] for mb in step.micro_batches] == expected
    assert step.forwarded_tokens == sum(row.tokens for mb in fresh.micro_batches for row in mb)
    assert step.queue.buffer == tuple(queue.buffer[i] for i in fresh.leftover)


def test_advancing_the_version_drops_buffered_samples_that_became_stale() -> None:
    config = QueueSettings(token_budget=64, max_staleness=1)
    old = [attrs.evolve(make_sample([1, 2, 3], [0, 1, 1], 0), model_version=0)]
    new = [attrs.evolve(make_sample([1, 2, 4], [0, 1, 1], 1), model_version=1)]
    queue = arrive(arrive(StepQueue(config), old, 1).queue, new, 1).queue
    assert len(queue.buffer) == 2
    moved = advance(queue, 2)
    assert moved.stale == tuple(old) and moved.queue.buffer == tuple(new)
    assert moved.released_tokens == 3 and moved.queue.buffered_tokens == 3


def test_a_budget_no_sample_fits_is_decided_after_a_run_of_oversize_samples() -> None:
    queue = StepQueue(QueueSettings(token_budget=4))
    long = [make_sample(range(8), [0] + [1] * 7, g) for g in range(OVERSIZE_IN_A_ROW_LIMIT)]
    for sample in long[:-1]:
        queue = arrive(queue, [sample], 0).queue
    assert not queue.budget_too_small
    assert arrive(queue, [make_sample([1, 2], [0, 1])], 0).queue.oversize_in_a_row == 0
    assert arrive(queue, long[-1:], 0).queue.budget_too_small


@st.composite
def pipelines(draw):
    config = draw(queue_settings.filter(lambda c: c.token_budget >= 12))
    sizes = draw(st.lists(st.integers(0, 6), min_size=1, max_size=40))  # samples per group
    lengths = draw(st.lists(st.integers(2, 12), min_size=1, max_size=40))
    choices = draw(st.lists(st.sampled_from(["start", "finish", "train"]), max_size=300))
    return config, sizes, lengths, choices


@settings(max_examples=150)
@given(pipelines())
def test_generator_and_queue_never_wait_on_each_other_and_stay_within_the_allowance(case):
    """Generation (the pacing ledger) and the trainer's queue, interleaved at random: the
    ledger's outstanding tokens equal what the queue holds once nothing is in transit, an
    admitted group keeps the expected total within the allowance, and whenever nothing is in
    flight and no group may start, the queue is ready to take a step (no deadlock)."""
    config, sizes, lengths, choices = case
    ledger, queue = pacing.GenerationLedger(), StepQueue(config)
    in_flight, version, started = [], 0, 0

    def group(n: int) -> list:
        size, length = sizes[n % len(sizes)], lengths[n % len(lengths)]
        return [attrs.evolve(make_sample([n % 7, *range(1, length)], [0] + [1] * (length - 1), n,
                                         rollout=f"{n}-{m}"), model_version=version)
                for m in range(size)]  # fmt: skip

    for choice in [*choices, *["finish"] * 50]:
        allowance = queue.allowance
        if choice == "start" and pacing.may_start_group(ledger, allowance):
            outstanding = ledger.queued_tokens + ledger.in_flight_tokens()
            if ledger.groups_completed and outstanding:
                assert outstanding + ledger.tokens_per_group <= allowance
            ledger = pacing.group_started(ledger)
            in_flight.append(group(started))
            started += 1
        elif choice == "finish" and in_flight:
            samples = in_flight.pop(0)
            ledger = pacing.group_finished(ledger, sum(len(s.sequence) for s in samples))
            decided = arrive(queue, samples, version)
            queue = decided.queue
            ledger = pacing.samples_taken(ledger, decided.released_tokens)
        elif choice == "train" and ready(queue, len(in_flight)):
            step = take_step(queue)
            queue = step.queue
            ledger = pacing.samples_taken(ledger, step.released_tokens)
            version += 1
            moved = advance(queue, version)
            queue = moved.queue
            ledger = pacing.samples_taken(ledger, moved.released_tokens)
        if not in_flight:
            assert ledger.queued_tokens == queue.buffered_tokens
            if not pacing.may_start_group(ledger, queue.allowance):
                assert ready(queue, 0)
