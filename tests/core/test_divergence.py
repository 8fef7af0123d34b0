"""The divergence rule: a step is applied only when its loss and gradient norm are finite; the
skipped steps are counted in a row and in all, and ``stop_after`` in a row stop the run."""

import math

from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.run.divergence import (
    NonfiniteSteps,
    after_step,
    diverged_message,
    must_stop,
    step_is_finite,
    weights_diverged_message,
)

values = st.floats(allow_nan=True, allow_infinity=True)


@given(values, values)
def test_a_step_is_applied_only_when_loss_and_norm_are_both_finite(loss, grad_norm) -> None:
    assert step_is_finite(loss, grad_norm) == (math.isfinite(loss) and math.isfinite(grad_norm))


@given(st.integers(0, 1000), st.lists(st.booleans(), max_size=40), st.integers(1, 6))
def test_skipped_steps_are_counted_in_a_row_and_in_all(start, finites, stop_after) -> None:
    steps = NonfiniteSteps(last_finite_step=start)
    stopped_at = None
    for index, finite in enumerate(finites):
        steps = after_step(steps, finite)
        if stopped_at is None and must_stop(steps, stop_after):
            stopped_at = index
    trailing = len(finites) - (
        max(i for i, f in enumerate(finites) if f) + 1 if any(finites) else 0
    )
    assert steps.in_a_row == trailing
    assert steps.total == finites.count(False)
    applied = [start + i + 1 for i, finite in enumerate(finites) if finite]
    assert steps.last_finite_step == (applied[-1] if applied else start)
    # the steps taken so far are the last finite one and those skipped since
    assert steps.last_finite_step + steps.in_a_row == start + len(finites)
    runs = "".join("x" if not f else "." for f in finites)
    first_run = runs.find("x" * stop_after)
    assert stopped_at == (None if first_run < 0 else first_run + stop_after - 1)


@given(st.integers(1, 5), st.floats(1e-8, 1e40), st.floats(0, 10))
def test_the_errors_name_the_settings_to_change(stop_after, learning_rate, max_grad_norm) -> None:
    steps = NonfiniteSteps(last_finite_step=7, in_a_row=stop_after, total=stop_after)
    message = diverged_message(
        steps, stop_after, math.nan, math.inf, learning_rate, max_grad_norm, "out/checkpoint-9"
    )
    assert f"stop_after_nonfinite_steps={stop_after}" in message
    assert f"steps 8 to {7 + stop_after}" in message
    assert "last finite weights (step 7) are in out/checkpoint-9" in message
    for text in (weights_diverged_message(3, learning_rate, max_grad_norm, "out"), message):
        assert f"learning_rate (now {learning_rate:g}" in text
        assert f"max_grad_norm={max_grad_norm:g}" in text
        assert ("turn gradient clipping on" in text) == (max_grad_norm <= 0)
