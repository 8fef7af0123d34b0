"""What the trainer sends into the rollout process: the :class:`LoopSpec` its loop is built
from (pickled across the spawn; :func:`check_picklable` fails early, at ``train()``, naming what
cannot be sent), and the error the process's failures raise in the trainer.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from asyncgrpo.core.rollout.cursor import PromptCursor
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.rollout.tools import callable_name


class RolloutWorkerError(RuntimeError):
    """The rollout process failed or hung; the message carries the child's traceback."""


def check_picklable(kind: str, objects: Sequence[Any] | Mapping[str, Any] | None) -> None:
    """Raise a ``TypeError`` naming the first object of ``kind`` that cannot be pickled."""
    items = objects.items() if isinstance(objects, Mapping) else enumerate(objects or ())
    for key, obj in items:
        try:
            pickle.dumps(obj)
        except Exception as error:
            name = callable_name(obj) if callable(obj) else repr(obj)
            where = f" (key {key!r})" if isinstance(objects, Mapping) else ""
            raise TypeError(
                f"{kind} {name!r}{where} cannot be sent to the rollout process: {error}. "
                "Use a module-level function, functools.partial or a callable class instance; "
                "lambdas and closures cannot be pickled"
            ) from error


@attrs.frozen
class LoopSpec:
    """Everything the child needs to build its loop (pickled into it)."""

    loop_cls: type  # AsyncRolloutLoop or a subclass (not imported: the loop imports far more)
    config: AsyncGRPOConfig
    model_name: str
    dataset: Any
    reward_funcs: tuple[Callable[..., Any], ...]
    processing_class: Any
    max_model_len: int
    token_budget: int
    rows_per_step: int
    tools: tuple[Callable[..., Any], ...] = ()
    environment_factory: Any = None
    lora_name: str | None = None
    start_cursor: PromptCursor = attrs.field(factory=PromptCursor)
    eval_datasets: Mapping[str, Any] = attrs.field(factory=dict)
    eval_reward_funcs: tuple[Callable[..., Any], ...] = ()  # empty: the reward_funcs
    loop_options: Mapping[str, Any] = attrs.field(factory=dict)  # loop_cls's own keywords

    def check(self) -> None:
        """Fail early on anything that cannot reach the child."""
        check_picklable("reward function", self.reward_funcs)
        check_picklable("eval reward function", self.eval_reward_funcs)
        check_picklable("tool", self.tools)
        if isinstance(self.environment_factory, Mapping):
            check_picklable("environment factory", self.environment_factory)
        elif self.environment_factory is not None:
            check_picklable("environment factory", [self.environment_factory])
        check_picklable("rollout loop class", [self.loop_cls])
        check_picklable("dataset", [self.dataset])
        check_picklable("eval dataset", dict(self.eval_datasets))
        check_picklable("processing class", [self.processing_class])
        check_picklable("config", [self.config])
        check_picklable("rollout loop option", dict(self.loop_options))
