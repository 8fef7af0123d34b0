"""Claims about an experiment that hold, fail or stay undecided at a stated confidence.

A sweep states what it expects as text; :func:`parse_claim` turns the text into a frozen
:class:`Claim`, and :mod:`asyncgrpo.core.experiments.verdicts` decides it from the runs. This
module is the claims' language: its grammar, records, parser and canonical text.

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
from collections.abc import Mapping
from decimal import Decimal

import attrs

from asyncgrpo.core.experiments.statistic import STATISTICS, Statistic

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
                raise self.fail(
                    "expected a metric name in gain(...)", "write gain(eval/held_out/reward)"
                )
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
