"""One vLLM server's HTTP transport: every call under the retry policy, a connection the server
dropped tried again, and the server's silence watched.

Faults: a timeout, a dropped connection or a 5xx is retried by the one retry policy
(:mod:`asyncgrpo.adapters.vllm.retries`: backoff, at most ``max_retries`` retries, all tries within
``timeout_s``) and counted (``retry_count``, logged as ``rollout/vllm_retry_count``); when the
tries run out the last cause is raised. A 4xx is the caller's mistake and raises at once; a
prompt the server rejects as too long raises :class:`PromptTooLongError`, which says which limit
to raise.

Idle connections: vLLM's API server closes a kept-alive connection after 5 s idle
(``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``); the client lets its own idle connections go sooner
(:data:`KEEPALIVE_EXPIRY_S`), and a request whose connection the server dropped as it went out
is sent once more on a new connection before the drop counts as anything
(``dropped_connection_count``, logged as ``rollout/vllm_dropped_connection_count``): a healthy
server is never taken for a lost one. A reply reset or cut short on the way (a flaky link, a
proxy) is sent again the same way.

A server that stops answering (frozen, overloaded to a standstill) is named within seconds: a
call that has had no answer for ``stall_s`` probes ``/health`` on a connection of its own; while
the server does not answer that either, the client logs ``the vLLM server at URL has not
answered for N s`` every 10 s, and once it has been silent for ``timeout_s`` the call raises
:class:`ServerNotAnswering`, naming the server, the setting and how to resume. The silence is
counted from the first probe that went unanswered until anything answers, across calls (the
calls of one push count in total). A request's own HTTP timeout comes
:data:`WATCHDOG_LEAD_S` later, so a silent server is always named as such; it is left for a
call that takes too long on a server that still answers ``/health`` (retried, as TRL retries a
timed-out generation request).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import anyio
import httpx
import structlog

from asyncgrpo.adapters.vllm.replies import VLLMError
from asyncgrpo.adapters.vllm.retries import RetryCounter, RetryPolicy, retrying
from asyncgrpo.core.servers.outage import Failure, after_silent_probe, classify_failure

log = structlog.get_logger("asyncgrpo.vllm_client")


class ServerUnreachable(VLLMError):
    """The server could not be reached or dropped the connection (it may be restarting)."""


class ServerNotAnswering(VLLMError):
    """The server took connections but answered nothing, not even ``/health``, for
    ``vllm_server_timeout`` seconds (a frozen or wedged server)."""


class ServerFailed(VLLMError):
    """A 5xx answer (retried as a failure of the try)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


KEEPALIVE_EXPIRY_S = 2.0
"""Seconds the client keeps an idle connection: below vLLM's 5 s (``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``),
so that the client lets a connection go before the server closes it."""
SILENCE_LOG_EVERY_S = 10.0
PROBE_TIMEOUT_S = 5.0
WATCHDOG_LEAD_S = PROBE_TIMEOUT_S + 5.0
"""Seconds a request's own HTTP timeouts come after ``timeout_s``: a silent server is named by
the silence watchdog (``ServerNotAnswering``), never by a bare ``ReadTimeout`` that races it.
The HTTP timeout is left for a call that takes too long on a server that answers ``/health``."""

_DROPPED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


def failure_of(error: BaseException | None, status: int | None = None) -> Failure:
    """Classify an ``httpx`` exception (or an HTTP ``status`` >= 500) for the retry logic.

    Example:
        >>> failure_of(httpx.ConnectError("refused")).value
        'unreachable'
        >>> failure_of(httpx.ReadTimeout("slow")).value
        'timeout'
    """
    if isinstance(error, ServerFailed):
        status = error.status
    return classify_failure(
        connect_failed=isinstance(error, (httpx.ConnectError, httpx.ConnectTimeout)),
        dropped=isinstance(error, _DROPPED),
        timed_out=isinstance(error, httpx.TimeoutException),
        status=status,
    )


class ServerTransport:
    """The HTTP side of a :class:`~asyncgrpo.adapters.vllm.client.VLLMClient` (its
    arguments of the same names).

    Args:
        gated: the client hands requests that find the server gone to its gate: such a
            request raises :class:`ServerUnreachable` at once instead of being retried.

    Attributes:
        retries: the retries so far (``retry_count``), shared with the client's own retries of
            aborted generations.
        dropped_connection_count: requests sent again on a new connection because the server
            had dropped theirs as they went out.
    """

    def __init__(
        self,
        base_url: str,
        timeout_s: float,
        *,
        max_retries: int,
        backoff_s: float,
        max_connections: int,
        gated: bool,
        stall_s: float,
        headers: Mapping[str, str] | None,
        stall_outage: bool,
    ) -> None:
        self.base_url = base_url
        self.timeout_s = timeout_s
        self.gated = gated
        self.stall_s = stall_s
        self.stall_outage = stall_outage
        self.policy = RetryPolicy(
            deadline_s=timeout_s, max_attempts=max_retries + 1, first_backoff_s=backoff_s
        )
        self.retries = RetryCounter(
            "retrying a request to the vLLM server", self.policy, url=self.base_url
        )
        self.dropped_connection_count = 0
        self._timeout = httpx.Timeout(timeout_s + WATCHDOG_LEAD_S, connect=min(timeout_s, 30.0))
        self._headers = dict(headers or {})
        self.http = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=self._timeout,
            headers=self._headers,
            limits=httpx.Limits(
                max_connections=max_connections,
                max_keepalive_connections=max_connections,
                keepalive_expiry=KEEPALIVE_EXPIRY_S,
            ),
        )
        self._last_answer = time.monotonic()  # of any request or probe
        self._silent_since: float | None = None  # silence seen by a probe, until an answer
        self._probe_lock = anyio.Lock()
        self._probed_at = -float("inf")
        self._probe_answered = True
        self._silence_logged_at = -float("inf")

    async def aclose(self) -> None:
        await self.http.aclose()

    async def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One call under the retry policy: a 2xx-4xx response, or the last failure raised (a
        gated client raises :class:`ServerUnreachable` at once when the server is gone)."""
        tries = 0
        try:
            async for attempt in retrying(self.policy, self._retryable, self.retries):
                with attempt:
                    tries += 1
                    return await self._send(method, path, **kwargs)
        except (httpx.TimeoutException, httpx.TransportError, ServerFailed) as error:
            where = f"{method} {self.base_url}{path}"
            cause = f"{type(error).__name__}: {error}"
            if isinstance(error, httpx.TimeoutException) and not str(error):
                cause += (
                    f"no reply in {self._timeout.read:.0f} s, though the server answers /health"
                )
            elif isinstance(error, _DROPPED) and not str(error):  # httpx says nothing of a reset
                cause += "the connection was reset or closed before the reply was whole"
            if self.gated and failure_of(error) is Failure.UNREACHABLE:
                raise ServerUnreachable(f"{where}: {cause}") from error
            retried = f" after {tries - 1} retries" if tries > 1 else ""
            raise VLLMError(
                f"{where} failed{retried}: {cause} (the tries of one call: "
                f"vllm_server_timeout={self.timeout_s:g} s)"
            ) from error
        raise AssertionError("unreachable: the retry loop returns or raises")

    def _retryable(self, error: BaseException) -> bool:
        if not isinstance(error, (httpx.TimeoutException, httpx.TransportError, ServerFailed)):
            return False
        return not self.gated or failure_of(error) is not Failure.UNREACHABLE

    async def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One try: a response below 500, else :class:`ServerFailed`. A connection the server
        dropped as the request went out (it closed it for idleness) is tried once more on a new
        connection, before the drop counts as a failure."""
        what = f"{method} {path}"
        try:
            response = await self._watched(lambda: self.http.request(method, path, **kwargs), what)
        except _DROPPED:
            self.dropped_connection_count += 1
            async with httpx.AsyncClient(
                base_url=self.base_url, timeout=self._timeout, headers=self._headers
            ) as fresh:
                response = await self._watched(lambda: fresh.request(method, path, **kwargs), what)
        if response.status_code >= 500:
            raise ServerFailed(
                f"{what}: HTTP {response.status_code}: {response.text[:500]}", response.status_code
            )
        return response

    async def _watched(
        self, send: Callable[[], Awaitable[httpx.Response]], what: str
    ) -> httpx.Response:
        """``send()``, watched: while it has no answer the server is probed, its silence
        logged, and after ``timeout_s`` of silence the call raises :class:`ServerNotAnswering`."""
        started = time.monotonic()
        outcome: list[httpx.Response | BaseException] = []
        async with anyio.create_task_group() as group:

            async def run() -> None:
                try:
                    outcome.append(await send())
                except Exception as error:  # handed to the caller below, unwrapped
                    outcome.append(error)
                group.cancel_scope.cancel()

            async def watch() -> None:
                silent = await self._until_silent_too_long(started, what)
                if self.stall_outage:
                    outcome.append(
                        ServerUnreachable(
                            f"the vLLM server at {self.base_url} has not answered for "
                            f"{silent:.0f} s ({what}), not even /health"
                        )
                    )
                    group.cancel_scope.cancel()
                    return
                outcome.append(
                    ServerNotAnswering(
                        f"the vLLM server at {self.base_url} has not answered for "
                        f"{silent:.0f} s ({what}; vllm_server_timeout={self.timeout_s:.0f} s): it "
                        "takes connections but answers nothing, not even /health (a frozen server, "
                        "or a network path to it that delivers nothing). Restart it or mend the "
                        "path, and resume the run (resume_from_checkpoint=True, or asyncgrpo "
                        "train --resume)"
                    )
                )
                group.cancel_scope.cancel()

            group.start_soon(run)
            group.start_soon(watch)
        result = outcome[0]
        if isinstance(result, BaseException):
            raise result
        self._answered()
        return result

    def _answered(self) -> None:
        self._last_answer, self._silent_since = time.monotonic(), None

    def _silent_from(self, started: float) -> float:
        """When the server's silence began, for a call that ``started`` then: a silence a probe
        already saw goes on across calls (the calls of one push count in total), else the
        later of the call's start and the server's last answer."""
        if self._silent_since is not None:
            return self._silent_since
        return max(started, self._last_answer)

    async def _until_silent_too_long(self, started: float, what: str) -> float:
        """Return once the server has answered nothing (no call, no probe) for ``timeout_s``
        (``stall_outage``: once a probe after ``stall_s`` of silence is not answered); probe
        ``/health`` after ``stall_s`` of silence, then about every ``SILENCE_LOG_EVERY_S`` (and
        at the deadline), logging the silence each time."""
        while True:
            await anyio.sleep(
                max(0.0, self._silent_from(started) + self.stall_s - time.monotonic())
            )
            silent_from = self._silent_from(started)
            if time.monotonic() - silent_from < self.stall_s:
                continue  # something answered meanwhile
            if await self._answers():
                continue
            if self._silent_since is None:
                self._silent_since = silent_from
            silent = time.monotonic() - silent_from
            if silent >= self.timeout_s or self.stall_outage:
                return silent
            step = after_silent_probe(
                time.monotonic(),
                self._silence_logged_at,
                SILENCE_LOG_EVERY_S,
                PROBE_TIMEOUT_S,
                silent_from + self.timeout_s,
            )
            if step.log_at is not None:
                await anyio.sleep(max(0.0, step.log_at - time.monotonic()))
                logged_since = time.monotonic() - self._silence_logged_at  # by another call
                if self._silent_since is not None and logged_since >= SILENCE_LOG_EVERY_S - 1.0:
                    self._silence_logged_at = time.monotonic()
                    log.warning(
                        f"the vLLM server at {self.base_url} has not answered for "
                        f"{time.monotonic() - silent_from:.0f} s",
                        call=what,
                        fails_after_s=round(self.timeout_s),
                    )
            await anyio.sleep(max(0.0, step.probe_at - time.monotonic()))

    async def _answers(self) -> bool:
        """Whether ``/health`` answers now, on a connection of its own (one probe at a time
        for all the calls that ask; a probe less than a second old is reused)."""
        async with self._probe_lock:
            if time.monotonic() - self._probed_at < 1.0:
                return self._probe_answered
            timeout = min(PROBE_TIMEOUT_S, self.stall_s, self.timeout_s)
            try:
                async with httpx.AsyncClient(
                    base_url=self.base_url, timeout=timeout, headers=self._headers
                ) as probe:
                    await probe.get("/health")
                answered = True
            except (httpx.TimeoutException, httpx.TransportError):
                answered = False
            self._probed_at = time.monotonic()
            self._probe_answered = answered
            if answered:
                self._last_answer, self._silent_since = self._probed_at, None
            return answered
