"""One group's run: its ``num_generations`` rollouts on the server it was admitted to.

Each rollout holds one of the server's slots (under its load cap and
``max_concurrent_rollouts``) while it runs the loop's ``generate_one`` hook, inside the group's
context (:mod:`asyncgrpo.shell.rollout.context`: its server, policy version and seeds). A group
whose server goes out of routing is generated again, whole and with the same seeds, on another
one (:meth:`~asyncgrpo.shell.rollout.admission.Admission.reroute`); a prompt the server rejects
as too long is skipped and counted. A finished group goes to the scoring task.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import structlog

from asyncgrpo.adapters.vllm.client import PromptTooLongError
from asyncgrpo.core.metrics import Observation, mean, total
from asyncgrpo.core.records import Rollout
from asyncgrpo.core.rollout import sample_wait
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.rollout import context
from asyncgrpo.shell.rollout.admission import Admission
from asyncgrpo.shell.rollout.heartbeat import Heartbeat
from asyncgrpo.shell.rollout.messages import GroupOutcome
from asyncgrpo.shell.rollout.prompts import PromptRows
from asyncgrpo.shell.rollout.scoring import PendingGroup
from asyncgrpo.shell.rollout.tools import ToolLoop
from asyncgrpo.shell.servers import ServerOut, ServerPool, SharedServers

log = structlog.get_logger("asyncgrpo.rollout")

TOO_LONG_IN_A_ROW = 32  # this many prompts in a row rejected as too long (or an epoch): raise

GenerateOne = Callable[[list[dict[str, Any]], list[Callable[..., Any]], int], Awaitable[Rollout]]


def _leaves(group: BaseExceptionGroup) -> list[Any]:
    """The exceptions of ``group``, nested groups flattened."""
    found: list[Any] = []
    for error in group.exceptions:
        found += _leaves(error) if isinstance(error, BaseExceptionGroup) else [error]
    return found


class GroupRunner:
    """Runs the groups the dispatcher admits (one :meth:`run` task per group).

    Args:
        config: reads ``num_generations``.
        pool: the run's servers (their slots, load caps and counts).
        generate_one: the loop's hook, one rollout of a prompt with its tools.
        tool_loop: opens and releases a rollout's environment.
        tools: the run's tools.
        prompt_rows: the dataset's rows (a row's prompt, the epoch's size).
        admission: where a group's server is released, and a new one found.
        heartbeat: publishes a skipped group's outcome.
        shared_servers: several servers' records (None with one: nothing to reroute to).
        observe: where ``rollout/duration_s`` and ``rollout/score_block_s`` go.
    """

    def __init__(
        self,
        config: AsyncGRPOConfig,
        pool: ServerPool,
        generate_one: GenerateOne,
        tool_loop: ToolLoop,
        tools: Sequence[Callable[..., Any]],
        prompt_rows: PromptRows,
        admission: Admission,
        heartbeat: Heartbeat,
        shared_servers: SharedServers | None,
        observe: Callable[..., None],
    ) -> None:
        self.config = config
        self.pool = pool
        self.generate_one = generate_one
        self.tool_loop = tool_loop
        self.tools = list(tools)
        self.prompt_rows = prompt_rows
        self.admission = admission
        self.heartbeat = heartbeat
        self.shared_servers = shared_servers
        self.observe = observe
        self.slots = anyio.Condition()  # a server's slot freed, or its load cap moved
        self._too_long_in_a_row = 0

    async def wake(self) -> None:
        """Let rollouts waiting for a slot look again (a load cap moved)."""
        async with self.slots:
            self.slots.notify_all()

    async def run(
        self,
        send: Any,
        position: int,
        row_index: int,
        row: dict[str, Any],
        group_id: int,
        server: int,
        version: int,
    ) -> None:
        """Generate the group of prompt ``position`` on ``server``, under policy ``version``
        (the one it was admitted with), and send it to scoring."""
        pending = PendingGroup(
            position=position,
            row_index=row_index,
            row=row,
            prompt=self.prompt_rows.prompt_of(row, row_index),
            group_id=group_id,
            model_version=version,
            rollouts=[],
            env_rewards=[],
            server=server,
        )
        context.GROUP.set((group_id, row_index))
        context.ROW.set(row)
        while True:
            results, too_long, lost = await self._generate(pending, position)
            if too_long:
                self._skip_too_long(pending, too_long[0])
                return
            if not lost:
                break
            await self._reroute(pending, lost[0])  # generated again, whole, on another server
        self._too_long_in_a_row = 0
        pending.rollouts = [r[0] for r in results if r is not None]
        pending.env_rewards = [r[1] for r in results if r is not None]
        pending.completed_at = time.monotonic()
        await send.send(pending)
        self.observe(mean("rollout/score_block_s", time.monotonic() - pending.completed_at))

    async def _generate(
        self, pending: PendingGroup, position: int
    ) -> tuple[list[Any], list[PromptTooLongError], list[ServerOut]]:
        """Run the group's rollouts on its server; the results, and the errors that end the
        group (a prompt too long, the server out of routing)."""
        context.SERVER.set(pending.server)
        context.GROUP_VERSION.set(pending.model_version)  # its rollouts finish under this policy
        results: list[tuple[Rollout, tuple[type, float] | None] | None] = [None] * (
            self.config.num_generations
        )

        async def one(index: int) -> None:
            # this task's copy: seeds from turn 0
            context.ROLLOUT.set(context.RolloutKey(position, index))
            results[index] = await self._one_rollout(pending)

        too_long: list[PromptTooLongError] = []
        lost: list[ServerOut] = []
        try:
            async with anyio.create_task_group() as tg:
                for index in range(self.config.num_generations):
                    tg.start_soon(one, index)
        except* PromptTooLongError as errors:
            too_long += _leaves(errors)
        except* ServerOut as errors:
            lost += _leaves(errors)
        finally:
            self.admission.release(self.pool, pending.server)
        return results, too_long, lost

    async def _reroute(self, pending: PendingGroup, lost: ServerOut) -> None:
        """The group's server went out of routing: wait for another one that can take the
        group and move the group there, at that server's policy version
        (:meth:`~asyncgrpo.shell.rollout.admission.Admission.reroute`)."""
        assert self.shared_servers is not None
        self.pool[pending.server].regenerated_groups += 1
        log.info(
            "a group is generated again on another server",
            position=pending.position,
            lost=lost.url,
            cause=str(lost)[:300],
        )
        pending.server, pending.model_version = await self.admission.reroute(
            self.pool, self.shared_servers, pending.model_version
        )

    def _skip_too_long(self, pending: PendingGroup, error: PromptTooLongError) -> None:
        """A prompt the server rejects as too long: skip its group (consumed, as a filtered
        prompt), count it (``rollout/prompt_too_long_count``) and log its row; raise when
        every prompt of an epoch, or ``TOO_LONG_IN_A_ROW`` in a row, were rejected."""
        self._too_long_in_a_row += 1
        limit = min(self.prompt_rows.size or TOO_LONG_IN_A_ROW, TOO_LONG_IN_A_ROW)
        if self._too_long_in_a_row >= limit:
            raise PromptTooLongError(
                f"the last {self._too_long_in_a_row} prompts were all rejected as too long; "
                f"no batch can reach the trainer. {error}"
            ) from error
        log.warning(
            "skipped a prompt the server rejected as too long",
            row=pending.row_index,
            position=pending.position,
            error=str(error)[:400],
        )
        self.admission.finished(0, pending.model_version)
        counted: tuple[Observation, ...] = (total("rollout/prompt_too_long_count", 1),)
        self.heartbeat.publish(
            GroupOutcome(
                pending.position,
                pending.row_index,
                (),
                counted,
                dropped=sample_wait.PROMPT_TOO_LONG,
            )
        )
        self.admission.report_in_flight()

    async def _one_rollout(
        self, pending: PendingGroup
    ) -> tuple[Rollout, tuple[type, float] | None]:
        """One rollout of ``pending`` on its server, holding one of the server's slots (under
        its load cap and ``max_concurrent_rollouts``)."""
        server = self.pool[pending.server]
        async with self.slots:
            while not self.pool.admits(pending.server):
                await self.slots.wait()
            server.in_flight += 1
        start = time.monotonic()
        environment = None
        try:
            prompt, tools, environment = await self.tool_loop.open_environment(
                pending.prompt, pending.row, pending.row_index, self.tools
            )
            rollout = await self.generate_one(prompt, tools, pending.group_id)
            env_reward = await self.tool_loop.environment_reward(environment)
            if environment is not None:
                self.tool_loop.release_environment(pending.row, environment)
        except ServerOut:  # generated again elsewhere: its environment is reset when reused
            if environment is not None:
                self.tool_loop.release_environment(pending.row, environment)
            raise
        finally:
            with anyio.CancelScope(shield=True):  # a cancelled sibling still frees its slot
                async with self.slots:
                    server.in_flight -= 1
                    server.completed += 1
                    self.slots.notify_all()
        self.observe(mean("rollout/duration_s", time.monotonic() - start))
        return rollout, env_reward
