"""Rank 0's ledger of the weight pushes that landed on the servers.

A push lands in one of two places. One the step waited for (the push at start, a push after a
step when the plan does not overlap it, a resync) lands on the trainer's thread:
:meth:`PushLedger.landed`. One beside the next step lands on the push thread:
:meth:`PushLedger.published`. Either way the ledger records the version the servers hold, the
rollout process learns it for each server that took the push (it samples from those), and the
evaluations learn it (one may be due at that version). A push's timings become ``perf/weight_*``
metrics on the trainer's thread: at once for a push waited for, at the next
:meth:`PushLedger.record_landed` for one beside the step.
"""

from __future__ import annotations

import queue
from collections.abc import Callable

from asyncgrpo.core import metrics
from asyncgrpo.shell.rollout import RolloutProcess
from asyncgrpo.shell.servers import SharedServers
from asyncgrpo.shell.weights import Pushed


class PushLedger:
    """What rank 0 knows of the pushes that landed.

    Args:
        observe: records metrics in the run's window (the trainer's thread only).
        servers: the run's servers (their trust records learn what a resync ended).
        on_version: told each version that lands (the run's evaluations: one may be due).

    Attributes:
        version: the policy version the servers hold (0 until the push at start lands).
        process: the rollout process, told each version once it runs.
    """

    def __init__(
        self,
        observe: Callable[..., None],
        servers: SharedServers | None,
        on_version: Callable[[int], None],
    ) -> None:
        self.version = 0
        self.process: RolloutProcess | None = None
        self.servers = servers
        self._on_version = on_version
        self._observe = observe
        self._unrecorded: queue.SimpleQueue[Pushed] = queue.SimpleQueue()

    def published(self, pushed: Pushed) -> None:
        """A push beside the step landed (any thread): the rollout process learns it now, the
        metrics follow on the trainer's thread (:meth:`record_landed`)."""
        self._tell_process(pushed)
        self._unrecorded.put(pushed)
        self._on_version(pushed.version)  # before this thread takes the next push

    def landed(self, pushed: Pushed) -> None:
        """A push the run waited for landed (the trainer's thread): tell the rollout process,
        end the outages a resync ended, and record the push."""
        self._tell_process(pushed)
        if pushed.resynced and self.process is not None:
            self.process.restart_wait_clock()
        for resynced in pushed.resynced:
            assert self.servers is not None  # rollouts go on there from here
            self.servers.trusts[resynced.server].pushed(resynced.covering, resynced.identity)
            self._observe(metrics.total("rollout/vllm_outage_count", 1))
        if pushed.resynced and self.process is not None:
            self.process.set_model_version(self.version)  # wakes the loop: routable again
        self._record(pushed)
        self._on_version(pushed.version)

    def record_landed(self) -> None:
        """Record the metrics of the pushes beside the step that landed since the last call
        (the trainer's thread)."""
        while True:
            try:
                self._record(self._unrecorded.get_nowait())
            except queue.Empty:
                return

    def _tell_process(self, pushed: Pushed) -> None:
        self.version = pushed.version
        if self.process is not None:
            for server in pushed.servers:
                self.process.set_server_version(server, pushed.version)
            self.process.set_model_version(self.version)

    def _record(self, pushed: Pushed) -> None:
        if pushed.push_s is not None:
            self._observe(metrics.mean("perf/weight_push_s", pushed.push_s))
        if pushed.held_s:
            self._observe(metrics.mean("perf/weight_push_held_s", pushed.held_s))
        if pushed.timings is not None:
            timings = pushed.timings
            self._observe(
                metrics.mean("perf/weight_sync_server_s", timings.total_s),
                metrics.mean("perf/weight_sync_pause_s", timings.pause_s),
                metrics.mean("perf/weight_sync_barrier_s", timings.barrier_s),
                metrics.mean("perf/weight_sync_transfer_s", timings.transfer_s),
                metrics.mean("perf/weight_sync_write_s", timings.write_s),
            )
            if timings.sent_bytes:
                self._observe(metrics.mean("perf/weight_sync_sent_bytes", timings.sent_bytes))
            if timings.unchanged_frac is not None:
                frac = timings.unchanged_frac
                self._observe(metrics.mean("perf/weight_sync_unchanged_frac", frac))
