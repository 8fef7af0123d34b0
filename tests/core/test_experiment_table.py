import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.experiments.claims import parse_claim
from asyncgrpo.core.experiments.curves import Censored, CurvePoint, Run, RunCurve
from asyncgrpo.core.experiments.statistic import Statistic
from asyncgrpo.core.experiments.stats import summarize
from asyncgrpo.core.experiments.table import (
    Table,
    comparison_table,
    format_number,
    group_runs,
    markdown,
    summary_cell,
    verdict_table,
)
from asyncgrpo.core.experiments.verdicts import evaluate_claims


@given(st.floats(1e-3, 1e9) | st.floats(-1e9, -1e-3))
def test_format_number_keeps_three_significant_digits(value):
    shown = float(format_number(value).replace(",", ""))
    assert shown == pytest.approx(value, rel=5e-3)


def test_cells_for_censored_values():
    assert summary_cell(summarize([1.0, 2.0, 3.0], rng=0), "s") == "2.00 s [1.00, 3.00]"
    partly = summarize([10.0, 12.0, 11.0, Censored(30.0)], rng=0)
    assert summary_cell(partly, "s", censorable=True).endswith("(3/4 reached)")
    never = summarize([Censored(30.0)] * 3, rng=0)
    assert summary_cell(never, "s", censorable=True) == "not reached (0/3 reached)"


def run(settings, seed, seconds, reached=True, entropy=0.5):
    metrics = {"entropy": entropy, "frac_reward_zero_std": 1.0, "perf/step_s": seconds / 3}
    rewards = [0.3, 0.6, 0.95 if reached else 0.7]
    points = [CurvePoint(i + 1, seconds * (i + 1) / 3, r, metrics) for i, r in enumerate(rewards)]
    return Run(settings, seed, RunCurve(points))


def test_a_comparison_table():
    runs = [run({"max_staleness": 0, "lr": 0.01}, s, t) for s, t in enumerate([20, 21, 22])]
    runs += [run({"max_staleness": 4, "lr": 0.01}, s, 12, reached=s != 2) for s in range(3)]
    runs += [run({"max_staleness": 4, "lr": 0.01}, 3, 12, entropy=0.001)]
    statistics = [
        Statistic("time_to", 0.9),
        Statistic("steps_to", 0.9),
        Statistic("final_reward", 1),
        Statistic("auc"),
        Statistic("collapsed"),
        Statistic("perf/step_s"),
    ]
    table = comparison_table(
        group_runs(runs), statistics, baseline="max_staleness=0", ratio_of=statistics[0]
    )
    assert table.header == (
        "setting",
        "runs",
        "time to 0.9",
        "steps to 0.9",
        "final reward (last 1)",
        "reward AUC, steps",
        "collapsed",
        "median perf/step_s",
        "time to 0.9 vs max_staleness=0",
    )
    base, async_ = table.rows
    assert base[:3] == ("max_staleness=0", "3", "21.0 s [20.0, 22.0]")
    assert base[6] == "0/3" and async_[6] == "1/4"
    assert base[-1].startswith("1.00x [")
    assert async_[2] == "12.0 s [12.0, not reached] (3/4 reached)"
    assert async_[3] == "3 steps [3, not reached] (3/4 reached)"
    assert async_[-1].startswith("0.571x [")
    text = markdown(table)
    assert text.count("\n") == 3


def test_the_table_does_not_move_when_rows_are_added():
    runs = [run({"a": a}, s, 10 + s + a) for a in (0, 1, 2) for s in range(4)]
    stat = [Statistic("time_to", 0.9)]
    full = comparison_table(group_runs(runs), stat, seed=3)
    part = comparison_table(group_runs(runs[:8]), stat, seed=3)
    assert full.rows[:2] == part.rows


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 5)), max_size=20))
def test_every_run_lands_in_exactly_one_labelled_group(specs):
    runs = [Run({"a": a, "b": b}, seed, RunCurve([])) for a, b, seed in specs]
    groups = group_runs(runs)
    assert sorted(id(r) for _, g in groups for r in g) == sorted(id(r) for r in runs)
    labels = [label for label, _ in groups]
    assert len(set(labels)) == len(labels)
    for label, members in groups:
        assert len({tuple(sorted(r.settings.items())) for r in members}) == 1
        if len(groups) > 1:
            for part in label.split(", "):
                key, value = part.split("=")
                assert all(r.settings[key] == value for r in members)
    by_a = group_runs(runs, keys=["a"])
    assert len(by_a) == len({a for a, _, _ in specs})


def test_markdown_escapes_pipes_and_checks_widths():
    text = markdown(Table(["x", "y"], [["a|b", "c"]]))
    lines = text.splitlines()
    assert all(len(re.findall(r"(?<!\\)\|", line)) == 3 for line in lines)
    with pytest.raises(ValueError, match="3 cells under 2 columns"):
        Table(["x", "y"], [["1", "2", "3"]])
    with pytest.raises(ValueError, match="not a setting"):
        comparison_table([("a=1", [])], [], baseline="a=2", ratio_of=Statistic("auc"))


def test_the_verdict_table():
    runs = [run({"a": 0}, s, 20 + s) for s in range(3)] + [run({"a": 1}, s, 10) for s in range(3)]
    verdicts = evaluate_claims(
        [parse_claim("time_to(0.9)[a=1] <= 0.8 * time_to(0.9)[a=0] @ 95%")], runs
    )
    ((outcome, claim, confidence, evidence),) = verdict_table(verdicts).rows
    assert (outcome, confidence) == ("holds", "95%")
    assert claim == "time_to(0.9)[a=1] <= 0.8 * time_to(0.9)[a=0] @ 95%"
    assert evidence.startswith("ratio 0.476 [")
