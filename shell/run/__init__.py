"""One training run: :class:`AsyncGRPOTrainer` and its step loop (:mod:`.training_run`),
callbacks, checkpoints, interrupts, hub uploads and the metrics log.
"""

from __future__ import annotations

from asyncgrpo.shell.config import configure_logging
from asyncgrpo.shell.run import checkpoints
from asyncgrpo.shell.run.inputs import eval_datasets_of
from asyncgrpo.shell.run.interrupts import (
    TrainingInterrupted,
    signal_name,
    signals_interrupt,
    signum_of,
)
from asyncgrpo.shell.run.metrics_log import (
    EVALUATIONS_FILE,
    MetricsFile,
    read_metrics,
)
from asyncgrpo.shell.run.trainer import AsyncGRPOTrainer
from asyncgrpo.shell.run.training_run import TrainOutput

__all__ = [
    "EVALUATIONS_FILE",
    "AsyncGRPOTrainer",
    "MetricsFile",
    "TrainOutput",
    "TrainingInterrupted",
    "checkpoints",
    "configure_logging",
    "eval_datasets_of",
    "read_metrics",
    "signal_name",
    "signals_interrupt",
    "signum_of",
]
