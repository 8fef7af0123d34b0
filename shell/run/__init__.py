"""One training run: :class:`AsyncGRPOTrainer` and its step loop (:mod:`.training_run`),
callbacks, checkpoints, interrupts, hub uploads and the metrics log.
"""

from __future__ import annotations

from asyncgrpo.shell.run import checkpoints
from asyncgrpo.shell.run.interrupts import (
    TrainingInterrupted,
    signal_name,
    signals_interrupt,
    signum_of,
)
from asyncgrpo.shell.run.metrics_log import MetricsFile, configure_logging, read_metrics
from asyncgrpo.shell.run.trainer import AsyncGRPOTrainer
from asyncgrpo.shell.run.training_run import TrainOutput

__all__ = [
    "AsyncGRPOTrainer",
    "MetricsFile",
    "TrainOutput",
    "TrainingInterrupted",
    "checkpoints",
    "configure_logging",
    "read_metrics",
    "signal_name",
    "signals_interrupt",
    "signum_of",
]
