"""The rollout process's side of the run's servers: a client of each, its load, its cap.

:class:`ServerPool` holds per server (:class:`PooledServer`) the client (with its gate), the
load cap adapted from that server's own ``/metrics`` (:mod:`asyncgrpo.core.rollout.pacing`), the
rollouts routed to it (``reserved``) and those holding a slot there (``in_flight``), and what
it generated. :meth:`ServerPool.route` asks :func:`asyncgrpo.core.servers.routing.route_group` which
server the next group goes to; ``max_concurrent_rollouts`` bounds the rollouts of all servers
together. A run with one server has a pool of one, routed to whenever the old single-server
rules admit a group. :meth:`ServerPool.report` gives the ``rollout/*`` metrics of each poll;
with several servers it adds per-server metrics under ``rollout/server/<i>/...``.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import anyio
import attrs

from asyncgrpo.adapters.vllm.client import VLLMClient
from asyncgrpo.adapters.vllm.replies import ServerMetrics
from asyncgrpo.core.metrics import Observation, mean, ratio, total
from asyncgrpo.core.rollout import pacing
from asyncgrpo.core.servers import routing
from asyncgrpo.shell.servers.outages import ServerOut


@attrs.define
class PooledServer:
    """One server as the rollout loop sees it.

    Attributes:
        client: the server's client.
        cap: its load cap.
        reserved: rollouts of groups routed to it and not finished.
        in_flight: rollouts holding one of its slots.
        completed: rollouts finished since its cap last moved (for the cap's raise).
        snapshot: its last ``/metrics`` (``None``: none yet, none offered, or it is out).
        requests, generated_tokens, regenerated_groups: counted since the last report.
        routed: groups routed to it in this run (never reset): equally loaded servers take
            turns (:func:`~asyncgrpo.core.servers.routing.load_key`).
        outages_reported: its trust record's outages at the last report.
    """

    client: VLLMClient
    cap: pacing.LoadCap
    reserved: int = 0
    in_flight: int = 0
    completed: int = 0
    snapshot: ServerMetrics | None = None
    requests: int = 0
    generated_tokens: int = 0
    regenerated_groups: int = 0
    routed: int = 0
    outages_reported: int = 0


class ServerPool:
    """The run's servers in the rollout process (see the module doc).

    Args:
        clients: one per server, in the run's order.
        max_concurrent_rollouts: the ceiling over all servers together.
        version_of: the trainer's version that landed on a server.
        routable: whether a server is known to hold the trainer's weights (a run with one
            server: always, its gate waits out an outage instead).
        outages: a server's outages so far (for ``rollout/server/<i>/outage_count``).
    """

    def __init__(
        self,
        clients: Sequence[VLLMClient],
        max_concurrent_rollouts: int,
        version_of: Callable[[int], int],
        routable: Callable[[int], bool],
        outages: Callable[[int], int] | None = None,
    ) -> None:
        self.max_concurrent_rollouts = max_concurrent_rollouts
        self.servers = [PooledServer(c, pacing.LoadCap(max_concurrent_rollouts)) for c in clients]
        self.version_of = version_of
        self.routable = routable
        self.outages = outages
        # at the last report: tokens generated, retries, requests sent again on a new
        # connection, groups regenerated (the clients' counters, from 0), each server's
        # preemptions (its own counter: None until its first /metrics, which is the baseline,
        # since a server counts from its start, earlier runs' requests included)
        none: list[int | None] = [None] * len(clients)
        self._reported = (0, 0, 0, 0, none)

    def __len__(self) -> int:
        return len(self.servers)

    def __getitem__(self, index: int) -> PooledServer:
        return self.servers[index]

    @property
    def reserved(self) -> int:
        return sum(s.reserved for s in self.servers)

    @property
    def in_flight(self) -> int:
        return sum(s.in_flight for s in self.servers)

    def views(self) -> list[routing.ServerView]:
        return [self._view(i) for i in range(len(self.servers))]

    def _view(self, index: int) -> routing.ServerView:
        server = self.servers[index]
        return routing.ServerView(
            self.routable(index),
            self.version_of(index),
            server.reserved,
            max(1, min(server.cap.cap, self.max_concurrent_rollouts)),
            server.snapshot.load if server.snapshot is not None else None,
            server.routed,
        )

    def route(self, steps_taken: int, max_staleness: int) -> int | None:
        """The server the next group goes to, or ``None`` (no room under
        ``max_concurrent_rollouts``, or no eligible server: :func:`~asyncgrpo.core.servers.routing.
        route_group`)."""
        if self.reserved >= self.max_concurrent_rollouts:
            return None
        return routing.route_group(self.views(), steps_taken, max_staleness)

    def admits(self, index: int) -> bool:
        """Whether one more rollout may take a slot on server ``index`` now: under its cap,
        and all servers' rollouts under ``max_concurrent_rollouts``."""
        server = self.servers[index]
        ceiling = self.max_concurrent_rollouts
        return (
            pacing.rollouts_to_admit(server.in_flight, server.cap, ceiling) > 0
            and self.in_flight < ceiling
        )

    async def start_caps(self, max_model_len: int) -> None:
        """Each server's first cap, from the KV cache its ``/metrics`` reports."""

        async def start(server: PooledServer) -> None:
            try:
                snapshot = await server.client.metrics()
            except ServerOut:
                snapshot = None
            server.cap = pacing.initial_load_cap(
                snapshot.kv_cache_tokens if snapshot else None,
                max_model_len,
                self.max_concurrent_rollouts,
            )

        await self._each(start)

    async def poll(self) -> None:
        """Scrape every server's ``/metrics`` and move its cap; a server out of routing keeps
        its cap and has no snapshot."""

        async def scrape(server: PooledServer) -> None:
            try:
                server.snapshot = await server.client.metrics()
            except ServerOut:
                server.snapshot = None
                return
            server.cap = pacing.next_load_cap(
                pacing.rollouts_completed(server.cap, server.completed),
                server.snapshot.load if server.snapshot else None,
                self.max_concurrent_rollouts,
            )
            server.completed = 0

        await self._each(scrape)

    async def _each(self, call: Callable[[PooledServer], Coroutine[Any, Any, None]]) -> None:
        if len(self.servers) == 1:
            await call(self.servers[0])
            return
        async with anyio.create_task_group() as group:
            for server in self.servers:
                group.start_soon(call, server)

    def report(self, elapsed_s: float, generated_tokens: int) -> list[Observation]:
        """The ``rollout/*`` metrics since the last report, ``elapsed_s`` seconds ago:
        throughput (``generated_tokens``: the loop's count so far), concurrency and its cap,
        retries, requests sent again on a new connection, regenerated groups, the servers' KV
        cache, requests and preemptions from their last ``/metrics``, and each server's own
        (:meth:`observations`)."""
        tokens, retries, dropped, regenerated, preemptions = self._reported
        clients = [server.client for server in self.servers]
        retries_now = sum(c.retry_count for c in clients)
        dropped_now = sum(c.dropped_connection_count for c in clients)
        regenerated_now = sum(c.regenerated_count for c in clients)
        found = [
            ratio("rollout/generated_tokens_per_s", generated_tokens - tokens, elapsed_s),
            mean("rollout/concurrency", self.in_flight),
            mean("rollout/concurrency_cap", sum(s.cap.cap for s in self.servers)),
            total("rollout/vllm_retry_count", retries_now - retries),
            total("rollout/vllm_dropped_connection_count", dropped_now - dropped),
            total("rollout/vllm_regenerated_count", regenerated_now - regenerated),
        ]
        snapshots = [(i, s.snapshot) for i, s in enumerate(self.servers) if s.snapshot is not None]
        if snapshots:
            preempted = 0
            for index, snapshot in snapshots:
                before = preemptions[index]
                if before is not None:  # a restarted server counts from 0 again
                    preempted += max(0, snapshot.preemptions - before)
                preemptions[index] = snapshot.preemptions
            found += [
                mean(
                    "rollout/vllm_kv_cache_usage_frac",
                    max(s.load.kv_cache_usage for _, s in snapshots),
                ),
                mean("rollout/vllm_running_requests", sum(s.load.running for _, s in snapshots)),
                mean("rollout/vllm_queued_requests", sum(s.load.waiting for _, s in snapshots)),
                total("rollout/vllm_preemption_count", preempted),
            ]
        self._reported = (generated_tokens, retries_now, dropped_now, regenerated_now, preemptions)
        return found + self.observations(elapsed_s)

    def observations(self, elapsed_s: float) -> list[Observation]:
        """Each server's ``rollout/server/<i>/...`` metrics since the last call (none with one
        server: the ``rollout/*`` metrics are its own)."""
        if len(self.servers) < 2:
            return []
        found: list[Observation] = []
        for index, server in enumerate(self.servers):
            prefix = f"rollout/server/{index}"
            found += [
                total(f"{prefix}/requests_count", server.requests),
                ratio(f"{prefix}/generated_tokens_per_s", server.generated_tokens, elapsed_s),
                mean(f"{prefix}/in_flight", server.in_flight),
                mean(f"{prefix}/concurrency_cap", server.cap.cap),
                total(f"{prefix}/regenerated_groups_count", server.regenerated_groups),
            ]
            if self.outages is not None:
                outages = self.outages(index)
                found.append(total(f"{prefix}/outage_count", outages - server.outages_reported))
                server.outages_reported = outages
            if server.snapshot is not None:
                found.append(
                    mean(f"{prefix}/kv_cache_usage_frac", server.snapshot.load.kv_cache_usage)
                )
            server.requests = server.generated_tokens = server.regenerated_groups = 0
        return found
