"""Resume takes the newest complete checkpoint; ``save_total_limit`` keeps the newest complete
ones and never deletes the checkpoint a resume would take, whatever damaged ones lie around."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.run.checkpoint_choice import (
    UNFINISHED,
    SavedCheckpoint,
    choose_resume,
    newest_first,
    to_rotate,
)


@st.composite
def run_directories(draw) -> list[SavedCheckpoint]:
    """A run's checkpoint directories: finished ones with distinct steps, some damaged, and
    ``.partial`` ones (a step may have both)."""
    steps = draw(st.lists(st.integers(0, 40), unique=True, max_size=10))
    saved = [
        SavedCheckpoint(step, problem=draw(st.none() | st.just(f"checkpoint-{step}/x: missing")))
        for step in steps
    ]
    partial_steps = draw(st.lists(st.integers(0, 40), unique=True, max_size=3))
    saved += [SavedCheckpoint(step, finished=False) for step in partial_steps]
    return draw(st.permutations(saved))


keeps = st.none() | st.integers(0, 5)


@given(run_directories())
def test_resume_takes_the_newest_complete_and_skips_exactly_the_newer(saved) -> None:
    choice = choose_resume(saved)
    complete = [s for s in saved if s.complete]
    if not complete:
        assert choice.checkpoint is None
        assert list(choice.skipped) == newest_first(saved)
        return
    assert choice.checkpoint.step == max(s.step for s in complete)
    order = newest_first(saved)
    assert list(choice.skipped) == order[: order.index(choice.checkpoint)]
    assert all(not s.complete for s in choice.skipped)
    assert all(s.why_not_complete for s in choice.skipped)


@given(run_directories())
def test_the_checkpoints_below_the_choice_do_not_change_it(saved) -> None:
    """A caller may check newest first and stop at the first complete checkpoint."""
    choice = choose_resume(saved)
    checked = [*choice.skipped, *([choice.checkpoint] if choice.checkpoint else [])]
    assert choose_resume(checked) == choice


@given(run_directories(), keeps)
def test_rotation_never_deletes_the_checkpoint_a_resume_takes(saved, keep) -> None:
    before = choose_resume(saved)
    rotated = to_rotate(saved, keep)
    rest = [s for s in saved if s not in rotated]
    assert choose_resume(rest).checkpoint == before.checkpoint


@given(run_directories(), keeps)
def test_rotation_keeps_the_newest_complete_and_nothing_newer_goes(saved, keep) -> None:
    rotated = to_rotate(saved, keep)
    rest = [s for s in saved if s not in rotated]
    complete = sorted((s for s in saved if s.complete), key=lambda s: s.step)
    if not keep or not complete:
        assert rotated == ()
        return
    assert sorted((s for s in rest if s.complete), key=lambda s: s.step) == complete[-keep:]
    assert all(s.finished and s.step <= complete[-1].step for s in rotated)
    assert all(s.step > complete[-1].step or not s.finished for s in rest if not s.complete)
    assert list(rotated) == sorted(rotated, key=lambda s: s.step)


def test_a_damaged_newest_checkpoint_is_not_the_one_kept() -> None:
    """The case that deleted every checkpoint that loads when a damaged one counted: keep 1,
    a damaged checkpoint-3 left by a crash, checkpoint-2 just written."""
    damaged = SavedCheckpoint(3, problem="checkpoint-3/dcp/__0_0.distcp: cut short")
    saved = [SavedCheckpoint(1), SavedCheckpoint(2), damaged]
    assert to_rotate(saved, keep=1) == (SavedCheckpoint(1),)
    assert choose_resume(saved).checkpoint == SavedCheckpoint(2)
    assert choose_resume(saved).skipped == (damaged,)


def test_an_unfinished_save_is_named_and_a_bad_limit_refused() -> None:
    assert SavedCheckpoint(4, finished=False).why_not_complete == UNFINISHED
    with pytest.raises(ValueError, match="save_total_limit must be None or >= 0"):
        to_rotate([SavedCheckpoint(1)], keep=-1)
    with pytest.raises(ValueError, match="share a step"):
        to_rotate([SavedCheckpoint(1), SavedCheckpoint(1, problem="x")], keep=1)
