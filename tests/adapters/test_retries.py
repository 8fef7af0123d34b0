"""The retry policy's waits are jittered (requests a server restart failed together do not come
back in lock-step), never shorter than the plain doubling backoff nor longer than 1.5 times it,
and the deadline still bounds a call's tries together (no server: a call that always fails)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from asyncgrpo.adapters.vllm.retries import (
    JITTER_FRACTION,
    RetryPolicy,
    jittered_backoff,
    retrying_blocking,
)

POLICY = RetryPolicy(deadline_s=600.0, first_backoff_s=0.5, max_backoff_s=30.0)


def schedule(seed: int, retries: int = 10) -> list[float]:
    """The waits before each of ``retries`` retries, with ``random`` seeded by ``seed``."""
    saved = random.getstate()
    random.seed(seed)
    try:
        wait = jittered_backoff(POLICY)
        return [wait(SimpleNamespace(attempt_number=n)) for n in range(1, retries + 1)]
    finally:
        random.setstate(saved)


def test_two_schedules_differ_and_each_wait_stays_within_its_bounds() -> None:
    first, second = schedule(seed=1), schedule(seed=2)
    assert first == schedule(seed=1)  # the jitter is random's, nothing else
    assert all(a != b for a, b in zip(first, second, strict=True)), (first, second)
    for waits in (first, second):
        for retry, wait in enumerate(waits):
            backoff = min(POLICY.first_backoff_s * 2**retry, POLICY.max_backoff_s)
            assert backoff <= wait <= (1 + JITTER_FRACTION) * backoff, (retry, wait)
    assert len({round(w, 6) for w in first[-4:]}) == 4  # spread at the cap too


class AlwaysFails(RuntimeError):
    pass


def test_the_deadline_bounds_the_jittered_tries_together() -> None:
    """Waits of 0.05-0.075 s, then 0.1-0.15 s: no wait is begun that would end past the
    0.4 s deadline, so every try starts within it. Checked on the waits as planned (when each
    began, and how long it was to be), not on the wall clock: a loaded machine oversleeps."""
    policy = RetryPolicy(deadline_s=0.4, first_backoff_s=0.05, max_backoff_s=0.1)
    planned: list[tuple[float, float]] = []  # (seconds since the first try, the wait)

    def before_sleep(state) -> None:
        planned.append((state.seconds_since_start, state.upcoming_sleep))

    tries = 0
    with pytest.raises(AlwaysFails, match=r"^try \d+$"):
        for attempt in retrying_blocking(
            policy, lambda error: isinstance(error, AlwaysFails), before_sleep
        ):
            with attempt:
                tries += 1
                raise AlwaysFails(f"try {tries}")
    assert planned and tries == len(planned) + 1, (tries, planned)
    for since_start, wait in planned:
        assert since_start + wait < policy.deadline_s, planned
    for retry, (_, wait) in enumerate(planned):
        backoff = min(policy.first_backoff_s * 2**retry, policy.max_backoff_s)
        assert backoff <= wait <= (1 + JITTER_FRACTION) * backoff, planned
