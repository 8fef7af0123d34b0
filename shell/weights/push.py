"""The run's weight pushes: after a step, and again after the vLLM server went away.

With several servers each push goes to every server in routing, in parallel, and lands on
each on its own: a server the push fails on (or that restarted) goes out of routing alone,
and the push counts on the others; a server back in the run gets the current weights through
:meth:`WeightPusher.resync` before it is routed to again. Only when a push lands nowhere does
the run wait for a server, as with one.

:class:`WeightPusher` pushes the policy through the run's
:class:`~asyncgrpo.shell.weights.paths.WeightSync` and tells the run what landed
(:class:`Pushed`); the run passes the version on to the rollout process. A push that fails
mid-run is taken as the server going away: it is recorded in the run's trust record shared with
the rollout process (:mod:`asyncgrpo.shell.servers.outages`),
and the next step waits for the server and pushes again before any sample is trusted. Before
every push rank 0 reads the server's identity: a server that restarted since the last push
(however fast, whether or not a request failed) is an outage too, and the push goes through
the same resync; after the push it reads the identity again, so a restart during the push is
not taken for a landed push. Every push is collective over the trainer's processes; rank 0
talks to the server and records the timings, and every process learns each stage's outcome,
so that all of them go on, push again or fail together. A push beside the step is sent by rank
0's push thread (:mod:`asyncgrpo.shell.weights.push_thread`), one snapshot at a time.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

import attrs
import structlog

from asyncgrpo.adapters.process_group import decided_on_rank0, first_failure
from asyncgrpo.adapters.transfer.files import SyncTimings
from asyncgrpo.adapters.vllm.client import VLLMClient, VLLMError
from asyncgrpo.adapters.vllm.retries import RetryCounter, RetryPolicy, retrying_blocking
from asyncgrpo.adapters.vllm.transport import ServerNotAnswering
from asyncgrpo.core.servers import outage as server_outage
from asyncgrpo.shell.learner import Learner, LoraPrecisionError
from asyncgrpo.shell.servers import ServerGone, SharedServers, run_async, wait_for_servers_out
from asyncgrpo.shell.weights.paths import Landing, Snapshot, WeightSync, landed_timings
from asyncgrpo.shell.weights.push_thread import PushThread

log = structlog.get_logger("asyncgrpo.trainer")


class _PushFailed(Exception):
    """A collective push stage failed (on some process); ``error`` is this process's own
    exception, if it was this one's."""

    def __init__(self, failure: str, error: Exception | None) -> None:
        super().__init__(failure)
        self.error = error


def _push_failed(error: BaseException) -> bool:
    return isinstance(error, _PushFailed)


_RESTARTED = "restarted"  # rank 0 to every rank: the server restarted since the last push


@attrs.frozen
class Resynced:
    """A server a push after an outage landed on (rank 0).

    Attributes:
        server: its index in the run's servers.
        covering: the outages seen before the push: once the rollout process knows the
            version, record them covered (``trust.pushed(covering, identity)``) so that
            rollouts go on there.
        identity: the server's identity the push landed on.
    """

    server: int
    covering: int
    identity: float | None


@attrs.frozen
class Pushed:
    """A push that landed: the policy of ``version`` is on ``servers``.

    Attributes:
        version: the learner's step whose weights were pushed.
        timings: the server side's seconds (rank 0; None on other ranks; with several
            servers each phase's longest).
        resynced: the servers the push reached after an outage (rank 0; empty for a push
            after a step).
        push_s: a push beside training (:meth:`WeightPusher.push_beside`): its own seconds,
            from the snapshot to the landing (rank 0).
        servers: the servers it landed on (rank 0).
        held_s: seconds it waited for an evaluation of an older version to finish (rank 0).
    """

    version: int
    timings: SyncTimings | None
    resynced: tuple[Resynced, ...] = ()
    push_s: float | None = None
    servers: tuple[int, ...] = (0,)
    held_s: float = 0.0


class WeightPusher:
    """Pushes the learner's weights to the servers; every method is collective.

    It coordinates each push across the trainer's processes (every process learns each
    stage's outcome), reads the servers' identities around it and retries a resync; a push
    beside the step goes to rank 0's :class:`~asyncgrpo.shell.weights.push_thread.PushThread`,
    which sends each snapshot through :meth:`_send_snapshot`.

    Args:
        weights: the run's sync path, started.
        learner: whose step names the version and whose processes take part.
        servers: the run's records of its servers (rank 0; None elsewhere).
        client: makes a new client of server ``i`` (keyword arguments: the client's options).
        server_timeout_s: ``vllm_server_timeout``, how long a server that went away may take
            to come back (with several: how long the run may have none).
        uninterruptible: a context in which a signal waits (a transfer the server takes part
            in must not be cut).
        hold: rank 0 calls it with a version before pushing it: it waits while an evaluation
            reads an older version (:meth:`VersionPin.hold
            <asyncgrpo.shell.servers.VersionPin.hold>`) and returns the seconds waited.
    """

    def __init__(
        self,
        weights: WeightSync,
        learner: Learner,
        servers: SharedServers | None,
        client: Callable[..., VLLMClient],
        server_timeout_s: float,
        uninterruptible: Callable[[], contextlib.AbstractContextManager[Any]],
        hold: Callable[[int], float] | None = None,
    ) -> None:
        self.weights = weights
        self.learner = learner
        self.servers = servers
        self.rank0 = learner.rank == 0
        self._client = client
        self.server_timeout_s = server_timeout_s
        self._uninterruptible = uninterruptible
        self._hold = hold or (lambda version: 0.0)
        self._thread: PushThread[Pushed] = PushThread(self._send_snapshot)  # rank 0's
        # rank 0: why a server's identity could not be read before the first push, by server
        self._unread_at_start: dict[int, Exception] = {}

    @property
    def count(self) -> int:
        """The run's servers (rank 0)."""
        assert self.servers is not None
        return len(self.servers)

    def push(self, at_start: bool = False) -> Pushed | None:
        """Push the current policy to the servers in routing (collective; rank 0 talks to
        them).

        Every process learns the push's outcome
        (:func:`~asyncgrpo.adapters.process_group.first_failure`). Mid-run, a server that
        restarted since the last push (rank 0 reads its identity first), or that the push
        failed on, is taken as gone: it is recorded; with several servers it leaves routing and
        the push counts on the others, and when the push landed nowhere the next step waits
        for a server and pushes again (:meth:`resync`) before any sample is trusted; a server
        that is there and still refuses fails the resync. ``at_start`` (every server must be
        there), it fails the run on every process.

        Returns:
            what landed, or None when it landed on no server (the next step resyncs).
        """
        start = time.monotonic()
        held_s = 0.0
        if self.rank0 and not at_start:
            held_s = self._hold(self.learner.step)
        # each target's identity, or _RESTARTED: every process pushes, or none
        plan = decided_on_rank0(lambda: self._targets(at_start), refusals=(ServerNotAnswering,))
        if plan == _RESTARTED:
            return None
        assert isinstance(plan, dict)
        targets: dict[int, float | None] = plan
        landing: Landing | None = None
        error: Exception | None = None
        try:
            with self._uninterruptible():  # the server takes part in a transfer: never cut it
                landing = self.weights.sync(
                    self.learner.step, time.monotonic() - start, tuple(targets)
                )
            if self.rank0:
                assert landing is not None
                landing = self._check_landing(targets, landing, at_start)
                error = self._nowhere(landing, at_start)
        except Exception as failed:
            error = failed
        failure = first_failure(error)
        if failure is None:
            landed = self._record_failures(landing, "trainer weight sync") if self.rank0 else ()
            return Pushed(
                self.learner.step,
                landed_timings(landing) if landing else None,
                servers=landed,
                held_s=held_s,
            )
        # the only server silent for the whole timeout, or weights no server can hold: the
        # run ends (a resync would meet the same again)
        ends_run = failure.startswith((ServerNotAnswering.__name__, LoraPrecisionError.__name__))
        if at_start or ends_run:
            raise error or RuntimeError(f"the weight push failed on another process: {failure}")
        if self.rank0:
            self._outage_on(tuple(targets), landing, failure, "trainer weight sync")
        return None

    def push_beside(self, on_landed: Callable[[Pushed], None]) -> bool:
        """Push the current policy while training goes on (collective up to the snapshot).

        Every process takes part in a snapshot of the weights (:meth:`WeightSync.snapshot`);
        rank 0 hands it to its push thread and returns at once, as the other processes do. The
        thread reads the identity of each server in routing first (one that restarted since
        the last push is an outage: nothing is sent to it; with none left, the next step
        resyncs), sends to the others, and reads their identities again. Pushes land in order:
        while one is in flight the newest snapshot waits for it (an older waiting one is
        replaced, never sent), so the step never waits for the servers, at most two snapshots
        exist, and the servers get the newest weights as soon as they can take them. When a
        push lands the thread calls ``on_landed``; the rollout process must learn the version
        only then, so that staleness counts from the weights the server holds. A push that
        fails on a server is an outage of that server recorded from when it began (with none
        left, the next step resyncs, pushing the current weights).

        Returns:
            whether a waiting snapshot was replaced (rank 0).
        """
        self.raise_if_failed()  # a push failed on the thread: no push follows
        with self._uninterruptible():  # the snapshot's gathers are collectives
            snapshot = self.weights.snapshot(self.learner.step)
        if not self.rank0:
            return False
        assert snapshot is not None
        return self._thread.hand(snapshot, on_landed)

    def _send_snapshot(self, snapshot: Snapshot) -> Pushed | None:
        """Rank 0's push thread: push one snapshot to the servers in routing and check that
        it landed on each (the identity read before it is still there after it).

        Returns:
            what landed, or None when it landed nowhere (the servers that restarted or that
            the push failed on are recorded as outages: the resync pushes anew).

        Raises:
            ServerNotAnswering: the run's only server stayed silent (the run ends).
        """
        held_s = self._hold(snapshot.version)  # an evaluation reads an older version
        began, started = time.time(), time.monotonic()
        targets = self._targets(at_start=False)
        if targets == _RESTARTED:  # recorded as outages: the resync pushes anew
            return None
        assert isinstance(targets, dict)
        try:
            landing = self._check_landing(
                targets, self.weights.send(snapshot, tuple(targets)), at_start=False
            )
        except Exception as error:  # outside the servers (a write): it reached none
            landing = dict.fromkeys(targets, error)
        silent = [outcome for outcome in landing.values() if self._ends_run(outcome)]
        if silent:
            raise silent[0]
        landed = self._record_failures(landing, "trainer weight push", since=began)
        if not landed:
            return None  # the resync pushes anew
        return Pushed(
            snapshot.version,
            landed_timings(landing),
            push_s=time.monotonic() - started,
            servers=landed,
            held_s=held_s,
        )

    def raise_if_failed(self) -> None:
        """Rank 0: raise the error a push raised on the push thread, if one did.

        Mostly :class:`ServerNotAnswering`: the run's only server answered nothing for
        ``vllm_server_timeout`` seconds (frozen or wedged). That is the end of the run, as it is
        when a step's own push meets it, not an outage to wait out for as long again. With
        several servers a silent one leaves routing instead."""
        self._thread.raise_if_failed()

    def _ends_run(self, outcome: object) -> TypeGuard[ServerNotAnswering]:
        """Whether what a server did is the run's only server staying silent (which ends the
        run; with several servers a silent one is an outage and leaves routing)."""
        return self.count == 1 and isinstance(outcome, ServerNotAnswering)

    def wait_landed(self) -> float:
        """Rank 0: wait until every push handed to the thread has landed or failed; the
        seconds waited (0 elsewhere)."""
        return self._thread.wait_landed()

    def _targets(self, at_start: bool) -> dict[int, float | None] | str:
        """Rank 0: the servers a push goes to, each with its identity read now: at start every
        server (one that does not answer is left to the push to report); mid-run those in
        routing whose identity is still the one pushed to (one that restarted, or does not
        answer, is recorded as an outage and left out). :data:`_RESTARTED` when none is left.
        Raises only :class:`ServerNotAnswering`, when the run's only server is silent."""
        assert self.servers is not None
        targets: dict[int, float | None] = {}
        if at_start:
            self._unread_at_start.clear()
        for index in range(self.count):
            if at_start:
                try:
                    targets[index] = self._read_identity(index)
                except Exception as error:
                    # the push goes there and reports the server if it fails too; if it lands,
                    # the landing check fails naming this error (_check_landing)
                    log.warning(
                        "reading the vLLM server's identity before the first weight push failed",
                        server=self.servers.urls[index],
                        cause=f"{type(error).__name__}: {error}",
                        exc_info=error,
                    )
                    self._unread_at_start[index] = error
                    targets[index] = None
                continue
            if not self.servers.routable(index):
                continue
            trust = self.servers.trusts[index]
            try:
                identity = self._read_identity(index)
            except Exception as error:
                if self._ends_run(error):
                    raise
                trust.outage(f"{type(error).__name__}: {error}", "trainer before a weight push")
                continue
            if server_outage.weights_known(
                trust.identity_seen(identity, "trainer before a weight push")
            ):
                targets[index] = identity
        return targets or _RESTARTED

    def _check_landing(
        self, targets: dict[int, float | None], landing: Landing, at_start: bool
    ) -> Landing:
        """Rank 0: a push landed on a server only if its identity after the push is the one
        read before it (else it restarted during the push); at start each server's record
        learns it."""
        assert self.servers is not None
        checked: Landing = dict(landing)
        for index, outcome in landing.items():
            if isinstance(outcome, Exception):
                continue
            try:
                after = self._read_identity(index)
                if not server_outage.push_landed(targets.get(index), after):
                    unread = self._unread_at_start.get(index) if at_start else None
                    if unread is not None:
                        raise VLLMError(
                            "the vLLM server's identity could not be read before the first "
                            f"weight push ({type(unread).__name__}: {unread}), so the push is not "
                            "known to have landed on the server that answers now: make the "
                            "server answer GET /metrics, then start the run again"
                        ) from unread
                    raise VLLMError("the vLLM server restarted during the weight push")
            except Exception as error:
                checked[index] = error
                continue
            if at_start:
                self.servers.trusts[index].pushed(0, after)
        return checked

    def _nowhere(self, landing: Landing, at_start: bool) -> Exception | None:
        """Rank 0: the error of a push that failed as a whole: it landed on no server, or (at
        start, where every server must take it) on not all of them; else None."""
        failed = [(i, e) for i, e in landing.items() if isinstance(e, Exception)]
        if not failed or (not at_start and len(failed) < len(landing)):
            return None
        index, error = failed[0]
        if self.count == 1:
            return error
        assert self.servers is not None
        named = VLLMError(
            f"the weight push to the vLLM server at {self.servers.urls[index]} "
            f"failed: {type(error).__name__}: {error}"
        )
        named.__cause__ = error
        return named

    def _record_failures(
        self, landing: Landing | None, where: str, since: float | None = None
    ) -> tuple[int, ...]:
        """Rank 0: record an outage of each server the push failed on; the servers it landed
        on."""
        assert self.servers is not None and landing is not None
        for index, outcome in landing.items():
            if isinstance(outcome, Exception):
                self.servers.trusts[index].outage(
                    f"{type(outcome).__name__}: {outcome}", where, since=since
                )
        return tuple(i for i, outcome in landing.items() if not isinstance(outcome, Exception))

    def _outage_on(
        self, targets: tuple[int, ...], landing: Landing | None, failure: str, where: str
    ) -> None:
        """Rank 0: a push that failed as a whole: an outage of each server it went to (its own
        failure when it has one)."""
        assert self.servers is not None
        for index in targets:
            outcome = (landing or {}).get(index)
            cause = (
                f"{type(outcome).__name__}: {outcome}"
                if isinstance(outcome, Exception)
                else failure
            )
            self.servers.trusts[index].outage(cause, where)

    def _read_identity(self, server: int = 0) -> float | None:
        # with other servers to turn to, a server that does not answer is out at once (one
        # retry), instead of holding the step for the retry policy's backoffs
        options = {"max_retries": 1, "stall_outage": True} if self.count > 1 else {}

        async def read() -> float | None:
            async with self._client(server, **options) as client:
                return await client.server_identity()

        return run_async(read)

    def resync(self, servers: Sequence[int] | None = None, attempts: int = 3) -> Pushed | None:
        """Push the current weights to servers back from an outage, then cover the outages
        seen before the push on each (collective); the identity read before and after the push
        is the one later readings compare with.

        ``servers=None``: no server is in routing. Rank 0 waits for them (up to
        ``vllm_server_timeout`` from when the last went away; every process raises
        :class:`ServerGone` when none comes back), then pushes to those that answer; a push
        that lands nowhere while they answer (or a server that restarted again during it) is
        tried ``attempts`` times under the retry policy (the same on every process: attempts,
        not time), then raised. ``servers`` given (a run with several, the others in routing):
        one try; a server it fails on stays out of routing and is tried again when it answers
        (returns None when it landed nowhere)."""
        self.wait_landed()
        if servers is not None:
            try:
                return self._resync_once(tuple(servers))
            except _PushFailed:
                return None
        policy = RetryPolicy(deadline_s=math.inf, max_attempts=attempts, first_backoff_s=1.0)
        counter = RetryCounter("pushing the weights again after an outage", policy)
        try:
            for attempt in retrying_blocking(policy, _push_failed, counter):
                with attempt:
                    return self._resync_once(None)
        except _PushFailed as failed:
            raise failed.error or RuntimeError(
                f"weight push after an outage failed: {failed}"
            ) from None
        raise AssertionError("unreachable: the retry loop returns or raises")

    def _resync_once(self, servers: tuple[int, ...] | None) -> Pushed:
        """One try of :meth:`resync` (collective); raises :class:`_PushFailed` on every process
        when it landed on no server (or a stage failed on any process), after recording it as
        an outage (rank 0)."""
        back, covering = self._wait_everywhere(servers)
        landing: Landing | None = None
        error: Exception | None = None
        before: dict[int, float | None] = {}
        try:
            if self.rank0:
                before = {i: self._read_identity(i) for i in back}
            self.weights.reconnect(back)
        except Exception as failed:
            error = failed
        failure = first_failure(error)
        if failure is None:
            try:
                with self._uninterruptible():
                    landing = self.weights.sync(self.learner.step, servers=back)
                if self.rank0:
                    assert landing is not None
                    landing = self._check_landing(before, landing, at_start=False)
                    error = self._nowhere(landing, at_start=False)
            except Exception as failed:
                error = failed
            failure = first_failure(error)
        if failure is not None:
            if self.rank0:
                self._outage_on(back, landing, failure, "resync")
            raise _PushFailed(failure, error)
        landed = self._record_failures(landing, "resync") if self.rank0 else ()
        # the identity read before the push, found again after it (_check_landing)
        resynced = tuple(Resynced(i, covering[i], before.get(i)) for i in landed)
        return Pushed(
            self.learner.step,
            landed_timings(landing) if landing else None,
            resynced=resynced,
            servers=landed,
        )

    def _wait_everywhere(
        self, servers: tuple[int, ...] | None
    ) -> tuple[tuple[int, ...], dict[int, int]]:
        """Rank 0 waits for the servers when none is in routing
        (:func:`~asyncgrpo.shell.servers.wait_for_servers_out`), or takes ``servers`` as they
        are; every process learns which servers the push goes to, and the outages it covers on
        each, or raises :class:`ServerGone` if none came back."""

        def wait() -> tuple[tuple[int, ...], dict[int, int]]:
            records = self.servers
            assert records is not None
            if servers is not None:
                return servers, records.outages_of(servers)
            back, covering, down_s = wait_for_servers_out(
                records, self._client, self.server_timeout_s
            )
            log.info(
                "vLLM server back; pushing the trainer's weights",
                down_s=round(down_s, 1),
                step=self.learner.step,
                **({"servers": [records.urls[i] for i in back]} if self.count > 1 else {}),
            )
            return back, covering

        return decided_on_rank0(wait, refusals=(ServerGone,))
