"""How much of the cluster a plan simulates (:mod:`asyncgrpo.core.experiments.scale`)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncgrpo.core.experiments.lengths import constant, from_quantiles
from asyncgrpo.core.experiments.scale import (
    MIN_ROWS_PER_STEP,
    ROUND_OFF,
    SCALE_TOLERANCE,
    simulation_scale,
)

TAIL = from_quantiles({0.5: 6500, 0.9: 16000}, maximum=27648, mean=8000)
"""Responses of a long-response math run: a mean of 8,000 tokens, a tail to 27,648."""


@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 700),
    st.integers(1, 3000),
    st.sampled_from([8, 32, 64, 96, 256, 512, 1024]),
    st.sampled_from([1, 4, 8, 16]),
    st.sampled_from([0.0, 0.005, SCALE_TOLERANCE, 0.1]),
)
def test_the_scale_is_the_largest_that_divides_the_servers_and_keeps_the_longest_response(
    servers, rows, prompts, generations, tolerance
) -> None:
    scale = simulation_scale(servers, rows, prompts, generations, TAIL, tolerance)
    samples = prompts * generations
    longest = TAIL.expected_longest(samples)

    def allowed(f: int) -> bool:
        return (
            servers % f == 0
            and rows / f >= MIN_ROWS_PER_STEP
            and prompts >= f
            and TAIL.expected_longest(samples // f) >= (1 - tolerance) * longest * (1 - ROUND_OFF)
        )

    assert scale == 1 or allowed(scale)
    larger = [f for f in range(scale + 1, servers + 1) if allowed(f)]
    assert not larger, f"scale {scale} while {larger} are allowed too"


def test_a_tail_bounds_the_scale_and_equal_lengths_do_not() -> None:
    # 128 GPUs of the math run: 40 servers, 2,592 rows, 512 prompts of 16
    assert simulation_scale(40, 2592, 512, 16, TAIL) == 10
    assert simulation_scale(40, 2592, 512, 16, TAIL, tolerance=0.0) == 1
    # every response as long: only the rows bound it (2,592 / 20 = 129.6 rows a step), not
    # the round-off of the expected longest, which differs with the count of draws
    assert simulation_scale(40, 2592, 512, 16, constant(8000), tolerance=0.0) == 20
    draws = [constant(8000).expected_longest(n) for n in (8192, 409)]
    assert abs(draws[0] - draws[1]) <= ROUND_OFF * 8000, draws
    assert simulation_scale(7, 2592, 512, 16, TAIL) == 7
    assert simulation_scale(7, 600, 512, 16, TAIL) == 1  # 86 rows a step: too few


def test_a_bad_tolerance_is_refused() -> None:
    with pytest.raises(ValueError, match="tolerance"):
        simulation_scale(40, 2592, 512, 16, TAIL, tolerance=1.0)


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from([8, 40, 120, 700]),
    st.sampled_from([64, 512, 1024]),
    st.floats(0.0, 1.0),
)
def test_a_groups_alike_lengths_never_allow_a_larger_share(servers, prompts, correlation) -> None:
    alone = simulation_scale(servers, 100_000, prompts, 16, TAIL)
    alike = simulation_scale(servers, 100_000, prompts, 16, TAIL, group_correlation=correlation)
    assert alike <= alone
    # the prompt sets the length: a step's longest is that of its prompts alone
    assert simulation_scale(servers, 100_000, prompts, 16, TAIL, group_correlation=1.0) == (
        simulation_scale(servers, 100_000, prompts, 1, TAIL)
    )
