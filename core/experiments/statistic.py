"""A named statistic of a run: the vocabulary of the claims and the tables.

A :class:`Statistic` names one number per run (the time or the steps to a reward, the final
reward, the reward's area under the curve, a collapse, a metric's gain or median), and
:func:`run_statistic` reads it off a run's curve with the functions of
:mod:`asyncgrpo.core.experiments.curves`.
"""

from __future__ import annotations

import math

import attrs

from asyncgrpo.core.experiments.curves import (
    DEFAULT_FINAL_POINTS,
    Censored,
    CollapseRule,
    Observed,
    RunCurve,
    auc_steps,
    auc_time,
    collapsed,
    final_reward,
    metric_gain,
    metric_median,
    steps_to,
    time_to,
)

STATISTICS = ("time_to", "steps_to", "final_reward", "auc", "auc_time", "collapsed", "gain")
"""The named statistics; any other :class:`Statistic` name is a logged metric (its median)."""

_NEEDS_THRESHOLD = ("time_to", "steps_to")


@attrs.frozen
class Statistic:
    """One number per run, by name:

    ========================  ====================================================  =========
    name (argument)           per run                                               unit
    ========================  ====================================================  =========
    ``time_to`` (threshold)   :func:`time_to`, censored when not reached            s
    ``steps_to`` (threshold)  :func:`steps_to`, censored when not reached           steps
    ``final_reward`` (k)      :func:`final_reward` of the last k points (default 3) reward
    ``auc``                   :func:`auc_steps`: mean reward against steps          reward
    ``auc_time``              :func:`auc_time`: mean reward against wall time       reward
    ``collapsed``             1 when :func:`collapsed`, else 0 (a count over runs)  runs
    ``gain`` (metric)         :func:`metric_gain`: its last value minus its first   metric's
    any other, a metric name  :func:`metric_median` of that metric                  metric's
    ========================  ====================================================  =========

    Example:
        >>> Statistic("time_to", 0.9).text, Statistic("perf/step_s").label
        ('time_to(0.9)', 'median perf/step_s')
    """

    name: str
    argument: float | str | None = None

    def __attrs_post_init__(self) -> None:
        if not self.name:
            raise ValueError("Statistic.name: empty")
        if self.name == "gain":
            if not isinstance(self.argument, str) or not self.argument:
                raise ValueError("Statistic gain: needs a metric name, e.g. gain(entropy)")
        elif isinstance(self.argument, str):
            raise ValueError(f"Statistic {self.name}: takes no metric name, got {self.argument}")
        elif self.name in _NEEDS_THRESHOLD:
            if self.argument is None or not math.isfinite(self.argument):
                raise ValueError(f"Statistic {self.name}: needs a finite reward threshold")
        elif self.name == "final_reward":
            a = self.argument
            if a is not None and (a != int(a) or a < 1):
                raise ValueError(f"Statistic final_reward: k must be an integer >= 1, got {a}")
        elif self.argument is not None:
            raise ValueError(f"Statistic {self.name}: takes no argument, got {self.argument}")

    @property
    def threshold(self) -> float:
        """The reward threshold of a statistic of :data:`_NEEDS_THRESHOLD` (``time_to``,
        ``steps_to``).

        Raises:
            ValueError: this statistic takes no threshold.
        """
        if self.argument is None or isinstance(self.argument, str):
            raise ValueError(f"Statistic {self.name}: has no reward threshold")
        return float(self.argument)

    @property
    def is_count(self) -> bool:
        """Whether it is a yes/no per run, summed over runs (``collapsed``)."""
        return self.name == "collapsed"

    @property
    def is_metric(self) -> bool:
        return self.name not in STATISTICS

    @property
    def unit(self) -> str:
        """``s`` for seconds (``time_to`` and metrics named ``*_s``), ``steps`` for
        ``steps_to``, else empty."""
        if self.name == "time_to" or (self.is_metric and self.name.endswith("_s")):
            return "s"
        return "steps" if self.name == "steps_to" else ""

    @property
    def text(self) -> str:
        """The statistic as a claim writes it: ``time_to(0.9)``, ``final_reward``."""
        if self.argument is None:
            return self.name
        if self.name == "gain":
            return f"gain({self.argument})"
        argument = int(self.argument) if self.name == "final_reward" else self.argument
        return f"{self.name}({argument!r})"

    @property
    def label(self) -> str:
        """A column title for people."""
        a = self.argument
        if self.name == "time_to":
            return f"time to {a:g}"
        if self.name == "steps_to":
            return f"steps to {a:g}"
        if self.name == "final_reward":
            return f"final reward (last {int(a or DEFAULT_FINAL_POINTS)})"
        if self.name == "gain":
            return f"gain of {a} (last - first)"
        fixed = {"auc": "reward AUC, steps", "auc_time": "reward AUC, time"}
        return fixed.get(self.name, self.name if self.is_count else f"median {self.name}")


def run_statistic(
    curve: RunCurve,
    statistic: Statistic,
    rule: CollapseRule | None = None,
) -> Observed:
    """The value of ``statistic`` for one run (see :class:`Statistic`); ``collapse`` uses
    ``rule``.

    Example:
        >>> from asyncgrpo.core.experiments.curves import CurvePoint
        >>> curve = RunCurve([CurvePoint(1, 2.0, 0.5), CurvePoint(2, 4.0, 1.0)])
        >>> [run_statistic(curve, Statistic(n, a)) for n, a in
        ...  [("time_to", 0.9), ("steps_to", 2.0), ("auc", None), ("collapsed", None)]]
        [4.0, Censored(at_least=2), 0.75, 0.0]
    """
    name, argument = statistic.name, statistic.argument
    if name == "time_to":
        return time_to(curve, statistic.threshold)
    if name == "steps_to":
        steps = steps_to(curve, statistic.threshold)
        return steps if isinstance(steps, Censored) else float(steps)
    if name == "final_reward":
        return final_reward(curve, int(argument or DEFAULT_FINAL_POINTS))
    if name == "auc":
        return auc_steps(curve)
    if name == "auc_time":
        return auc_time(curve)
    if name == "collapsed":
        return float(collapsed(curve, rule))
    if name == "gain":
        return metric_gain(curve, str(argument))
    return metric_median(curve, name)
