"""Interval strategies: steps fire every N steps, epochs once per crossed pass, no never."""

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.run.schedule import due, evaluation_due, interval_steps


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


@given(st.integers(1, 6), st.lists(st.integers(1, 4), min_size=1, max_size=30), st.booleans())
def test_evaluations_cover_every_crossed_multiple_once(every, gaps, on_start) -> None:
    """Versions land at increasing steps (gaps: a push may cover several steps). Each
    evaluated version crosses a multiple of ``every`` the last evaluated one did not; no
    multiple that a landed version reached is left without an evaluation at or after it;
    the start is evaluated only with eval_on_start."""
    landed = list(itertools.accumulate(gaps))
    last = None
    evaluated = []
    if evaluation_due(0, every, last, at_start=True, on_start=on_start):
        evaluated.append(last := 0)
    for version in landed:
        if evaluation_due(version, every, last, at_start=False, on_start=on_start):
            evaluated.append(last := version)
    assert (0 in evaluated) == on_start
    multiples = [v // every for v in evaluated if v > 0]
    assert multiples == sorted(set(multiples))  # one evaluation per crossed multiple at most
    assert set(range(1, landed[-1] // every + 1)) <= {  # every multiple reached is covered
        m for v in evaluated if v > 0 for m in range(1, v // every + 1)
    }


def test_evaluation_never_fires_without_a_strategy_and_not_twice_at_a_resume() -> None:
    assert not evaluation_due(10, None, None, at_start=True, on_start=True)
    assert not evaluation_due(10, 5, 10, at_start=True, on_start=True)
    assert not evaluation_due(11, 5, 10, at_start=False, on_start=False)
    assert evaluation_due(15, 5, 10, at_start=False, on_start=False)
