import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncgrpo.core.experiments.lengths import (
    Lengths,
    LengthsError,
    check_correlation,
    constant,
    from_histogram,
    from_quantiles,
    group_quantiles,
    independent_draws,
    uniform,
    uniform_with_mean,
)


@st.composite
def quantile_workloads(draw):
    """A maximum, increasing quantiles below it and a mean the quantiles allow (a mean they do
    not allow must fail naming the range)."""
    maximum = draw(st.integers(64, 32768))
    probabilities = sorted(
        set(
            draw(
                st.lists(st.sampled_from([0.1, 0.25, 0.5, 0.75, 0.9, 0.99]), min_size=1, max_size=4)
            )
        )
    )
    values = sorted(
        draw(
            st.lists(
                st.integers(1, maximum), min_size=len(probabilities), max_size=len(probabilities)
            )
        )
    )
    quantiles = dict(zip(probabilities, map(float, values), strict=True))
    mean = draw(st.floats(1.0, float(maximum)))
    try:
        from_quantiles(quantiles, maximum, mean)
    except LengthsError as error:
        assert "they allow" in str(error)
        mean = from_quantiles(quantiles, maximum).mean  # linear: always allowed
    return quantiles, float(maximum), mean


@settings(max_examples=60, deadline=None)
@given(quantile_workloads())
def test_quantiles_keep_the_given_quantiles_maximum_and_mean(workload) -> None:
    quantiles, maximum, mean = workload
    lengths = from_quantiles(quantiles, maximum, mean)
    assert lengths.mean == pytest.approx(mean, rel=1e-6, abs=1e-6)
    assert lengths.maximum == maximum
    for probability, value in quantiles.items():
        assert lengths.quantile(probability) == pytest.approx(value)


@settings(max_examples=60, deadline=None)
@given(quantile_workloads(), st.integers(0, 2**32 - 1))
def test_samples_lie_within_the_range_with_the_mean(workload, seed) -> None:
    quantiles, maximum, mean = workload
    lengths = from_quantiles(quantiles, maximum, mean)
    drawn = lengths.sample(np.random.default_rng(seed), 4000)
    assert drawn.min() >= lengths.minimum and drawn.max() <= maximum
    spread = np.sqrt(max(lengths.second_moment - lengths.mean**2, 0.0))
    assert abs(drawn.mean() - lengths.mean) <= 6 * spread / np.sqrt(4000) + 0.5


@settings(max_examples=60, deadline=None)
@given(quantile_workloads())
def test_a_step_waits_longer_the_more_responses_it_holds(workload) -> None:
    """The expected longest of n grows with n, from the mean (n = 1) up to the maximum: what a
    synchronous step of n responses waits for."""
    lengths = from_quantiles(*workload[:2], workload[2])
    longest = [lengths.expected_longest(n) for n in (1, 8, 64, 512)]
    assert longest[0] == pytest.approx(lengths.mean, rel=1e-3)
    assert all(a <= b + 1e-6 for a, b in itertools.pairwise(longest))
    assert longest[-1] <= lengths.maximum + 1e-6


def test_a_mean_the_quantiles_cannot_give_names_the_range() -> None:
    with pytest.raises(LengthsError, match="they allow"):
        from_quantiles({0.5: 1000.0}, maximum=2000.0, mean=1900.0)
    with pytest.raises(LengthsError, match="must not decrease"):
        from_quantiles({0.5: 1000.0, 0.9: 500.0}, maximum=2000.0)


def test_a_long_tail_holds_more_kv_in_flight_than_its_mean_suggests() -> None:
    """Same mean, a tail to the maximum: a request in flight holds more tokens (long responses
    stay longer), and 64 responses' longest is far longer."""
    even = constant(2000)
    tail = from_quantiles({0.5: 1200.0, 0.9: 3500.0}, maximum=16384.0, mean=2000.0)
    assert tail.in_flight_tokens() > 1.3 * even.in_flight_tokens()
    assert tail.expected_longest(64) > 3 * even.expected_longest(64)


@given(st.lists(st.integers(0, 50), min_size=1, max_size=6).filter(any))
def test_a_histogram_gives_each_bin_its_share(counts) -> None:
    edges = [1.0 + 100.0 * i for i in range(len(counts) + 1)]
    lengths = from_histogram(edges, counts)
    total = sum(counts)
    expected = sum(c / total * (edges[i] + edges[i + 1]) / 2 for i, c in enumerate(counts))
    assert lengths.mean == pytest.approx(expected)


@given(st.integers(1, 500), st.integers(0, 500), st.floats(0.0, 1.0), st.floats(1.0, 50.0))
def test_uniform_with_mean_and_units(low, width, where, unit) -> None:
    high = low + width
    mean = low + where * width
    lengths = uniform_with_mean(low, high, mean)
    assert lengths.mean == pytest.approx(mean, abs=1e-9 * high)
    coarse = lengths.in_units(unit)
    assert coarse.maximum == pytest.approx(max(1.0, high / unit))
    assert coarse.minimum >= 1.0


def test_knots_must_run_from_0_to_1_and_not_decrease() -> None:
    with pytest.raises(LengthsError, match="from probability 0 to 1"):
        Lengths(((0.0, 1.0), (0.5, 2.0)))
    with pytest.raises(LengthsError, match="must not decrease"):
        Lengths(((0.0, 5.0), (1.0, 2.0)))
    assert uniform(4, 8).mean == 6.0


@settings(max_examples=25, deadline=None)
@given(st.floats(0.0, 1.0), st.integers(2, 16), st.integers(0, 2**32 - 1))
def test_a_groups_lengths_keep_the_distribution_whatever_their_correlation(
    correlation, size, seed
) -> None:
    rng = np.random.default_rng(seed)
    quantiles = np.concatenate([group_quantiles(rng, size, correlation) for _ in range(4000)])
    assert quantiles.min() >= 0.0 and quantiles.max() <= 1.0
    counts, _ = np.histogram(quantiles, bins=4, range=(0.0, 1.0))
    # each quarter holds its quarter of the draws (4,000 groups: a few percent of chance)
    assert np.all(np.abs(counts / quantiles.size - 0.25) < 0.02), counts


@settings(max_examples=25, deadline=None)
@given(st.floats(0.05, 0.95), st.integers(0, 2**32 - 1))
def test_the_more_alike_a_groups_lengths_the_less_they_spread_within_it(correlation, seed) -> None:
    lengths = uniform(4, 128)

    def spread(c: float) -> float:
        rng = np.random.default_rng(seed)
        return float(np.mean([lengths.sample(rng, 8, c).std() for _ in range(500)]))

    alone, partly, alike = spread(0.0), spread(correlation), spread(1.0)
    assert alike == 0.0 < partly < alone


def test_correlation_0_draws_as_before_and_1_gives_the_group_one_length() -> None:
    lengths = from_quantiles({0.5: 1500, 0.9: 6000}, maximum=8192, mean=2650)
    before = np.random.default_rng(3).random(16)
    expected = np.clip(
        np.floor(np.interp(before, *zip(*lengths.knots, strict=True)) + 0.5), 1, 8192
    )
    assert np.array_equal(lengths.sample(np.random.default_rng(3), 16), expected)
    assert np.array_equal(lengths.sample(np.random.default_rng(3), 16, 0.0), expected)
    alike = lengths.sample(np.random.default_rng(3), 16, 1.0)
    assert len(set(alike.tolist())) == 1


@given(st.integers(1, 64), st.floats(0.0, 1.0))
def test_a_group_is_worth_between_one_and_all_its_draws(count, correlation) -> None:
    draws = independent_draws(count, correlation)
    assert 1.0 - 1e-9 <= draws <= count + 1e-9
    assert independent_draws(count, 0.0) == count and independent_draws(count, 1.0) == 1.0


@pytest.mark.parametrize("correlation", [-0.1, 1.5, float("nan")])
def test_a_correlation_outside_0_to_1_is_refused_naming_the_setting(correlation) -> None:
    with pytest.raises(LengthsError, match=r"group_length_correlation lies in \[0, 1\]"):
        check_correlation(correlation, "group_length_correlation")
    with pytest.raises(LengthsError, match="lies in"):
        group_quantiles(np.random.default_rng(0), 4, correlation)
