"""asyncgrpo: asynchronous GRPO training with a vLLM rollout process and an FSDP2 learner.

    from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer

See ``docs/`` for the guide. The names below are imported on first use, so that importing a
submodule (vLLM loads :mod:`asyncgrpo.adapters.transfer.plugin` into each of its processes) does
not pull in the trainer.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncgrpo.core.records import Rollout, RolloutGroup, TrainingSample, TurnRecord
    from asyncgrpo.shell.config import AsyncGRPOConfig, configure_logging
    from asyncgrpo.shell.harness import HarnessAsyncGRPOTrainer, capture_url
    from asyncgrpo.shell.rollout import AsyncRolloutLoop
    from asyncgrpo.shell.run import AsyncGRPOTrainer

__version__ = importlib.metadata.version("asyncgrpo")
"""The installed distribution's version (pyproject.toml's ``version``)."""

_HOMES = {
    "AsyncGRPOConfig": "asyncgrpo.shell.config",
    "AsyncGRPOTrainer": "asyncgrpo.shell.run",
    "AsyncRolloutLoop": "asyncgrpo.shell.rollout",
    "HarnessAsyncGRPOTrainer": "asyncgrpo.shell.harness",
    "capture_url": "asyncgrpo.shell.harness",
    "configure_logging": "asyncgrpo.shell.config",
    "Rollout": "asyncgrpo.core.records",
    "RolloutGroup": "asyncgrpo.core.records",
    "TrainingSample": "asyncgrpo.core.records",
    "TurnRecord": "asyncgrpo.core.records",
}

__all__ = [
    "AsyncGRPOConfig",
    "AsyncGRPOTrainer",
    "AsyncRolloutLoop",
    "HarnessAsyncGRPOTrainer",
    "Rollout",
    "RolloutGroup",
    "TrainingSample",
    "TurnRecord",
    "capture_url",
    "configure_logging",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'asyncgrpo' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The module's names with the public ones that :func:`__getattr__` imports on first use."""
    return sorted(set(globals()) | set(__all__))
