"""``HarnessAsyncGRPOTrainer``: asynchronous GRPO for agents that run in their own harness.

The trainer TRL's AsyncGRPOTrainer documentation points agent users to (OpenEnv's "Training on
harnesses"): the constructor and config of :class:`~asyncgrpo.AsyncGRPOTrainer`, plus an
OpenEnv session factory and harness adapter. Each rollout is one harness session on the
group's dataset row, its model turns sampled from the trainer's vLLM servers and its reward
from the session's ``verify()``
(:class:`~asyncgrpo.shell.harness.loop.HarnessRolloutLoop`); everything after the rollout
(scoring, staleness, the learner, the weight push) is the base trainer's. docs/harness.md.
"""

from __future__ import annotations

import inspect
from typing import Any

from asyncgrpo.adapters.openenv import harness_api
from asyncgrpo.shell.harness.loop import HarnessRolloutLoop
from asyncgrpo.shell.run import AsyncGRPOTrainer


class HarnessAsyncGRPOTrainer(AsyncGRPOTrainer):
    """:class:`~asyncgrpo.AsyncGRPOTrainer` whose rollouts an OpenEnv harness drives.

    Takes the base trainer's arguments, and these (by keyword):
        harness_session_factory: OpenEnv ``ResourceSessionFactory``: ``create(task=row,
            seed=..., episode_id=...)`` makes one rollout's session (its messages, tools and
            ``verify()``). ``row`` is the group's row of ``train_dataset`` (``{}`` without one,
            then ``max_steps`` sets the length); a row needs no ``prompt`` column.
        harness_adapter: OpenEnv ``HarnessAdapter`` that runs a rollout (``run_white_box``),
            e.g. ``MCPHarnessAdapter()``: the model's turns are sampled by the trainer
            (white-box). None: the sessions run their own agent (OpenEnv's
            ``LoopOwningSession``: ``wait_for_completion(timeout_s)``), which calls the
            trainer's capture endpoint at :func:`~asyncgrpo.capture_url` (``episode_id``)
            for every model turn (black-box).
        harness_limits: OpenEnv ``HarnessRunLimits`` (``max_turns``, tool-call caps); None:
            ``max_turns`` is ``max_tool_calling_iterations + 1`` (10 when that is None). Its
            ``sampling`` must be empty: sampling follows the config (``temperature``, ...).

    ``reward_funcs`` is optional: the session's ``verify()`` reward is one more source, summed
    with theirs; ``None`` from every source leaves a rollout unscored. ``tools`` and
    ``environment_factory`` are the session's business and not accepted.

    Example::

        from openenv.core.harness import MCPHarnessAdapter
        trainer = HarnessAsyncGRPOTrainer(model="path/to/model", train_dataset=tasks,
                                          harness_session_factory=CalculatorSessions(),
                                          harness_adapter=MCPHarnessAdapter(),
                                          args=AsyncGRPOConfig(output_dir="runs/calc"))
        trainer.train()
    """

    loop_cls = HarnessRolloutLoop

    def __init__(
        self,
        *args: Any,
        harness_session_factory: Any,
        harness_adapter: Any = None,
        harness_limits: Any = None,
        **kwargs: Any,
    ) -> None:
        given = inspect.signature(AsyncGRPOTrainer).bind(*args, **kwargs).arguments
        if given.get("tools") or given.get("environment_factory") is not None:
            raise ValueError(
                "HarnessAsyncGRPOTrainer: the harness session provides the tools and the "
                "environment; pass neither tools nor environment_factory"
            )
        check_harness(harness_session_factory, harness_adapter, harness_limits)
        self.harness_session_factory = harness_session_factory
        super().__init__(*args, **kwargs)
        self.loop_options = {
            "session_factory": harness_session_factory,
            "harness_adapter": harness_adapter,
            "harness_limits": harness_limits,
        }

    def _task_maker(self, environment_factory: Any) -> Any:
        """The session factory makes each rollout's prompt and reward."""
        return self.harness_session_factory


def check_harness(session_factory: Any, adapter: Any, limits: Any) -> None:
    """Fail at construction, naming the argument, on a harness the rollouts cannot use.

    Raises:
        TypeError: the factory has no ``create`` or the adapter no ``run_white_box``.
        ValueError: ``harness_limits.sampling`` is set.
    """
    harness = harness_api()
    if not callable(getattr(session_factory, "create", None)):
        raise TypeError(
            f"harness_session_factory: {type(session_factory).__name__} has no "
            "create(task, seed, episode_id); give an OpenEnv "
            "ResourceSessionFactory"
        )
    if adapter is not None and not callable(getattr(adapter, "run_white_box", None)):
        raise TypeError(
            f"harness_adapter: {type(adapter).__name__} has no run_white_box; give "
            "an OpenEnv HarnessAdapter such as MCPHarnessAdapter()"
        )
    if limits is not None:
        if not isinstance(limits, harness.HarnessRunLimits):
            raise TypeError(
                f"harness_limits: expected OpenEnv's HarnessRunLimits, got {type(limits).__name__}"
            )
        if limits.sampling:
            raise ValueError(
                f"harness_limits.sampling={limits.sampling!r}: the trainer samples "
                "with the config's settings (temperature, top_p, "
                "max_completion_length, ...); set them there and leave sampling "
                "empty"
            )
