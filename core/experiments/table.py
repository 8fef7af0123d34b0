"""The comparison table of an experiment as strings, so the shell only prints.

:func:`group_runs` sorts runs into settings; :func:`comparison_table` summarises each setting's
statistics over its seeds (:mod:`asyncgrpo.core.experiments.stats`) into cells such as
``14.7 s [12.1, 17.9]`` (median over seeds [bootstrap interval]), ``not reached (1/3
reached)`` or ``1/3`` (collapsed runs); :func:`verdict_table` lists claims' verdicts; and
:func:`markdown` renders any :class:`Table`.

Example:
    >>> from asyncgrpo.core.experiments.curves import CurvePoint, Run, RunCurve
    >>> from asyncgrpo.core.experiments.statistic import Statistic
    >>> def run(staleness, seed, seconds):
    ...     curve = RunCurve([CurvePoint(1, seconds / 2, 0.5), CurvePoint(2, seconds, 0.95)])
    ...     return Run({"max_staleness": staleness, "lr": 0.01}, seed, curve)
    >>> runs = [run(0, s, t) for s, t in enumerate([20.0, 22.0, 21.0])]
    >>> runs += [run(1, s, t) for s, t in enumerate([12.0, 13.0, 12.5])]
    >>> table = comparison_table(group_runs(runs), [Statistic("time_to", 0.9)],
    ...                          baseline="max_staleness=0", ratio_of=Statistic("time_to", 0.9))
    >>> print(markdown(table))
    | setting | runs | time to 0.9 | time to 0.9 vs max_staleness=0 |
    |---|---|---|---|
    | max_staleness=0 | 3 | 21.0 s [20.0, 22.0] | 1.00x [0.909, 1.10] |
    | max_staleness=1 | 3 | 12.5 s [12.0, 13.0] | 0.595x [0.545, 0.650] |
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Sequence

import attrs
import numpy as np

from asyncgrpo.core.experiments.claims import Selector
from asyncgrpo.core.experiments.curves import CollapseRule, Run
from asyncgrpo.core.experiments.statistic import Statistic, run_statistic
from asyncgrpo.core.experiments.stats import (
    DEFAULT_CONFIDENCE,
    DEFAULT_RESAMPLES,
    Interval,
    Summary,
    compare_settings,
    summarize,
)
from asyncgrpo.core.experiments.verdicts import Verdict


def format_number(value: float, whole: bool = False) -> str:
    """About three significant digits, thousands separated, no exponent for everyday sizes;
    ``inf``, ``-inf``, and ``undefined`` for NaN. With ``whole`` (counts such as steps) a
    whole number is written without decimals.

    Example:
        >>> [format_number(v) for v in (12345.6, 123.4, 14.66, 1.234, 0.01234, 0.0, -2.5)]
        ['12,346', '123', '14.7', '1.23', '0.0123', '0', '-2.50']
        >>> format_number(12.0, whole=True), format_number(12.5, whole=True)
        ('12', '12.5')
    """
    if math.isnan(value):
        return "undefined"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    size = abs(value)
    if size == 0:
        return "0"
    if whole and value.is_integer():
        return f"{value:,.0f}"
    if size >= 1000:
        return f"{value:,.0f}"
    if size >= 100:
        return f"{value:.0f}"
    if size >= 10:
        return f"{value:.1f}"
    if size >= 1:
        return f"{value:.2f}"
    return f"{value:#.3g}"


def _bound(value: float, censorable: bool, whole: bool) -> str:
    if censorable and math.isinf(value) and value > 0:
        return "not reached"
    return format_number(value, whole)


def interval_cell(
    interval: Interval,
    unit: str = "",
    suffix: str = "",
    censorable: bool = False,
    whole: bool = False,
) -> str:
    """``14.7 s [12.1, 17.9]``: the estimate, its unit (or ``suffix`` glued on, as ``x``) and
    its interval; with ``censorable`` an infinite bound reads ``not reached``; ``whole`` as in
    :func:`format_number`.

    Example:
        >>> interval_cell(Interval(14.66, 12.1, float("inf"), 0.9), "s", censorable=True)
        '14.7 s [12.1, not reached]'
    """
    estimate = format_number(interval.estimate, whole) + suffix + (f" {unit}" if unit else "")
    low, high = _bound(interval.low, censorable, whole), _bound(interval.high, censorable, whole)
    return f"{estimate} [{low}, {high}]"


def summary_cell(
    summary: Summary, unit: str = "", censorable: bool = False, whole: bool = False
) -> str:
    """A setting's median over seeds with its interval; for a censorable statistic (time or
    steps to a threshold) how many runs reached it when not all did, and ``not reached`` when
    the median is infinite (half or more never reached it).

    Example:
        >>> from asyncgrpo.core.experiments.curves import Censored
        >>> summary_cell(summarize([10.0, 12.0, Censored(40.0)], rng=0), "s", censorable=True)
        '12.0 s [10.0, not reached] (2/3 reached)'
        >>> summary_cell(summarize([10.0, Censored(40.0)], rng=0), "s", censorable=True)
        'not reached (1/2 reached)'
    """
    reached = f" ({summary.reached}/{summary.n} reached)" if summary.censored else ""
    if censorable and math.isinf(summary.median.estimate):
        return "not reached" + reached
    return interval_cell(summary.median, unit, censorable=censorable, whole=whole) + reached


def count_cell(count: int, total: int) -> str:
    """``1/3``: runs that collapsed out of the setting's runs.

    Example:
        >>> count_cell(0, 3)
        '0/3'
    """
    return f"{count}/{total}"


def _strings(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(values)


@attrs.frozen
class Table:
    """A table of strings: a header and rows of the same width."""

    header: tuple[str, ...] = attrs.field(converter=_strings)
    rows: tuple[tuple[str, ...], ...] = attrs.field(converter=lambda rows: tuple(map(tuple, rows)))

    def __attrs_post_init__(self) -> None:
        for row in self.rows:
            if len(row) != len(self.header):
                raise ValueError(
                    f"Table: a row of {len(row)} cells under {len(self.header)} columns"
                )


def markdown(table: Table) -> str:
    """The table in markdown (``|`` in a cell escaped).

    Example:
        >>> print(markdown(Table(["a", "b"], [["1", "x|y"]])))
        | a | b |
        |---|---|
        | 1 | x\\|y |
    """

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return "\n".join([line(table.header), "|" + "---|" * len(table.header), *map(line, table.rows)])


def group_runs(
    runs: Sequence[Run], keys: Sequence[str] | None = None
) -> tuple[tuple[str, tuple[Run, ...]], ...]:
    """Runs grouped into settings, in the order settings first appear.

    Runs belong together when their ``keys`` settings agree (default: all settings). A group's
    label names the settings that differ between groups (``max_staleness=1``), or ``all runs``
    when there is one group.

    Example:
        >>> from asyncgrpo.core.experiments.curves import RunCurve
        >>> runs = [Run({"max_staleness": s, "lr": 0.01}, seed, RunCurve([]))
        ...         for seed in (0, 1) for s in (0, 4)]
        >>> [(label, len(group)) for label, group in group_runs(runs)]
        [('max_staleness=0', 2), ('max_staleness=4', 2)]
    """

    def key_of(run: Run) -> tuple[tuple[str, str | None], ...]:
        names = keys if keys is not None else sorted(run.settings)
        return tuple((k, run.settings.get(k)) for k in names)

    groups: dict[tuple[tuple[str, str | None], ...], list[Run]] = {}
    for run in runs:
        groups.setdefault(key_of(run), []).append(run)
    every = {k for key in groups for k, _ in key}
    varying = [k for k in sorted(every) if len({dict(key).get(k) for key in groups}) > 1]
    out = []
    for key, members in groups.items():
        settings = dict(key)
        given = [f"{k}={settings[k]}" for k in varying if settings.get(k) is not None]
        unset = [f"{k}=None" for k in varying if settings.get(k) is None]
        label = ", ".join(given or unset) or "all runs"  # a setting a run lacks is left out
        out.append((label, tuple(members)))
    return tuple(out)


def _generator(seed: int, *parts: str) -> np.random.Generator:
    """A generator per cell, so a cell does not change when rows or columns are added."""
    return np.random.default_rng([seed, *(zlib.crc32(p.encode()) for p in parts)])


def baseline_label(groups: Sequence[tuple[str, Sequence[Run]]], baseline: str) -> str:
    """The label of the setting ``baseline`` names: a label, or settings (``k=v, ...``) that
    the runs of exactly one setting all have.

    Example:
        >>> from asyncgrpo.core.experiments.curves import RunCurve
        >>> groups = [("eval_strategy=no", [Run({"eval_strategy": "no"}, 0, RunCurve([]))]),
        ...           ("eval_steps=5, eval_strategy=steps",
        ...            [Run({"eval_strategy": "steps", "eval_steps": "5"}, 0, RunCurve([]))])]
        >>> baseline_label(groups, "eval_strategy=steps")
        'eval_steps=5, eval_strategy=steps'
    """
    labels = [label for label, _ in groups]
    if baseline in labels:
        return baseline
    pairs = [part.split("=", 1) for part in baseline.split(",") if "=" in part]
    if pairs and len(pairs) == len(baseline.split(",")):
        selector = Selector(tuple((k.strip(), v.strip()) for k, v in pairs))
        found = [
            label
            for label, runs in groups
            if runs and all(selector.matches(r.settings) for r in runs)
        ]
        if len(found) == 1:
            return found[0]
    raise ValueError(
        f"baseline {baseline!r} is not a setting, nor the settings of exactly one; the settings: "
        f"{labels}"
    )


def comparison_table(
    groups: Sequence[tuple[str, Sequence[Run]]],
    statistics: Sequence[Statistic],
    baseline: str | None = None,
    ratio_of: Statistic | None = None,
    confidence: float = DEFAULT_CONFIDENCE,
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    collapse_rule: CollapseRule | None = None,
) -> Table:
    """One row per setting: its label, its run count, then each statistic's cell (median over
    seeds with its bootstrap interval; ``collapsed`` as a count). With ``baseline`` (a group's
    label) and ``ratio_of``, a last column gives that statistic's ratio to the baseline's, with
    its interval (each setting resampled on its own); ``-`` where a ratio is undefined
    (values not all positive).

    Example:
        >>> from asyncgrpo.core.experiments.curves import CurvePoint, RunCurve
        >>> curve = RunCurve([CurvePoint(1, 1.0, 0.5, {"entropy": 0.3})])
        >>> table = comparison_table([("all runs", [Run({}, 0, curve), Run({}, 1, curve)])],
        ...                          [Statistic("final_reward"), Statistic("collapsed")])
        >>> table.rows
        (('all runs', '2', '0.500 [0.500, 0.500]', '0/2'),)
    """
    rule = collapse_rule or CollapseRule()
    if baseline is not None:
        baseline = baseline_label(groups, baseline)
    if (baseline is None) != (ratio_of is None):
        raise ValueError("a ratio column needs both a baseline setting and ratio_of")
    header = ["setting", "runs", *(s.label for s in statistics)]
    if ratio_of is not None:
        header.append(f"{ratio_of.label} vs {baseline}")
    base_runs = dict(groups).get(baseline, ()) if baseline is not None else ()
    rows = []
    for label, runs in groups:
        row = [label, str(len(runs))]
        for statistic in statistics:
            values = [run_statistic(run.curve, statistic, rule) for run in runs]
            if statistic.is_count:
                row.append(count_cell(int(sum(float(v) for v in values)), len(values)))
                continue
            summary = summarize(
                values, confidence, resamples, _generator(seed, label, statistic.text)
            )
            censorable = statistic.name in ("time_to", "steps_to")
            whole = statistic.name == "steps_to"
            row.append(summary_cell(summary, statistic.unit, censorable, whole))
        if ratio_of is not None:
            values = [run_statistic(run.curve, ratio_of, rule) for run in runs]
            base = [run_statistic(run.curve, ratio_of, rule) for run in base_runs]
            ratio = compare_settings(
                values,
                base,
                1.0,
                "median",
                confidence,
                resamples,
                _generator(seed, label, "vs", str(baseline), ratio_of.text),
            ).ratio
            row.append("-" if ratio is None else interval_cell(ratio, suffix="x"))
        rows.append(row)
    return Table(header, rows)


def verdict_table(verdicts: Sequence[Verdict]) -> Table:
    """One row per claim: verdict, claim, confidence, the numbers that decided it.

    Example:
        >>> from asyncgrpo.core.experiments.claims import parse_claim
        >>> from asyncgrpo.core.experiments.verdicts import evaluate_claim
        >>> verdict = evaluate_claim(parse_claim("collapsed[] == 0"), [])
        >>> verdict_table([verdict]).rows
        (('undecided', 'collapsed[] == 0', '90%', 'no run matches collapsed[]'),)
    """
    return Table(
        ["verdict", "claim", "confidence", "evidence"],
        [
            [v.outcome.value, v.claim.text, f"{v.confidence * 100:.10g}%", v.reason]
            for v in verdicts
        ],
    )
