"""Surviving a vLLM server restart: the state the trainer and the rollout process share, the
rollout side's gate, and the trainer side's wait for the server.

A run with several servers keeps one record per server (:class:`SharedServers`: each server's
:class:`SharedTrust` and the trainer's version that landed on it). There a server that goes
away is only taken out of routing: its gate (``reroute``) raises :class:`ServerOut` instead of
waiting, and the rollout loop generates the groups it held again on another server with the
same seeds; the trainer pushes its current weights to it once it answers again
(:mod:`.watch`), and only while none of them serves does the run wait, and finally fail
(:func:`wait_for_servers`).

The decisions are :mod:`asyncgrpo.core.servers.outage`'s; this module holds the shared
counters (:class:`SharedTrust`, in shared memory across the process boundary) and the waits:

- the rollout process (:class:`RolloutGate`, a :class:`~asyncgrpo.adapters.vllm.client.ServerGate`)
  records an outage when a request finds the server gone or the server's identity changed (a
  restart no request saw), sends nothing while the trainer's weights are not known to be on
  the server, and has requests that crossed an outage re-issued;
- the trainer (:func:`wait_for_server`) waits for the server to answer and serve the model, up
  to ``vllm_server_timeout`` from the first failure, logging while it waits, then pushes its
  current weights and marks the outages seen before the push as covered.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import time
from collections.abc import Callable, Iterator, Sequence

import anyio
import structlog

from asyncgrpo.adapters.vllm.client import VLLMClient, VLLMError
from asyncgrpo.adapters.vllm.retries import RetryCounter, RetryPolicy, retrying
from asyncgrpo.core.servers import outage as server_outage
from asyncgrpo.core.servers.outage import OutageClock, ServerTrust
from asyncgrpo.shell.servers.bridge import run_async

log = structlog.get_logger("asyncgrpo.server_watch")
_CONTEXT = mp.get_context("spawn")
POLL_S = 0.2  # how often the rollout process looks whether the trainer pushed
GATE_LOG_EVERY_S = 30.0
LOCK_TIMEOUT_S = 10.0  # no holder keeps the trust lock this long unless it died holding it


class ServerGone(VLLMError):
    """The vLLM server did not come back within ``vllm_server_timeout``."""


class ServerOut(VLLMError):
    """A server of a run with several went away (or holds unknown weights): what was being
    generated there is generated again on another server."""

    def __init__(self, url: str, cause: str = "") -> None:
        super().__init__(
            f"the vLLM server at {url} is out of routing" + (f": {cause}" if cause else "")
        )
        self.url = url


class SharedTrust:
    """:class:`~asyncgrpo.core.servers.outage.ServerTrust` in shared memory, plus when the
    pending outage was first seen (``time.time()`` seconds, comparable across processes)."""

    def __init__(self, url: str = "", pooled: bool = False) -> None:
        self.url = url  # named in the logs
        self.pooled = pooled  # one of several servers: an outage takes it out of routing
        # a plain lock, not the default RLock: if a process dies holding it (a SIGKILLed rollout
        # process), another may take it over after LOCK_TIMEOUT_S instead of waiting forever
        self._lock = _CONTEXT.Lock()
        self._counts = _CONTEXT.Array("q", 2, lock=False)  # outages, trusted
        self._identity = _CONTEXT.Value("d", math.nan, lock=False)  # NaN: unknown
        self._down_since = _CONTEXT.Value("d", 0.0, lock=False)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        if not self._lock.acquire(timeout=LOCK_TIMEOUT_S):
            log.warning(
                "a process died holding the server-trust lock; taking it over",
                waited_s=LOCK_TIMEOUT_S,
            )
        try:
            yield
        finally:
            self._lock.release()

    def read(self) -> ServerTrust:
        with self._locked():
            return self._read()

    def _read(self) -> ServerTrust:
        identity = float(self._identity.value)
        return ServerTrust(
            int(self._counts[0]), int(self._counts[1]), None if math.isnan(identity) else identity
        )

    def _write(self, before: ServerTrust, after: ServerTrust, since: float | None = None) -> None:
        self._counts[0], self._counts[1] = after.outages, after.trusted
        self._identity.value = math.nan if after.identity is None else after.identity
        if after.outages != before.outages:
            self._down_since.value = time.time() if since is None else since

    def down_since(self) -> float:
        """When the pending outage was first seen (meaningless while none is pending)."""
        return float(self._down_since.value)

    def outage(self, cause: str, where: str, since: float | None = None) -> ServerTrust:
        """Record that the server went away; log it when this starts a new outage, which
        counts from ``since`` (``time.time()``, e.g. when a failed push began) or now."""
        with self._locked():
            before = self._read()
            after = server_outage.outage_seen(before)
            self._write(before, after, since)
        if after != before and self.pooled:
            log.warning(
                "vLLM server out of routing: its groups are generated again on the "
                "other servers, and it gets the trainer's weights when it answers again",
                server=self.url,
                seen_by=where,
                cause=cause[:300],
            )
        elif after != before:
            log.warning(
                "vLLM server unreachable; waiting for it, then the trainer pushes its "
                "weights and what was in flight is generated again",
                seen_by=where,
                cause=cause[:300],
            )
        return after

    def identity_seen(self, identity: float | None, where: str) -> ServerTrust:
        """Record the server's identity read now; a new one is a restart (an outage)."""
        with self._locked():
            before = self._read()
            after = server_outage.identity_seen(before, identity)
            self._write(before, after)
        if after != before:
            log.warning(
                "vLLM server restarted (its identity changed, no request failed); the "
                "trainer pushes its weights and what was in flight is generated again",
                seen_by=where,
                identity=identity,
                pushed_to=before.identity,
                **({"server": self.url} if self.pooled else {}),
            )
        return after

    def pushed(self, covering: int, identity: float | None = None) -> ServerTrust:
        """The trainer's weights reached the server (of ``identity``) after ``covering``
        outages were seen."""
        with self._locked():
            before = self._read()
            after = server_outage.weights_pushed(before, covering, identity)
            self._write(before, after)
        return after


class SharedServers:
    """The run's record of each of its servers, shared with the rollout process: the server's
    :class:`SharedTrust` and the trainer's version that landed on it (written by the trainer
    only, read by the rollout process).

    Args:
        urls: the run's servers, in order.
        first: the first server's record, when it exists already.
    """

    def __init__(self, urls: Sequence[str] = ("",), first: SharedTrust | None = None) -> None:
        pooled = len(urls) > 1
        trusts = [SharedTrust(url, pooled) for url in urls]
        if first is not None:
            trusts[0] = first
        self.urls = tuple(urls)
        self.trusts = tuple(trusts)
        self._versions = _CONTEXT.Array("q", len(urls), lock=False)

    def __len__(self) -> int:
        return len(self.trusts)

    def version(self, server: int) -> int:
        """The trainer's version that landed on ``server`` (0 before the first push)."""
        return int(self._versions[server])

    def set_version(self, server: int, version: int) -> None:
        self._versions[server] = version

    def routable(self, server: int) -> bool:
        """The trainer's weights are known to be on ``server`` (no outage pending)."""
        return server_outage.weights_known(self.trusts[server].read())

    def out(self) -> tuple[int, ...]:
        """The servers with an outage pending, in order."""
        return tuple(i for i in range(len(self)) if not self.routable(i))

    def outages_of(self, servers: Sequence[int]) -> dict[int, int]:
        """The outages seen so far on each of ``servers``: what a push that lands there
        covers."""
        return {i: self.trusts[i].read().outages for i in servers}

    def all_gone_since(self) -> float | None:
        """When the last server went away, if none is routable (``time.time()`` seconds),
        else ``None`` (:func:`~asyncgrpo.core.servers.outage.all_gone_since`)."""
        return server_outage.all_gone_since(
            [None if self.routable(i) else self.trusts[i].down_since() for i in range(len(self))]
        )


class RolloutGate:
    """The rollout process's :class:`~asyncgrpo.adapters.vllm.client.ServerGate`.

    Requests wait while an outage is pending, logging every 30 s; a gate that ``reroute``s
    (one of several servers) raises :class:`ServerOut` instead, so that the group is generated
    again on another server.

    Args:
        trust: the counters shared with the trainer.
        timeout_s: ``vllm_server_timeout``; the gate gives up ``2 x timeout_s`` after the outage
            began (the trainer gives up after ``timeout_s`` and stops this process first).
        reroute: raise :class:`ServerOut` instead of waiting for the server.
    """

    def __init__(self, trust: SharedTrust, timeout_s: float, reroute: bool = False) -> None:
        self.trust = trust
        self.timeout_s = timeout_s
        self.reroute = reroute
        self._logged_at = 0.0  # one line per 30 s for all the requests that wait
        self._warned_no_identity = False

    async def enter(self) -> int:
        trust = self.trust.read()
        if server_outage.weights_known(trust):
            return trust.outages
        if self.reroute:
            raise ServerOut(self.trust.url, "an outage is pending")
        clock = OutageClock(down_since=self.trust.down_since())
        while not server_outage.weights_known(trust := self.trust.read()):
            decision = server_outage.next_wait(
                clock, time.time(), 2 * self.timeout_s, first_backoff_s=POLL_S, max_backoff_s=POLL_S
            )
            if decision.give_up:
                raise ServerGone(
                    f"the trainer did not push its weights to the vLLM server within "
                    f"{decision.waited_s:.0f} s of the outage (2 x vllm_server_timeout)"
                )
            if decision.waited_s > 0 and time.time() - self._logged_at >= GATE_LOG_EVERY_S:
                self._logged_at = time.time()
                log.warning(
                    "rollouts wait for the vLLM server and the trainer's weights",
                    down_s=round(decision.waited_s),
                )
            clock = decision.clock
            await anyio.sleep(decision.sleep_s)
        return trust.outages

    async def unreachable(self, error: BaseException) -> None:
        self.trust.outage(f"{type(error).__name__}: {error}", "rollout process")
        if self.reroute:
            raise ServerOut(self.trust.url, f"{type(error).__name__}: {error}") from error
        await self.enter()

    def trusted(self, started: int) -> bool:
        return server_outage.request_trusted(self.trust.read(), started)

    def identity_seen(self, identity: float | None) -> None:
        if identity is None and not self._warned_no_identity:
            self._warned_no_identity = True
            log.warning(
                "the vLLM server does not tell its identity (no process_start_time_seconds in "
                "/metrics: several API servers?); a restart that no request sees is caught only "
                "as foreign weights"
            )
        self.trust.identity_seen(identity, "rollout process")


class _NotBack(Exception):
    """The server does not answer ``/health`` or does not serve the model yet."""


async def wait_for_server(
    client: VLLMClient, down_since: float, timeout_s: float, probe_timeout_s: float = 5.0
) -> float:
    """Probe ``/health`` and ``/v1/models`` under the retry policy until the server answers and
    serves the model, logging every 10 s; returns the seconds waited since ``down_since``
    (``time.time()``).

    Raises:
        ServerGone: ``timeout_s`` passed since ``down_since``; names the setting.
    """
    remaining = max(timeout_s - (time.time() - down_since), 1e-3)
    policy = RetryPolicy(deadline_s=remaining, first_backoff_s=0.5, max_backoff_s=5.0)
    counter = RetryCounter("waiting for the vLLM server", policy, url=client.base_url)
    try:
        async for attempt in retrying(policy, lambda e: isinstance(e, _NotBack), counter):
            with attempt:
                if not await client.healthy(min(probe_timeout_s, timeout_s)):
                    raise _NotBack
    except _NotBack:
        raise ServerGone(
            f"the vLLM server at {client.base_url} has not answered for "
            f"{time.time() - down_since:.0f} s (vllm_server_timeout={timeout_s:.0f} s); restart it "
            "and resume the run (resume_from_checkpoint=True, or asyncgrpo train --resume)"
        ) from None
    return time.time() - down_since


async def wait_for_servers(
    clients: Sequence[VLLMClient], down_since: float, timeout_s: float, probe_timeout_s: float = 5.0
) -> tuple[tuple[int, ...], float]:
    """:func:`wait_for_server` for a run whose servers are all away: probe them together until
    at least one answers and serves the model; returns the indices of those that do and the
    seconds waited since ``down_since`` (when the last of them went away).

    Raises:
        ServerGone: ``timeout_s`` passed since ``down_since`` with none back; names them all.
    """
    if len(clients) == 1:
        return (0,), await wait_for_server(clients[0], down_since, timeout_s, probe_timeout_s)
    remaining = max(timeout_s - (time.time() - down_since), 1e-3)
    policy = RetryPolicy(deadline_s=remaining, first_backoff_s=0.5, max_backoff_s=5.0)
    urls = ", ".join(c.base_url for c in clients)
    counter = RetryCounter("waiting for the vLLM servers", policy, url=urls)
    answered: list[bool] = [False] * len(clients)

    async def probe(index: int) -> None:
        answered[index] = await clients[index].healthy(min(probe_timeout_s, timeout_s))

    try:
        async for attempt in retrying(policy, lambda e: isinstance(e, _NotBack), counter):
            with attempt:
                async with anyio.create_task_group() as group:
                    for index in range(len(clients)):
                        group.start_soon(probe, index)
                if not any(answered):
                    raise _NotBack
    except _NotBack:
        raise ServerGone(
            f"none of the run's vLLM servers ({urls}) has answered for "
            f"{time.time() - down_since:.0f} s (vllm_server_timeout={timeout_s:.0f} s); restart "
            "them and resume the run (resume_from_checkpoint=True, or asyncgrpo train --resume)"
        ) from None
    return tuple(i for i, ok in enumerate(answered) if ok), time.time() - down_since


def wait_for_servers_out(
    records: SharedServers, client_of: Callable[[int], VLLMClient], timeout_s: float
) -> tuple[tuple[int, ...], dict[int, int], float]:
    """Wait until a server out of routing (every server, if none is out) answers and serves
    the model (:func:`wait_for_servers`): those that do, the outages seen on each before the
    wait (a push that lands on it covers them), and the seconds since the last went away.

    Raises:
        ServerGone: ``timeout_s`` passed with none back (with one server: since it went away;
            with several: since the last of them did).
    """
    out = records.out() or tuple(range(len(records)))
    covering = records.outages_of(out)
    if len(records) == 1:
        down_since = records.trusts[0].down_since()
    else:
        down_since = records.all_gone_since() or time.time()

    async def wait() -> tuple[tuple[int, ...], float]:
        clients = [client_of(i) for i in out]
        try:
            return await wait_for_servers(clients, down_since, timeout_s)
        finally:
            with anyio.CancelScope(shield=True):
                for client in clients:
                    await client.aclose()

    answered, down_s = run_async(wait)
    back = tuple(out[i] for i in answered)
    return back, {i: covering[i] for i in back}, down_s
