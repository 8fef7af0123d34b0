"""The run's weight pushes as the step loop sees them: the push at start, the push after a
step (beside the next step when the plan allows, else waited for), a resync when servers need
the weights again, and the wait for every push at the end.

:class:`~asyncgrpo.shell.weights.WeightPusher` makes each push (collective over the trainer's
processes); the :class:`~asyncgrpo.shell.run.push_ledger.PushLedger` records what landed and
tells the rollout process. When the servers need the weights again is rank 0's to see
(:meth:`RunPushes.resync_due`): with one server, when its weights are unknown (it went away);
with several, when none is in routing or some out of routing answer again (the
:class:`~asyncgrpo.shell.servers.ServerWatch`).
"""

from __future__ import annotations

from collections.abc import Callable

import structlog

from asyncgrpo.adapters.process_group import decided_on_rank0, free_bytes
from asyncgrpo.core import metrics
from asyncgrpo.core.servers import outage as server_outage
from asyncgrpo.core.weights import sync as weight_sync
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.rollout import RolloutProcess
from asyncgrpo.shell.run.push_ledger import PushLedger
from asyncgrpo.shell.servers import ServerSettings, ServerWatch, SharedServers
from asyncgrpo.shell.weights import WeightPusher, WeightSync

log = structlog.get_logger("asyncgrpo.trainer")


class RunPushes:
    """The pushes of one run (every method collective unless it says rank 0).

    Args:
        pusher: makes each push.
        weights: the run's sync path (its snapshot size, for the plan).
        ledger: records what landed (rank 0).
        args: reads ``weight_push_overlap``.
        rank0: whether this is rank 0 (it records what landed and watches the servers).
        servers: the run's servers (rank 0; None elsewhere).
        observe: records metrics in the run's window.

    Attributes:
        plan: whether pushes after steps run beside training (set by :meth:`start`).
        resync_servers: the servers the next resync goes to (None: wait for any; rank 0).
    """

    def __init__(
        self,
        pusher: WeightPusher,
        weights: WeightSync,
        ledger: PushLedger,
        args: AsyncGRPOConfig,
        rank0: bool,
        servers: SharedServers | None,
        observe: Callable[..., None],
    ) -> None:
        self.pusher = pusher
        self.weights = weights
        self.ledger = ledger
        self.args = args
        self.rank0 = rank0
        self.servers = servers
        self.observe = observe
        self.plan: weight_sync.PushPlan | None = None
        self.resync_servers: tuple[int, ...] | None = None
        self._watch: ServerWatch | None = None  # rank 0, several servers: those out of routing

    def start(self, model_name: str) -> None:
        """Push the trainer's weights (the server may hold others: a resumed run, a server
        left over from an earlier run) so that staleness 0 means equal policies; plan the
        pushes after steps; with several servers, rank 0 starts watching those out of
        routing."""
        self.push(at_start=True)
        self.plan = self._plan()
        if self.rank0 and self.servers is not None and len(self.servers) > 1:
            self._watch = ServerWatch(
                ServerSettings.of(self.args), model_name, self.servers
            ).start()

    def _plan(self) -> weight_sync.PushPlan:
        """Whether the pushes after steps run beside training (rank 0 measures the memory a
        snapshot needs and has free; every process follows its choice)."""
        if not self.args.weight_push_overlap:
            return weight_sync.PushPlan(
                False, 0, "weight_push_overlap=False: the step waits for the push"
            )

        def plan() -> weight_sync.PushPlan:
            size, where = self.weights.snapshot_size()
            choice = weight_sync.plan_push(size, free_bytes(where), where)
            log.info("weight push", overlapped=choice.overlapped, reason=choice.reason)
            return choice

        return decided_on_rank0(plan)

    def push(self, at_start: bool = False) -> None:
        """Push the current policy and wait for it; what landed goes to the ledger."""
        pushed = self.pusher.push(at_start=at_start)
        if pushed is not None and self.rank0:
            self.ledger.landed(pushed)

    def after_step(self) -> None:
        """The push after a step: beside the next step when the plan allows
        (:meth:`WeightPusher.push_beside`), else waited for."""
        assert self.plan is not None
        if not self.plan.overlapped:
            self.push()
            return
        if self.pusher.push_beside(self.ledger.published):
            self.observe(metrics.total("perf/weight_snapshots_replaced_count", 1))

    def resync(self, servers: tuple[int, ...] | None) -> None:
        """Push the current weights to servers back from an outage
        (:meth:`WeightPusher.resync`; ``servers`` None: wait for any)."""
        pushed = self.pusher.resync(servers)
        if pushed is not None and self.rank0:
            self.ledger.landed(pushed)

    def resync_due(self, process: RolloutProcess) -> bool:
        """Rank 0, while the step waits for samples: whether the weights must be pushed again
        first: no server holds them (:attr:`resync_servers` None: wait for one), or, with
        several, servers out of routing answer again (:meth:`servers_back`)."""
        self.resync_servers = None
        if self.servers is None or len(self.servers) == 1:
            return not server_outage.weights_known(process.trust.read())
        if not any(self.servers.routable(i) for i in range(len(self.servers))):
            return True
        return self.servers_back()

    def servers_back(self) -> bool:
        """Rank 0, several servers: whether servers out of routing answer again; the next
        resync pushes the current weights to them (:attr:`resync_servers`)."""
        back = self._watch.take_back() if self._watch is not None else ()
        self.resync_servers = back or None
        return bool(back)

    def wait_landed(self) -> None:
        """Wait until the servers hold the weights of every push made; raise if the push
        thread found a server frozen."""
        self.pusher.wait_landed()
        self.pusher.raise_if_failed()

    def close(self) -> None:
        """Stop watching the servers; a transfer the server takes part in is never cut (the
        push in flight lands first)."""
        if self._watch is not None:
            self._watch.stop()
        self.pusher.wait_landed()
