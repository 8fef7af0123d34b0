import ast
import math
import re
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.loss.metrics import LOSS_METRICS
from asyncgrpo.core.loss.objectives.weights import OBJECTIVE_METRICS
from asyncgrpo.core.metrics import (
    Aggregation,
    MetricWindow,
    declared,
    maximum,
    mean,
    merge,
    minimum,
    ratio,
    record,
    summarize,
    total,
)
from asyncgrpo.core.run.planner import BATCH_METRICS

PACKAGE = Path(__file__).resolve().parents[2]
MAKERS = {
    "mean": Aggregation.MEAN,
    "total": Aggregation.SUM,
    "maximum": Aggregation.MAX,
    "minimum": Aggregation.MIN,
}


def trl_convention(name: str) -> Aggregation:
    """TRL's AsyncGRPOTrainer's naming of a metric by its aggregation, from the last ``/`` part
    of its name (placeholders of an f-string left out): ``count`` sums, ``max``/``min`` keep the
    extreme, anything else is a mean."""
    words = set(re.findall(r"[a-z0-9]+", re.sub(r"\{[^}]*\}", "", name.rsplit("/", 1)[-1])))
    for word, aggregation in (
        ("count", Aggregation.SUM),
        ("max", Aggregation.MAX),
        ("min", Aggregation.MIN),
    ):
        if word in words:
            return aggregation
    return Aggregation.MEAN


def made_in_the_package() -> list[tuple[str, str, Aggregation]]:
    """Every metric the package makes with a maker and a literal name: (where, name, maker's
    aggregation)."""
    found = []
    for path in sorted(PACKAGE.glob("[cs]*/**/*.py")):  # core/, shell/
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            func = node.func
            maker = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            first = node.args[0]
            if maker not in MAKERS or not isinstance(first, ast.Constant | ast.JoinedStr):
                continue
            name = (
                first.value
                if isinstance(first, ast.Constant)
                else "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in first.values)
            )
            if (isinstance(name, str) and "/" in name) or name in ("reward", "loss", "grad_norm"):
                found.append((f"{path.relative_to(PACKAGE)}:{node.lineno}", name, MAKERS[maker]))
    return found


def test_the_package_makes_metrics_with_declared_aggregations_named_as_trl_names_them() -> None:
    """A metric's aggregation is what its maker declares; its name must still say it the way
    TRL's AsyncGRPOTrainer does, so a user reading ``..._count`` sees a total."""
    made = made_in_the_package()
    assert len(made) > 60, made  # the scan finds the makers
    assert {a for _, _, a in made} == set(MAKERS.values())
    wrong = [(where, name, a.value) for where, name, a in made if trl_convention(name) is not a]
    assert not wrong, wrong
    for table in (LOSS_METRICS, OBJECTIVE_METRICS, BATCH_METRICS):
        wrong = [(name, a.value) for name, a in table.items() if trl_convention(name) is not a]
        assert not wrong, wrong


def test_a_rename_does_not_change_the_aggregation() -> None:
    """Negative control of the convention test: a name that says ``count`` is still a mean
    when made by :func:`mean` (the window does what the maker says), and the convention check
    above would name it."""
    window = record(MetricWindow(), [mean("x/odd_count", 1.0), mean("x/odd_count", 3.0)])
    assert summarize(window) == {"x/odd_count": 2.0}
    assert trl_convention("x/odd_count") is Aggregation.SUM
    assert trl_convention("tools/{}/call_count") is Aggregation.SUM
    assert trl_convention("completions/min_length") is Aggregation.MIN


def test_a_table_declares_a_bulk_metric_and_refuses_an_undeclared_one() -> None:
    table = {"clip_ratio/low_min": Aggregation.MIN, "entropy": Aggregation.MEAN}
    assert declared("clip_ratio/low_min", 0.5, 7, table) == minimum("clip_ratio/low_min", 0.5)
    assert declared("entropy", 0.5, 7, table) == mean("entropy", 0.5, weight=7)
    with pytest.raises(ValueError, match="'objective/new_thing' has no declared aggregation"):
        declared("objective/new_thing", 1.0, 1, table)


finite = st.floats(-1e6, 1e6)
made = st.one_of(
    st.builds(mean, st.just("reward"), finite, st.floats(0.5, 10)),
    st.builds(maximum, st.just("sample/staleness_max"), finite),
    st.builds(minimum, st.just("completions/min_length"), finite),
    st.builds(total, st.just("sample/dropped_stale_count"), finite),
)
observations = st.lists(
    st.one_of(
        made,
        st.builds(
            ratio, st.just("rollout/generated_tokens_per_s"), st.floats(0, 1e6), st.floats(0.1, 100)
        ),
    ),
    max_size=30,
)


def close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        (math.isnan(a[k]) and math.isnan(b[k])) or a[k] == pytest.approx(b[k], rel=1e-9, abs=1e-6)
        for k in a
    )


@given(observations, st.integers(0, 30))
def test_splitting_and_merging_windows_gives_the_same_summary(obs, cut) -> None:
    whole = summarize(record(MetricWindow(), obs))
    left, right = record(MetricWindow(), obs[:cut]), record(MetricWindow(), obs[cut:])
    assert close(summarize(merge(left, right)), whole)
    assert close(summarize(merge(right, left)), whole)


@given(observations)
def test_each_rule_matches_a_direct_computation(obs) -> None:
    summary = summarize(record(MetricWindow(), obs))
    by_name: dict[str, list] = {}
    for o in obs:
        by_name.setdefault(o.name, []).append(o)
    for name, items in by_name.items():
        amounts = [o.amount for o in items]
        weights = [o.weight for o in items]
        if items[0].is_ratio:
            expected = sum(amounts) / sum(weights)
        elif items[0].aggregation is Aggregation.SUM:
            expected = sum(amounts)
        elif items[0].aggregation is Aggregation.MAX:
            expected = max(amounts)
        elif items[0].aggregation is Aggregation.MIN:
            expected = min(amounts)
        else:
            expected = sum(a * w for a, w in zip(amounts, weights, strict=True)) / sum(weights)
        assert summary[name] == pytest.approx(expected, rel=1e-9, abs=1e-6)


def test_ratio_is_total_over_total_and_nan_when_empty() -> None:
    window = record(
        MetricWindow(),
        [ratio("tools/failure_frequency", 1, 4), ratio("tools/failure_frequency", 0, 4)],
    )
    assert summarize(window)["tools/failure_frequency"] == 0.125
    empty = record(MetricWindow(), [ratio("tools/failure_frequency", 0, 0)])
    assert math.isnan(summarize(empty)["tools/failure_frequency"])


def test_non_finite_values_are_ignored_and_mixing_kinds_is_an_error() -> None:
    window = record(
        MetricWindow(), [mean("reward_group_std", float("nan")), mean("reward_group_std", 2.0)]
    )
    assert summarize(window)["reward_group_std"] == 2.0
    with pytest.raises(ValueError, match="record it one way"):
        record(MetricWindow(), [mean("x", 1.0), ratio("x", 1, 1)])
    with pytest.raises(ValueError, match="weight must be"):
        mean("x", 1.0, weight=-1)
