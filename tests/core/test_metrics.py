import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.metrics import (
    Aggregation,
    MetricWindow,
    aggregation_for,
    merge,
    ratio,
    record,
    summarize,
    value,
)


@pytest.mark.parametrize(
    ("name", "aggregation"),
    [
        ("sample/dropped_stale_count", Aggregation.SUM),
        ("tools/search/call_count", Aggregation.SUM),
        ("batch/dropped_oversize_count", Aggregation.SUM),
        ("sample/staleness_max", Aggregation.MAX),
        ("completions/max_length", Aggregation.MAX),
        ("rollout/turns_max", Aggregation.MAX),
        ("sampling/importance_sampling_ratio/min", Aggregation.MIN),
        ("clip_ratio/low_min", Aggregation.MIN),
        ("completions/min_terminated_length", Aggregation.MIN),
        ("reward", Aggregation.MEAN),
        ("rollout/turns_mean", Aggregation.MEAN),
        ("max_staleness_setting/value", Aggregation.MEAN),
        ("batch/row_imbalance", Aggregation.MEAN),
    ],
)
def test_aggregation_is_decided_by_the_last_name_part(name, aggregation) -> None:
    assert aggregation_for(name) is aggregation


finite = st.floats(-1e6, 1e6)
names = st.sampled_from(
    ["reward", "sample/staleness_max", "completions/min_length", "sample/dropped_stale_count"]
)
observations = st.lists(
    st.one_of(
        st.builds(value, names, finite, st.floats(0.5, 10)),
        st.builds(
            ratio, st.just("rollout/generated_tokens_per_s"), st.floats(0, 1e6), st.floats(0.1, 100)
        ),
    ),
    max_size=30,
)


def close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        (math.isnan(a[k]) and math.isnan(b[k])) or a[k] == pytest.approx(b[k], rel=1e-9, abs=1e-6)
        for k in a
    )


@given(observations, st.integers(0, 30))
def test_splitting_and_merging_windows_gives_the_same_summary(obs, cut) -> None:
    whole = summarize(record(MetricWindow(), obs))
    left, right = record(MetricWindow(), obs[:cut]), record(MetricWindow(), obs[cut:])
    assert close(summarize(merge(left, right)), whole)
    assert close(summarize(merge(right, left)), whole)


@given(observations)
def test_each_rule_matches_a_direct_computation(obs) -> None:
    summary = summarize(record(MetricWindow(), obs))
    by_name: dict[str, list] = {}
    for o in obs:
        by_name.setdefault(o.name, []).append(o)
    for name, items in by_name.items():
        amounts = [o.amount for o in items]
        weights = [o.weight for o in items]
        if items[0].is_ratio:
            expected = sum(amounts) / sum(weights)
        elif name.endswith("_count"):
            expected = sum(amounts)
        elif name.endswith("_max"):
            expected = max(amounts)
        elif "min_" in name:
            expected = min(amounts)
        else:
            expected = sum(a * w for a, w in zip(amounts, weights, strict=True)) / sum(weights)
        assert summary[name] == pytest.approx(expected, rel=1e-9, abs=1e-6)


def test_ratio_is_total_over_total_and_nan_when_empty() -> None:
    window = record(
        MetricWindow(),
        [ratio("tools/failure_frequency", 1, 4), ratio("tools/failure_frequency", 0, 4)],
    )
    assert summarize(window)["tools/failure_frequency"] == 0.125
    empty = record(MetricWindow(), [ratio("tools/failure_frequency", 0, 0)])
    assert math.isnan(summarize(empty)["tools/failure_frequency"])


def test_non_finite_values_are_ignored_and_mixing_kinds_is_an_error() -> None:
    window = record(
        MetricWindow(), [value("reward_group_std", float("nan")), value("reward_group_std", 2.0)]
    )
    assert summarize(window)["reward_group_std"] == 2.0
    with pytest.raises(ValueError, match="record it one way"):
        record(MetricWindow(), [value("x", 1.0), ratio("x", 1, 1)])
    with pytest.raises(ValueError, match="weight must be"):
        value("x", 1.0, weight=-1)
