"""A run's evaluations: when it asks for one, and what it does with the result.

Whenever a push lands (beside a step, waited for, or at the start), the run asks
:func:`~asyncgrpo.core.run.schedule.evaluation_due` whether the landed version is due
(``eval_strategy="steps"``, every ``eval_steps``; ``eval_on_start``). If it is, it asks the
rollout process for an evaluation of that version, pinning it: the pushes of later versions
wait until the evaluation has finished (:class:`~asyncgrpo.shell.servers.VersionPin`), while
the steps go on. The outcome arrives with the rollout process's messages, often some steps
later; its metrics (:func:`~asyncgrpo.core.experiments.evaluation.evaluation_metrics`) are
logged at the step of the evaluated version ``v``, never in a later step's window: in the row of
step ``v`` of ``metrics.jsonl`` (:meth:`WindowLog.evaluation
<asyncgrpo.shell.run.metrics_log.WindowLog.evaluation>`), and to the callbacks (``on_log``,
hence every tracker of ``report_to``, then ``on_evaluate``) with ``state.global_step`` at ``v``
for those calls (:meth:`Callbacks.evaluate <asyncgrpo.shell.run.callbacks.Callbacks.evaluate>`).
Every evaluation is also a row of ``evaluations.jsonl`` (``step`` is its weight version,
``time_s`` the seconds since training began). A failed evaluation counts in the window where it
is known (``eval/failed_count``). At the end of training the run waits for the evaluation in
flight.

Only rank 0 evaluates. The last version whose evaluation arrived is saved in checkpoints, so a
resumed run does not evaluate the same weights again, and evaluates again one lost in flight.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from asyncgrpo.adapters.models.causal_lm import checkpoint_named
from asyncgrpo.adapters.transfer.files import DiskReload
from asyncgrpo.core import metrics
from asyncgrpo.core.experiments.evaluation import evaluation_metrics
from asyncgrpo.core.run import schedule
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.rollout import EvalOutcome, LoopSpec, RolloutProcess
from asyncgrpo.shell.run.inputs import RunInputs
from asyncgrpo.shell.run.metrics_log import MetricsFile
from asyncgrpo.shell.servers import ServerSettings, run_async

log = structlog.get_logger("asyncgrpo.evaluation")
EVAL_WEIGHTS = ".vllm_eval_weights"  # under output_dir: the weights an evaluation pushes first


class Evaluations:
    """A run's evaluation schedule and results (rank 0).

    Args:
        every: optimizer steps between evaluations (None: ``eval_strategy="no"``).
        on_start: ``eval_on_start``.
        last: the version the checkpoint the run resumes from evaluated last (None: none).
        on_metrics: called with each evaluation's version and metrics on the trainer's thread
            (the ``metrics.jsonl`` row and the callbacks of that version's step).

    Attributes:
        process: the rollout process, once started.
        file: ``evaluations.jsonl``, once the run writes logs (rank 0).
        completed: the last version whose evaluation arrived (saved in checkpoints).
    """

    def __init__(
        self,
        every: int | None,
        on_start: bool,
        last: int | None,
        on_metrics: Callable[[int, dict[str, float]], None],
    ) -> None:
        self.every = every
        self.on_start = on_start
        self.last = last  # the last version asked for
        self.completed = last
        self.on_metrics = on_metrics
        self.process: RolloutProcess | None = None
        self.file: MetricsFile | None = None
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._asked_at: dict[int, float] = {}

    def landed(self, version: int, at_start: bool = False) -> None:
        """The weights of ``version`` are on the servers (any thread: the push thread calls it
        before it takes the next snapshot, so the pin is in place before a later push)."""
        with self._lock:
            if self.process is None or self.process.pin.pinned() is not None:
                return
            if not schedule.evaluation_due(
                version, self.every, self.last, at_start=at_start, on_start=self.on_start
            ):
                return
            request = self.process.request_evaluation(version, step=version)
            self._asked_at[request.request_id] = time.monotonic()
            self.last = version
        log.info("evaluation asked for", version=version, request=request.request_id)

    def outcome(self, outcome: EvalOutcome) -> list[metrics.Observation]:
        """An evaluation's result: its metrics go to ``on_metrics`` (at its version's step),
        ``evaluations.jsonl`` and the log; the window gets only a failure's count."""
        request = outcome.request
        took = time.monotonic() - self._asked_at.pop(request.request_id, time.monotonic())
        if outcome.error:
            log.warning(
                "evaluation failed; the run goes on",
                version=request.version,
                error=outcome.error[:500],
            )
            return [metrics.total("eval/failed_count", 1)]
        figures: dict[str, float] = {}
        for evaluation in outcome.evaluations:
            figures.update(evaluation_metrics(evaluation))
        figures["eval/duration_s"] = took
        self.completed = request.version
        if self.file is not None:
            self.file.write(request.version, {"time_s": time.monotonic() - self.started, **figures})
        headline = {
            name: round(value, 4)
            for name, value in figures.items()
            if name.endswith("/reward") or name.split("/")[-1].startswith("pass@")
        }
        log.info("evaluation", version=request.version, seconds=round(took, 1), **headline)
        self.on_metrics(request.version, figures)
        return []

    def in_flight(self) -> bool:
        """An evaluation was asked for and its outcome has not been taken yet."""
        return bool(self._asked_at)

    def wait_for_last(self, take: Callable[[float], Any], timeout_s: float) -> None:
        """At the end of training: take the rollout process's messages (``take(wait_s)``,
        which hands them to the run) until the evaluation in flight has arrived, for at most
        ``timeout_s``; then release the pin whatever happened."""
        deadline = time.monotonic() + timeout_s
        while self.in_flight() and time.monotonic() < deadline:
            take(0.5)
        if self.in_flight():
            log.warning(
                "the last evaluation did not finish in time; not waited for", timeout_s=timeout_s
            )
            self._asked_at.clear()
        self.release()

    def release(self) -> None:
        """Let pushes go whatever evaluation is in flight (the run ends)."""
        if self.process is not None:
            self.process.pin.cancel()


def evaluation_spec(inputs: RunInputs, args: AsyncGRPOConfig) -> LoopSpec:
    """The loop an evaluation outside training builds (the trainer's rollout code, reward
    functions, tools and evaluation datasets), sized by the first server's context."""

    async def max_model_len() -> int:
        async with ServerSettings.of(args).client(inputs.model_name) as client:
            return await client.max_model_len()

    longest = run_async(max_model_len)
    return LoopSpec(
        loop_cls=inputs.loop_cls,
        config=args,
        model_name=inputs.model_name,
        dataset=None,
        reward_funcs=inputs.reward_funcs,
        processing_class=inputs.processing_class,
        max_model_len=longest,
        token_budget=args.token_budget or longest,
        rows_per_step=1,
        tools=inputs.tools,
        environment_factory=inputs.environment_factory,
        eval_datasets=inputs.eval_datasets,
        eval_reward_funcs=inputs.eval_reward_funcs,
        loop_options=inputs.loop_options,
    )


def push_to_servers(model: Any, args: AsyncGRPOConfig, model_name: str, output_dir: Path) -> int:
    """Put ``model``'s weights on every server by disk (an evaluation before training: the
    servers may hold other weights); the version they count as, 0."""
    weights = checkpoint_named(model, model.state_dict())
    settings = ServerSettings.of(args)

    async def push() -> None:
        for server in range(settings.count):
            async with settings.client(model_name, server) as client:
                await DiskReload(client, output_dir / EVAL_WEIGHTS).sync(weights)

    run_async(push)
    return 0
