"""Rank 0 of a run with several servers: a task that watches the servers out of routing.

A server goes out of routing when a request, a probe or a push finds it gone (its
:class:`~asyncgrpo.shell.servers.outages.SharedTrust` has an outage pending). While the run goes
on with the others, :class:`ServerWatch` probes each server that is out (``/health`` and
``/v1/models``, :data:`POLL_S` apart) and hands those that answer again to the step loop
(:meth:`ServerWatch.take_back`), which pushes them the trainer's current weights before they
are routed to again. A server that restarted has a new identity; the push after it records
the identity, as after a first push.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import anyio
import structlog

from asyncgrpo.shell.servers.bridge import start_async
from asyncgrpo.shell.servers.endpoint import ServerSettings
from asyncgrpo.shell.servers.outages import SharedServers

log = structlog.get_logger("asyncgrpo.server_watch")
POLL_S = 1.0
PROBE_TIMEOUT_S = 5.0


class ServerWatch:
    """Probes the servers out of routing, a task on the trainer's event loop
    (:mod:`asyncgrpo.shell.servers.bridge`; see the module doc).

    Args:
        settings: the run's servers.
        model: the served model name the servers must serve again.
        servers: the run's records of its servers (an outage pending: out of routing).
    """

    def __init__(
        self, settings: ServerSettings, model: str, servers: SharedServers, poll_s: float = POLL_S
    ) -> None:
        self.settings = settings
        self.model = model
        self.servers = servers
        self.poll_s = poll_s
        self._back: set[int] = set()
        self._announced: dict[int, int] = {}  # server -> the outage its return was logged for
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._task: Future[object] | None = None

    def start(self) -> ServerWatch:
        self._stopped.clear()
        self._task = start_async(self._watch)
        return self

    def take_back(self) -> tuple[int, ...]:
        """The servers out of routing that answer and serve the model again, in order (each
        handed over once: one that is still out later is probed and handed over again)."""
        with self._lock:
            back, self._back = tuple(sorted(self._back)), set()
        return tuple(i for i in back if not self.servers.routable(i))

    def stop(self) -> None:
        """Cancel the probes and wait until their clients are closed."""
        if self._task is not None:
            self._task.cancel()
            self._stopped.wait(PROBE_TIMEOUT_S + 5.0)
            self._task = None

    async def _watch(self) -> None:
        clients = [self.settings.client(self.model, i) for i in range(self.settings.count)]
        answered: dict[int, bool] = {}

        async def probe(index: int) -> None:
            answered[index] = await clients[index].healthy(
                min(PROBE_TIMEOUT_S, self.settings.stall_s)
            )

        try:
            while True:
                with self._lock:
                    waiting = [i for i in self.servers.out() if i not in self._back]
                answered.clear()
                async with anyio.create_task_group() as group:
                    for index in waiting:
                        group.start_soon(probe, index)
                for index in sorted(i for i, ok in answered.items() if ok):
                    outages = self.servers.trusts[index].read().outages
                    if self._announced.get(index) != outages:
                        self._announced[index] = outages
                        log.info(
                            "vLLM server answers again; the trainer pushes its weights to "
                            "it before routing to it",
                            server=self.settings.urls[index],
                        )
                    with self._lock:
                        self._back.add(index)
                await anyio.sleep(self.poll_s)
        finally:
            with anyio.CancelScope(shield=True):
                for client in clients:
                    await client.aclose()
            self._stopped.set()
