"""Agents in their own harness: :class:`HarnessAsyncGRPOTrainer` (:mod:`.trainer`), the trainer
TRL's AsyncGRPOTrainer documentation names for them, and :class:`HarnessRolloutLoop`
(:mod:`.loop`), whose rollouts an OpenEnv harness drives (docs/harness.md).
"""

from __future__ import annotations

from asyncgrpo.shell.harness.loop import HarnessRolloutLoop, MeasuredSession
from asyncgrpo.shell.harness.trainer import HarnessAsyncGRPOTrainer

__all__ = ["HarnessAsyncGRPOTrainer", "HarnessRolloutLoop", "MeasuredSession"]
