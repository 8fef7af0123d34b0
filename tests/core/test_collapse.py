"""The spread watch: spreadless steps are counted in a row, warned about once per run of them,
and stop the run only when asked."""

from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.run.collapse import (
    SpreadSettings,
    SpreadWatch,
    Verdict,
    close_step,
    group_seen,
    step_due,
)

steps = st.lists(st.lists(st.booleans(), max_size=12), min_size=1, max_size=30)
settings = st.builds(SpreadSettings, share=st.sampled_from([0.5, 0.9, 1.0]),
                     warn_after=st.integers(1, 4),
                     stop_after=st.none() | st.integers(1, 8))  # fmt: skip


def run(plan: list[list[bool]], config: SpreadSettings) -> list[Verdict]:
    watch, verdicts = SpreadWatch(), []
    for groups in plan:
        for zero_spread in groups:
            watch = group_seen(watch, zero_spread)
        watch, verdict = close_step(watch, config)
        verdicts.append(verdict)
    return verdicts


def spreadless(groups: list[bool], share: float) -> bool:
    return bool(groups) and sum(groups) / len(groups) >= share


@given(steps, settings)
def test_verdicts_follow_the_spreadless_steps_in_a_row(plan, config) -> None:
    verdicts = run(plan, config)
    in_a_row, warned = 0, False
    for groups, verdict in zip(plan, verdicts, strict=True):
        if not groups:
            assert verdict is Verdict.NONE
            continue
        if not spreadless(groups, config.share):
            in_a_row, warned = 0, False
            assert verdict is Verdict.NONE
            continue
        in_a_row += 1
        if config.stop_after is not None and in_a_row >= config.stop_after:
            assert verdict is Verdict.STOP
        elif in_a_row >= config.warn_after and not warned:
            assert verdict is Verdict.WARN
            warned = True
        else:
            assert verdict is Verdict.NONE


@given(steps, settings)
def test_without_stop_after_a_run_never_stops_and_warns_once_per_collapse(plan, config) -> None:
    config = SpreadSettings(config.share, config.warn_after, None)
    verdicts = run(plan, config)
    assert Verdict.STOP not in verdicts
    collapses = 0
    in_a_row = 0
    for groups in plan:
        if not groups:
            continue
        in_a_row = in_a_row + 1 if spreadless(groups, config.share) else 0
        collapses += in_a_row == config.warn_after
    assert verdicts.count(Verdict.WARN) == collapses


def test_a_collapse_is_warned_about_within_warn_after_steps_and_stopped_at_stop_after() -> None:
    config = SpreadSettings(share=0.9, warn_after=3, stop_after=5)
    learning = [[False, True, False, False]] * 4
    collapsed = [[True] * 8] * 6
    verdicts = run(learning + collapsed, config)
    assert verdicts[:4] == [Verdict.NONE] * 4
    assert verdicts[4:] == [Verdict.NONE, Verdict.NONE, Verdict.WARN, Verdict.NONE, Verdict.STOP,
                            Verdict.STOP]  # fmt: skip


@given(st.integers(0, 40), st.integers(1, 20))
def test_a_step_is_due_once_a_steps_worth_of_zero_spread_groups_arrived(zero, per_step) -> None:
    watch = SpreadWatch()
    for _ in range(zero):
        watch = group_seen(watch, True)
    assert step_due(watch, per_step) == (zero >= per_step)
