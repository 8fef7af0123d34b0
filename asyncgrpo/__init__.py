"""asyncgrpo: asynchronous GRPO training with a vLLM rollout process and an FSDP2 learner.

    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer

See ``docs/`` for the guide.
"""

from asyncgrpo.core.records import Rollout, RolloutGroup, TrainingSample, TurnRecord
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.rollout_loop import AsyncRolloutLoop
from asyncgrpo.shell.trainer import AsyncGRPOTrainer

__all__ = [
    "AsyncGRPOConfig",
    "AsyncGRPOTrainer",
    "AsyncRolloutLoop",
    "Rollout",
    "RolloutGroup",
    "TrainingSample",
    "TurnRecord",
]
