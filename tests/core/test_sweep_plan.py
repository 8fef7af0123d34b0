"""A sweep's plan: every (settings, seed) once, names unique and safe, settings interleaved,
and a restarted sweep never runs a finished run again."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.experiments.sweep_plan import (
    Action,
    Status,
    expand,
    next_action,
    plan_runs,
    setting_label,
)

values = st.lists(
    st.one_of(
        st.integers(-3, 5),
        st.sampled_from(["a", "b/c", "x y"]),
        st.booleans(),
        st.floats(0.001, 1.0),
    ),
    min_size=1,
    max_size=3,
    unique_by=str,
)
grids = st.dictionaries(
    st.sampled_from(["max_staleness", "loss_type", "learning_rate"]), values, max_size=2
)
seeds = st.lists(st.integers(0, 50), min_size=1, max_size=5, unique=True)


@given(grids, seeds)
def test_every_setting_runs_once_per_seed_with_a_unique_safe_name(grid, seed_list) -> None:
    runs = plan_runs(grid, (), seed_list)
    settings = expand(grid, ())
    assert len(runs) == len(settings) * len(seed_list)
    wanted = {(setting_label(s), seed) for s in settings for seed in seed_list}
    assert {(r.label, r.seed) for r in runs} == wanted
    names = [r.name for r in runs]
    assert len(set(names)) == len(names)
    assert all(".." not in n and not n.startswith("/") and " " not in n for n in names)


@given(grids, seeds)
def test_settings_interleave_no_setting_always_first(grid, seed_list) -> None:
    runs = plan_runs(grid, (), seed_list)
    per_seed = len(runs) // len(seed_list)
    firsts = [runs[i * per_seed].label for i in range(len(seed_list))]
    if per_seed > 1 and len(seed_list) > 1:
        assert len(set(firsts)) > 1
    for i in range(len(seed_list)):  # each seed's block runs every setting
        block = runs[i * per_seed : (i + 1) * per_seed]
        assert {r.seed for r in block} == {seed_list[i]}


def test_a_grid_value_must_be_a_list_and_settings_must_differ() -> None:
    with pytest.raises(ValueError, match=r"grid.max_staleness must be a non-empty list"):
        expand({"max_staleness": 4}, ())
    with pytest.raises(ValueError, match="same settings twice"):
        expand({}, [{"a": 1}, {"a": 1}])
    with pytest.raises(ValueError, match="at least one seed"):
        plan_runs({}, (), ())


@pytest.mark.parametrize(
    ("status", "checkpoint", "retry", "action"),
    [
        (Status.FINISHED, True, True, Action.SKIP),
        (Status.FAILED, True, False, Action.SKIP),
        (Status.FAILED, True, True, Action.START),
        (Status.RUNNING, True, False, Action.RESUME),
        (Status.RUNNING, False, False, Action.START),
        (Status.INTERRUPTED, True, False, Action.RESUME),
        (Status.PLANNED, False, False, Action.START),
    ],
)
def test_a_restarted_sweep_skips_finished_runs_and_resumes_interrupted_ones(
    status, checkpoint, retry, action
) -> None:
    assert next_action(status, checkpoint, retry) is action


def test_no_status_leads_to_running_a_finished_run_again() -> None:
    for checkpoint, retry in itertools.product([False, True], repeat=2):
        assert next_action(Status.FINISHED, checkpoint, retry) is Action.SKIP
