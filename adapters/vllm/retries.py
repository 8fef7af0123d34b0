"""The one retry policy of every call to a vLLM server, on ``tenacity``.

A call is tried again after a failure its caller names retryable, with a backoff that doubles
from ``first_backoff_s`` up to ``max_backoff_s``, until it succeeds, ``max_attempts`` tries
were made, or ``deadline_s`` seconds passed since the first try (all tries together: a server
that stops answering is given ``vllm_server_timeout`` in total, never that much per try; no
wait is begun that would end past it). Each wait is its backoff plus a random jitter of up to
half of it (:data:`JITTER_FRACTION`), so that the requests a server restart failed together
(up to ``max_concurrent_rollouts``) do not all come back in the same instant. The last failure
is raised as it was. Each retry is counted and, at most every ``log_every_s``, logged
with what is being retried and for how long.

Used by the HTTP client's requests and aborted generations
(:mod:`asyncgrpo.adapters.vllm.client`), the trainer's wait for a server that went away and its
weight push after it (``asyncgrpo.shell.servers``, ``asyncgrpo.shell.weights``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import anyio
import attrs
import structlog
import tenacity

log = structlog.get_logger("asyncgrpo.retries")

JITTER_FRACTION = 0.5
"""A wait is its backoff times 1 to 1 + this, drawn uniformly (``random``'s global state)."""


@attrs.frozen
class RetryPolicy:
    """How long and how often a call is tried.

    Attributes:
        deadline_s: seconds from the first try after which no try starts (all tries together).
        max_attempts: tries at most (the first included); ``None``: until the deadline.
        first_backoff_s: the backoff before the second try; doubles per try. Each wait is
            its backoff plus a random jitter of up to :data:`JITTER_FRACTION` of it.
        max_backoff_s: the longest backoff, before its jitter (a wait is at most
            ``(1 + JITTER_FRACTION) * max_backoff_s``).
        log_every_s: a retry is logged at most this often.
    """

    deadline_s: float
    max_attempts: int | None = None
    first_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    log_every_s: float = 10.0

    def __attrs_post_init__(self) -> None:
        if not self.deadline_s > 0:
            raise ValueError(f"a retry deadline must be > 0 s, got {self.deadline_s}")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1 or None, got {self.max_attempts}")


class RetryCounter:
    """Counts the retries of the calls it watches, and logs them (at most every
    ``policy.log_every_s``) as ``message`` with ``fields``, the try, the seconds since the first
    try and the cause."""

    def __init__(self, message: str, policy: RetryPolicy, **fields: Any) -> None:
        self.message = message
        self.fields = fields
        self.policy = policy
        self.count = 0
        self._logged_at = -float("inf")

    def __call__(self, state: tenacity.RetryCallState) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self._logged_at < self.policy.log_every_s:
            return
        self._logged_at = now
        error = state.outcome.exception() if state.outcome is not None else None
        log.warning(
            self.message,
            **self.fields,
            attempt=state.attempt_number,
            waited_s=round(state.seconds_since_start or 0.0, 1),
            gives_up_after_s=self.policy.deadline_s,
            cause=f"{type(error).__name__}: {error}"[:300],
        )


def retrying(
    policy: RetryPolicy,
    retry_on: Callable[[BaseException], bool],
    counter: RetryCounter | None = None,
) -> tenacity.AsyncRetrying:
    """An ``async for attempt in retrying(...)`` loop over the tries of one call.

    Args:
        policy: when to stop and how long to wait.
        retry_on: whether a failure is worth another try; any other is raised at once.
        counter: counts and logs the retries.

    Example::

        async for attempt in retrying(RetryPolicy(deadline_s=60), is_transient):
            with attempt:
                reply = await client.get("/health")
    """
    return tenacity.AsyncRetrying(sleep=anyio.sleep, **_arguments(policy, retry_on, counter))


def retrying_blocking(
    policy: RetryPolicy,
    retry_on: Callable[[BaseException], bool],
    counter: RetryCounter | None = None,
) -> tenacity.Retrying:
    """:func:`retrying` for blocking code (``for attempt in retrying_blocking(...)``). Several
    processes that retry a collective call in step must stop on attempts, not on time: give
    them ``deadline_s=math.inf`` (their clocks differ)."""
    return tenacity.Retrying(**_arguments(policy, retry_on, counter))


def _arguments(
    policy: RetryPolicy, retry_on: Callable[[BaseException], bool], counter: RetryCounter | None
) -> dict[str, Any]:
    stop: Any = tenacity.stop_before_delay(policy.deadline_s)
    if policy.max_attempts is not None:
        stop = stop | tenacity.stop_after_attempt(policy.max_attempts)
    return {
        "stop": stop,
        "wait": jittered_backoff(policy),
        "retry": tenacity.retry_if_exception(retry_on),
        "before_sleep": counter,
        "reraise": True,
    }


def jittered_backoff(policy: RetryPolicy) -> tenacity.wait.wait_base:
    """The wait before retry ``k`` (0 for the first), in seconds: the backoff
    ``b = min(first_backoff_s * 2 ** k, max_backoff_s)`` plus a jitter drawn uniformly from
    ``[0, JITTER_FRACTION * b]`` (tenacity's ``wait_random_exponential``, full jitter, over the
    same doubling). The waits are never shorter than without jitter, so a call is given at
    least the time it was before its ``max_attempts`` run out; ``deadline_s`` still bounds
    every call's tries together."""
    return tenacity.wait_exponential(
        multiplier=policy.first_backoff_s, max=policy.max_backoff_s
    ) + tenacity.wait_random_exponential(
        multiplier=JITTER_FRACTION * policy.first_backoff_s,
        max=JITTER_FRACTION * policy.max_backoff_s,
    )
