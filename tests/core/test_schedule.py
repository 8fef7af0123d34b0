"""Interval strategies: steps fire every N steps, epochs once per crossed pass, no never."""

import itertools

from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.schedule import due


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
