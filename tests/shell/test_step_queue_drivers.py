"""The trainer and ``asyncgrpo simulate`` drive the same step queue: fed the same stream of
groups, they take the same steps and drop the same samples.

The trainer's side runs its real ``_plan_next_step`` over a ``FakeRolloutProcess`` (a fake: a
real rollout process cannot replay a fixed stream), so no server or model is involved.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncgrpo.adapters.models.causal_lm import tiny_config
from asyncgrpo.core import metrics
from asyncgrpo.core.records import TrainingSample, TrainingSequence
from asyncgrpo.core.rollout import cursor
from asyncgrpo.core.run.step_queue import NONE_IN_FLIGHT, InFlight
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.experiments.simulate import SimulationConfig, _take_step
from asyncgrpo.shell.experiments.simulation_state import Pipeline
from asyncgrpo.shell.rollout import AsyncRolloutLoop, GroupOutcome
from asyncgrpo.shell.run.flops import FlopsMeter
from asyncgrpo.shell.run.inputs import RunInputs
from asyncgrpo.shell.run.training_run import (
    RolloutSide,
    RunBooks,
    RunParts,
    TrainingRun,
    new_step_queue,
)
from asyncgrpo.shell.servers import SharedTrust


class FakeRolloutProcess:
    """Replays ticks of messages: each ``get`` returns the current tick's next message, or
    ``None`` once the tick is exhausted, after which the next tick begins."""

    def __init__(self, ticks: list[list[GroupOutcome]]) -> None:
        self.ticks = [list(t) for t in ticks]
        self.taken = 0
        self.step_sizes: list[float] = []
        self.trust = SharedTrust()  # the server never goes away here

    def get(self, wait_s: float) -> GroupOutcome | None:
        if not self.ticks:
            raise RuntimeError("the stream ran out before the queue was ready")
        if self.ticks[0]:
            return self.ticks[0].pop(0)
        self.ticks.pop(0)
        return None

    def samples_taken(self, tokens: int) -> None:
        self.taken += tokens

    def samples_dropped(self, reason: str, count: int) -> None:
        pass  # only a long wait's report tells them

    def set_steps_taken(self, steps: int) -> None:
        self.steps = steps

    def step_consumed(self, tokens: float) -> None:
        self.step_sizes.append(tokens)

    def in_flight(self) -> InFlight:
        return NONE_IN_FLIGHT


def _group(position: int, version: int, lengths: list[int]) -> GroupOutcome:
    samples = []
    for member, length in enumerate(lengths):
        tokens = [position % 5, *range(10 + member, 10 + member + length - 1)]
        seq = TrainingSequence(tokens, [0] + [1] * (length - 1), [0.0] + [-0.5] * (length - 1))
        samples.append(
            TrainingSample(seq, 1.0, version, position, position, position, f"{position}-{member}")
        )
    return GroupOutcome(position, position, tuple(samples), ())


@st.composite
def streams(draw):
    """Ticks of groups; each group started some versions behind the number of ticks so far
    (a stand-in for the trainer's version, which both sides advance per step)."""
    ticks, position = [], 0
    for _ in range(draw(st.integers(5, 30))):
        tick = []
        for _ in range(draw(st.integers(0, 3))):
            lengths = draw(st.lists(st.integers(2, 40), min_size=0, max_size=4))
            tick.append((position, draw(st.integers(0, 3)), lengths))
            position += 1
        ticks.append(tick)
    return ticks


@functools.cache
def _cpu_flops() -> FlopsMeter:
    return FlopsMeter(tiny_config("qwen3", vocab_size=64), torch.device("cpu"), False)


def _trainer_run(
    tmp: Path, budget: int, rows: int, max_staleness: int, process: FakeRolloutProcess
) -> TrainingRun:
    """A run on rank 0 whose rollout side is ``process``; its servers never go away (no
    resync is due) and nothing is pushed (planning steps touches neither weights nor parity)."""
    args = AsyncGRPOConfig(
        output_dir=str(tmp),
        max_staleness=max_staleness,
        token_budget=budget,
        gradient_accumulation_steps=rows,
        disable_tqdm=True,
    )
    model_config = tiny_config("qwen3", vocab_size=64)
    inputs = RunInputs(
        args=args,
        model_name="tiny",
        model_config=model_config,
        processing_class=None,
        dataset=None,
        reward_funcs=(),
        tools=(),
        environment_factory=None,
        loop_cls=AsyncRolloutLoop,
        callbacks=None,
        after_checkpoint=lambda step, rank0: None,
    )
    learner = SimpleNamespace(rank=0, world_size=1, step=0, device=torch.device("cpu"), bf16=False)
    books = RunBooks.open(inputs, learner, None)
    books.intake.queue = new_step_queue(budget, learner, args)
    books.intake.process = process
    pushes = SimpleNamespace(
        servers_back=lambda: False,
        resync_due=lambda process: False,
        pusher=SimpleNamespace(raise_if_failed=lambda: None),
    )
    rollout = RolloutSide(process, _cpu_flops(), budget)
    return TrainingRun(books, RunParts(weights=None, pushes=pushes, parity=None, rollout=rollout))


@settings(max_examples=25, deadline=None)
@given(streams(), st.integers(48, 160), st.integers(1, 2), st.integers(0, 3))
def test_trainer_and_simulator_take_the_same_steps(tmp_path_factory, ticks, budget, rows, ms):
    tmp = tmp_path_factory.mktemp("run")

    def outcomes(version: int, tick) -> list[GroupOutcome]:
        return [_group(p, max(0, version - lag), lengths) for p, lag, lengths in tick]

    # The simulator's side: one tick per call, its version advancing per step taken.
    sim = SimulationConfig(
        token_budget=budget,
        rows_per_step=rows,
        max_staleness=ms,
        prompt_tokens=8,
        min_completion_tokens=1,
        max_completion_tokens=8,
    )
    state = Pipeline(sim, np.random.default_rng(0), np.zeros(sim.dataset_size))
    sim_steps, sim_sizes, versions, sim_stale = [], [], [], 0.0
    for tick in ticks:
        versions.append(state.version)
        for outcome in outcomes(state.version, tick):
            state.prompt_cursor = cursor.group_outcome(
                state.prompt_cursor, outcome.position, len(outcome.samples)
            )
            state.queue.append(outcome.samples)
        step = _take_step(state)
        if step is not None:
            sim_steps.append([s.rollout_id for s in step.samples])
            sim_sizes.append(state.steps.tokens_per_step)
            sim_stale = metrics.summarize(state.window).get("sample/dropped_stale_count", 0.0)
            state.version += 1
            state.policy = state.version  # its weights land before the next step

    # The trainer's side: the same groups, built at the versions the simulator saw.
    process = FakeRolloutProcess([outcomes(v, t) for v, t in zip(versions, ticks, strict=True)])
    run = _trainer_run(tmp, budget, rows, ms, process)
    trainer_steps = []
    for _ in sim_steps:
        rows_of_step = run._plan_next_step(run.rollout)
        trainer_steps.append([s.rollout_id for r in rows_of_step.rows for s in r.samples])
        run.learner.step += 1
        run.ledger.version = run.learner.step  # its weights land before the next step, as simulated
    trainer_stale = metrics.summarize(run.window).get("sample/dropped_stale_count", 0.0)

    assert trainer_steps == sim_steps
    assert process.step_sizes == sim_sizes
    assert trainer_stale == sim_stale


def test_a_budget_no_sample_fits_ends_the_run_with_an_error_naming_it(tmp_path) -> None:
    long = [_group(p, 0, [40] * 8) for p in range(8)]
    run = _trainer_run(tmp_path, 16, 1, 1, FakeRolloutProcess([long] * 10))
    with pytest.raises(ValueError, match="token_budget=16 is too small"):
        run._plan_next_step(run.rollout)


@pytest.mark.parametrize(("budget", "rows", "warned"), [(96, 1, 1), (96, 2, 0), (160, 1, 0)])
def test_a_group_larger_than_a_step_is_warned_of_once(tmp_path, budget, rows, warned) -> None:
    """Groups of four 40-token samples (160 tokens, no prefix shared) do not fit a step of
    one 96-token row: the run warns once, naming the fix, however many such groups arrive; a
    step of two such rows, or one of 160 tokens, holds a group and nothing is said."""
    from structlog.testing import capture_logs

    ticks = [[_group(4 * tick + p, 0, [40] * 4) for p in range(4)] for tick in range(4)]
    run = _trainer_run(tmp_path, budget, rows, 1, FakeRolloutProcess(ticks))
    with capture_logs() as logs:
        run._plan_next_step(run.rollout)
    said = [e for e in logs if e["event"].startswith("a group does not fit one step")]
    assert len(said) == warned, logs
    if warned:
        assert "raise token_budget or gradient_accumulation_steps" in said[0]["event"]
        assert (said[0]["token_budget"], said[0]["rows_per_step"]) == (budget, rows)


@pytest.mark.parametrize(
    ("max_staleness", "weight_sync_s"), [(0, 0.0), (1, 0.0), (4, 0.0), (2, 0.3), (4, 0.3)]
)
def test_the_simulator_drops_no_stale_sample_when_generation_keeps_up(
    tmp_path, max_staleness, weight_sync_s
):
    """Generation 3x faster than training, pushes instant or taking 0.3 s beside the next step
    (the servers' policy lags the steps taken): the allowance counts what the trainer holds
    and the lag, a group in flight counts as the largest so far, late groups of an older
    policy go ahead of newer ones and a step waits for them when they need its room, so no
    sample waits long enough to go stale (before the queue counted them, 23% of the trained
    samples at max_staleness 1 and three times as many as were trained at 4; before the last
    three, 157 of 3,217 samples at max_staleness 2 with the 0.3 s push, in 60 steps)."""
    from asyncgrpo.shell.experiments.simulate import simulate

    config = SimulationConfig(
        max_steps=30,
        max_staleness=max_staleness,
        logging_steps=5,
        generation_tokens_per_s=20_000.0,
        weight_sync_s=weight_sync_s,
    )
    windows = simulate(config, tmp_path, progress=False)[1:]
    assert sum(w.get("sample/dropped_stale_count", 0.0) for w in windows) == 0
    assert all(w["sample/staleness_max"] <= max_staleness for w in windows)


class SlippedInProcess(FakeRolloutProcess):
    """A fake rollout process whose generator admits a group against the old step count at the
    moment the trainer takes a short step (a race a real process shows about once in a few
    hundred steps): the group is in flight once the step is announced, and arrives next."""

    def __init__(self, ticks: list[list[GroupOutcome]], slipped: GroupOutcome) -> None:
        super().__init__(ticks)
        self.slipped: GroupOutcome | None = slipped
        self.steps = 0

    def in_flight(self) -> InFlight:
        if self.steps > 0 and self.slipped is not None:
            return InFlight(1, self.slipped.samples[0].model_version, 1)
        return NONE_IN_FLIGHT

    def get(self, wait_s: float) -> GroupOutcome | None:
        if self.steps > 0 and self.slipped is not None:
            slipped, self.slipped = self.slipped, None
            return slipped
        return super().get(wait_s)


def test_a_group_admitted_as_a_short_step_is_taken_waits_for_it_instead_of_going_stale(tmp_path):
    """max_staleness 0: the first group alone makes a short step ready (nothing in flight);
    the step is announced, a group admitted against the old count shows in flight, and the
    trainer takes it into the step, where it is fresh. Taken without it, it would arrive one
    step late and be dropped as stale."""
    first, slipped = _group(0, 0, [20, 20]), _group(1, 0, [3, 3])
    process = SlippedInProcess([[first], [], [], []], slipped)
    run = _trainer_run(tmp_path, 64, 1, 0, process)
    step = run._plan_next_step(run.rollout)
    taken = {s.rollout_id for r in step.rows for s in r.samples}
    assert taken == {"0-0", "0-1", "1-0", "1-1"}
    assert metrics.summarize(run.window).get("sample/dropped_stale_count", 0.0) == 0.0
    assert process.steps == 1


def test_restored_samples_join_the_queue_within_the_staleness_rule_and_are_not_released() -> None:
    """A resumed run puts its checkpoint's queued samples back: one more than
    ``max_staleness`` behind the resumed version is dropped as stale and its position
    consumed; the others are taken by the next step, and their tokens, which the new rollout
    process never counted, are not reported to it as taken."""
    from asyncgrpo.shell.run.intake import SampleIntake
    from asyncgrpo.shell.run.spread_guard import SpreadGuard

    def sample(position: int, version: int) -> TrainingSample:
        sequence = TrainingSequence([1, 2, 3, 4], [0, 1, 1, 1], [0.0, -1.0, -1.0, -1.0])
        return TrainingSample(sequence, 1.0, version, position, position, position, f"{position}")

    restored = [sample(3, 4), sample(3, 4), sample(4, 2)]  # the resumed version is 5
    start = cursor.group_outcome(cursor.group_outcome(cursor.PromptCursor(3), 3, 2), 4, 1)
    observed: list[metrics.Observation] = []
    intake = SampleIntake(
        start, lambda: 5, lambda *o: observed.extend(o), SpreadGuard(None, 2), lambda e: (), 16
    )
    intake.queue = new_step_queue(
        8,
        SimpleNamespace(world_size=1),
        SimpleNamespace(gradient_accumulation_steps=1, max_staleness=1),
    )
    intake.restore(restored)
    assert intake.cursor.is_consumed(4) and not intake.cursor.is_consumed(3)
    assert intake.take_done() == {"stale": [4]}
    assert {o.name for o in observed} >= {"sample/dropped_stale_count"}
    intake.process = FakeRolloutProcess([])
    step = intake.take_step()
    assert [s.prompt_position for s in step.samples] == [3, 3]
    assert intake.process.taken == 0  # restored tokens: the new process never counted them
