"""Surviving a vLLM server that goes away mid-run: pure decisions over what was observed.

Three questions, each one function:

1. **Is this an outage?** :func:`classify_failure` sorts a failed request: the server could not
   be reached, or dropped the connection, or a proxy in front of it answered 502/503/504
   (:attr:`Failure.UNREACHABLE`: the server may have died and come back with other weights);
   a request that timed out or got another 5xx (the server is there but slow or failing:
   retried as before, never an outage).
2. **How long have we waited?** :func:`next_wait` steps an :class:`OutageClock`: keep waiting
   (probe again after a backoff), log now (every ``log_every_s``), or give up after
   ``timeout_s`` (the config's ``vllm_server_timeout``) counted from the first failure.
3. **What must be re-pushed and regenerated?** :class:`ServerTrust` counts outages seen
   (by the rollout process or the trainer) and the outages the trainer's weights have been
   pushed after. While an outage is not covered (:func:`weights_known` false) no request is
   sent; a request is trusted only when no outage was seen between its start and its end
   (:func:`request_trusted`), else it is re-issued, so nothing generated under unknown weights
   (a restarted server serves the checkpoint it loaded, not the trainer's policy) is trained.
4. **Did the server restart unseen?** A restart faster than the next request fails nothing.
   :func:`identity_seen` compares the server's identity (a per-boot value: the API server's
   process start time) read by a probe with the identity of the server the trainer last
   pushed to: a different one is an outage like any other. The rollout process probes after
   every finished request (before trusting it) and on every ``/metrics`` poll, the trainer
   before every push; :func:`push_landed` says whether one server took a whole push.

Example:
    >>> trust = ServerTrust()
    >>> started = trust.outages                 # a request starts
    >>> trust = outage_seen(trust)              # it fails: the server is gone
    >>> weights_known(trust), request_trusted(trust, started)
    (False, False)
    >>> trust = weights_pushed(trust, covering=trust.outages)  # the trainer pushed again
    >>> weights_known(trust), request_trusted(trust, trust.outages)
    (True, True)
    >>> trust = weights_pushed(trust, covering=trust.outages, identity=1700000000.25)
    >>> started = trust.outages                 # a request starts; the server restarts unseen
    >>> trust = identity_seen(trust, 1700000042.5)   # the probe after it finished
    >>> weights_known(trust), request_trusted(trust, started)
    (False, False)
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import attrs

UNREACHABLE_STATUSES = frozenset({502, 503, 504})


class Failure(enum.Enum):
    """What a failed request says about the server."""

    UNREACHABLE = "unreachable"  # refused, dropped, or 502/503/504: it may have restarted
    TIMEOUT = "timeout"  # no answer in time: slow, still there
    SERVER_ERROR = "server_error"  # another 5xx: there, and failing


def classify_failure(
    *, connect_failed: bool, dropped: bool, timed_out: bool, status: int | None
) -> Failure:
    """Sort one failed request.

    Args:
        connect_failed: no connection could be opened (refused, reset during connect).
        dropped: the connection broke mid-request (closed without a reply, reset).
        timed_out: the request ran past its timeout (a connect timeout counts as
            ``connect_failed``).
        status: the HTTP status when the server answered (>= 500), else ``None``.

    Example:
        >>> classify_failure(connect_failed=True, dropped=False, timed_out=False, status=None)
        <Failure.UNREACHABLE: 'unreachable'>
        >>> classify_failure(connect_failed=False, dropped=False, timed_out=False, status=500)
        <Failure.SERVER_ERROR: 'server_error'>
    """
    if connect_failed or dropped or status in UNREACHABLE_STATUSES:
        return Failure.UNREACHABLE
    if timed_out:
        return Failure.TIMEOUT
    return Failure.SERVER_ERROR


@attrs.frozen
class OutageClock:
    """One wait for the server to come back (seconds on one monotonic clock).

    Attributes:
        down_since: when the outage was first seen.
        probes: probes made so far.
        logged_at: when the wait was last logged (``None``: not yet).
    """

    down_since: float
    probes: int = 0
    logged_at: float | None = None


@attrs.frozen
class WaitDecision:
    """What to do next while the server is away.

    Attributes:
        give_up: ``timeout_s`` has passed since ``down_since``: raise.
        log: log the wait now (the first time, then every ``log_every_s``).
        sleep_s: seconds before the next probe (never past the deadline).
        waited_s: seconds since the outage was first seen.
        clock: the clock after this probe.
    """

    give_up: bool
    log: bool
    sleep_s: float
    waited_s: float
    clock: OutageClock


def next_wait(
    clock: OutageClock,
    now: float,
    timeout_s: float,
    log_every_s: float = 10.0,
    first_backoff_s: float = 0.5,
    max_backoff_s: float = 5.0,
) -> WaitDecision:
    """Decide the next step of a wait for the server after a failed probe at ``now``.

    The backoff doubles from ``first_backoff_s`` up to ``max_backoff_s`` and is cut so that the
    last probe falls on the deadline; ``give_up`` once ``now - down_since >= timeout_s``.

    Example:
        >>> d = next_wait(OutageClock(down_since=100.0), now=100.0, timeout_s=60.0)
        >>> d.give_up, d.log, d.sleep_s
        (False, True, 0.5)
        >>> next_wait(d.clock, now=160.0, timeout_s=60.0).give_up
        True
    """
    waited = max(0.0, now - clock.down_since)
    if waited >= timeout_s:
        return WaitDecision(True, True, 0.0, waited, clock)
    log = clock.logged_at is None or now - clock.logged_at >= log_every_s
    backoff = min(first_backoff_s * 2.0 ** min(clock.probes, 32), max_backoff_s)
    sleep_s = max(0.0, min(backoff, timeout_s - waited))
    updated = attrs.evolve(
        clock, probes=clock.probes + 1, logged_at=now if log else clock.logged_at
    )
    return WaitDecision(False, log, sleep_s, waited, updated)


PROBE_GAP_S = 0.5
"""Seconds the silence watchdog leaves at least between two of its probes."""


@attrs.frozen
class SilenceStep:
    """What a call's silence watchdog does after a ``/health`` probe found the server silent.

    Attributes:
        log_at: when to log the silence (now, or the time the log is due), monotonic seconds;
            None: not before the next probe.
        probe_at: when to start the next probe, monotonic seconds (after ``log_at``).
    """

    log_at: float | None
    probe_at: float


def after_silent_probe(
    now: float, logged_at: float, every_s: float, probe_s: float, deadline: float
) -> SilenceStep:
    """The silence watchdog's next step after a probe that ended at ``now`` unanswered.

    The silence is logged every ``every_s`` (the last log at ``logged_at``); a probe takes up
    to ``probe_s``, and one may end early (it reused another call's probe), so a log is never
    left to a probe that cannot end in time: when the log is due within a second it is made
    now, when no probe started now could end before it is due it is made at the due time from
    this probe's verdict, and the next probe starts so that it ends when the next log (or the
    ``deadline``, when the call gives up) is due. The logs therefore come every ``every_s``
    whatever the probes take (they came every ~14 s for 10 when a reused probe ended early).

    Example:
        >>> after_silent_probe(now=107.0, logged_at=100.0, every_s=10.0, probe_s=5.0,
        ...                    deadline=200.0)
        SilenceStep(log_at=110.0, probe_at=115.0)
        >>> after_silent_probe(now=104.0, logged_at=100.0, every_s=10.0, probe_s=5.0,
        ...                    deadline=200.0)
        SilenceStep(log_at=None, probe_at=105.0)
    """
    due = logged_at + every_s
    log_at: float | None = None
    if now >= due - 1.0:
        log_at = now
    elif due - now < probe_s + PROBE_GAP_S and due < deadline:
        log_at = due  # a probe starting at the earliest, PROBE_GAP_S from now, may end late
    next_due = due if log_at is None else log_at + every_s
    earliest = now + PROBE_GAP_S if log_at is None else log_at
    return SilenceStep(log_at, max(earliest, min(next_due, deadline) - probe_s))


@attrs.frozen
class ServerTrust:
    """Whether the server is known to serve the trainer's weights.

    Attributes:
        outages: outages seen so far (a failed request, a failed probe, a restart).
        trusted: the last outage the trainer's weights were pushed after (``outages`` when
            none is pending).
        identity: the identity of the server the trainer's weights were last pushed to
            (its API server's start time, seconds since the epoch); ``None`` when unknown
            (no push yet, or a server that does not tell it).
    """

    outages: int = 0
    trusted: int = 0
    identity: float | None = None

    def __attrs_post_init__(self) -> None:
        if not 0 <= self.trusted <= self.outages:
            raise ValueError(f"ServerTrust: need 0 <= trusted <= outages, got {self}")


def weights_known(trust: ServerTrust) -> bool:
    """The trainer's weights were pushed after the last outage seen: requests may be sent."""
    return trust.trusted == trust.outages


def outage_seen(trust: ServerTrust) -> ServerTrust:
    """Record a failure that says the server went away (a request, a probe, a restart seen).

    Every request in flight when the server dies fails; the first failure counts a new outage
    and the others, seen while it is pending (not yet covered by a push), belong to it, so one
    outage is counted once. A failure after the push is a new outage.
    """
    if not weights_known(trust):
        return trust
    return attrs.evolve(trust, outages=trust.outages + 1)


def request_trusted(trust: ServerTrust, started_in: int) -> bool:
    """A request started when ``started_in`` outages were seen, finished now: its tokens came
    from the trainer's weights only if no outage was seen meanwhile and none is pending."""
    return started_in == trust.outages and weights_known(trust)


def weights_pushed(trust: ServerTrust, covering: int, identity: float | None = None) -> ServerTrust:
    """The trainer pushed its weights to a server that answered, having read ``covering``
    outages before it started the push: those are covered (a later one is still pending).
    ``identity``: the pushed-to server's identity (:func:`push_landed` held), remembered for
    :func:`identity_seen`; ``None`` keeps the one known."""
    return attrs.evolve(
        trust,
        trusted=max(trust.trusted, min(covering, trust.outages)),
        identity=trust.identity if identity is None else identity,
    )


def identity_seen(trust: ServerTrust, identity: float | None) -> ServerTrust:
    """A probe read the server's identity: if it is not the identity of the server the
    trainer's weights were pushed to, the server restarted since (whether or not a request
    failed), and that is an outage (:func:`outage_seen`). An unknown identity on either side
    says nothing."""
    if identity is None or trust.identity is None or identity == trust.identity:
        return trust
    return outage_seen(trust)


def push_landed(before: float | None, after: float | None) -> bool:
    """The server's identity read just before and just after a push agree: one server took
    the whole push (no restart in between). Two unknowns agree (a server that does not tell
    its identity: only failed requests can say it went away)."""
    return before == after


def all_gone_since(down_since: Sequence[float | None]) -> float | None:
    """A run with several servers goes on while one of them serves; it waits, and finally
    fails, only while none does. Given when each server's pending outage began (``None``: it
    serves), when the last of them went away, or ``None`` while one still serves; the wait
    for the run's servers counts from there (:func:`next_wait`).

    Example:
        >>> all_gone_since([100.0, None]) is None
        True
        >>> all_gone_since([100.0, 130.0])
        130.0
    """
    if not down_since or any(since is None for since in down_since):
        return None
    return max(since for since in down_since if since is not None)
