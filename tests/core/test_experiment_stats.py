import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.experiments.curves import Censored
from asyncgrpo.core.experiments.stats import (
    as_numbers,
    bootstrap_interval,
    bootstrap_replicates,
    compare_settings,
    percentile_bounds,
    summarize,
)

times = st.floats(0.1, 1000.0)
values = st.lists(times, min_size=1, max_size=12)
maybe_censored = st.lists(times | st.builds(Censored, times), min_size=1, max_size=12)


def median(values) -> float:
    return summarize(values, resamples=10, rng=0).median.estimate


def ratio_interval(a, b, **kwargs):
    """``median(A) / median(B)`` with its bootstrap interval, as compare_settings gives it."""
    ratio = compare_settings(a, b, 1.0, **kwargs).ratio
    assert ratio is not None
    return ratio


@given(values, st.data())
def test_censoring_never_lowers_a_median(numbers, data):
    censor = data.draw(st.lists(st.booleans(), min_size=len(numbers), max_size=len(numbers)))
    mixed = [Censored(v) if c else v for v, c in zip(numbers, censor, strict=True)]
    assert median(mixed) >= median(numbers)


@given(maybe_censored)
def test_the_median_is_infinite_exactly_when_half_or_more_are_censored(mixed):
    censored = sum(isinstance(v, Censored) for v in mixed)
    assert math.isinf(median(mixed)) == (censored >= len(mixed) / 2)
    summary = summarize(mixed, resamples=200, rng=0)
    assert (summary.n, summary.censored, summary.reached) == (
        len(mixed),
        censored,
        len(mixed) - censored,
    )
    assert math.isinf(summary.mean) == (censored > 0)


@given(maybe_censored, st.sampled_from(["median", "mean"]), st.sampled_from([0.5, 0.8, 0.95]))
def test_an_interval_is_ordered_and_inside_the_range_of_the_values(mixed, statistic, level):
    numbers = as_numbers(mixed)
    interval = bootstrap_interval(mixed, statistic, level, resamples=300, rng=1)
    slack = 1e-12 * max(numbers[np.isfinite(numbers)], default=0.0)  # a mean's rounding
    assert numbers.min() - slack <= interval.low <= interval.high <= numbers.max() + slack
    assert interval.confidence == level
    wider = bootstrap_interval(mixed, statistic, 0.99, resamples=300, rng=1)
    assert wider.low <= interval.low and interval.high <= wider.high


@given(maybe_censored, st.integers(0, 2**32 - 1))
def test_the_same_seed_gives_the_same_interval(mixed, seed):
    a = bootstrap_interval(mixed, resamples=100, rng=seed)
    b = bootstrap_interval(mixed, resamples=100, rng=np.random.default_rng(seed))
    assert a == b


@given(maybe_censored, st.sampled_from([0.5, 0.9, 0.95]))
def test_the_ratio_interval_of_identical_samples_contains_one(mixed, level):
    interval = ratio_interval(mixed, mixed, confidence=level, resamples=1000, rng=2)
    assert interval.low <= 1.0 <= interval.high


small_ints = st.lists(st.integers(1, 100).map(float), min_size=1, max_size=8)


@given(small_ints, small_ints, st.integers(1, 16).map(lambda k: k / 4))
def test_ratio_and_difference_decide_a_claim_alike(a, b, coefficient):
    """For positive values ``A/B <= c`` iff ``A - cB <= 0`` replicate by replicate, so the
    ratio's interval and the difference's interval give the same verdict."""
    c = compare_settings(a, b, coefficient, resamples=500, rng=3)
    assert c.ratio is not None
    assert (c.ratio.high <= coefficient) == (c.difference.high <= 0)
    assert (c.ratio.low > coefficient) == (c.difference.low > 0)
    assert (c.ratio.low >= coefficient) == (c.difference.low >= 0)


def test_censored_sides_of_a_ratio():
    reached, never = [10.0, 11.0, 12.0], [Censored(50.0)] * 3
    assert ratio_interval(reached, never, rng=0).high == 0.0
    assert ratio_interval(never, reached, rng=0).low == math.inf
    both = ratio_interval(never, never, rng=0)
    assert math.isnan(both.estimate) and (both.low, both.high) == (-math.inf, math.inf)
    assert compare_settings(reached, never, 0.8, rng=0).difference.high == -math.inf


def test_a_ratio_of_values_that_are_not_positive_is_refused():
    assert compare_settings([0.5, -0.1], [0.2, 0.3], rng=0).ratio is None


def test_bad_inputs_fail_loudly():
    with pytest.raises(ValueError, match="NaN"):
        as_numbers([1.0, math.nan])
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_interval([1.0], confidence=90)
    with pytest.raises(ValueError, match="no values"):
        summarize([])


def test_percentile_bounds_pick_order_statistics_outward():
    r = np.arange(1000.0)
    assert percentile_bounds(r, 0.9) == (49.0, 950.0)
    assert percentile_bounds(np.array([1.0, math.inf]), 0.5) == (1.0, math.inf)


# ---------------------------------------------------------------- coverage, known answers

TRUE_MEDIAN = 1.0  # lognormal(0, 1): median exp(0) = 1


def _coverage(runs: int, trials: int, interval_of, seed: int) -> float:
    """Share of ``trials`` synthetic experiments (``runs`` lognormal draws each) whose
    interval covers the true median."""
    rng = np.random.default_rng(seed)
    hits = 0
    for _ in range(trials):
        draws = rng.lognormal(0.0, 1.0, runs)
        low, high = interval_of(draws, rng)
        hits += low <= TRUE_MEDIAN <= high
    return hits / trials


def test_a_90_percent_interval_of_the_median_covers_the_true_median_about_90_percent():
    def ninety(draws, rng):
        interval = bootstrap_interval(draws, "median", 0.9, resamples=1000, rng=rng)
        return interval.low, interval.high

    coverage = _coverage(runs=25, trials=600, interval_of=ninety, seed=20261201)
    assert 0.85 <= coverage <= 0.95, coverage


def test_negative_control_an_interval_from_the_wrong_quantiles_covers_far_less():
    """The same replicates, but the 25% and 75% quantiles (a 50% interval) passed off as a 90%
    one: the coverage check above must be able to tell."""

    def mislabelled(draws, rng):
        return percentile_bounds(bootstrap_replicates(draws, "median", 1000, rng), 0.5)

    coverage = _coverage(runs=25, trials=600, interval_of=mislabelled, seed=20261201)
    assert coverage < 0.7, coverage


def test_negative_control_an_interval_that_ignores_the_sample_size_covers_far_less():
    """Resampling 100 values per replicate from 25 runs (as if there were 100 seeds) makes the
    interval about half as wide as it should be."""

    def overconfident(draws, rng):
        picks = rng.integers(0, draws.size, size=(1000, 100))
        return percentile_bounds(np.median(draws[picks], axis=1), 0.9)

    coverage = _coverage(runs=25, trials=600, interval_of=overconfident, seed=20261201)
    assert coverage < 0.7, coverage


def test_coverage_of_the_ratio_interval_on_two_settings_with_a_known_ratio():
    """Setting A's times are B's times x 0.7 in distribution: a 90% interval of
    median(A) / median(B) covers 0.7 in roughly 90% of synthetic experiments."""
    rng = np.random.default_rng(7)
    hits, trials = 0, 300
    for _ in range(trials):
        a = 0.7 * rng.lognormal(0.0, 0.5, 25)
        b = rng.lognormal(0.0, 0.5, 25)
        hits += ratio_interval(a, b, confidence=0.9, resamples=1000, rng=rng).contains(0.7)
    assert 0.85 <= hits / trials <= 0.97, hits / trials
