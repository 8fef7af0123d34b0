"""The run's weight pushes: after a step, and again after the vLLM server went away.

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
so that all of them go on, push again or fail together.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable
from typing import Any

import anyio
import attrs
import structlog
import torch.distributed as dist

from asyncgrpo.adapters.retries import RetryCounter, RetryPolicy, retrying_blocking
from asyncgrpo.adapters.vllm_client import ServerNotAnswering, VLLMClient, VLLMError
from asyncgrpo.adapters.weight_transfer import SyncTimings
from asyncgrpo.core import server_outage
from asyncgrpo.shell.learner import Learner
from asyncgrpo.shell.servers import ServerGone, SharedTrust, wait_for_server
from asyncgrpo.shell.weights.paths import Snapshot, WeightSync

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
class Pushed:
    """A push that landed: the policy of ``version`` is on the server.

    Attributes:
        version: the learner's step whose weights were pushed.
        timings: the server side's seconds (rank 0; None on other ranks).
        resynced: the push followed an outage (the server went away or restarted).
        covering: after a resync, the outages seen before the push (rank 0): once the rollout
            process knows ``version``, record them covered (``trust.pushed(covering,
            identity)``) so that rollouts go on.
        identity: after a resync, the server's identity the push landed on (rank 0).
        push_s: a push beside training (:meth:`WeightPusher.push_beside`): its own seconds,
            from the snapshot to the landing (rank 0).
    """

    version: int
    timings: SyncTimings | None
    resynced: bool = False
    covering: int = 0
    identity: float | None = None
    push_s: float | None = None


class WeightPusher:
    """Pushes the learner's weights to the server; every method is collective.

    Args:
        weights: the run's sync path, started.
        learner: whose step names the version and whose processes take part.
        trust: the run's trust record (rank 0; None elsewhere).
        client: a new client of the server.
        server_timeout_s: ``vllm_server_timeout``, how long a server that went away may take
            to come back.
        uninterruptible: a context in which a signal waits (a transfer the server takes part
            in must not be cut).
    """

    def __init__(
        self,
        weights: WeightSync,
        learner: Learner,
        trust: SharedTrust | None,
        client: Callable[[], VLLMClient],
        server_timeout_s: float,
        uninterruptible: Callable[[], contextlib.AbstractContextManager[Any]],
    ) -> None:
        self.weights = weights
        self.learner = learner
        self.trust = trust
        self.rank0 = learner.rank == 0
        self._client = client
        self.server_timeout_s = server_timeout_s
        self._uninterruptible = uninterruptible
        self._queue_lock = threading.Lock()
        self._waiting: tuple[Snapshot, float | None] | None = None  # the next snapshot to send
        self._sender: threading.Thread | None = None  # rank 0's push thread, while it sends

    def push(self, at_start: bool = False) -> Pushed | None:
        """Push the current policy to the server (collective; rank 0 talks to the server).

        Every process learns the push's outcome (:meth:`_agreed`). Mid-run, a server that
        restarted since the last push (rank 0 reads its identity first, and every process
        learns it), or a push that failed, is taken as the server going away: it is recorded,
        and the next step waits for the server and pushes again (:meth:`resync`) before any
        sample is trusted; a server that is there and still refuses fails the resync.
        ``at_start`` (the server must be there), it fails the run on every process.

        Returns:
            what landed, or None when the server went away (the next step resyncs).
        """
        start = time.monotonic()
        before: list[Any] = [None]  # rank 0: the server's identity, or _RESTARTED
        if self.rank0:
            before = [self._identity_before_push(at_start)]
        if self.learner.world_size > 1:
            dist.broadcast_object_list(before, src=0)  # every process pushes, or none
        if before[0] == _RESTARTED:
            return None
        timings, error = None, None
        try:
            with self._uninterruptible():  # the server takes part in a transfer: never cut it
                timings = self.weights.sync(self.learner.step, time.monotonic() - start)
            if self.rank0:
                self._landed(before[0], at_start)
        except Exception as failed:
            error = failed
        failure = self._agreed(error)
        if failure is None:
            return Pushed(self.learner.step, timings)
        silent = failure.startswith(ServerNotAnswering.__name__)  # for the whole timeout
        if at_start or silent:
            raise error or RuntimeError(f"the weight push failed on another process: {failure}")
        if self.rank0:
            self._outage(failure, "trainer weight sync")
        return None

    def push_beside(self, on_landed: Callable[[Pushed], None]) -> bool:
        """Push the current policy while training goes on (collective up to the snapshot).

        Every process reads the server's identity (rank 0) and takes a snapshot of the weights
        together (:meth:`WeightSync.snapshot`); rank 0 hands it to its push thread and returns
        at once, as the other processes do. Pushes land in order: while one is in flight the
        newest snapshot waits for it (an older waiting one is replaced, never sent), so the
        step never waits for the server, at most two snapshots exist, and the server gets the
        newest weights as soon as it can take them. When a push lands, the thread calls
        ``on_landed``; the rollout process must learn the version only then, so that
        staleness counts from the weights the server holds. A push that fails is an outage
        recorded from when it began (the next step resyncs, pushing the current weights).

        Returns:
            whether a waiting snapshot was replaced (rank 0).
        """
        before: list[Any] = [None]  # rank 0: the server's identity, or _RESTARTED
        if self.rank0:
            before = [self._identity_before_push(at_start=False)]
        if self.learner.world_size > 1:
            dist.broadcast_object_list(before, src=0)  # every process snapshots, or none
        if before[0] == _RESTARTED:
            return False
        with self._uninterruptible():  # the snapshot's gathers are collectives
            snapshot = self.weights.snapshot(self.learner.step)
        if not self.rank0:
            return False
        assert snapshot is not None
        with self._queue_lock:
            replaced = self._waiting is not None
            self._waiting = (snapshot, before[0])
            if self._sender is None:
                self._sender = threading.Thread(target=self._send_waiting, args=(on_landed,),
                                                name="asyncgrpo-weight-push",
                                                daemon=True)  # fmt: skip
                self._sender.start()
        return replaced

    def _send_waiting(self, on_landed: Callable[[Pushed], None]) -> None:
        """Rank 0's push thread: send the waiting snapshots in order until none waits; check
        that one server took each; report each that landed."""
        while True:
            with self._queue_lock:
                waiting, self._waiting = self._waiting, None
                if waiting is None:
                    self._sender = None
                    return
            snapshot, before = waiting
            began, started = time.time(), time.monotonic()
            try:
                timings = self.weights.send(snapshot)
                self._landed(before, at_start=False)
            except Exception as error:
                assert self.trust is not None
                self.trust.outage(f"{type(error).__name__}: {error}", "trainer weight push",
                                  since=began)  # fmt: skip
                with self._queue_lock:
                    self._waiting, self._sender = None, None  # the resync pushes anew
                return
            on_landed(Pushed(snapshot.version, timings, push_s=time.monotonic() - started))

    def wait_landed(self) -> float:
        """Rank 0: wait until every push handed to the thread has landed or failed; the
        seconds waited (0 elsewhere)."""
        started = time.monotonic()
        while True:
            with self._queue_lock:
                sender = self._sender
            if sender is None:
                return time.monotonic() - started
            sender.join()

    def _identity_before_push(self, at_start: bool) -> Any:
        """Rank 0: the server's identity, recorded against the last push's; :data:`_RESTARTED`
        when an outage is pending (seen now or before). Never raises: at start a server that
        does not answer is left to the push to report."""
        assert self.trust is not None
        try:
            identity = self._read_identity()
        except Exception as error:
            if at_start:
                return None
            self._outage(f"{type(error).__name__}: {error}", "trainer before a weight push")
            return _RESTARTED
        if at_start:  # the run's first push: nothing to compare with yet
            return identity
        trust = self.trust.identity_seen(identity, "trainer before a weight push")
        return identity if server_outage.weights_known(trust) else _RESTARTED

    def _landed(self, before: float | None, at_start: bool) -> None:
        """Rank 0: raise unless the server's identity after a push is the one read before it
        (a restart during the push); at start the run's trust learns it."""
        assert self.trust is not None
        after = self._read_identity()
        if not server_outage.push_landed(before, after):
            raise VLLMError("the vLLM server restarted during the weight push")
        if at_start:
            self.trust.pushed(0, after)

    def _read_identity(self) -> float | None:
        async def read() -> float | None:
            async with self._client() as client:
                return await client.server_identity()

        return anyio.run(read)

    def _outage(self, cause: str, where: str) -> None:
        assert self.trust is not None
        self.trust.outage(cause, where)

    def resync(self, attempts: int = 3) -> Pushed:
        """Wait for the server (rank 0, up to ``vllm_server_timeout`` from the outage; every
        process raises :class:`ServerGone` when it stays away), then every process reconnects
        and pushes the current weights, each stage's outcome agreed by all; the outages seen
        before the push are then covered (collective), and the server's identity, read before
        and after the push, is the one later readings compare with. A push that fails while
        the server answers (or a server that restarted again during it) is tried ``attempts``
        times under the retry policy (the same on every process: attempts, not time), then
        raised."""
        self.wait_landed()
        policy = RetryPolicy(deadline_s=math.inf, max_attempts=attempts, first_backoff_s=1.0)
        counter = RetryCounter("pushing the weights again after an outage", policy)
        try:
            for attempt in retrying_blocking(policy, _push_failed, counter):
                with attempt:
                    return self._resync_once()
        except _PushFailed as failed:
            raise failed.error or RuntimeError(
                f"weight push after an outage failed: {failed}"
            ) from None
        raise AssertionError("unreachable: the retry loop returns or raises")

    def _resync_once(self) -> Pushed:
        """One try of :meth:`resync` (collective); raises :class:`_PushFailed` on every process
        when a stage failed on any, after recording it as an outage (rank 0)."""
        covering = self._wait_everywhere()
        timings, error, before, identity = None, None, None, None
        try:
            before = self._read_identity() if self.rank0 else None
            self.weights.reconnect()
        except Exception as failed:
            error = failed
        failure = self._agreed(error)
        if failure is None:
            try:
                with self._uninterruptible():
                    timings = self.weights.sync(self.learner.step)
                if self.rank0:
                    identity = self._read_identity()
                    if not server_outage.push_landed(before, identity):
                        raise VLLMError("the vLLM server restarted during the weight push")
            except Exception as failed:
                error = failed
            failure = self._agreed(error)
        if failure is not None:
            if self.rank0:
                self._outage(failure, "resync")
            raise _PushFailed(failure, error)
        return Pushed(self.learner.step, timings, resynced=True, covering=covering,
                      identity=identity)  # fmt: skip

    def _agreed(self, error: Exception | None) -> str | None:
        """The outcome of a collective stage on every process: ``None`` when it succeeded on
        all, else the first failure (``"<Type>: <message>"``, rank 0's first)."""
        failure = None if error is None else f"{type(error).__name__}: {error}"
        if self.learner.world_size == 1:
            return failure
        failures: list[str | None] = [None] * self.learner.world_size
        dist.all_gather_object(failures, failure)
        return next((f if rank == 0 else f"rank {rank}: {f}" for rank, f in enumerate(failures)
                     if f is not None), None)  # fmt: skip

    def _wait_everywhere(self) -> int:
        """Rank 0 waits for the server (:meth:`_wait_for_server`); every process then raises
        :class:`ServerGone` if it stayed away. The outages covered (rank 0; 0 elsewhere)."""
        covering, gone = 0, None
        if self.rank0:
            try:
                covering = self._wait_for_server()
            except ServerGone as error:
                gone = error
        if self.learner.world_size > 1:
            verdict = [None if gone is None else str(gone)]
            dist.broadcast_object_list(verdict, src=0)
            if verdict[0] is not None and gone is None:
                raise ServerGone(verdict[0])
        if gone is not None:
            raise gone
        return covering

    def _wait_for_server(self) -> int:
        """Rank 0: wait until the server answers; the outages seen before the wait."""
        assert self.trust is not None
        trust = self.trust
        covering = trust.read().outages

        async def wait() -> float:
            async with self._client() as client:
                return await wait_for_server(client, trust.down_since(),
                                             self.server_timeout_s)  # fmt: skip

        down_s = anyio.run(wait)
        log.info("vLLM server back; pushing the trainer's weights", down_s=round(down_s, 1),
                 step=self.learner.step)  # fmt: skip
        return covering
