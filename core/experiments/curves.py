"""One run's learning curve and the numbers an experiment reads off it.

A :class:`RunCurve` is what a run's ``metrics.jsonl`` says over time: one :class:`CurvePoint`
per logged window (the optimizer step it ends at, wall seconds since the run started, the
window's mean ``reward`` and every other metric it logged). From a curve:

* :func:`time_to` / :func:`steps_to` a reward threshold: the first logged point whose reward is
  at or above the threshold. A run that never gets there is **censored**, a
  :class:`Censored` value (the run ended after ``at_least`` seconds or steps without reaching
  it), never a number, so a statistic over seeds cannot mistake "not reached" for "fast";
* :func:`final_reward`: the mean reward of the last ``k`` logged points;
* :func:`auc_steps` / :func:`auc_time`: the area under the reward curve against steps or wall
  seconds (trapezoid), divided by the span, so it is the curve's mean reward (a constant curve
  gives that constant);
* :func:`collapse_step` / :func:`collapsed`: a policy collapse by an explicit
  :class:`CollapseRule` over the per-step metrics;
* :func:`metric_median`: any logged metric's median over the run (``perf/step_s``, ...).

A :class:`~asyncgrpo.core.experiments.statistic.Statistic` names one of these (the claims' and
tables' vocabulary, :mod:`asyncgrpo.core.experiments.statistic`). A :class:`Run` is a curve
with the settings and seed it ran with.

Example:
    >>> curve = RunCurve([CurvePoint(1, 2.0, 0.2), CurvePoint(2, 4.0, 0.6),
    ...                   CurvePoint(3, 6.0, 0.9), CurvePoint(4, 8.0, 0.95)])
    >>> time_to(curve, 0.9), steps_to(curve, 0.9), time_to(curve, 0.99)
    (6.0, 3, Censored(at_least=8.0))
    >>> round(final_reward(curve, last=2), 3), round(auc_steps(curve), 3)
    (0.925, 0.692)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from asyncgrpo.core.frozen import FrozenMap

DEFAULT_FINAL_POINTS = 3
"""Logged points :func:`final_reward` averages when a statistic does not say."""


def _float_map(metrics: Mapping[str, Any] | None) -> FrozenMap[str, float]:
    """Numeric entries only (``null`` in the JSONL becomes NaN); strings and the like dropped."""
    out: dict[str, float] = {}
    for key, value in (metrics or {}).items():
        if value is None:
            out[str(key)] = math.nan
        elif isinstance(value, bool | int | float):
            out[str(key)] = float(value)
    return FrozenMap(out)


@attrs.frozen
class Censored:
    """A time or step count that was not observed: the run ended after ``at_least`` (seconds
    or steps) without reaching the threshold. It counts as +infinity in statistics over seeds.

    Example:
        >>> Censored(12.5).at_least, float(Censored(12.5))
        (12.5, inf)
    """

    at_least: float

    def __float__(self) -> float:
        return math.inf


Observed = float | Censored
"""A per-run value that may be censored."""


@attrs.frozen
class CurvePoint:
    """One logged window of a run.

    Attributes:
        step: the optimizer step the window ends at (``metrics.jsonl``'s ``step``), >= 0.
        wall_s: wall seconds since the run started, at the end of that step, >= 0.
        reward: the window's mean reward; NaN when the window logged none.
        metrics: every other numeric metric of the window (NaN where the file has ``null``).
    """

    step: int = attrs.field(converter=int)
    wall_s: float = attrs.field(converter=float)
    reward: float = attrs.field(converter=float)
    metrics: FrozenMap[str, float] = attrs.field(factory=FrozenMap, converter=_float_map)

    def __attrs_post_init__(self) -> None:
        if self.step < 0:
            raise ValueError(f"CurvePoint.step: must be >= 0, got {self.step}")
        if not (math.isfinite(self.wall_s) and self.wall_s >= 0):
            raise ValueError(f"CurvePoint.wall_s: must be finite and >= 0, got {self.wall_s}")
        if math.isinf(self.reward):
            raise ValueError(f"CurvePoint.reward: must be finite or NaN, got {self.reward}")

    def metric(self, name: str) -> float:
        """The value of metric ``name`` at this point (``reward`` included), NaN if absent."""
        if name == "reward":
            return self.reward
        return self.metrics.get(name, math.nan)


def _points(values: Iterable[CurvePoint]) -> tuple[CurvePoint, ...]:
    return tuple(values)


@attrs.frozen
class RunCurve:
    """A run's logged points, in order: steps strictly increasing, wall time never decreasing.

    Example:
        >>> RunCurve([CurvePoint(2, 1.0, 0.5), CurvePoint(1, 2.0, 0.5)])
        Traceback (most recent call last):
        ...
        ValueError: RunCurve.points: steps must increase, got step 1 after step 2
    """

    points: tuple[CurvePoint, ...] = attrs.field(converter=_points)

    def __attrs_post_init__(self) -> None:
        for before, after in zip(self.points, self.points[1:], strict=False):
            if after.step <= before.step:
                raise ValueError(
                    f"RunCurve.points: steps must increase, got step {after.step} after step "
                    f"{before.step}"
                )
            if after.wall_s < before.wall_s:
                raise ValueError(
                    f"RunCurve.points: wall time must not decrease, got {after.wall_s} s at step "
                    f"{after.step} after {before.wall_s} s at step {before.step}"
                )

    @property
    def last_step(self) -> int:
        return self.points[-1].step if self.points else 0

    @property
    def last_wall_s(self) -> float:
        return self.points[-1].wall_s if self.points else 0.0


def _setting_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _settings_map(settings: Mapping[str, Any]) -> FrozenMap[str, str]:
    return FrozenMap({str(k): _setting_text(v) for k, v in settings.items()})


@attrs.frozen
class Run:
    """One run of an experiment: the settings it overrode (values as text, booleans as
    ``true``/``false``), its seed and its curve.

    Example:
        >>> Run({"max_staleness": 1, "use_lora": False}, 0, RunCurve([])).settings
        FrozenMap({'max_staleness': '1', 'use_lora': 'false'})
    """

    settings: FrozenMap[str, str] = attrs.field(converter=_settings_map)
    seed: int = attrs.field(converter=int)
    curve: RunCurve

    def describe(self) -> str:
        """``max_staleness=1, seed=0``: the run for people."""
        return ", ".join([*(f"{k}={v}" for k, v in self.settings.items()), f"seed={self.seed}"])


def evaluation_only(row: Mapping[str, Any]) -> bool:
    """Whether a ``metrics.jsonl`` row holds only an evaluation's ``eval/...`` figures: a row
    of its own at a step that logged no window (the evaluation of version 0, or of a step
    between logging steps).

    Example:
        >>> evaluation_only({"step": 0, "eval/held/reward": 0.5}), evaluation_only({"step": 1})
        (True, False)
    """
    names = [name for name in row if name != "step"]
    return bool(names) and all(name.startswith("eval/") for name in names)


def curve_from_rows(
    rows: Iterable[Mapping[str, Any]], reward_key: str = "reward", wall_key: str | None = None
) -> RunCurve:
    """A curve from a run's ``metrics.jsonl`` rows (one dict per logged window, with ``step``).

    Wall seconds come from ``row[wall_key]`` when a key is given; otherwise they are the summed
    step times: each window's mean ``perf/step_s`` times the steps it covers (its ``step``
    minus the previous window's). The summed step times leave out what comes before the first
    step (model loading, the server's start), so two runs are timed alike whatever their
    start-up took. A row that holds only an evaluation (:func:`evaluation_only`) is a point
    without a reward at the wall time of the window before it.

    Example:
        >>> rows = [{"step": 2, "reward": 0.1, "perf/step_s": 0.5, "loss": None},
        ...         {"step": 4, "reward": 0.3, "perf/step_s": 0.25}]
        >>> [(p.step, p.wall_s, p.reward) for p in curve_from_rows(rows).points]
        [(2, 1.0, 0.1), (4, 1.5, 0.3)]
    """
    points, wall_s, previous = [], 0.0, 0
    for row in rows:
        step = int(row["step"])
        metrics = {k: v for k, v in row.items() if k not in ("step", reward_key)}
        reward = row.get(reward_key)
        if evaluation_only(row):
            points.append(CurvePoint(step, wall_s, math.nan, metrics))
            continue
        if wall_key is not None:
            if row.get(wall_key) is None:
                raise ValueError(f"metrics row at step {step} has no {wall_key!r}")
            wall_s = float(row[wall_key])
        else:
            step_s = row.get("perf/step_s")
            if step_s is None:
                raise ValueError(
                    f"metrics row at step {step} has no 'perf/step_s', so its wall time is "
                    "unknown; pass wall_key naming a column of seconds since the start"
                )
            wall_s += float(step_s) * (step - previous)
        points.append(
            CurvePoint(step, wall_s, math.nan if reward is None else float(reward), metrics)
        )
        previous = step
    return RunCurve(points)


def first_crossing(curve: RunCurve, threshold: float) -> CurvePoint | None:
    """The first point whose reward is at or above ``threshold`` (NaN rewards never are), or
    None when the run never gets there.

    Example:
        >>> curve = RunCurve([CurvePoint(1, 1.0, 0.95), CurvePoint(2, 2.0, 0.5)])
        >>> first_crossing(curve, 0.9).step, first_crossing(curve, 0.99)
        (1, None)
    """
    return next((p for p in curve.points if p.reward >= threshold), None)


def time_to(curve: RunCurve, threshold: float) -> Observed:
    """Wall seconds until the first point with reward >= ``threshold``, or
    :class:`Censored` at the run's last wall time when no point reaches it.

    Example:
        >>> time_to(RunCurve([CurvePoint(1, 3.0, 0.5), CurvePoint(2, 7.5, 0.9)]), 0.9)
        7.5
    """
    point = first_crossing(curve, threshold)
    return Censored(curve.last_wall_s) if point is None else point.wall_s


def steps_to(curve: RunCurve, threshold: float) -> int | Censored:
    """Optimizer steps until the first point with reward >= ``threshold``, or
    :class:`Censored` at the run's last step. Steps are known only at logged points, so with
    ``logging_steps`` k this is a multiple of k.

    Example:
        >>> steps_to(RunCurve([CurvePoint(5, 3.0, 0.5), CurvePoint(10, 7.5, 0.7)]), 0.9)
        Censored(at_least=10)
    """
    point = first_crossing(curve, threshold)
    return Censored(curve.last_step) if point is None else point.step


def _rewarded(curve: RunCurve) -> list[CurvePoint]:
    points = [p for p in curve.points if not math.isnan(p.reward)]
    if not points:
        raise ValueError("the run logged no reward, so it has no reward curve")
    return points


def final_reward(curve: RunCurve, last: int = DEFAULT_FINAL_POINTS) -> float:
    """Mean reward of the last ``last`` points that logged a reward (all of them if fewer).

    Example:
        >>> final_reward(RunCurve([CurvePoint(1, 1.0, 0.0), CurvePoint(2, 2.0, 0.5),
        ...                        CurvePoint(3, 3.0, 1.0)]), last=2)
        0.75
    """
    if last < 1:
        raise ValueError(f"final_reward: last must be >= 1, got {last}")
    return float(np.mean([p.reward for p in _rewarded(curve)[-last:]]))


def _mean_under(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Trapezoid area under ``ys`` over ``xs`` divided by the span; the plain mean of ``ys``
    when the span is zero (a single point)."""
    span = xs[-1] - xs[0]
    if span <= 0:
        return float(np.mean(ys))
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    shares = np.diff(x) / span  # each segment's share of the span (no underflow on tiny spans)
    return float(np.sum(shares * (y[1:] + y[:-1]) / 2))


def auc_steps(curve: RunCurve) -> float:
    """Area under the reward curve against steps, from the first to the last point that logged
    a reward, divided by that span of steps: the curve's mean reward over training.

    Example:
        >>> auc_steps(RunCurve([CurvePoint(1, 1.0, 0.0), CurvePoint(3, 2.0, 1.0)]))
        0.5
    """
    points = _rewarded(curve)
    return _mean_under([float(p.step) for p in points], [p.reward for p in points])


def auc_time(curve: RunCurve) -> float:
    """Area under the reward curve against wall seconds divided by the span of seconds: the
    mean reward over the run's time, so a run that learns in fewer seconds scores higher.

    Example:
        >>> auc_time(RunCurve([CurvePoint(1, 0.0, 0.0), CurvePoint(2, 1.0, 1.0),
        ...                    CurvePoint(3, 4.0, 1.0)]))
        0.875
    """
    points = _rewarded(curve)
    return _mean_under([p.wall_s for p in points], [p.reward for p in points])


def metric_median(curve: RunCurve, name: str) -> float:
    """Median of metric ``name`` over the points that logged a finite value.

    Example:
        >>> metric_median(RunCurve([CurvePoint(1, 1.0, 0.0, {"perf/step_s": 0.3}),
        ...                         CurvePoint(2, 2.0, 0.0, {"perf/step_s": 0.5}),
        ...                         CurvePoint(3, 3.0, 0.0, {"perf/step_s": 0.4})]), "perf/step_s")
        0.4
    """
    values = [v for p in curve.points if math.isfinite(v := p.metric(name))]
    if not values:
        raise ValueError(f"metric {name!r} has no finite value in this run")
    return float(np.median(values))


def metric_gain(curve: RunCurve, name: str) -> float:
    """Metric ``name``'s last finite value minus its first (e.g. a held-out evaluation's
    reward after training against before it).

    Example:
        >>> metric_gain(RunCurve([CurvePoint(1, 1.0, 0.0, {"eval/t/reward": 0.2}),
        ...                       CurvePoint(2, 2.0, 0.0, {}),
        ...                       CurvePoint(3, 3.0, 0.0, {"eval/t/reward": 0.5})]),
        ...             "eval/t/reward")
        0.3
    """
    values = [v for p in curve.points if math.isfinite(v := p.metric(name))]
    if not values:
        raise ValueError(f"metric {name!r} has no finite value in this run")
    return round(values[-1] - values[0], 12)


@attrs.frozen
class CollapseRule:
    """When a run counts as collapsed.

    A logged point is *collapsing* when its ``entropy`` (``entropy_key``) is below
    ``entropy_below`` **and** its share of groups without reward spread
    (``frac_reward_zero_std``, ``zero_std_key``) is above ``zero_std_above`` **and**, when
    ``reward_below`` is set, its reward is below that. A run collapses at the first of
    ``consecutive`` consecutive logged points that are all collapsing. A point missing one of
    the metrics (or with NaN) is not collapsing, so it breaks a streak.

    The rule describes a policy that stopped exploring (tiny entropy) and stopped learning
    (almost no group has a reward spread, so almost nothing is trained on): the collapse
    measured here at lr 1e-2 took entropy from 0.5 to 0.004 in 8 steps and left almost no group
    with spread. A policy that *solved* the task also has groups without spread (all
    rewards 1); set ``reward_below`` to tell the two apart on a task whose reward scale you know.

    Example:
        >>> CollapseRule()
        CollapseRule(entropy_below=0.05, zero_std_above=0.9, consecutive=3, reward_below=None, \
entropy_key='entropy', zero_std_key='frac_reward_zero_std')
    """

    entropy_below: float = 0.05
    zero_std_above: float = 0.9
    consecutive: int = 3
    reward_below: float | None = None
    entropy_key: str = "entropy"
    zero_std_key: str = "frac_reward_zero_std"

    def __attrs_post_init__(self) -> None:
        if self.consecutive < 1:
            raise ValueError(f"CollapseRule.consecutive: must be >= 1, got {self.consecutive}")
        if not 0.0 <= self.zero_std_above <= 1.0:
            raise ValueError(
                f"CollapseRule.zero_std_above: a share in [0, 1], got {self.zero_std_above}"
            )

    def collapsing(self, point: CurvePoint) -> bool:
        """Whether one point meets the rule's condition."""
        entropy, zero_std = point.metric(self.entropy_key), point.metric(self.zero_std_key)
        reward_low = self.reward_below is None or point.reward < self.reward_below
        return entropy < self.entropy_below and zero_std > self.zero_std_above and reward_low


def collapse_step(curve: RunCurve, rule: CollapseRule | None = None) -> int | None:
    """The step of the first point of the first streak of ``rule.consecutive`` collapsing
    points, or None when the run never collapses (``rule`` defaults to ``CollapseRule()``).

    Example:
        >>> def point(step, entropy):
        ...     return CurvePoint(step, step, 0.0,
        ...                       {"entropy": entropy, "frac_reward_zero_std": 1.0})
        >>> curve = RunCurve([point(1, 0.5), point(2, 0.01), point(3, 0.2), point(4, 0.01),
        ...                   point(5, 0.004)])
        >>> collapse_step(curve, CollapseRule(consecutive=2)), collapse_step(curve)
        (4, None)
    """
    rule = rule or CollapseRule()
    streak = 0
    for index, point in enumerate(curve.points):
        streak = streak + 1 if rule.collapsing(point) else 0
        if streak == rule.consecutive:
            return curve.points[index - rule.consecutive + 1].step
    return None


def collapsed(curve: RunCurve, rule: CollapseRule | None = None) -> bool:
    """Whether the run collapses by ``rule`` (see :func:`collapse_step`).

    Example:
        >>> collapsed(RunCurve([CurvePoint(1, 1.0, 0.5, {"entropy": 0.6})]))
        False
    """
    return collapse_step(curve, rule) is not None
