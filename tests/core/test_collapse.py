"""The spread watch: spreadless steps are counted in a row and in all, warned about less and
less often (at warn_after, then 2, 4, 8... times it in all), and stop the run only when asked."""

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
settings = st.builds(
    SpreadSettings,
    share=st.sampled_from([0.5, 0.9, 1.0]),
    warn_after=st.integers(1, 4),
    stop_after=st.none() | st.integers(1, 8),
)


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
    in_a_row, total, due = 0, 0, config.warn_after
    for groups, verdict in zip(plan, verdicts, strict=True):
        if not groups:
            assert verdict is Verdict.NONE
            continue
        if not spreadless(groups, config.share):
            in_a_row = 0
            assert verdict is Verdict.NONE
            continue
        in_a_row, total = in_a_row + 1, total + 1
        if config.stop_after is not None and in_a_row >= config.stop_after:
            assert verdict is Verdict.STOP
        elif in_a_row >= config.warn_after and total >= due:
            assert verdict is Verdict.WARN
            due *= 2
        else:
            assert verdict is Verdict.NONE


@given(steps, settings)
def test_without_stop_after_a_run_never_stops_and_warns_a_few_times(plan, config) -> None:
    """Only once warn_after steps in a row were spreadless, and at most 1 + log2(total /
    warn_after) times in all: a spread that comes and goes, or a long collapse, is not warned
    about at every step."""
    config = SpreadSettings(config.share, config.warn_after, None)
    verdicts = run(plan, config)
    assert Verdict.STOP not in verdicts
    total = in_a_row = 0
    for groups, verdict in zip(plan, verdicts, strict=True):
        if groups:
            in_a_row = in_a_row + 1 if spreadless(groups, config.share) else 0
            total += in_a_row > 0
        assert verdict is not Verdict.WARN or in_a_row >= config.warn_after
    warnings = verdicts.count(Verdict.WARN)
    assert warnings == 0 or config.warn_after * 2 ** (warnings - 1) <= total


def test_a_spread_that_comes_and_goes_is_warned_about_at_3_6_12_24_spreadless_steps() -> None:
    config = SpreadSettings(share=0.9, warn_after=3, stop_after=None)
    flat, learning = [True] * 8, [False] * 8
    verdicts = run(([flat] * 3 + [learning]) * 8, config)  # 24 spreadless steps, 8 collapses
    warned_at = [i for i, verdict in enumerate(verdicts) if verdict is Verdict.WARN]
    assert warned_at == [2, 6, 14, 30]  # after 3, 6, 12 and 24 spreadless steps in all


def test_a_collapse_is_warned_about_within_warn_after_steps_and_stopped_at_stop_after() -> None:
    config = SpreadSettings(share=0.9, warn_after=3, stop_after=5)
    learning = [[False, True, False, False]] * 4
    collapsed = [[True] * 8] * 6
    verdicts = run(learning + collapsed, config)
    assert verdicts[:4] == [Verdict.NONE] * 4
    assert verdicts[4:] == [
        Verdict.NONE,
        Verdict.NONE,
        Verdict.WARN,
        Verdict.NONE,
        Verdict.STOP,
        Verdict.STOP,
    ]


@given(st.integers(0, 40), st.integers(1, 20))
def test_a_step_is_due_once_a_steps_worth_of_zero_spread_groups_arrived(zero, per_step) -> None:
    watch = SpreadWatch()
    for _ in range(zero):
        watch = group_seen(watch, True)
    assert step_due(watch, per_step) == (zero >= per_step)
