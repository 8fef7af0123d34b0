"""asyncgrpo: asynchronous GRPO training with a vLLM rollout process and an FSDP2 learner.

The user-facing records are re-exported here; see ``docs/`` for the guide.
"""

from asyncgrpo.core.records import Rollout, RolloutGroup, TrainingSample, TurnRecord

__all__ = ["Rollout", "RolloutGroup", "TrainingSample", "TurnRecord"]
