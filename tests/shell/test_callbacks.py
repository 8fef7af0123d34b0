"""Callbacks see transformers' state and control; ``report_to`` trackers are transformers' own
reporting callbacks, fed each logged window."""

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import TrainerCallback
from transformers.integrations import get_reporting_integration_callbacks

from asyncgrpo import AsyncGRPOConfig
from asyncgrpo.shell.run.callbacks import Callbacks


def windows_to_tensorboard(tmp_path: Path, windows: list[dict[str, float]]) -> EventAccumulator:
    args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="tensorboard", max_steps=2)
    callbacks = Callbacks(get_reporting_integration_callbacks(args.report_to), args, None, None)
    callbacks.train_begin(
        optimizer=None,
        lr_scheduler=None,
        global_step=0,
        logging_steps=1,
        save_steps=0,
        rank=0,
        local_rank=0,
    )
    for step, window in enumerate(windows, start=1):
        callbacks.step_end(step, 0.0, should_log=True, should_save=False)
        callbacks.log(window)
    callbacks.train_end()
    (logdir,) = (tmp_path / "runs").iterdir()
    events = EventAccumulator(str(logdir))
    events.Reload()
    return events


def test_report_to_tensorboard_writes_each_window_under_transformers_names(tmp_path) -> None:
    events = windows_to_tensorboard(
        tmp_path, [{"reward": 0.5, "perf/step_s": 1.5}, {"reward": 0.75, "perf/step_s": 1.25}]
    )
    assert [(s.step, s.value) for s in events.Scalars("train/reward")] == [(1, 0.5), (2, 0.75)]
    assert [s.value for s in events.Scalars("train/perf/step_s")] == [1.5, 1.25]


class StepsOfEvaluations(TrainerCallback):
    """The step ``on_evaluate`` sees with each evaluation's version."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.seen.append((state.global_step, metrics["eval/held/version"]))


def test_an_evaluation_arriving_steps_later_is_logged_at_its_version_in_tensorboard(
    tmp_path,
) -> None:
    """Evaluations of versions 0, 2 and 4 arrive after steps 1, 3 (two at once) and 6 were
    logged: tensorboard's event files hold each at its own version's step, none dropped; the
    training curve keeps its steps, and ``on_evaluate`` sees the version's step."""
    args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="tensorboard", max_steps=6)
    seen = StepsOfEvaluations()
    callbacks = Callbacks(
        [*get_reporting_integration_callbacks(args.report_to), seen], args, None, None
    )
    callbacks.train_begin(
        optimizer=None,
        lr_scheduler=None,
        global_step=0,
        logging_steps=1,
        save_steps=0,
        rank=0,
        local_rank=0,
    )
    arrivals = {1: [0], 3: [], 5: [2], 6: [4]}  # after step s's row: the versions that arrive
    for step in range(1, 7):
        callbacks.step_end(step, 0.0, should_log=True, should_save=False)
        callbacks.log({"reward": step / 10})
        for version in arrivals.get(step, []):
            callbacks.evaluate(
                {"eval/held/reward": version / 8, "eval/held/version": version}, step=version
            )
        assert callbacks.state.global_step == step
    callbacks.train_end()
    (logdir,) = (tmp_path / "runs").iterdir()
    events = EventAccumulator(str(logdir))
    events.Reload()
    assert [(s.step, s.value) for s in events.Scalars("train/eval/held/reward")] == [
        (0, 0.0),
        (2, 0.25),
        (4, 0.5),
    ]
    assert [s.step for s in events.Scalars("train/reward")] == [1, 2, 3, 4, 5, 6]
    assert seen.seen == [(0, 0), (2, 2), (4, 4)]
    history = [
        (h["step"], h["eval/held/version"])
        for h in callbacks.state.log_history
        if "eval/held/version" in h
    ]
    assert history == [(0, 0), (2, 2), (4, 4)]
