"""Metric windows: everything recorded since the last log, aggregated by the metric's name.

TRL's AsyncGRPOTrainer rules, applied by :func:`aggregation_for`:

* a **ratio** recorded with :func:`ratio` (rates such as ``rollout/generated_tokens_per_s``,
  fractions such as ``tools/failure_frequency``) is total numerator / total denominator;
* otherwise a name whose last part contains the word ``count`` is **summed**
  (``sample/dropped_stale_count`` counts since the last log);
* a last part containing the word ``max`` or ``min`` keeps the **extreme**
  (``sample/staleness_max``, ``completions/min_length``);
* anything else is the **mean** of the recorded values. A value measured per rollout, sample or
  call is recorded with its weight (the number of items it stands for), so the window's mean is
  over all items, not over batches;
* a value recorded with :func:`latest` (an evaluation's result, which a window may hold more
  than one of) keeps the one of the highest order (its weight version), whatever the order the
  windows merge in.

Windows are immutable and merge associatively (:func:`merge`), so windows from several
processes or several steps combine into the same summary in any order.

Example:
    >>> window = record(MetricWindow(), [
    ...     value("sample/staleness_max", 2), value("sample/staleness_max", 5),
    ...     value("sample/dropped_stale_count", 3), value("sample/dropped_stale_count", 4),
    ...     value("reward", 1.0, weight=3), value("reward", 0.0, weight=1),
    ...     ratio("rollout/generated_tokens_per_s", 1000, 2.0),
    ...     ratio("rollout/generated_tokens_per_s", 500, 3.0),
    ... ])
    >>> summarize(window)
    {'reward': 0.75, 'rollout/generated_tokens_per_s': 300.0, 'sample/dropped_stale_count': 7.0, \
'sample/staleness_max': 5.0}
"""

from __future__ import annotations

import math
import re
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


_WORDS = re.compile(r"[a-z0-9]+")


def aggregation_for(name: str) -> Aggregation:
    """The aggregation a plain value of metric ``name`` gets, from its last ``/`` part.

    Example:
        >>> [aggregation_for(n).value for n in
        ...  ["tools/search/call_count", "completions/max_length", "clip_ratio/low_min",
        ...   "reward", "rollout/turns_mean"]]
        ['sum', 'max', 'min', 'mean', 'mean']
    """
    words = set(_WORDS.findall(name.rsplit("/", 1)[-1].lower()))
    if "count" in words:
        return Aggregation.SUM
    if "max" in words:
        return Aggregation.MAX
    if "min" in words:
        return Aggregation.MIN
    return Aggregation.MEAN


@attrs.frozen
class Observation:
    """One recorded measurement: a weighted value, or a numerator/denominator pair (ratio)."""

    name: str
    amount: float
    weight: float = 1.0
    is_ratio: bool = False
    aggregation: Aggregation | None = None
    """Declared by the maker (:func:`latest`); None: read from the name
    (:func:`aggregation_for`)."""


def value(name: str, amount: float, weight: float = 1.0) -> Observation:
    """A plain value; ``weight`` is the number of items (rollouts, samples, calls) it averages.

    A non-finite value is ignored, so one NaN (e.g. a std over one item) cannot poison a window.
    """
    if weight < 0:
        raise ValueError(f"metric {name!r}: weight must be >= 0, got {weight}")
    return Observation(name=name, amount=float(amount), weight=float(weight))


def ratio(name: str, numerator: float, denominator: float) -> Observation:
    """A ratio recorded as its parts; the window reports total numerator / total denominator."""
    if denominator < 0:
        raise ValueError(f"metric {name!r}: denominator must be >= 0, got {denominator}")
    return Observation(name=name, amount=float(numerator), weight=float(denominator), is_ratio=True)


def latest(name: str, amount: float, order: float) -> Observation:
    """A value that replaces older ones: a window keeps the one of the highest ``order`` (an
    evaluation's weight version), so two results in one window report the newest.

    Example:
        >>> summarize(record(MetricWindow(), [latest("eval/test/reward", 0.5, order=5),
        ...                                   latest("eval/test/reward", 0.25, order=2)]))
        {'eval/test/reward': 0.5}
    """
    return Observation(name=name, amount=float(amount), weight=float(order),
                       aggregation=Aggregation.LATEST)  # fmt: skip


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


@attrs.frozen
class MetricWindow:
    """Everything recorded since the last log, one :class:`Stat` per metric name."""

    stats: Mapping[str, Stat] = attrs.field(factory=dict, converter=FrozenMap)

    def __len__(self) -> int:
        return len(self.stats)


def record(window: MetricWindow, observations: Iterable[Observation]) -> MetricWindow:
    """The window with ``observations`` added.

    Raises:
        ValueError: when one name is recorded both as a ratio and as a plain value.
    """
    stats = dict(window.stats)
    for observation in observations:
        kind = _aggregation_of(observation)
        stat = stats.get(observation.name) or Stat(kind)
        if stat.aggregation is not kind:
            raise ValueError(
                f"metric {observation.name!r} was recorded as {stat.aggregation.value} and "
                f"then as {kind.value}; record it one way"
            )
        stats[observation.name] = stat.add(observation)
    return MetricWindow(stats)


def _aggregation_of(observation: Observation) -> Aggregation:
    if observation.aggregation is not None:
        return observation.aggregation
    return Aggregation.RATIO if observation.is_ratio else aggregation_for(observation.name)


def merge(a: MetricWindow, b: MetricWindow) -> MetricWindow:
    """Combine two windows (e.g. from two processes); associative and commutative."""
    stats = dict(a.stats)
    for name, stat in b.stats.items():
        stats[name] = stats[name].combine(stat) if name in stats else stat
    return MetricWindow(stats)


def summarize(window: MetricWindow) -> dict[str, float]:
    """One value per metric name, sorted by name; NaN where nothing finite was recorded."""
    return {name: window.stats[name].result() for name in sorted(window.stats)}
