"""Claims about an experiment that hold, fail or stay undecided at a stated confidence.

A sweep states what it expects as text; :func:`parse_claim` turns the text into a frozen
:class:`Claim` and :func:`evaluate_claim` decides it from the runs.

Grammar (whitespace between tokens is free)::

    claim      := term op right [ '@' number '%' ]
    right      := number                          a constant
                | [ number '*' ] term             another setting, times a positive factor
    term       := statistic '[' [ pair { ',' pair } ] ']'
    statistic  := 'time_to' '(' number ')'        wall seconds to a reward threshold
                | 'steps_to' '(' number ')'       optimizer steps to a reward threshold
                | 'final_reward' [ '(' integer ')' ]   mean reward of the last k points (3)
                | 'auc' | 'auc_time'              mean reward against steps / wall time
                | 'collapsed'                     runs that collapsed (a count)
                | 'gain' '(' metric ')'            a metric's last value minus its first
                | metric                          a logged metric's median over the run
    metric     := [A-Za-z_][A-Za-z0-9_./-]*       e.g. perf/step_s, entropy
    pair       := key '=' value                   a setting the runs share
    key        := [A-Za-z_][A-Za-z0-9_.]*
    value      := bare | '"' [^"]* '"'            bare: no space, ',', '[', ']', '=', '"'
    op         := '<=' | '<' | '>=' | '>' | '=='  ('==' for counts only)

The selector ``[max_staleness=1, loss_type=cispo]`` picks the runs whose settings have those
values (numbers compare as numbers: ``1e-2`` matches ``0.01``); ``[]`` picks every run. The
trailing ``@ 95%`` states the confidence; without it the evaluator's default (90%) applies.

Examples of claims::

    time_to(0.9)[max_staleness=1] <= 0.8 * time_to(0.9)[max_staleness=0]
    final_reward[loss_type=cispo] >= final_reward[loss_type=score_centering] @ 95%
    collapsed[max_staleness=4] == 0
    perf/step_s[max_staleness=4] < 0.5
    gain(eval/held_out/reward)[] > 0

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

Example:
    >>> claim = parse_claim("time_to(0.9)[max_staleness=1]<=0.8*time_to(0.9)[max_staleness=0]")
    >>> format_claim(claim)
    'time_to(0.9)[max_staleness=1] <= 0.8 * time_to(0.9)[max_staleness=0]'
    >>> parse_claim("final_reward[lr=1e-2] >= 0.5 @ 95%").confidence
    0.95
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Mapping, Sequence
from decimal import Decimal
from enum import Enum

import attrs
import numpy as np

from asyncgrpo.core.experiments.curves import (
    STATISTICS,
    CollapseRule,
    Observed,
    Run,
    Statistic,
    run_statistic,
)
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

OPERATORS = ("<=", "<", ">=", ">", "==")

_NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_METRIC = re.compile(r"[A-Za-z_][A-Za-z0-9_./-]*")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
_BARE = re.compile(r'[^\s,\[\]="]+')
_QUOTED = re.compile(r'"([^"]*)"')
_OPERATOR = re.compile(r"<=|>=|==|<|>")


def _number_text(value: float) -> str:
    """Shortest text that parses back to the same float (``0.8``, ``1e-05``, ``3``)."""
    value = float(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def _as_number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def same_setting(wanted: str, actual: str) -> bool:
    """Whether a selector value picks a run's setting: the same text, or the same number.

    Example:
        >>> same_setting("1e-2", "0.01"), same_setting("cispo", "CISPO")
        (True, False)
    """
    if wanted == actual:
        return True
    a, b = _as_number(wanted), _as_number(actual)
    return a is not None and a == b


@attrs.frozen
class Selector:
    """Settings a run must have, in the order written: ``[max_staleness=1, lr=1e-2]``.

    Example:
        >>> Selector((("model", "Qwen/Qwen3-0.6B"), ("note", "a b"))).text
        '[model=Qwen/Qwen3-0.6B, note="a b"]'
    """

    pairs: tuple[tuple[str, str], ...] = attrs.field(
        converter=lambda pairs: tuple((str(k), str(v)) for k, v in pairs)
    )

    def __attrs_post_init__(self) -> None:
        keys = [k for k, _ in self.pairs]
        for key, value in self.pairs:
            if not _KEY.fullmatch(key):
                raise ValueError(f"Selector: {key!r} is not a setting name ({_KEY.pattern})")
            if '"' in value:
                raise ValueError(f"Selector: the value of {key} may not contain '\"'")
        if len(set(keys)) != len(keys):
            raise ValueError(f"Selector: a setting appears twice in {keys}")

    def matches(self, settings: Mapping[str, str]) -> bool:
        return all(k in settings and same_setting(v, settings[k]) for k, v in self.pairs)

    @property
    def text(self) -> str:
        def value(v: str) -> str:
            return v if _BARE.fullmatch(v) else f'"{v}"'

        return "[" + ", ".join(f"{k}={value(v)}" for k, v in self.pairs) + "]"


@attrs.frozen
class Term:
    """A statistic over the runs a selector picks: ``time_to(0.9)[max_staleness=1]``."""

    statistic: Statistic
    selector: Selector

    @property
    def text(self) -> str:
        return self.statistic.text + self.selector.text


@attrs.frozen
class Claim:
    """``left op coefficient * right``, or ``left op coefficient`` when ``right`` is None.

    Attributes:
        left: the claimed-about side.
        operator: one of ``<=``, ``<``, ``>=``, ``>``, ``==`` (``==`` only between counts).
        right: the other setting, or None to compare with the constant ``coefficient``.
        coefficient: the factor on ``right`` (> 0), or the constant.
        confidence: the stated confidence (0.9 for ``@ 90%``), or None for the evaluator's.
    """

    left: Term
    operator: str
    right: Term | None
    coefficient: float = attrs.field(converter=float)
    confidence: float | None = None

    def __attrs_post_init__(self) -> None:
        if self.operator not in OPERATORS:
            raise ValueError(f"Claim.operator: one of {OPERATORS}, got {self.operator!r}")
        if not math.isfinite(self.coefficient):
            raise ValueError(f"Claim.coefficient: must be finite, got {self.coefficient}")
        if self.right is not None and self.coefficient <= 0:
            raise ValueError(
                f"Claim.coefficient: the factor on the other setting must be > 0, got "
                f"{self.coefficient}"
            )
        count = self.left.statistic.is_count
        if self.right is not None and self.right.statistic.is_count != count:
            raise ValueError(
                "Claim: a count (collapsed) compares with a count or a number, not with a "
                f"statistic ({self.left.statistic.text} vs {self.right.statistic.text})"
            )
        if self.operator == "==" and not count:
            raise ValueError(
                f"Claim: '==' is exact, so only counts (collapsed) use it; for "
                f"{self.left.statistic.text} state a bound with <= or >="
            )
        if self.confidence is not None and not 0.0 < self.confidence < 1.0:
            raise ValueError(f"Claim.confidence: in (0, 1), got {self.confidence}")

    @property
    def text(self) -> str:
        return format_claim(self)


def format_claim(claim: Claim) -> str:
    """The claim's canonical text; :func:`parse_claim` reads it back to an equal claim.

    Example:
        >>> format_claim(parse_claim("collapsed[ max_staleness = 4 ]==0"))
        'collapsed[max_staleness=4] == 0'
    """
    if claim.right is None:
        right = _number_text(claim.coefficient)
    elif claim.coefficient == 1.0:
        right = claim.right.text
    else:
        right = f"{_number_text(claim.coefficient)} * {claim.right.text}"
    text = f"{claim.left.text} {claim.operator} {right}"
    if claim.confidence is not None:
        text += f" @ {_percent_text(claim.confidence)}%"
    return text


def _percent_text(fraction: float) -> str:
    """``0.9`` as ``90``, exactly: the shortest decimal of the float, times 100 in decimal."""
    percent = (Decimal(repr(float(fraction))) * 100).normalize()
    return f"{percent:f}"


class ClaimSyntaxError(ValueError):
    """A claim that does not parse: names the claim, the position (0-based) and the fix."""

    def __init__(self, text: str, position: int, problem: str, fix: str) -> None:
        self.text, self.position, self.problem, self.fix = text, position, problem, fix
        super().__init__(
            f"cannot parse claim {text!r} at position {position}: {problem}\n"
            f"    {text}\n    {' ' * position}^\n"
            f"fix: {fix}"
        )


_EXAMPLE = "time_to(0.9)[max_staleness=1] <= 0.8 * time_to(0.9)[max_staleness=0]"


class _Parser:
    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def fail(self, problem: str, fix: str, at: int | None = None) -> ClaimSyntaxError:
        return ClaimSyntaxError(self.text, self.pos if at is None else at, problem, fix)

    def skip(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def peek(self, literal: str) -> bool:
        self.skip()
        return self.text.startswith(literal, self.pos)

    def take(self, literal: str, problem: str, fix: str) -> None:
        if not self.peek(literal):
            raise self.fail(problem, fix)
        self.pos += len(literal)

    def match(self, pattern: re.Pattern[str]) -> re.Match[str] | None:
        self.skip()
        found = pattern.match(self.text, self.pos)
        if found:
            self.pos = found.end()
        return found

    def number(self, what: str, fix: str) -> float:
        start = self.pos
        found = self.match(_NUMBER)
        value = None if found is None else _as_number(found.group())
        if value is None:
            raise self.fail(f"expected {what}", fix, at=self.pos if found is None else start)
        return value

    def claim(self) -> Claim:
        left = self.term()
        self.skip()
        op_at = self.pos
        operator = self.match(_OPERATOR)
        if operator is None:
            raise self.fail(
                "expected a comparison (<=, <, >=, >, ==) after the first term",
                f"compare two terms or a term and a number, e.g. {_EXAMPLE}",
            )
        right, coefficient = self.right()
        confidence = self.confidence()
        self.skip()
        if self.pos != len(self.text):
            raise self.fail(
                "unexpected text after the claim",
                "end the claim after its right side, or state a confidence as '@ 90%'",
            )
        self.check(left, operator.group(), right, coefficient, op_at)
        return Claim(left, operator.group(), right, coefficient, confidence)

    def check(
        self, left: Term, operator: str, right: Term | None, coefficient: float, at: int
    ) -> None:
        """The rules a well-formed claim can still break, with their fixes."""
        count = left.statistic.is_count
        if right is not None and right.statistic.is_count != count:
            raise self.fail(
                f"{left.statistic.text} and {right.statistic.text} do not compare: one is a "
                "count of runs (collapsed), the other a statistic",
                "compare collapsed with a number (collapsed[max_staleness=4] == 0) or with "
                "another collapsed[...]",
                at=at,
            )
        if operator == "==" and not count:
            raise self.fail(
                f"'==' is exact, so only counts (collapsed) use it, not {left.statistic.text}",
                f"state a bound instead: {left.text} >= ... or <= ...",
                at=at,
            )
        if right is not None and coefficient <= 0:
            raise self.fail(
                f"the factor on the other setting must be > 0, got {_number_text(coefficient)}",
                "use a positive factor, e.g. 0.8 * time_to(0.9)[max_staleness=0]",
                at=at,
            )

    def right(self) -> tuple[Term | None, float]:
        self.skip()
        if _NUMBER.match(self.text, self.pos):
            value = self.number("a number", "write a number such as 0.8")
            if not self.peek("*"):
                return None, value
            self.pos += 1
            self.skip()
            if not _METRIC.match(self.text, self.pos):
                raise self.fail(
                    "expected a term after '*'",
                    "a factor multiplies a term, e.g. 0.8 * time_to(0.9)[max_staleness=0]",
                )
            return self.term(), value
        if _METRIC.match(self.text, self.pos):
            return self.term(), 1.0
        raise self.fail(
            "expected a number or a term after the comparison",
            f"e.g. '>= 0.5' or '<= 0.8 * time_to(0.9)[max_staleness=0]'; full example: {_EXAMPLE}",
        )

    def confidence(self) -> float | None:
        if not self.peek("@"):
            return None
        self.pos += 1
        self.skip()
        start = self.pos
        percent = self.number("a confidence in percent after '@'", "write e.g. '@ 90%'")
        self.take("%", "expected '%' after the confidence", "write the confidence as '@ 90%'")
        if not 0.0 < percent < 100.0:
            raise self.fail(
                f"a confidence of {percent:g}% is not between 0% and 100%",
                "state e.g. '@ 90%' or '@ 95%'",
                at=start,
            )
        return float(Decimal(self.text[start : self.pos - 1].strip()) / 100)

    def term(self) -> Term:
        return Term(self.statistic(), self.selector())

    def statistic(self) -> Statistic:
        self.skip()
        start = self.pos
        found = self.match(_METRIC)
        if found is None:
            raise self.fail(
                "expected a statistic",
                f"start with one of {', '.join(STATISTICS)} or a metric name such as "
                f"perf/step_s; e.g. {_EXAMPLE}",
            )
        name = found.group()
        if name in ("time_to", "steps_to"):
            self.take(
                "(",
                f"{name} needs a reward threshold",
                f"write {name}(0.9): the first logged reward >= 0.9",
            )
            threshold = self.number("a reward threshold", f"write {name}(0.9)")
            self.take(")", f"expected ')' after the threshold of {name}", f"write {name}(0.9)")
            return Statistic(name, threshold)
        if name == "final_reward" and self.peek("("):
            self.pos += 1
            at = self.pos
            k = self.number("a count of logged points", "write final_reward(3)")
            if k != int(k) or k < 1:
                raise self.fail(
                    "final_reward(k) needs a whole number k >= 1",
                    "write final_reward(3) for the last 3 logged points",
                    at=at,
                )
            self.take(")", "expected ')' after final_reward's k", "write final_reward(3)")
            return Statistic(name, float(k))
        if name == "gain":
            self.take("(", "gain needs a metric", "write gain(eval/held_out/reward)")
            self.skip()
            metric = self.match(_METRIC)
            if metric is None:
                raise self.fail("expected a metric name in gain(...)",
                                "write gain(eval/held_out/reward)")  # fmt: skip
            self.take(")", "expected ')' after gain's metric", "write gain(eval/held_out/reward)")
            return Statistic(name, metric.group())
        if self.peek("("):
            if name in ("median", "mean"):
                raise self.fail(
                    f"{name}(...) is not a statistic",
                    "a metric stands for its median over a run: write perf/step_s[...], not "
                    "median(perf/step_s)[...]",
                    at=start,
                )
            raise self.fail(
                f"{name} takes no argument",
                "only time_to, steps_to, final_reward and gain take one; a metric is its median",
            )
        return Statistic(name)

    def selector(self) -> Selector:
        self.take(
            "[",
            "expected '[' and the settings of the runs after the statistic",
            "add a selector such as [max_staleness=1] (or [] for every run)",
        )
        pairs: list[tuple[str, str]] = []
        if self.peek("]"):
            self.pos += 1
            return Selector(())
        while True:
            key = self.match(_KEY)
            if key is None:
                raise self.fail(
                    "expected a setting name in the selector",
                    "write [name=value, ...], e.g. [max_staleness=1]",
                )
            if key.group() in (k for k, _ in pairs):
                raise self.fail(
                    f"setting {key.group()} appears twice in the selector",
                    "name each setting once",
                    at=key.start(),
                )
            self.take("=", f"expected '=' after {key.group()}", f"write {key.group()}=value")
            self.skip()
            value = self.match(_QUOTED) or self.match(_BARE)
            if value is None:
                raise self.fail(
                    f"expected a value for {key.group()}",
                    'write a bare value (1, cispo, 1e-2) or quote it: "a b"',
                )
            pairs.append((key.group(), value.group(1) if value.re is _QUOTED else value.group()))
            if self.peek("]"):
                self.pos += 1
                return Selector(pairs)
            self.take(
                ",",
                "expected ',' or ']' in the selector",
                "separate settings with ',' and close with ']'",
            )


def parse_claim(text: str) -> Claim:
    """Parse a claim (grammar in the module's docstring); :class:`ClaimSyntaxError` otherwise.

    Example:
        >>> parse_claim("collapsed[max_staleness=4] == 0").right is None
        True
        >>> parse_claim("time_to(0.9) <= 1")
        Traceback (most recent call last):
        ...
        asyncgrpo.core.experiments.claims.ClaimSyntaxError: cannot parse claim \
'time_to(0.9) <= 1' at position 13: expected '[' and the settings of the runs after the \
statistic
            time_to(0.9) <= 1
                         ^
        fix: add a selector such as [max_staleness=1] (or [] for every run)
    """
    return _Parser(text).claim()


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
