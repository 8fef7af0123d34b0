"""One run of a sweep, in its own process: ``python -m asyncgrpo.shell.experiments.sweep_run
RUN_DIR SWEEP_PID``, started by :mod:`asyncgrpo.shell.experiments.sweep`.

It trains from ``RUN_DIR/run_spec.json`` (the run's config fields, model, dataset, reward
functions, loop and stop rule) with the callbacks the stop rule asks for, resumes from the run's
last checkpoint when the sweep says so, and writes ``run.json`` at the end. It stops cleanly, as
on SIGTERM, when the sweep process is gone.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from asyncgrpo.shell.config import (
    AsyncGRPOConfig,
    import_named,
    load_eval_datasets,
    load_named_dataset,
)
from asyncgrpo.shell.experiments.sweep import RUN_RESULT, RUN_SPEC, StopRule
from asyncgrpo.shell.run import signals_interrupt


class StopAtThreshold(TrainerCallback):
    """Ends a run after the first logged window whose ``metric`` reaches ``threshold``."""

    def __init__(self, threshold: float, metric: str = "reward") -> None:
        self.threshold = threshold
        self.metric = metric

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        value = (logs or {}).get(self.metric)
        if value is not None and value >= self.threshold:
            control.should_training_stop = True


class StopAfterWallTime(TrainerCallback):
    """Ends a run once ``seconds`` of training passed (checked at each step's end)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started = time.monotonic()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.started = time.monotonic()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if time.monotonic() - self.started >= self.seconds:
            control.should_training_stop = True


def train_one(run_dir: Path) -> int:
    """The run process: train from ``run_dir/run_spec.json``; ``run.json`` records the end."""
    spec = json.loads((run_dir / RUN_SPEC).read_text())
    for folder in spec["import_path"]:
        if folder not in sys.path:
            sys.path.insert(0, folder)  # the rollout process, spawned, inherits sys.path
    from asyncgrpo.shell.run import AsyncGRPOTrainer

    callbacks: list[TrainerCallback] = []
    stop = StopRule(**spec["stop"])
    if stop.reward_threshold is not None:
        callbacks.append(StopAtThreshold(stop.reward_threshold, stop.threshold_metric))
    if stop.wall_time_s is not None:
        callbacks.append(StopAfterWallTime(stop.wall_time_s))
    cls: type[AsyncGRPOTrainer] = AsyncGRPOTrainer
    if spec["loop"]:
        cls = type(
            "SweepTrainer", (AsyncGRPOTrainer,), {"loop_cls": import_named(spec["loop"], "loop")}
        )
    trainer = cls(
        model=spec["model"],
        args=AsyncGRPOConfig(**spec["config"]),
        reward_funcs=[import_named(r, "reward function") for r in spec["reward_funcs"]],
        train_dataset=load_named_dataset(spec["dataset"]),
        eval_dataset=load_eval_datasets(spec.get("eval_dataset") or {}) or None,
        eval_reward_funcs=[
            import_named(r, "eval reward function") for r in spec.get("eval_reward_funcs", [])
        ]
        or None,
        callbacks=callbacks,
    )
    output = trainer.train(resume_from_checkpoint=True if spec["resume"] else None)
    (run_dir / RUN_RESULT).write_text(
        json.dumps({"global_step": output.global_step, "training_loss": output.training_loss})
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m asyncgrpo.shell.experiments.sweep_run RUN_DIR SWEEP_PID``: one run of a sweep;
    it stops (cleanly, as on SIGTERM) when the sweep process is gone."""
    from asyncgrpo.adapters.parent_death import die_with_parent
    from asyncgrpo.shell.run import configure_logging

    args = list(sys.argv[1:] if argv is None else argv)
    die_with_parent(signal.SIGTERM, int(args[1]))
    configure_logging()
    with signals_interrupt():
        return train_one(Path(args[0]))


if __name__ == "__main__":
    raise SystemExit(main())
