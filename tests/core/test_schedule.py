"""Interval strategies: steps fire every N steps, epochs once per crossed pass, no never."""

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.run.schedule import due, interval_steps


@given(every=st.integers(1, 20), steps=st.integers(1, 200))
def test_steps_fire_once_every_n_steps(every: int, steps: int) -> None:
    fired = [s for s in range(1, steps + 1) if due("steps", s, every, 0.0, 0.0)]
    assert fired == list(range(every, steps + 1, every))


@given(progress=st.lists(st.floats(0.0, 0.7), min_size=1, max_size=50))
def test_epoch_fires_once_per_whole_pass_crossed(progress: list[float]) -> None:
    epochs = [0.0]
    for delta in progress:
        epochs.append(epochs[-1] + delta)
    pairs = enumerate(itertools.pairwise(epochs))
    fired = sum(due("epoch", i + 1, 0, before, after) for i, (before, after) in pairs)
    assert fired == int(epochs[-1])


@given(step=st.integers(1, 100), before=st.floats(0, 5), delta=st.floats(0, 5))
def test_no_never_fires(step: int, before: float, delta: float) -> None:
    assert not due("no", step, 1, before, before + delta)


@given(count=st.integers(0, 10_000), max_steps=st.integers(-1, 10_000))
def test_a_whole_interval_is_a_count_of_steps(count: int, max_steps: int) -> None:
    assert interval_steps(count, max_steps) == count


@given(fraction=st.floats(0.001, 0.999), max_steps=st.integers(1, 10_000))
def test_a_fractional_interval_is_that_share_of_max_steps_rounded_up(fraction, max_steps):
    steps = interval_steps(fraction, max_steps)
    assert steps == max(1, math.ceil(fraction * max_steps))
    assert 1 <= steps <= max_steps


@given(fraction=st.floats(0.001, 0.999), max_steps=st.integers(-5, 0))
def test_a_fractional_interval_without_max_steps_is_refused(fraction, max_steps) -> None:
    with pytest.raises(ValueError, match="needs max_steps > 0"):
        interval_steps(fraction, max_steps)
