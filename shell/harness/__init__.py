"""Agents in their own harness: :class:`HarnessAsyncGRPOTrainer` (:mod:`.trainer`), the trainer
TRL's AsyncGRPOTrainer documentation names for them, and :class:`HarnessRolloutLoop`
(:mod:`.loop`), whose rollouts an OpenEnv harness drives, white-box or through the capture
endpoint its agents call (:mod:`.capture`, :func:`capture_url`; docs/harness.md).
"""

from __future__ import annotations

from asyncgrpo.shell.harness.capture import CaptureEndpoint, capture_url
from asyncgrpo.shell.harness.loop import HarnessRolloutLoop, MeasuredSession
from asyncgrpo.shell.harness.trainer import HarnessAsyncGRPOTrainer

__all__ = [
    "CaptureEndpoint",
    "HarnessAsyncGRPOTrainer",
    "HarnessRolloutLoop",
    "MeasuredSession",
    "capture_url",
]
