import math

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.experiments.curves import (
    Censored,
    CollapseRule,
    CurvePoint,
    Run,
    RunCurve,
    auc_steps,
    auc_time,
    collapse_step,
    collapsed,
    curve_from_rows,
    final_reward,
    first_crossing,
    metric_median,
    steps_to,
    time_to,
)
from asyncgrpo.core.experiments.statistic import Statistic, run_statistic

rewards = st.floats(-1.0, 2.0) | st.just(math.nan)


@st.composite
def curves(draw, min_points: int = 0, max_points: int = 12, nan_rewards: bool = True):
    """A curve: increasing steps, non-decreasing wall seconds, rewards in [-1, 2] (some NaN
    unless ``nan_rewards`` is False), an entropy and a zero-std share per point."""
    n = draw(st.integers(min_points, max_points))
    points, step, wall = [], 0, 0.0
    for _ in range(n):
        step += draw(st.integers(1, 5))
        wall += draw(st.floats(0.0, 10.0))
        metrics = {
            "entropy": draw(st.sampled_from([0.001, 0.01, 0.3, 0.6])),
            "frac_reward_zero_std": draw(st.sampled_from([0.0, 0.5, 0.95, 1.0])),
        }
        reward = draw(rewards if nan_rewards else st.floats(-1.0, 2.0))
        points.append(CurvePoint(step, wall, reward, metrics))
    return RunCurve(points)


thresholds = st.floats(-1.5, 2.5)


@given(curves(), thresholds)
def test_time_and_steps_to_are_the_first_crossing(curve, threshold):
    t, s = time_to(curve, threshold), steps_to(curve, threshold)
    crossed = [i for i, p in enumerate(curve.points) if p.reward >= threshold]
    if not crossed:
        assert t == Censored(curve.last_wall_s)
        assert s == Censored(curve.last_step)
        assert first_crossing(curve, threshold) is None
        return
    first = curve.points[crossed[0]]
    assert (t, s) == (first.wall_s, first.step)
    assert all(not p.reward >= threshold for p in curve.points[: crossed[0]])


@given(curves(), thresholds, thresholds)
def test_a_higher_threshold_is_never_reached_sooner(curve, a, b):
    low, high = sorted((a, b))
    assert float(steps_to(curve, low)) <= float(steps_to(curve, high))
    assert float(time_to(curve, low)) <= float(time_to(curve, high))


def test_censored_is_not_a_number():
    curve = RunCurve([CurvePoint(1, 1.0, 0.1), CurvePoint(2, 5.0, 0.2)])
    result = time_to(curve, 0.9)
    assert isinstance(result, Censored) and result.at_least == 5.0
    assert not isinstance(result, float | int)
    assert float(result) == math.inf


@given(
    st.lists(st.integers(1, 5), min_size=1, max_size=10),
    st.lists(st.floats(0.0, 5.0), min_size=10, max_size=10),
    st.floats(-1.0, 1.0),
)
def test_auc_of_a_constant_curve_is_that_constant(gaps, dts, value):
    steps = [sum(gaps[: i + 1]) for i in range(len(gaps))]
    walls = [sum(dts[: i + 1]) for i in range(len(gaps))]
    curve = RunCurve([CurvePoint(s, w, value) for s, w in zip(steps, walls, strict=True)])
    assert auc_steps(curve) == pytest.approx(value, abs=1e-12)
    assert auc_time(curve) == pytest.approx(value, abs=1e-12)
    assert final_reward(curve) == pytest.approx(value, abs=1e-12)


@given(curves(min_points=1, nan_rewards=False))
def test_auc_lies_between_the_lowest_and_highest_reward(curve):
    lowest = min(p.reward for p in curve.points)
    highest = max(p.reward for p in curve.points)
    for auc in (auc_steps(curve), auc_time(curve)):
        assert lowest - 1e-9 <= auc <= highest + 1e-9


@given(curves(min_points=2, nan_rewards=False), st.floats(0.0, 1.0))
def test_a_point_on_a_segment_does_not_change_the_auc_against_steps(curve, where):
    a, b = curve.points[0], curve.points[1]
    if b.step - a.step < 2:
        return
    step = a.step + 1
    share = (step - a.step) / (b.step - a.step)
    mid = CurvePoint(step, a.wall_s, a.reward + share * (b.reward - a.reward))
    longer = RunCurve([a, mid, *curve.points[1:]])
    assert auc_steps(longer) == pytest.approx(auc_steps(curve), abs=1e-9)


def test_auc_against_time_rewards_learning_sooner():
    # the same rewards at the same steps; the slow run's second step took 9 s, not 1 s
    slow = RunCurve([CurvePoint(1, 0.0, 0.0), CurvePoint(2, 9.0, 1.0), CurvePoint(3, 10.0, 1.0)])
    fast = RunCurve([CurvePoint(1, 0.0, 0.0), CurvePoint(2, 1.0, 1.0), CurvePoint(3, 10.0, 1.0)])
    assert auc_steps(slow) == auc_steps(fast) == 0.75
    assert auc_time(slow) == pytest.approx(0.55)
    assert auc_time(fast) == pytest.approx(0.95)


@given(curves(min_points=1, nan_rewards=False), st.integers(1, 20))
def test_final_reward_is_the_mean_of_the_last_points(curve, last):
    tail = [p.reward for p in curve.points][-last:]
    assert final_reward(curve, last) == pytest.approx(sum(tail) / len(tail))


def test_nan_rewards_are_skipped_and_no_reward_is_an_error():
    curve = RunCurve([CurvePoint(1, 1.0, 0.5), CurvePoint(2, 2.0, math.nan)])
    assert final_reward(curve, 1) == 0.5
    assert auc_steps(curve) == 0.5
    with pytest.raises(ValueError, match="no reward"):
        final_reward(RunCurve([CurvePoint(1, 1.0, math.nan)]))


def _reference_collapse(curve, rule):
    flags = "".join("x" if rule.collapsing(p) else "." for p in curve.points)
    index = flags.find("x" * rule.consecutive)
    return None if index < 0 else curve.points[index].step


rules = st.builds(
    CollapseRule,
    entropy_below=st.sampled_from([0.005, 0.05, 0.5]),
    zero_std_above=st.sampled_from([0.4, 0.9]),
    consecutive=st.integers(1, 4),
    reward_below=st.none() | st.floats(-1.0, 2.0),
)


@given(curves(), rules)
def test_collapse_is_the_first_streak_of_collapsing_points(curve, rule):
    assert collapse_step(curve, rule) == _reference_collapse(curve, rule)
    assert collapsed(curve, rule) == (_reference_collapse(curve, rule) is not None)


def test_the_default_collapse_rule_on_a_measured_collapse():
    # entropy 0.5 -> 0.004 in 8 steps, afterwards almost no group with reward spread
    entropy = [0.5, 0.4, 0.3, 0.1, 0.04, 0.01, 0.006, 0.004, 0.004]
    zero_std = [0.1, 0.1, 0.2, 0.5, 0.92, 0.97, 1.0, 1.0, 1.0]
    curve = RunCurve(
        [
            CurvePoint(i + 1, i, 0.3, {"entropy": e, "frac_reward_zero_std": z})
            for i, (e, z) in enumerate(zip(entropy, zero_std, strict=True))
        ]
    )
    assert collapse_step(curve) == 5
    # a solved task has no spread either: reward_below tells the two apart
    solved = RunCurve([attrs.evolve(p, reward=1.0) for p in curve.points])
    assert collapsed(solved)
    assert not collapsed(solved, CollapseRule(reward_below=0.9))


def test_a_point_missing_a_metric_breaks_a_streak():
    bad = {"entropy": 0.001, "frac_reward_zero_std": 1.0}
    curve = RunCurve(
        [
            CurvePoint(1, 1, 0, bad),
            CurvePoint(2, 2, 0, {"entropy": 0.001}),
            CurvePoint(3, 3, 0, bad),
        ]
    )
    assert collapse_step(curve, CollapseRule(consecutive=2)) is None


def test_curve_from_rows_sums_step_times_over_the_steps_of_each_window():
    rows = [
        {"step": 5, "reward": 0.2, "perf/step_s": 1.0, "entropy": 0.5, "name": "x"},
        {"step": 10, "reward": None, "perf/step_s": 2.0, "entropy": None},
        {"step": 12, "reward": 0.9, "perf/step_s": 0.5},
    ]
    curve = curve_from_rows(rows)
    assert [p.wall_s for p in curve.points] == [5.0, 15.0, 16.0]
    assert math.isnan(curve.points[1].reward) and math.isnan(curve.points[1].metric("entropy"))
    assert "name" not in curve.points[0].metrics
    assert time_to(curve, 0.9) == 16.0
    timed = curve_from_rows(
        [{**r, "elapsed_s": 3.0 * r["step"]} for r in rows], wall_key="elapsed_s"
    )
    assert [p.wall_s for p in timed.points] == [15.0, 30.0, 36.0]
    with pytest.raises(ValueError, match="perf/step_s"):
        curve_from_rows([{"step": 1, "reward": 0.0}])


def test_records_refuse_bad_data():
    with pytest.raises(ValueError, match="steps must increase"):
        RunCurve([CurvePoint(1, 0.0, 0.0), CurvePoint(1, 1.0, 0.0)])
    with pytest.raises(ValueError, match="wall time must not decrease"):
        RunCurve([CurvePoint(1, 2.0, 0.0), CurvePoint(2, 1.0, 0.0)])
    with pytest.raises(ValueError, match="threshold"):
        Statistic("time_to")
    with pytest.raises(ValueError, match="no argument"):
        Statistic("auc", 1.0)
    with pytest.raises(ValueError, match="integer"):
        Statistic("final_reward", 2.5)
    with pytest.raises(ValueError, match="zero_std_above"):
        CollapseRule(zero_std_above=2.0)


def test_run_statistics():
    curve = RunCurve(
        [
            CurvePoint(1, 2.0, 0.5, {"perf/step_s": 2.0}),
            CurvePoint(2, 3.0, 1.0, {"perf/step_s": 1.0}),
            CurvePoint(3, 4.0, 1.0, {"perf/step_s": 1.0}),
        ]
    )
    assert run_statistic(curve, Statistic("time_to", 1.0)) == 3.0
    assert run_statistic(curve, Statistic("steps_to", 1.0)) == 2.0
    assert run_statistic(curve, Statistic("steps_to", 1.5)) == Censored(3)
    assert run_statistic(curve, Statistic("final_reward", 1)) == 1.0
    assert run_statistic(curve, Statistic("final_reward")) == pytest.approx(2.5 / 3)
    assert run_statistic(curve, Statistic("perf/step_s")) == 1.0
    assert run_statistic(curve, Statistic("collapsed")) == 0.0
    assert Statistic("perf/step_s").unit == "s" and Statistic("steps_to", 1.0).unit == "steps"
    with pytest.raises(ValueError, match="perf/nothing"):
        metric_median(curve, "perf/nothing")
    run = Run({"lr": 0.01, "flag": True}, 3, curve)
    assert run.describe() == "lr=0.01, flag=true, seed=3"


def test_rows_of_evaluations_alone_are_points_without_reward_or_step_time() -> None:
    """metrics.jsonl gives an evaluation at a step that logged no window a row of its own
    (version 0's, or one between logging steps): it is a curve point at the wall time so far,
    without a reward, that leaves the windows' step counts and the pipeline figures alone."""
    from asyncgrpo.core.experiments.curves import metric_gain
    from asyncgrpo.core.experiments.prediction_figures import pipeline_figures, samples_per_s

    windows = [
        {"step": 2, "reward": 0.25, "perf/step_s": 0.5, "batch/samples_per_step": 4.0},
        {"step": 4, "reward": 0.75, "perf/step_s": 1.0, "batch/samples_per_step": 8.0},
    ]
    rows = [
        {"step": 0, "eval/held/reward": 0.125},
        windows[0],
        {"step": 3, "eval/held/reward": 0.5},
        windows[1],
    ]
    curve = curve_from_rows(rows)
    assert [(p.step, p.wall_s) for p in curve.points] == [(0, 0.0), (2, 1.0), (3, 1.0), (4, 3.0)]
    assert final_reward(curve, last=2) == 0.5 and auc_steps(curve) == 0.5
    assert metric_gain(curve, "eval/held/reward") == 0.375
    assert pipeline_figures(rows, skip_windows=0) == pipeline_figures(windows, skip_windows=0)
    assert samples_per_s(rows, skip_windows=1) == samples_per_s(windows, skip_windows=1) == 8.0
