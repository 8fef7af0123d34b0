"""How the trainer's weights reach the vLLM servers: one :class:`WeightSync` object per run.

Three implementations share the protocol (``start``, ``sync(version)``, ``reconnect``,
``close`` and what they report). Each push names the servers it goes to and returns each
one's outcome (:data:`Landing`); with several servers the weights are gathered once (the disk
path writes one file that every server reloads, the engines have one transfer group per
server, an adapter is written once and loaded on each) and reach the servers in parallel,
except through vLLM's NCCL engine, whose sends go one after another
(:attr:`~asyncgrpo.core.weights.sync.Engine.parallel_sends`); each engine send is bounded by
``weight_sync_timeout``, so a hung server costs the others at most that:

- :class:`DiskWeights`: the full policy as safetensors, reloaded by the server
  (:class:`~asyncgrpo.adapters.transfer.files.DiskReload`);
- :class:`EngineWeights`: streamed through the server's weight-transfer engine, ``nccl`` or
  ``asyncgrpo_gloo`` (:class:`~asyncgrpo.adapters.transfer.engine.EngineSync`); through
  ``asyncgrpo_gloo`` with ``weight_sync_delta``, only what changed since the last push
  (:mod:`asyncgrpo.core.weights.delta`);
- :class:`~asyncgrpo.shell.weights.lora_path.AdapterWeights`: a PEFT model's LoRA adapter
  (:mod:`.lora_path`).

:func:`~asyncgrpo.shell.weights.choice.open_weight_sync` chooses and builds the run's path
(:mod:`.choice`). Every method is a collective over the trainer's processes; rank 0 talks to
the server and gets the timings.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import structlog
from torch import Tensor

from asyncgrpo.adapters.process_group import HOST_MEMORY
from asyncgrpo.adapters.transfer.delta import DeltaEncoder, Patch
from asyncgrpo.adapters.transfer.files import (
    DiskReload,
    SyncTimings,
    slowest,
    write_safetensors,
)
from asyncgrpo.adapters.transfer.streams import record_ready
from asyncgrpo.adapters.vllm.client import VLLMClient
from asyncgrpo.adapters.vllm.replies import VLLMError
from asyncgrpo.core.weights import delta as weight_delta
from asyncgrpo.core.weights import sync as weight_sync
from asyncgrpo.shell.servers import each_server_async

if TYPE_CHECKING:
    from asyncgrpo.adapters.transfer.engine import EngineSync
    from asyncgrpo.shell.learner import Learner

log = structlog.get_logger("asyncgrpo.weight_sync")

Landing = dict[int, SyncTimings | Exception]
"""A push's outcome on each server it was sent to (rank 0): its timings, or why it failed."""
Client = Callable[[int], VLLMClient]
"""Makes a new client of server ``i``."""


def landed_timings(landing: Landing) -> SyncTimings | None:
    """The timings of the servers a push landed on (each phase's longest), or None."""
    timings = [t for t in landing.values() if isinstance(t, SyncTimings)]
    return slowest(timings) if timings else None


def each_server(
    servers: Sequence[int], call: Callable[[int], SyncTimings], parallel: bool = True
) -> Landing:
    """``call(i)`` for every server ``i``, in parallel threads when there are several and
    ``parallel`` (else one after another, on this thread); each outcome or its exception. A
    failed call does not keep the others from theirs."""
    results: Landing = {}

    def one(index: int) -> None:
        try:
            results[index] = call(index)
        except Exception as error:  # that server's outcome; the others go on
            results[index] = error

    if len(servers) == 1 or not parallel:
        for index in servers:
            one(index)
        return results
    threads = [
        threading.Thread(target=one, args=(i,), name=f"asyncgrpo-push-{i}", daemon=True)
        for i in servers
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {i: results[i] for i in servers}


class WeightSync(Protocol):
    """The trainer's side of one weight-sync path.

    Attributes:
        backend: what the run reports: ``"disk"``, ``"nccl"``, ``"asyncgrpo_gloo"`` or
            ``"adapter"`` (known after the first sync for a PEFT model).
        lora_name: the adapter prefix rollouts must name in their requests, else ``None``.
    """

    @property
    def backend(self) -> str: ...

    @property
    def lora_name(self) -> str | None: ...

    def start(self) -> None:
        """Open what the path needs for the run (collective)."""

    def sync(
        self, version: int, barrier_s: float = 0.0, servers: Sequence[int] = (0,)
    ) -> Landing | None:
        """Push the current policy as ``version`` to ``servers`` (collective); rank 0 returns
        each server's outcome, ``barrier_s`` being the time already spent waiting for the other
        processes. A failure outside the servers (a write, a gather) raises."""

    def snapshot(self, version: int) -> Snapshot | None:
        """Copy what a push of ``version`` sends, so that training may go on while it is sent
        (collective; rank 0 gets the copy, the others ``None``). Only after a first
        :meth:`sync`."""

    def send(self, snapshot: Snapshot, servers: Sequence[int] = (0,)) -> Landing:
        """Push a snapshot to ``servers`` (rank 0 only, from any thread)."""

    def snapshot_size(self) -> tuple[int, str]:
        """The bytes a snapshot takes, and where it lives (for the overlap decision)."""

    def reconnect(self, servers: Sequence[int] = (0,)) -> None:
        """After ``servers`` went away and came back: open the path to them again
        (collective)."""

    def close(self) -> None:
        """Release what :meth:`start` opened; the server keeps serving."""


@attrs.frozen(eq=False)
class Snapshot:
    """What one push sends, copied out of the learner: ``weights`` (name to tensor, in send
    order) for merged weights, ``None`` for an adapter already written to disk; on CUDA,
    ``ready`` completes when the copies have (a sender on another stream waits for it:
    :mod:`asyncgrpo.adapters.transfer.streams`)."""

    version: int
    weights: dict[str, Tensor] | None
    ready: Any = None


def _copied(weights: Iterable[tuple[str, Tensor]]) -> dict[str, Tensor]:
    """Own copies: an exported tensor may share storage with a parameter (one process, the
    export dtype), which the next optimizer step changes."""
    return {name: tensor.detach().clone() for name, tensor in weights}


def _sent(timings: SyncTimings | None) -> SyncTimings:
    assert timings is not None, "the sending rank gets timings"
    return timings


def _synced_bytes(learner: Learner) -> int:
    return sum(
        dtype.itemsize * math.prod(shape) for _, dtype, shape in learner.export.weight_metadata()
    )


class DiskWeights:
    """Merged weights through safetensors in ``directory`` (written once) and each server's
    reload; with ``keep_kv_cache`` (``weight_push_keeps_kv_cache``) the servers keep their KV
    cache across it."""

    backend = weight_sync.DISK
    lora_name = None

    def __init__(
        self, learner: Learner, client: Client, directory: Path, keep_kv_cache: bool = False
    ):
        self.learner = learner
        self.client = client
        self.directory = directory
        self.keep_kv_cache = keep_kv_cache

    def start(self) -> None:
        pass

    def sync(
        self, version: int, barrier_s: float = 0.0, servers: Sequence[int] = (0,)
    ) -> Landing | None:
        state = self.learner.export.synced_state_dict()  # a collective on every rank
        if self.learner.rank != 0:
            return None
        return self._push(state, barrier_s, servers)

    def snapshot(self, version: int) -> Snapshot | None:
        state = self.learner.export.synced_state_dict()  # a collective on every rank
        return Snapshot(version, _copied(state.items())) if self.learner.rank == 0 else None

    def send(self, snapshot: Snapshot, servers: Sequence[int] = (0,)) -> Landing:
        assert snapshot.weights is not None
        return self._push(snapshot.weights, 0.0, servers)

    def snapshot_size(self) -> tuple[int, str]:
        return _synced_bytes(self.learner), HOST_MEMORY

    def _push(self, state: dict[str, Tensor], barrier_s: float, servers: Sequence[int]) -> Landing:
        """One write, then every server reloads it in parallel (a failed write raises)."""
        written = time.monotonic()
        write_safetensors(state, self.directory)
        write_s = time.monotonic() - written

        async def reload(index: int) -> SyncTimings:
            async with self.client(index) as client:
                disk = DiskReload(client, self.directory, self.keep_kv_cache)
                return await disk.reload(barrier_s, write_s)

        return each_server_async(servers, reload)

    def reconnect(self, servers: Sequence[int] = (0,)) -> None:
        pass

    def close(self) -> None:
        pass


class EngineWeights:
    """Merged weights streamed through each server's weight-transfer engine (one transfer
    group per server). With one server the weights stream straight from the gathers; with
    several they are gathered once into a snapshot and sent to every server in parallel.

    With ``weight_sync_delta`` rank 0 keeps the last push (:class:`DeltaEncoder`) and sends
    each server that holds it only the patches to the new one; a server that does not (the
    run's first push, one reconnected, one a push failed on or that a push went without) gets
    the full policy."""

    lora_name = None

    def __init__(
        self, learner: Learner, args: Any, client: Client, backend: str, server_workers: int
    ) -> None:
        self.learner = learner
        self.args = args
        self.client = client
        self.backend = backend
        self.server_workers = server_workers
        self.urls: tuple[str, ...] = tuple(args.server_urls)
        self.engines: dict[int, EngineSync] = {}
        self.delta = DeltaEncoder() if args.weight_sync_delta else None
        self.in_sync: set[int] = set()  # servers holding the last push exactly (delta only)

    @property
    def engine(self) -> EngineSync | None:
        """The first server's engine (the only one of a run with one server)."""
        return self.engines.get(0)

    def start(self) -> None:
        """Open a transfer group with each server.

        Raises:
            VLLMError: a server that does not open its group (gone since the run checked it,
                or started without the engine), naming it, the cause and the fix.
        """
        for index in range(len(self.urls)):
            try:
                self._start(index)
            except Exception as error:
                raise VLLMError(
                    f"the vLLM server at {self.urls[index]} did not open its weight-transfer "
                    f"group at the start of the run ({type(error).__name__}: {error}). Check "
                    'that it runs, with --weight-transfer-config \'{"backend": '
                    f'"{self.backend}"}}\', and start the run again (asyncgrpo train --resume '
                    "continues from the last checkpoint)"
                ) from error

    def _start(self, index: int) -> None:
        from asyncgrpo.adapters.transfer.engine import EngineSync, WeightStream

        source = WeightStream(self.learner.export.weight_metadata, self.learner.export.iter_weights)
        self.engines[index] = EngineSync.join(
            self.urls[index],
            functools.partial(self.client, index),
            self.backend,
            source,
            workers=self.server_workers,
            rank=self.learner.rank,
            timeout_s=self.args.weight_sync_timeout,
            api_key=self.args.server_api_key,
            device=self.learner.device,
            keep_kv_cache=self.args.weight_push_keeps_kv_cache,
        )
        if self.delta is not None:
            self.engines[index].keep_baseline()

    def sync(
        self, version: int, barrier_s: float = 0.0, servers: Sequence[int] = (0,)
    ) -> Landing | None:
        if not self.engines:
            raise RuntimeError("EngineWeights.sync called before start()")
        if self.delta is not None:
            weights = self.learner.export.iter_weights()  # a collective on every rank
            if self.learner.rank != 0:
                for _ in weights:
                    pass
                return None
            return self._push_delta(weights, servers, self.delta, barrier_s)
        if len(self.urls) > 1:  # gathered once, sent to each
            snapshot = self.snapshot(version)
            return self.send(snapshot, servers) if snapshot is not None else None
        engine = self.engines[0]
        if self.learner.rank != 0:
            engine.sync(barrier_s)
            return None
        full_bytes = _synced_bytes(self.learner)
        return each_server(
            servers,
            lambda index: attrs.evolve(_sent(engine.sync(barrier_s)), sent_bytes=full_bytes),
        )

    def snapshot(self, version: int) -> Snapshot | None:
        weights = self.learner.export.iter_weights()  # a collective on every rank
        if self.learner.rank != 0:
            for _ in weights:
                pass
            return None
        copies = _copied(weights)
        return Snapshot(version, copies, ready=record_ready(self.learner.device))

    def send(self, snapshot: Snapshot, servers: Sequence[int] = (0,)) -> Landing:
        if not self.engines:
            raise RuntimeError("EngineWeights.send called before start()")
        assert snapshot.weights is not None
        if self.delta is not None:
            if snapshot.ready is not None:  # the copies must be done before they are compared
                snapshot.ready.synchronize()
            return self._push_delta(snapshot.weights.items(), servers, self.delta)
        weights = list(snapshot.weights.items())
        full_bytes = sum(tensor.nbytes for _, tensor in weights)
        return each_server(
            servers,
            lambda index: attrs.evolve(
                self.engines[index].send_snapshot(weights, snapshot.ready), sent_bytes=full_bytes
            ),
            parallel=self._parallel_sends,
        )

    def _push_delta(
        self,
        weights: Iterable[tuple[str, Tensor]],
        servers: Sequence[int],
        encoder: DeltaEncoder,
        barrier_s: float = 0.0,
    ) -> Landing:
        """Rank 0: the patches from the last push to ``weights`` for each server that holds
        the last push, the full policy for any other; afterwards only the servers it landed
        on hold it. ``barrier_s``: the time already spent waiting for the other processes."""
        stats: weight_delta.DeltaStats | None = None
        patches: list[Patch] = []
        if encoder.has_baseline:
            patches, stats = encoder.encode(weights)
        else:
            encoder.remember(weights)
        full = list(encoder.previous.items())
        full_bytes = sum(tensor.nbytes for _, tensor in full)

        def push(index: int) -> SyncTimings:
            engine = self.engines[index]
            if stats is not None and weight_delta.gets_delta(index, self.in_sync):
                return attrs.evolve(
                    engine.send_patches(patches),
                    barrier_s=barrier_s,
                    sent_bytes=stats.sent_bytes,
                    unchanged_frac=stats.unchanged_frac,
                )
            sent = engine.send_snapshot(full)
            return attrs.evolve(sent, barrier_s=barrier_s, sent_bytes=full_bytes)

        landing = each_server(servers, push, parallel=self._parallel_sends)
        self.in_sync = {i for i in servers if isinstance(landing[i], SyncTimings)}
        return landing

    @property
    def _parallel_sends(self) -> bool:
        engine = weight_sync.engine_named(self.backend)
        return engine is None or engine.parallel_sends

    def snapshot_size(self) -> tuple[int, str]:
        engine = weight_sync.engine_named(self.backend)  # None for a path without an engine
        on_device = engine is not None and engine.needs_cuda
        where = str(self.learner.device) if on_device else HOST_MEMORY
        return _synced_bytes(self.learner), where

    def reconnect(self, servers: Sequence[int] = (0,)) -> None:
        """A restarted server has no group with the trainer: leave the old one, join anew (its
        next push is full)."""
        for index in servers:
            self.in_sync.discard(index)
            self._close(index)
            self._start(index)

    def close(self) -> None:
        for index in list(self.engines):
            self._close(index)

    def _close(self, index: int) -> None:
        engine = self.engines.pop(index, None)
        if engine is None:
            return
        try:
            engine.close()
        except Exception as error:  # the run's outcome stands; the server keeps serving
            log.warning(
                "could not leave the weight-transfer group",
                server=self.urls[index],
                error=str(error)[:300],
            )
