"""Evaluations in the rollout process: every held-out prompt generated at one pinned weight
version, beside training, and scored by the run's reward functions (or its ``eval_reward_funcs``).

The trainer asks for an evaluation of version ``v`` once the weights of ``v`` have landed on
the servers, and holds its later pushes until the evaluation has finished (the pin, see
:mod:`asyncgrpo.shell.servers.pins`): every completion of an evaluation comes from the weights
of ``v``, and training goes on meanwhile (its samples grow at most as stale as
``max_staleness`` allows). The loop's :class:`Evaluator` runs each request: each prompt's
``eval_num_generations`` rollouts go through the loop's own rollout code (its hooks, tools and
environments; see :meth:`AsyncRolloutLoop.evaluation_rollout
<asyncgrpo.shell.rollout.loop.AsyncRolloutLoop.evaluation_rollout>`) with the evaluation's
sampling settings, split over the servers that hold ``v``, at most ``concurrency`` at a time,
and below training's priority where the server schedules by priority.

An evaluation whose version left the servers (a resync after an outage pushed newer weights)
fails, and says so; it is never finished with other weights.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import anyio
import attrs

from asyncgrpo.core.experiments.evaluation import Evaluation, PromptScore
from asyncgrpo.core.records import Rollout
from asyncgrpo.core.rollout.advantages import sum_rewards
from asyncgrpo.core.run.step_queue import InFlight
from asyncgrpo.shell.rollout.messages import EvalOutcome
from asyncgrpo.shell.rollout.prompts import PromptRows
from asyncgrpo.shell.rollout.scoring import PendingGroup, reward_columns
from asyncgrpo.shell.servers import EvalRequest, run_async


class VersionGone(RuntimeError):
    """The pinned version is no longer on any server (a resync pushed newer weights)."""


@attrs.frozen
class EvalRollout:
    """One rollout of an evaluation: which prompt, which of its completions, on which server.

    Attributes:
        dataset: the evaluation dataset's name.
        row_index: the prompt's row.
        index: which of the prompt's ``eval_num_generations`` completions (its seed).
        server: the server it runs on (one that holds ``version``).
        version: the pinned weight version.
    """

    dataset: str
    row_index: int
    index: int
    server: int
    version: int


RolloutFn = Callable[
    [EvalRollout, list[dict[str, Any]], Mapping[str, Any]],
    Awaitable[tuple[Rollout, tuple[type, float] | None]],
]


class Evaluator:
    """Runs the evaluations a loop is asked for.

    Args:
        datasets: the evaluation datasets by name (their rows in order).
        reward_funcs: the reward functions that score evaluations (the run's, unless it
            gives its own ``eval_reward_funcs``).
        generations: completions per prompt (``eval_num_generations``).
        concurrency: rollouts of an evaluation in flight at once.
        rollout: the loop's rollout of one :class:`EvalRollout` (prompt, row) -> (rollout,
            environment reward).
        versions: each server's weight version now.
        wait_for_change: returns when the servers' versions may have changed.
        doing: the loop's activity recorder, for the reward functions' calls.
    """

    def __init__(
        self,
        datasets: Mapping[str, Any],
        reward_funcs: Sequence[Callable[..., Any]],
        generations: int,
        concurrency: int,
        rollout: RolloutFn,
        versions: Callable[[], Sequence[int]],
        wait_for_change: Callable[[], Awaitable[None]],
        doing: Callable[[str, tuple[int, int]], AbstractContextManager[None]],
    ) -> None:
        self.rows = {name: PromptRows(data, 0, False) for name, data in datasets.items()}
        self.reward_funcs = list(reward_funcs)
        self.generations = generations
        self.limiter = anyio.CapacityLimiter(max(1, concurrency))
        self._rollout = rollout
        self._versions = versions
        self._wait_for_change = wait_for_change
        self._doing = doing

    async def evaluate(self, request: EvalRequest) -> EvalOutcome:
        """Every dataset at ``request.version``; a failure (the version gone, a reward
        function or a server that failed) comes back in the outcome's ``error``, never half a
        result."""
        started = time.monotonic()
        try:
            servers = await self._servers_holding(request.version)
            evaluations = []
            for name, rows in self.rows.items():
                prompts = await self._dataset(name, rows, request.version, servers)
                evaluations.append(
                    Evaluation(
                        name, request.version, prompts, request.step, time.monotonic() - started
                    )
                )
        except Exception as error:
            return EvalOutcome(request, (), f"{type(error).__name__}: {error}")
        return EvalOutcome(request, tuple(evaluations))

    async def _servers_holding(self, version: int) -> list[int]:
        """The servers whose weights are ``version``, once one is (the push that landed it
        may still be telling the rollout process)."""
        while True:
            versions = list(self._versions())
            servers = [i for i, v in enumerate(versions) if v == version]
            if servers:
                return servers
            if all(v > version for v in versions):
                raise VersionGone(
                    f"the weights of version {version} left the servers (now at versions "
                    f"{versions}) before the evaluation began"
                )
            await self._wait_for_change()

    def _check_still_at(self, server: int, version: int) -> None:
        now = self._versions()[server]
        if now != version:
            raise VersionGone(
                f"server {server} moved from version {version} to {now} during the evaluation "
                "(a resync after an outage); its completions are not all of one version"
            )

    async def _dataset(
        self, name: str, rows: PromptRows, version: int, servers: list[int]
    ) -> tuple[PromptScore, ...]:
        size = rows.size or 0
        scores: list[PromptScore | None] = [None] * size
        async with anyio.create_task_group() as tg:
            for row_index in range(size):
                tg.start_soon(self._prompt, name, rows, row_index, version, servers, scores)
        return tuple(s for s in scores if s is not None)

    async def _prompt(
        self,
        name: str,
        rows: PromptRows,
        row_index: int,
        version: int,
        servers: list[int],
        scores: list[PromptScore | None],
    ) -> None:
        row = rows.row(row_index)
        prompt = rows.prompt_of(row, row_index)
        results: list[tuple[Rollout, tuple[type, float] | None] | None] = [None] * self.generations

        async def one(index: int) -> None:
            server = servers[(row_index * self.generations + index) % len(servers)]
            async with self.limiter:
                results[index] = await self._rollout(
                    EvalRollout(name, row_index, index, server, version), prompt, row
                )
            self._check_still_at(server, version)

        async with anyio.create_task_group() as tg:
            for index in range(self.generations):
                tg.start_soon(one, index)
        done = [r for r in results if r is not None]
        pending = PendingGroup(
            position=-1 - row_index,
            row_index=row_index,
            row=row,
            prompt=prompt,
            group_id=-1,
            model_version=version,
            rollouts=[r[0] for r in done],
            env_rewards=[r[1] for r in done],
        )
        columns = await reward_columns(pending, self.reward_funcs, self._doing)
        k = len(done)
        totals = sum_rewards([*columns.values(), [r.reward for r in pending.rollouts]], k)
        scores[row_index] = PromptScore(
            row_index,
            [t if t is not None and math.isfinite(t) else math.nan for t in totals],
            {f: [math.nan if v is None else v for v in vs] for f, vs in columns.items()},
            [len(r.completion_ids) for r in pending.rollouts],
        )


@attrs.frozen
class _HeldVersion:
    """The channels of a loop that only evaluates: the servers hold ``version``, nobody
    trains."""

    version: int

    def publish(self, message: Any) -> None:
        pass

    def model_version(self) -> int:
        return self.version

    def tokens_per_step(self) -> float | None:
        return None

    def tokens_taken(self) -> int:
        return 0

    def steps_taken(self) -> int:
        return self.version

    def report_in_flight(self, in_flight: InFlight) -> None:
        pass

    def beat(self, activity: str = "") -> None:
        pass

    def stop_requested(self) -> bool:
        return False

    async def wait_for_trainer(self) -> None:
        await anyio.sleep_forever()

    def eval_request(self) -> EvalRequest | None:
        return None

    def eval_finished(self, request_id: int) -> None:
        pass


def evaluate_now(spec: Any, version: int, step: int) -> EvalOutcome:
    """Evaluate ``spec.eval_datasets`` in this process with a loop built from ``spec`` (a
    :class:`~asyncgrpo.shell.rollout.spec.LoopSpec`), the servers holding weight ``version``
    (an evaluation outside training: ``trainer.evaluate()``, ``asyncgrpo eval``)."""
    loop = spec.loop_cls(
        spec.config,
        spec.model_name,
        None,
        list(spec.reward_funcs),
        spec.processing_class,
        _HeldVersion(version),
        max_model_len=spec.max_model_len,
        token_budget=spec.token_budget,
        tools=list(spec.tools),
        environment_factory=spec.environment_factory,
        lora_name=spec.lora_name,
        eval_datasets=spec.eval_datasets,
        eval_reward_funcs=spec.eval_reward_funcs,
    )

    async def run() -> EvalOutcome:
        async with loop.opened():
            return await loop.evaluate(EvalRequest(1, version, step))

    return run_async(run)
