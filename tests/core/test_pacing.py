import functools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.records import TrainingSample, TrainingSequence
from asyncgrpo.core.rollout.pacing import (
    GenerationLedger,
    LoadCap,
    ServerLoad,
    group_finished,
    group_started,
    initial_load_cap,
    may_start_group,
    next_load_cap,
    rollouts_completed,
    rollouts_to_admit,
    samples_taken,
    token_allowance,
)


def sample(version: int) -> TrainingSample:
    seq = TrainingSequence(input_ids=[1, 2], trained_mask=[0, 1], sampler_logprobs=[0.0, -1.0])
    return TrainingSample(seq, 1.0, version, 0, 0, 0, "r")


@given(
    st.one_of(st.none(), st.floats(1, 1e6)),
    st.integers(0, 8),
    st.integers(1, 4096),
    st.integers(1, 8),
)
def test_token_allowance_is_at_least_one_step(tokens, max_s, budget, rows) -> None:
    allowance = token_allowance(tokens, max_s, budget, rows)
    step = budget * rows if tokens is None else tokens
    assert allowance == pytest.approx(max(max_s, 1) * step)


def test_one_group_at_a_time_until_the_first_completes() -> None:
    ledger = GenerationLedger()
    assert may_start_group(ledger, allowance=1.0, behind=0, max_staleness=0)
    ledger = group_started(ledger)
    assert not may_start_group(ledger, allowance=1e12, behind=0, max_staleness=0)
    ledger = group_finished(ledger, forwarded_tokens=100)
    assert ledger.largest_group_tokens == 100 and ledger.queued_tokens == 100
    assert may_start_group(ledger, allowance=500, behind=0, max_staleness=0)
    with pytest.raises(ValueError, match="no group in flight"):
        group_finished(GenerationLedger(), 1)


@given(
    st.builds(
        GenerationLedger,
        st.integers(0, 10**5),
        st.integers(0, 8),
        st.integers(0, 50),
        st.integers(0, 10**4),
    ),
    st.floats(0, 10**6),
    st.integers(0, 6),
    st.integers(0, 5),
)
def test_no_group_starts_whose_samples_can_only_go_stale(ledger, allowance, behind, max_s):
    """A group started ``behind`` steps after the server's policy is trained at least that
    many versions later: beyond ``max_staleness`` it never starts; within, the policy's lag
    changes nothing."""
    decided = may_start_group(ledger, allowance, behind=behind, max_staleness=max_s)
    if behind > max_s:
        assert not decided
    else:
        assert decided == may_start_group(ledger, allowance, behind=0, max_staleness=max_s)


@st.composite
def pipelines(draw):
    return dict(
        max_staleness=draw(st.integers(0, 4)),
        group_tokens=draw(st.lists(st.integers(1, 3000), min_size=1, max_size=8)),
        budget=draw(st.integers(256, 4096)),
        rows=draw(st.integers(1, 4)),
        gen_ticks=draw(st.integers(1, 5)),
        train_ticks=draw(st.integers(1, 5)),
    )


@given(pipelines())
def test_pipeline_makes_progress_and_respects_the_allowance(case) -> None:
    """A toy worker and trainer driven only by the pacing functions: the trainer pulls the
    queue eagerly, drops stale samples and steps once it holds a full step. Whatever the sizes
    and speeds, with max_staleness=0 too: pacing never blocks the worker while the trainer
    starves, steps keep coming when generation can feed them, no trained sample is staler than
    max_staleness, and no group starts while queued + in-flight tokens exceed the allowance."""
    max_staleness, sizes = case["max_staleness"], case["group_tokens"]
    target = case["budget"] * case["rows"]
    ledger = GenerationLedger()
    tokens_per_step = None
    version = 0
    in_flight: list[list[int]] = []  # [ticks left, version at start]
    queue: list[tuple[int, int]] = []  # (tokens, version)
    buffer: list[tuple[int, int]] = []
    training_left = 0
    started = 0
    for _ in range(3000):
        allowance = token_allowance(tokens_per_step, max_staleness, case["budget"], case["rows"])
        starving = not training_left and not queue and not in_flight
        behind = int(training_left > 0)  # the weights reach the worker when the step ends
        admits = functools.partial(may_start_group, behind=behind, max_staleness=max_staleness)
        assert not starving or admits(ledger, allowance), "pacing blocks a starved trainer"
        while len(in_flight) < 16 and admits(ledger, allowance):
            if ledger.groups_completed and (ledger.queued_tokens or ledger.groups_in_flight):
                assert ledger.queued_tokens + ledger.in_flight_tokens() <= allowance
            ledger = group_started(ledger)
            in_flight.append([case["gen_ticks"], version])
        for group in in_flight:
            group[0] -= 1
        for _, group_version in [g for g in in_flight if g[0] == 0]:
            size = sizes[started % len(sizes)]
            started += 1
            ledger = group_finished(ledger, size)
            queue.append((size, group_version))
        in_flight = [g for g in in_flight if g[0] > 0]
        if training_left:
            training_left -= 1
            if training_left == 0:
                version += 1
            continue
        ledger = samples_taken(ledger, sum(t for t, _ in queue))
        buffer = [b for b in buffer + queue if version - b[1] <= max_staleness]
        queue = []
        if sum(t for t, _ in buffer) >= target or (buffer and max(sizes) >= target):
            step, total = [], 0
            while buffer and (not step or total + buffer[0][0] <= target):
                total += buffer[0][0]
                step.append(buffer.pop(0))
            assert all(version - v <= max_staleness for _, v in step)
            tokens_per_step = float(total)
            training_left = case["train_ticks"]
    generation_capacity = 3000 / case["gen_ticks"] * 16 * min(sizes)
    if generation_capacity >= 6 * target:
        assert version >= 3, f"only {version} steps in 3000 ticks"


@given(st.one_of(st.none(), st.integers(0, 10**7)), st.integers(1, 8192), st.integers(1, 1024))
def test_initial_cap_in_bounds(kv_tokens, max_len, ceiling) -> None:
    cap = initial_load_cap(kv_tokens, max_len, ceiling).cap
    assert 1 <= cap <= ceiling
    if kv_tokens is None:
        assert cap == ceiling


snapshots = st.one_of(
    st.none(),
    st.builds(ServerLoad, st.floats(0.0, 1.0), st.integers(0, 1000), st.integers(0, 1000)),
)


@given(
    st.integers(1, 1024),
    st.integers(1, 2048),
    st.lists(st.tuples(snapshots, st.integers(0, 200)), max_size=40),
)
def test_cap_stays_in_bounds_and_admissions_never_exceed_either_limit(ceiling, start, events):
    state = LoadCap(cap=min(start, ceiling))
    in_flight = 0
    for snapshot, completed in events:
        previous = state.cap
        state = next_load_cap(rollouts_completed(state, completed), snapshot, ceiling)
        assert 1 <= state.cap <= ceiling
        if snapshot is not None and snapshot.kv_cache_usage > 0.8:
            assert state.cap <= max(1, previous)
        if snapshot is not None and state.cap > previous:
            assert state.cap - previous <= max(1, int(np.ceil(previous * 0.25)))
        admit = rollouts_to_admit(in_flight, state, ceiling)
        in_flight += admit
        assert admit == 0 or in_flight <= min(state.cap, ceiling)
        in_flight = max(0, in_flight - completed)


def test_raise_is_bounded_by_rollouts_completed_since_last_raise() -> None:
    idle = ServerLoad(kv_cache_usage=0.1, running=1, waiting=0)
    assert next_load_cap(LoadCap(100, completed_since_raise=3), idle, 512) == LoadCap(103, 0)
    assert next_load_cap(LoadCap(100, completed_since_raise=0), idle, 512).cap == 100
    busy = ServerLoad(kv_cache_usage=0.5, running=1, waiting=2)
    assert next_load_cap(LoadCap(100, 50), busy, 512).cap == 100
    assert next_load_cap(LoadCap(100, 50), ServerLoad(0.7, 1, 0), 512).cap == 100
    assert next_load_cap(LoadCap(1, 50), ServerLoad(0.95, 1, 0), 512).cap == 1
    assert next_load_cap(LoadCap(100, 50), None, 64).cap == 64
