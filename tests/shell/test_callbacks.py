"""Callbacks see transformers' state and control; ``report_to`` trackers are transformers' own
reporting callbacks, fed each logged window."""

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers.integrations import get_reporting_integration_callbacks

from asyncgrpo import AsyncGRPOConfig
from asyncgrpo.shell.run.callbacks import Callbacks


def windows_to_tensorboard(tmp_path: Path, windows: list[dict[str, float]]) -> EventAccumulator:
    args = AsyncGRPOConfig(output_dir=str(tmp_path), report_to="tensorboard", max_steps=2)
    callbacks = Callbacks(get_reporting_integration_callbacks(args.report_to), args, None, None)
    callbacks.train_begin(optimizer=None, lr_scheduler=None, global_step=0, logging_steps=1,
                          save_steps=0, rank=0, local_rank=0)  # fmt: skip
    for step, window in enumerate(windows, start=1):
        callbacks.step_end(step, 0.0, should_log=True, should_save=False)
        callbacks.log(window)
    callbacks.train_end()
    (logdir,) = (tmp_path / "runs").iterdir()
    events = EventAccumulator(str(logdir))
    events.Reload()
    return events


def test_report_to_tensorboard_writes_each_window_under_transformers_names(tmp_path) -> None:
    events = windows_to_tensorboard(tmp_path, [{"reward": 0.5, "perf/step_s": 1.5},
                                               {"reward": 0.75, "perf/step_s": 1.25}])  # fmt: skip
    assert [(s.step, s.value) for s in events.Scalars("train/reward")] == [(1, 0.5), (2, 0.75)]
    assert [s.value for s in events.Scalars("train/perf/step_s")] == [1.5, 1.25]
