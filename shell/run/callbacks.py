"""transformers ``TrainerCallback``s in the asynchronous loop, with a real ``TrainerState`` and
``TrainerControl``.

Events: ``on_init_end`` (end of the trainer's constructor), ``on_train_begin``,
``on_step_begin`` (a step's rows are planned), ``on_step_end``, ``on_log`` (with the logged
window's metrics, and with each evaluation's), ``on_evaluate`` (with an evaluation's metrics,
when it arrives, at the step of its weight version; rank 0),
``on_save`` (a checkpoint was written), ``on_train_end``.

The trainer's own schedule (``logging_strategy``/``logging_steps``/``logging_first_step``,
``save_strategy``/``save_steps``) sets ``control.should_log`` and ``control.should_save`` before
``on_step_end``, as transformers' ``DefaultFlowCallback`` would; a callback may change them or
set ``control.should_training_stop``, and the loop does what ``control`` says after the
callbacks ran. With several processes, rank 0's ``control`` decides for all.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState
from transformers.trainer_callback import CallbackHandler, ExportableState


class _Handler(CallbackHandler):
    """transformers' ``CallbackHandler`` without its warning about a missing
    ``DefaultFlowCallback``: the trainer's loop sets the flow itself."""

    def __init__(self, callbacks: Sequence[Any], model: Any, processing_class: Any) -> None:
        self.callbacks: list[TrainerCallback] = []
        for callback in callbacks:
            self.add_callback(callback)
        self.model = model
        self.processing_class = processing_class
        self.optimizer = None
        self.lr_scheduler = None
        self.train_dataloader = None
        self.eval_dataloader = None


class Callbacks:
    """The trainer's callbacks and the state and control they see.

    Args:
        callbacks: ``TrainerCallback`` instances or classes (a class is instantiated).
        args: the trainer's ``AsyncGRPOConfig``, passed to every event.
    """

    def __init__(self, callbacks: Sequence[Any], args: Any, model: Any, processing_class: Any):
        self.args = args
        self.handler = _Handler(callbacks, model, processing_class)
        self.state = TrainerState(
            stateful_callbacks=[c for c in self.handler.callbacks if isinstance(c, ExportableState)]
        )
        self.control = TrainerControl()

    def _event(self, name: str, **kwargs: Any) -> TrainerControl:
        self.control = getattr(self.handler, name)(self.args, self.state, self.control, **kwargs)
        return self.control

    def init_end(self) -> None:
        self._event("on_init_end")

    def train_begin(
        self,
        *,
        optimizer: Any,
        lr_scheduler: Any,
        global_step: int,
        logging_steps: int,
        save_steps: int,
        rank: int,
        local_rank: int,
    ) -> None:
        """Start a ``train()`` call: a fresh state at ``global_step`` (a resumed run's step)."""
        self.handler.optimizer = optimizer
        self.handler.lr_scheduler = lr_scheduler
        self.state = TrainerState(
            max_steps=max(self.args.max_steps, 0),
            num_train_epochs=self.args.num_train_epochs,
            logging_steps=logging_steps,
            save_steps=save_steps,
            is_world_process_zero=rank == 0,
            is_local_process_zero=local_rank == 0,
            stateful_callbacks=self.state.stateful_callbacks,
            trial_name=self.state.trial_name,
            trial_params=self.state.trial_params,
        )
        self.state.global_step = global_step
        self.control = TrainerControl()
        self._event("on_train_begin")

    def step_begin(self) -> None:
        self._event("on_step_begin")

    def step_end(
        self, global_step: int, epoch: float, should_log: bool, should_save: bool
    ) -> TrainerControl:
        """Record the step, set the schedule's flow, run ``on_step_end``; the control to obey."""
        self.state.global_step = global_step
        self.state.epoch = epoch
        self.control.should_log = self.control.should_log or should_log
        self.control.should_save = self.control.should_save or should_save
        return self._event("on_step_end")

    def log(self, logs: dict[str, float]) -> None:
        """``on_log`` with the window's metrics; they join ``state.log_history``."""
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.control.should_log = False
        self._event("on_log", logs=logs)

    def evaluate(self, metrics: dict[str, float], step: int | None = None) -> None:
        """An evaluation's metrics at ``step`` (default: the current step), as transformers'
        ``Trainer.evaluate`` hands them on: ``on_log`` (so every tracker of ``report_to`` logs
        them), then ``on_evaluate``; they join ``state.log_history``.

        An evaluation made during training arrives some steps after its weight version
        ``step``; ``state.global_step`` is ``step`` for these two calls only, so that the
        trackers draw it where it was made (each tracker keys a value by its name and step:
        tensorboard and mlflow by the step given, wandb and trackio by the logged
        ``train/global_step``; an earlier step than other metrics' last is kept, since no
        tracker here requires one metric's steps to increase across names).
        ``control.should_log`` is left as the step loop set it.
        """
        now = self.state.global_step
        self.state.global_step = now if step is None else step
        should_log = self.control.should_log
        try:
            self.state.log_history.append({**metrics, "step": self.state.global_step})
            self._event("on_log", logs=metrics)
            self.control.should_log = should_log
            self.control.should_evaluate = False
            self._event("on_evaluate", metrics=metrics)
        finally:
            self.state.global_step = now

    def save(self) -> None:
        self.control.should_save = False
        self._event("on_save")

    def train_end(self) -> None:
        self._event("on_train_end")
