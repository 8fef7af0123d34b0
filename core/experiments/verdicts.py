"""Verdicts on claims (:mod:`asyncgrpo.core.experiments.claims`): a claim holds, fails or stays
undecided at a stated confidence, decided from the runs a sweep made.

How a claim is decided (see :mod:`asyncgrpo.core.experiments.stats`):

* **two settings**, ``A op c * B``: the median over A's runs against ``c`` times the median
  over B's, each setting resampled on its own. The claim **holds** when the whole bootstrap
  interval of ``median(A) - c * median(B)`` satisfies ``op 0``, **fails** when the whole
  interval violates it, and is **undecided** otherwise. For positive values (times, steps)
  this is exactly the ratio rule: ``A <= c * B`` holds when the interval of ``A / B`` lies at
  or below ``c`` and fails when it lies entirely above; the ratio is reported too. Runs that
  never reached a threshold count as +infinity.
* **a setting against a constant**, ``A op k``: the bootstrap interval of ``median(A)``
  against ``k``, by the same rule.
* **counts** (``collapsed``): exact. ``collapsed[X] == 0`` holds when no run of X collapsed.

No run matching a side leaves the claim undecided (the sweep may not have run it yet); a
selector key that no run has, or a metric that a run never logged, is an error.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from enum import Enum

import attrs
import numpy as np

from asyncgrpo.core.experiments.claims import Claim, Selector
from asyncgrpo.core.experiments.curves import CollapseRule, Observed, Run
from asyncgrpo.core.experiments.statistic import Statistic, run_statistic
from asyncgrpo.core.experiments.stats import (
    DEFAULT_CONFIDENCE,
    DEFAULT_RESAMPLES,
    Comparison,
    RandomSource,
    Summary,
    compare_settings,
    summarize,
)
from asyncgrpo.core.names import did_you_mean


class Outcome(Enum):
    """A claim's verdict."""

    HOLDS = "holds"
    FAILS = "fails"
    UNDECIDED = "undecided"


@attrs.frozen
class Verdict:
    """How a claim came out, with the numbers that decided it.

    Attributes:
        claim: the claim.
        outcome: holds, fails or undecided.
        confidence: the confidence it was decided at.
        left, right: each side's summary over its runs (None for counts, a constant, or no
            runs).
        comparison: for two settings, the ratio and the difference with their intervals.
        counts: for counts, (left, right) collapsed runs; right is None against a constant.
        runs: how many runs each side has (right 0 against a constant).
        reason: one line for people.
    """

    claim: Claim
    outcome: Outcome
    confidence: float
    left: Summary | None
    right: Summary | None
    comparison: Comparison | None
    counts: tuple[int, int | None] | None
    runs: tuple[int, int]
    reason: str


def select_runs(runs: Sequence[Run], selector: Selector) -> list[Run]:
    """The runs a selector picks. A selector key that no run has is an error (a typo), not an
    empty selection.

    Example:
        >>> from asyncgrpo.core.experiments.curves import RunCurve
        >>> runs = [Run({"max_staleness": s}, 0, RunCurve([])) for s in (0, 1)]
        >>> [r.settings["max_staleness"] for r in select_runs(runs, Selector([("max_staleness",
        ...                                                                    "1")]))]
        ['1']
    """
    known = {key for run in runs for key in run.settings}
    for key, _ in selector.pairs:
        if key not in known:
            raise ValueError(
                f"no run has a setting {key!r}{did_you_mean(key, known)}; the runs' settings are "
                f"{', '.join(sorted(known)) or 'none'}"
            )
    return [run for run in runs if selector.matches(run.settings)]


def _values(runs: Sequence[Run], statistic: Statistic, rule: CollapseRule) -> list[Observed]:
    values = []
    for run in runs:
        try:
            values.append(run_statistic(run.curve, statistic, rule))
        except ValueError as error:
            names = {n for p in run.curve.points for n in p.metrics} | {"reward"}
            hint = did_you_mean(statistic.name, names) if statistic.is_metric else ""
            raise ValueError(f"run {run.describe()}: {error}{hint}") from None
    return values


def _decide(low: float, high: float, operator: str, bound: float) -> Outcome:
    """Holds when the whole interval [low, high] satisfies ``x op bound``, fails when the whole
    interval violates it."""
    holds = {
        "<=": high <= bound,
        "<": high < bound,
        ">=": low >= bound,
        ">": low > bound,
    }[operator]
    fails = {
        "<=": low > bound,
        "<": low >= bound,
        ">=": high < bound,
        ">": high <= bound,
    }[operator]
    return Outcome.HOLDS if holds else Outcome.FAILS if fails else Outcome.UNDECIDED


def _exact(left: float, operator: str, right: float) -> Outcome:
    ok = {
        "<=": left <= right,
        "<": left < right,
        ">=": left >= right,
        ">": left > right,
        "==": left == right,
    }[operator]
    return Outcome.HOLDS if ok else Outcome.FAILS


def _g(value: float) -> str:
    return f"{value:.3g}"


def _span(low: float, high: float) -> str:
    return f"[{_g(low)}, {_g(high)}]"


def evaluate_claim(
    claim: Claim,
    runs: Sequence[Run],
    confidence: float = DEFAULT_CONFIDENCE,
    resamples: int = DEFAULT_RESAMPLES,
    rng: RandomSource = 0,
    collapse_rule: CollapseRule | None = None,
) -> Verdict:
    """Decide ``claim`` from ``runs`` (see the module's docstring for the rules).
    ``confidence`` applies when the claim states none; ``collapse_rule`` (default
    ``CollapseRule()``) decides ``collapsed``.

    Example:
        >>> from asyncgrpo.core.experiments.claims import parse_claim
        >>> from asyncgrpo.core.experiments.curves import CurvePoint, RunCurve
        >>> def run(staleness, seed, seconds):
        ...     curve = RunCurve([CurvePoint(1, seconds / 2, 0.5), CurvePoint(2, seconds, 0.95)])
        ...     return Run({"max_staleness": staleness}, seed, curve)
        >>> runs = [run(0, s, t) for s, t in enumerate([20.0, 22.0, 21.0, 19.0, 23.0])]
        >>> runs += [run(1, s, t) for s, t in enumerate([12.0, 13.0, 12.5, 11.0, 14.0])]
        >>> claim = parse_claim(
        ...     "time_to(0.9)[max_staleness=1] <= 0.8 * time_to(0.9)[max_staleness=0]")
        >>> verdict = evaluate_claim(claim, runs)
        >>> verdict.outcome.value
        'holds'
        >>> verdict.reason
        'ratio 0.595 [0.543, 0.667] vs 0.8; left - 0.8 x right -4.3 [-5.9, -2.7] (5 and 5 runs)'
    """
    confidence = claim.confidence if claim.confidence is not None else confidence
    rule = collapse_rule or CollapseRule()
    left_runs = select_runs(runs, claim.left.selector)
    right_runs = [] if claim.right is None else select_runs(runs, claim.right.selector)
    counts = (len(left_runs), len(right_runs))

    missing = [
        t.text for t, n in ((claim.left, counts[0]), (claim.right, counts[1])) if t and not n
    ]
    if missing:
        reason = f"no run matches {' or '.join(missing)}"
        return Verdict(claim, Outcome.UNDECIDED, confidence, None, None, None, None, counts, reason)
    left_values = _values(left_runs, claim.left.statistic, rule)
    if claim.left.statistic.is_count:
        left_count = int(sum(float(v) for v in left_values))
        if claim.right is None:
            bound, right_count = claim.coefficient, None
        else:
            right_values = _values(right_runs, claim.right.statistic, rule)
            right_count = int(sum(float(v) for v in right_values))
            bound = claim.coefficient * right_count
        outcome = _exact(left_count, claim.operator, bound)
        of_right = "" if right_count is None else f" vs {right_count} of {counts[1]}"
        reason = f"{left_count} of {counts[0]} runs{of_right}"
        tally = (left_count, right_count)
        return Verdict(claim, outcome, confidence, None, None, None, tally, counts, reason)
    generator = np.random.default_rng(rng)
    if claim.right is None:
        left = summarize(left_values, confidence, resamples, generator)
        outcome = _decide(left.median.low, left.median.high, claim.operator, claim.coefficient)
        reason = (
            f"median {_g(left.median.estimate)} {_span(left.median.low, left.median.high)} vs "
            f"{_g(claim.coefficient)} ({counts[0]} runs, {left.censored} censored)"
        )
        return Verdict(claim, outcome, confidence, left, None, None, None, counts, reason)
    right_values = _values(right_runs, claim.right.statistic, rule)
    comparison = compare_settings(
        left_values, right_values, claim.coefficient, "median", confidence, resamples, generator
    )
    left = summarize(left_values, confidence, resamples, generator)
    right = summarize(right_values, confidence, resamples, generator)
    d = comparison.difference
    outcome = _decide(d.low, d.high, claim.operator, 0.0)
    parts = []
    if comparison.ratio is not None:
        r = comparison.ratio
        parts.append(f"ratio {_g(r.estimate)} {_span(r.low, r.high)} vs {_g(claim.coefficient)}")
    scaled = "right" if claim.coefficient == 1 else f"{_g(claim.coefficient)} x right"
    parts.append(f"left - {scaled} {_g(d.estimate)} {_span(d.low, d.high)}")
    censored = left.censored + right.censored
    reason = "; ".join(parts) + f" ({counts[0]} and {counts[1]} runs"
    reason += f", {censored} censored)" if censored else ")"
    return Verdict(claim, outcome, confidence, left, right, comparison, None, counts, reason)


def evaluate_claims(
    claims: Sequence[Claim],
    runs: Sequence[Run],
    confidence: float = DEFAULT_CONFIDENCE,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    collapse_rule: CollapseRule | None = None,
) -> tuple[Verdict, ...]:
    """Every claim's verdict. Each claim draws from its own generator, seeded by ``seed`` and
    the claim's text, so a verdict does not change when other claims are added or reordered.

    Example:
        >>> evaluate_claims([], [])
        ()
    """
    return tuple(
        evaluate_claim(
            claim,
            runs,
            confidence,
            resamples,
            np.random.default_rng([seed, zlib.crc32(claim.text.encode())]),
            collapse_rule,
        )
        for claim in claims
    )


def exit_status(verdicts: Sequence[Verdict]) -> int:
    """1 when any claim fails, else 0 (undecided claims do not fail a run of ``compare``).

    Example:
        >>> exit_status([])
        0
    """
    return int(any(v.outcome is Outcome.FAILS for v in verdicts))
