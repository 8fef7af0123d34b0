"""Metric windows: everything recorded since the last log, each metric aggregated as its maker
declared.

A metric's reduction is declared where it is made, by the function that makes it, never read
from its name (a rename cannot change how it adds up):

* :func:`mean` (a value measured per rollout, sample or call is recorded with its weight, the
  number of items it stands for, so the window's mean is over all items, not over batches);
* :func:`total` (counts since the last log: ``sample/dropped_stale_count``);
* :func:`maximum` and :func:`minimum` keep the extreme (``sample/staleness_max``,
  ``completions/min_length``);
* :func:`ratio`: total numerator / total denominator (rates such as
  ``rollout/generated_tokens_per_s``, fractions such as ``tools/failure_frequency``);
* :func:`latest`: the value of the highest order (an evaluation's result, which a window may
  hold more than one of, keeps the newest weight version's), whatever the order the windows
  merge in.

Metrics made in bulk as a name-to-value mapping (the loss's, an objective's, a step's
``batch/*``) are declared in a table beside their names and recorded with :func:`declared`.
The names follow TRL's AsyncGRPOTrainer's convention (a ``count`` is a total, a ``max`` or
``min`` the extreme), which a test checks against the declarations.

Windows are immutable and merge associatively (:func:`merge`), so windows from several
processes or several steps combine into the same summary in any order.

Example:
    >>> window = record(MetricWindow(), [
    ...     maximum("sample/staleness_max", 2), maximum("sample/staleness_max", 5),
    ...     total("sample/dropped_stale_count", 3), total("sample/dropped_stale_count", 4),
    ...     mean("reward", 1.0, weight=3), mean("reward", 0.0, weight=1),
    ...     ratio("rollout/generated_tokens_per_s", 1000, 2.0),
    ...     ratio("rollout/generated_tokens_per_s", 500, 3.0),
    ... ])
    >>> summarize(window)
    {'reward': 0.75, 'rollout/generated_tokens_per_s': 300.0, 'sample/dropped_stale_count': 7.0, \
'sample/staleness_max': 5.0}
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from enum import Enum

import attrs

from asyncgrpo.core.frozen import FrozenMap


class Aggregation(Enum):
    """How a metric's values combine inside a window."""

    MEAN = "mean"
    SUM = "sum"
    MAX = "max"
    MIN = "min"
    RATIO = "ratio"
    LATEST = "latest"


@attrs.frozen
class Observation:
    """One recorded measurement and how it aggregates: a weighted value, an extreme, a count,
    a numerator/denominator pair (ratio) or an ordered value (latest)."""

    name: str
    amount: float
    aggregation: Aggregation
    weight: float = 1.0
    """The items a mean stands for; a ratio's denominator; a latest value's order."""

    @property
    def is_ratio(self) -> bool:
        return self.aggregation is Aggregation.RATIO


def mean(name: str, amount: float, weight: float = 1.0) -> Observation:
    """A value averaged over the window; ``weight`` is the number of items (rollouts, samples,
    calls) it averages.

    A non-finite value is ignored, so one NaN (e.g. a std over one item) cannot poison a window.
    """
    if weight < 0:
        raise ValueError(f"metric {name!r}: weight must be >= 0, got {weight}")
    return Observation(name, float(amount), Aggregation.MEAN, float(weight))


def total(name: str, amount: float) -> Observation:
    """A count added up over the window (events since the last log).

    Example:
        >>> summarize(record(MetricWindow(), [total("tools/search/call_count", 2),
        ...                                   total("tools/search/call_count", 1)]))
        {'tools/search/call_count': 3.0}
    """
    return Observation(name, float(amount), Aggregation.SUM)


def maximum(name: str, amount: float) -> Observation:
    """A value of which the window keeps the largest."""
    return Observation(name, float(amount), Aggregation.MAX)


def minimum(name: str, amount: float) -> Observation:
    """A value of which the window keeps the smallest."""
    return Observation(name, float(amount), Aggregation.MIN)


def ratio(name: str, numerator: float, denominator: float) -> Observation:
    """A ratio recorded as its parts; the window reports total numerator / total denominator."""
    if denominator < 0:
        raise ValueError(f"metric {name!r}: denominator must be >= 0, got {denominator}")
    return Observation(name, float(numerator), Aggregation.RATIO, float(denominator))


def latest(name: str, amount: float, order: float) -> Observation:
    """A value that replaces older ones: a window keeps the one of the highest ``order`` (an
    evaluation's weight version), so two results in one window report the newest.

    Example:
        >>> summarize(record(MetricWindow(), [latest("eval/test/reward", 0.5, order=5),
        ...                                   latest("eval/test/reward", 0.25, order=2)]))
        {'eval/test/reward': 0.5}
    """
    return Observation(name, float(amount), Aggregation.LATEST, float(order))


_MAKERS = {Aggregation.SUM: total, Aggregation.MAX: maximum, Aggregation.MIN: minimum}


def declared(
    name: str, amount: float, weight: float, table: Mapping[str, Aggregation]
) -> Observation:
    """A metric made in bulk (a name-to-value mapping), aggregated as ``table`` declares its
    name; ``weight`` counts for a mean only.

    Raises:
        ValueError: when ``table`` does not declare ``name``.

    Example:
        >>> table = {"clip_ratio/high_max": Aggregation.MAX, "entropy": Aggregation.MEAN}
        >>> declared("clip_ratio/high_max", 0.5, 7, table).aggregation.value
        'max'
        >>> declared("entropy", 1.5, 7, table).weight
        7.0
    """
    aggregation = table.get(name)
    if aggregation is None:
        raise ValueError(
            f"metric {name!r} has no declared aggregation: add it to the table of the module "
            f"that makes it (one of: {sorted({a.value for a in table.values()})}), beside the "
            f"names it declares: {sorted(table)}"
        )
    if aggregation is Aggregation.MEAN:
        return mean(name, amount, weight)
    if aggregation in _MAKERS:
        return _MAKERS[aggregation](name, amount)
    raise ValueError(
        f"metric {name!r}: a table declares means, totals and extremes, not {aggregation.value}"
    )


@attrs.frozen
class Stat:
    """The running state of one metric in a window."""

    aggregation: Aggregation
    total: float = 0.0
    weight: float = 0.0
    extreme: float = math.nan

    def add(self, observation: Observation) -> Stat:
        amount, weight = observation.amount, observation.weight
        if self.aggregation is Aggregation.RATIO:
            return Stat(self.aggregation, self.total + amount, self.weight + weight)
        if self.aggregation is Aggregation.LATEST:
            return self.combine(Stat(self.aggregation, amount, weight, amount))
        if not math.isfinite(amount):
            return self
        if self.aggregation is Aggregation.MAX:
            best = amount if math.isnan(self.extreme) else max(self.extreme, amount)
            return attrs.evolve(self, extreme=best)
        if self.aggregation is Aggregation.MIN:
            best = amount if math.isnan(self.extreme) else min(self.extreme, amount)
            return attrs.evolve(self, extreme=best)
        if self.aggregation is Aggregation.SUM:
            return attrs.evolve(self, total=self.total + amount)
        return Stat(self.aggregation, self.total + amount * weight, self.weight + weight)

    def combine(self, other: Stat) -> Stat:
        if other.aggregation is not self.aggregation:
            raise ValueError(
                f"cannot merge a {self.aggregation.value} metric with a "
                f"{other.aggregation.value} one"
            )
        if self.aggregation is Aggregation.LATEST:  # the higher order; ties: the larger value
            if (self.weight, self.total) >= (other.weight, other.total) and self.weight > 0:
                return self
            return other
        extremes = [e for e in (self.extreme, other.extreme) if not math.isnan(e)]
        pick = max if self.aggregation is Aggregation.MAX else min
        return Stat(
            self.aggregation,
            self.total + other.total,
            self.weight + other.weight,
            pick(extremes) if extremes else math.nan,
        )

    def result(self) -> float:
        if self.aggregation is Aggregation.LATEST:
            return self.total
        if self.aggregation in (Aggregation.MAX, Aggregation.MIN):
            return self.extreme
        if self.aggregation is Aggregation.SUM:
            return self.total
        return self.total / self.weight if self.weight > 0 else math.nan


def _frozen_stats(stats: Mapping[str, Stat]) -> FrozenMap[str, Stat]:
    return FrozenMap(stats)


@attrs.frozen
class MetricWindow:
    """Everything recorded since the last log, one :class:`Stat` per metric name."""

    stats: Mapping[str, Stat] = attrs.field(factory=dict, converter=_frozen_stats)

    def __len__(self) -> int:
        return len(self.stats)


def record(window: MetricWindow, observations: Iterable[Observation]) -> MetricWindow:
    """The window with ``observations`` added.

    Raises:
        ValueError: when one name is recorded both as a ratio and as a plain value.
    """
    stats = dict(window.stats)
    for observation in observations:
        kind = observation.aggregation
        stat = stats.get(observation.name) or Stat(kind)
        if stat.aggregation is not kind:
            raise ValueError(
                f"metric {observation.name!r} was recorded as {stat.aggregation.value} and "
                f"then as {kind.value}; record it one way"
            )
        stats[observation.name] = stat.add(observation)
    return MetricWindow(stats)


def merge(a: MetricWindow, b: MetricWindow) -> MetricWindow:
    """Combine two windows (e.g. from two processes); associative and commutative."""
    stats = dict(a.stats)
    for name, stat in b.stats.items():
        stats[name] = stats[name].combine(stat) if name in stats else stat
    return MetricWindow(stats)


def summarize(window: MetricWindow) -> dict[str, float]:
    """One value per metric name, sorted by name; NaN where nothing finite was recorded."""
    return {name: window.stats[name].result() for name in sorted(window.stats)}


LENGTH_QUARTERS = 4
"""Completion lengths are told apart by quarter of ``max_completion_length``."""


def length_quarter(trained_tokens: int, max_completion_length: int) -> int:
    """1 to :data:`LENGTH_QUARTERS`: the quarter of ``(0, max_completion_length]`` that a
    sample's trained tokens fall in (a multi-turn sample past it counts in the last).

    Example:
        >>> [length_quarter(n, 256) for n in (1, 64, 65, 192, 256, 300)]
        [1, 1, 2, 3, 4, 4]
    """
    share = math.ceil(LENGTH_QUARTERS * trained_tokens / max(max_completion_length, 1))
    return min(LENGTH_QUARTERS, max(1, share))
