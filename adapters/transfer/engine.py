"""Weight sync through a vLLM weight-transfer engine: one of
:data:`~asyncgrpo.core.weights.sync.ENGINES`, ``nccl`` (vLLM's, GPU servers) or
``asyncgrpo_gloo`` (:mod:`asyncgrpo.adapters.transfer.gloo`, CPU servers).

The server must have been started with ``--weight-transfer-config '{"backend": ...}'``. Once per
run the trainer joins a group with the server's workers (``/init_weight_transfer_engine``); each
sync then pauses the server, streams every tensor of the policy to it (``/start_weight_update``,
``/update_weights`` alongside the broadcasts, ``/finish_weight_update``), drops the KV computed
by the old weights and resumes. Nothing touches the disk, and the server may be on another
machine that can reach the trainer's address.

A trainer interrupted between ``/start_weight_update`` and ``/finish_weight_update`` (Ctrl-C, a
kill, a crash) leaves the server's update session open, and vLLM then refuses every later
``/start_weight_update`` (HTTP 500, "already active"). :class:`ResumingWeightSyncClient`
closes such a session before it starts its own: the full round that follows overwrites every
weight the half-done one touched.
"""

from __future__ import annotations

import importlib
import ipaddress
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any, cast
from urllib.parse import urlsplit

import anyio
import torch
from anyio.from_thread import start_blocking_portal
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerWeightTransferEngine,
    WeightSource,
)
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from asyncgrpo.adapters.transfer.background import Background
from asyncgrpo.adapters.transfer.delta import Patch
from asyncgrpo.adapters.transfer.files import SyncTimings
from asyncgrpo.adapters.transfer.plugin import register
from asyncgrpo.adapters.transfer.streams import record_ready, stream_ordered
from asyncgrpo.adapters.vllm.auth import bearer
from asyncgrpo.adapters.vllm.client import VLLMClient
from asyncgrpo.adapters.vllm.server import free_port
from asyncgrpo.core.names import spoken_list
from asyncgrpo.core.weights.sync import ENGINES, engine_named


def address_towards(url: str) -> str:
    """This machine's address on the route to the server at ``url`` (where the server's
    workers reach the trainer); loopback for a server on this machine.

    Example:
        >>> address_towards("http://127.0.0.1:8000")
        '127.0.0.1'
    """
    host = urlsplit(url).hostname or "127.0.0.1"
    resolved = socket.gethostbyname(host)
    if ipaddress.ip_address(resolved).is_loopback:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((resolved, 9))  # UDP: picks the route, sends nothing
        return probe.getsockname()[0]


class WeightStream(WeightSource):
    """A :class:`WeightSource` over two callables: ``metadata`` lists ``(name, dtype, shape)``
    without gathering; ``weights`` yields ``(name, tensor)`` in the same order, and is a
    collective every trainer rank runs (see ``Learner.iter_weights``).

    Each iteration is one round of that collective. The stream keeps the round it handed out,
    so a sender that fails half way can still run the gathers the other ranks are in
    (:meth:`finish_round`). Every tensor it hands out is stream-ordered after the weights were
    last written (:func:`~asyncgrpo.adapters.transfer.streams.stream_ordered`): the sender may
    pack on a CUDA stream of its own.
    """

    def __init__(
        self,
        metadata: Callable[[], list[tuple[str, torch.dtype, tuple[int, ...]]]],
        weights: Callable[[], Iterator[tuple[str, torch.Tensor]]],
    ) -> None:
        self._metadata = metadata
        self._weights = weights
        self._round: Iterator[tuple[str, torch.Tensor]] | None = None
        self._begun: Iterator[tuple[str, torch.Tensor]] | None = None  # not yet iterated
        self._replay: list[tuple[str, torch.Tensor]] | None = None
        self._ready: torch.cuda.Event | None = None

    def metadata(self) -> list[ParamMeta]:
        if self._replay is not None:  # from the snapshot itself: the model is not touched
            return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self._replay]
        return [ParamMeta(name, dtype, tuple(shape)) for name, dtype, shape in self._metadata()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._replay is not None:
            replay, self._replay = self._replay, None
            return stream_ordered(replay, self._ready)
        if self._begun is not None:  # the round new_round began
            self._round, self._begun = self._begun, None
        else:
            self._round = stream_ordered(self._weights(), self._ready)
        return self._round

    def replay(
        self, weights: list[tuple[str, torch.Tensor]], ready: torch.cuda.Event | None = None
    ) -> None:
        """The next round yields ``weights`` (a snapshot taken earlier) instead of gathering,
        and the metadata comes from them: only the sender iterates it, no other rank takes
        part, and the model is not read (the trainer may be training it meanwhile). ``ready``
        completes when the snapshot's copies have (:func:`record_ready`)."""
        self._replay, self._ready = weights, ready

    def new_round(self, ready: torch.cuda.Event | None = None) -> None:
        """Forget the last round and begin the next: ``weights`` is called here, before the
        send starts, so whatever it decides when called (a PEFT merge refused for the
        server's dtype) raises before anything reaches the server; the next iteration (or
        :meth:`finish_round`) runs that round. ``ready`` completes once the last write to the
        weights (the optimizer step) has run."""
        self._round, self._begun, self._ready = None, None, ready
        self._begun = stream_ordered(self._weights(), ready)

    def finish_round(self) -> None:
        """Run to its end the round this push began (a whole round if it began none), so that
        this rank takes part in every collective gather of it, as the other ranks do."""
        if self._round is None:
            self._round, self._begun = self._begun or iter(self._weights()), None
        for _ in self._round:
            pass


# seconds a leaving trainer waits for the server to close its side of the group, and a failed
# send for the server's resume (a healthy server answers in well under a second)
LEAVE_TIMEOUT_S = 5.0
# seconds a send that outlived its watchdog gets, once its group is aborted, to give up
# (NCCL's abort ends the kernels it waits in; gloo's shutdown fails its pending broadcast)
ABORT_GRACE_S = 10.0
# seconds the engine's HTTP calls (``/start_weight_update``, ``/update_weights``...) wait past
# ``weight_sync_timeout``: a server (or a link) that answers nothing is named by the send's
# watchdog (WeightSendTimeout), never by a bare ``requests`` read timeout that races it, and
# the call then gives up within ABORT_GRACE_S
WIRE_LEAD_S = 2.0
# seconds a handshake (joining a server's transfer group) may take, at most (less when
# weight_sync_timeout is less): a server whose workers are stuck would otherwise hold each
# try of the handshake for the whole send timeout (and the group's store wait) before the
# push may try again; a healthy server's workers join in seconds
HANDSHAKE_TIMEOUT_S = 120.0


class WeightSendTimeout(TimeoutError):
    """A weight send to a server did not finish within ``weight_sync_timeout``; its transfer
    group was aborted. The push takes it as that server's outage (retried after the server
    answers, the group opened anew)."""


class WeightHandshakeTimeout(TimeoutError):
    """Joining a server's transfer group did not finish within its bound
    (:data:`HANDSHAKE_TIMEOUT_S`, or ``weight_sync_timeout`` when less); taken as that
    server's outage, as a send that timed out is."""


def handshake_within(join: Callable[[], Any], timeout_s: float, server: str) -> Any:
    """``join()`` (the handshake that makes a transfer group with a server's workers) on a
    daemon thread, waited for at most ``timeout_s`` seconds: its engine, or its error.

    Raises:
        WeightHandshakeTimeout: the handshake took longer (the thread is left to its own
            timeouts; it never keeps the process alive).

    Example:
        >>> handshake_within(lambda: "engine", 1.0, server="http://127.0.0.1:8000")
        'engine'
    """
    joining = Background(join, name="asyncgrpo-weight-handshake")
    if not joining.wait(timeout_s):
        raise WeightHandshakeTimeout(
            f"joining the weight-transfer group of the vLLM server at {server} did not finish "
            f"within {timeout_s:g} s (the handshake's bound: at most {HANDSHAKE_TIMEOUT_S:g} s, "
            "or weight_sync_timeout when less); the push tries again once the server answers. "
            "Its log says whether its workers are still busy with an earlier transfer"
        )
    return joining.result(0.0)


def send_within(
    send: Callable[[], None], timeout_s: float, abort: Callable[[], None], server: str
) -> None:
    """Run ``send`` on a thread of its own and wait at most ``timeout_s`` seconds for it.

    vLLM's NCCL engine blocks in a CUDA stream ``synchronize()`` with no timeout: a server
    that dies mid-send would hold the trainer forever. On expiry ``abort()`` tears the
    transfer group down (which ends the blocked NCCL calls), the thread gets
    :data:`ABORT_GRACE_S` to give up, and :class:`WeightSendTimeout` is raised naming the
    server and the setting. A send that fails in time raises its own error here.

    The thread takes the caller's CUDA device (a per-thread setting) so that the send
    allocates, gathers and packs where the caller would have. It is a daemon thread: one that
    even the abort cannot free stays blocked, but never keeps the process alive.

    Example:
        >>> send_within(lambda: None, 1.0, abort=lambda: None, server="http://127.0.0.1:8000")
    """
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def on_device() -> None:
        if device is not None:
            torch.cuda.set_device(device)
        send()

    sending = Background(on_device, name="asyncgrpo-weight-send")
    if not sending.wait(timeout_s):
        abort()
        freed = sending.wait(ABORT_GRACE_S)
        timeout = WeightSendTimeout(
            f"the weight send to the vLLM server at {server} did not finish within "
            f"weight_sync_timeout={timeout_s:g} s; its transfer group was aborted and is opened "
            "anew when the server answers. If the server is healthy but the send is slow "
            "(a large model, a slow link), raise weight_sync_timeout (and ddp_timeout with it "
            "when several trainer processes run)"
        )
        if not freed:
            timeout.add_note(f"the send was still blocked {ABORT_GRACE_S:g} s after the abort")
        raise timeout
    sending.raise_if_failed()


class ResumingWeightSyncClient(HTTPVLLMWeightSyncClient):
    """vLLM's HTTP weight-sync client, able to start after a trainer that left a session open,
    sending the server's API key when given one (:mod:`asyncgrpo.adapters.vllm.auth`)."""

    def __init__(self, base_url: str, timeout: float = 300, api_key: str | None = None) -> None:
        super().__init__(base_url, timeout=timeout)
        self._headers = bearer(api_key)

    def _post(self, path: str, json: dict[str, Any] | None = None) -> None:
        import requests

        response = requests.post(
            f"{self.base_url}/{path}", json=json, timeout=self.timeout, headers=self._headers
        )
        response.raise_for_status()

    def start_weight_update(self) -> None:
        import requests

        try:
            super().start_weight_update()
        except requests.HTTPError as refused:  # a timeout or a lost link is no open session
            try:  # an open session of an interrupted trainer: close it, then start ours
                self.finish_weight_update()
            except Exception:
                raise refused from None  # no session was open: the refusal has another cause
            super().start_weight_update()


class EngineSync:
    """Weight sync through the server's weight-transfer engine (every trainer rank holds one).

    Args:
        base_url: the server's URL.
        client: makes a :class:`VLLMClient` for it (rank 0 pauses and resumes the server).
        engine: the trainer's side of the engine, joined with the server's workers
            (:meth:`join`); its ``source`` is a :class:`WeightStream`.
        timeout_s: longest wait for one send, in seconds (``weight_sync_timeout``): past it the
            group is aborted and the send raises :class:`WeightSendTimeout`.
        device: the learner's device; on CUDA every send waits for the writes queued on its
            current stream before reading the weights.
        keep_kv_cache: leave the server's KV cache as it is after a push
            (``weight_push_keeps_kv_cache``) instead of dropping it and recomputing the running
            requests' KV.
    """

    def __init__(
        self,
        base_url: str,
        client: Callable[[], VLLMClient],
        engine: TrainerWeightTransferEngine[Any],
        *,
        timeout_s: float,
        device: torch.device | None = None,
        keep_kv_cache: bool = False,
    ) -> None:
        if not isinstance(engine.source, WeightStream):
            raise TypeError("EngineSync needs an engine whose source is a WeightStream")
        self.base_url = base_url
        self.engine = engine
        self.source: WeightStream = engine.source
        self.sender = engine.is_sender
        self.timeout_s = timeout_s
        self.device = device or torch.device("cpu")
        self.keep_kv_cache = keep_kv_cache
        # Rank 0 pauses and resumes the server through one client on one event loop, kept for
        # the run; the transfer runs on a watched thread (send_within) that takes the caller's
        # device: its gathers are collectives of the trainer's process group.
        self._portal: Any = None
        if self.sender:
            self._portal_context = start_blocking_portal()
            self._portal = self._portal_context.__enter__()
            self._client = client()

    @classmethod
    def join(
        cls,
        base_url: str,
        client: Callable[[], VLLMClient],
        backend: str,
        source: WeightStream,
        *,
        workers: int,
        rank: int,
        timeout_s: float,
        api_key: str | None = None,
        device: torch.device | None = None,
        keep_kv_cache: bool = False,
    ) -> EngineSync:
        """Join a transfer group with the server's ``workers`` (``ServerTransfer.workers``)
        through ``backend`` (``"nccl"`` or ``"asyncgrpo_gloo"``, as the server was started
        with); ``rank`` is this trainer process's rank (rank 0 sends, the others only gather);
        ``timeout_s`` bounds each send, and the handshake too where it is under
        :data:`HANDSHAKE_TIMEOUT_S`; ``keep_kv_cache`` leaves the server's KV cache as it is
        after a push (``weight_push_keeps_kv_cache``) instead of dropping it.

        Raises:
            WeightHandshakeTimeout: the handshake outlived its bound."""
        info = _init_info(backend, address_towards(base_url), workers + 1, rank, timeout_s)
        wire = ResumingWeightSyncClient(base_url, timeout=timeout_s + WIRE_LEAD_S, api_key=api_key)
        engine = handshake_within(
            lambda: WeightTransferTrainerFactory.trainer_init(info, client=wire, source=source),
            min(timeout_s, HANDSHAKE_TIMEOUT_S),
            base_url,
        )
        return cls(
            base_url,
            client,
            engine,
            timeout_s=timeout_s,
            device=device,
            keep_kv_cache=keep_kv_cache,
        )

    def sync(self, barrier_s: float = 0.0) -> SyncTimings | None:
        """Push the source's current weights (collective; rank 0 gets the timings).

        When rank 0's side fails (the server died: the pause, the stream or the resume fails,
        or the send outlives its watchdog), rank 0 first runs the gathers of the round the
        other ranks are still in, then raises: every rank leaves the push after the same
        collectives."""
        ready = record_ready(self.device)  # after the optimizer step queued on this stream
        if not self.sender:
            self.source.new_round(ready)
            self.engine.send_weights()
            return None
        self.source.new_round(ready)
        try:
            return self._send(barrier_s)
        except Exception:
            self.source.finish_round()
            raise

    def send_snapshot(
        self, weights: list[tuple[str, torch.Tensor]], ready: torch.cuda.Event | None = None
    ) -> SyncTimings:
        """Rank 0: push a snapshot of the weights taken earlier (the other ranks took part in
        its gathers then); may run on another thread than the trainer's. ``ready`` completes
        when the snapshot's copies have (:func:`record_ready` after them)."""
        if not self.sender:
            raise RuntimeError("EngineSync.send_snapshot runs on the sending rank (rank 0)")
        self.source.replay(weights, ready)
        return self._send(0.0)

    def send_patches(self, patches: list[Patch]) -> SyncTimings:
        """Rank 0: push a delta (:mod:`asyncgrpo.adapters.transfer.delta`) to a server that
        holds the previous push; may run on another thread than the trainer's.

        Raises:
            TypeError: the engine sends no patches (only ``asyncgrpo_gloo`` does).
        """
        if not self.sender:
            raise RuntimeError("EngineSync.send_patches runs on the sending rank (rank 0)")
        send = getattr(self.engine, "send_patches", None)
        if send is None:
            raise TypeError(f"{type(self.engine).__name__} sends no delta patches")
        return self._send(0.0, lambda: send(patches))

    def keep_baseline(self) -> None:
        """Make every full push ask the server to keep the policy it receives, which later
        :meth:`send_patches` rounds patch.

        Raises:
            TypeError: the engine sends no patches (only ``asyncgrpo_gloo`` does).
        """
        if not hasattr(self.engine, "send_patches"):
            raise TypeError(f"{type(self.engine).__name__} sends no delta patches")
        setattr(self.engine, "keep_baseline", True)  # noqa: B010 (the gloo engine's setting)

    def _send(self, barrier_s: float, send: Callable[[], None] | None = None) -> SyncTimings:
        start = time.monotonic()
        self._portal.call(self._client.admin.pause, self.keep_kv_cache)
        paused = time.monotonic()
        try:
            send_within(
                send or self.engine.send_weights,
                self.timeout_s,
                self.engine.shutdown,
                self.base_url,
            )
            if not self.keep_kv_cache:
                self._portal.call(self._client.admin.reset_prefix_cache)
        except BaseException as failed:  # resume the server all the same, keep this cause
            try:
                self._portal.call(self._resume_within, LEAVE_TIMEOUT_S)
            except TimeoutError:
                failed.add_note(
                    f"resuming the server got no answer within {LEAVE_TIMEOUT_S:g} s either"
                )
            except Exception as also:
                failed.add_note(f"resuming the server failed too: {type(also).__name__}: {also}")
            raise
        self._portal.call(self._client.admin.resume)
        done = time.monotonic()
        return SyncTimings(pause_s=paused - start, barrier_s=barrier_s, transfer_s=done - paused)

    async def _resume_within(self, timeout_s: float) -> None:
        """Resume the server after a failed send: a courtesy bounded by ``timeout_s``, not by
        ``weight_sync_timeout`` again (the send has waited that long already; a server that
        stays paused is pushed to again, which resumes it, once it answers)."""
        with anyio.fail_after(timeout_s):
            await self._client.admin.resume()

    def close(self) -> None:
        """Leave the group; the server keeps serving and accepts a new trainer.

        Telling the server is a courtesy bounded by ``LEAVE_TIMEOUT_S``, not the run's
        ``weight_sync_timeout``: a run that ends because its server went silent does not wait
        that long again, and a server never told replaces the group at the next trainer's
        handshake."""
        self.engine.shutdown()
        if self.sender:
            # join() gave the engine this HTTP client; vLLM types it as the bare protocol
            wire = cast(HTTPVLLMWeightSyncClient, self.engine.client)
            wire.timeout = min(wire.timeout, LEAVE_TIMEOUT_S)
            try:
                wire.shutdown_weight_transfer_engine()
            finally:
                self._portal.call(self._client.aclose)
                self._portal_context.__exit__(None, None, None)


def _init_info(backend: str, address: str, world_size: int, rank: int, timeout_s: float) -> Any:
    engine = engine_named(backend)
    if engine is None:
        known = spoken_list(e.backend for e in ENGINES)
        raise ValueError(f"no trainer-side weight transfer for backend {backend!r}; use {known}")
    if engine.vllm_classes is not None:
        register()  # an engine vLLM does not ship: into this process's trainer factory
    module = importlib.import_module(engine.module)
    return module.trainer_init_info(address, free_port(address), world_size, rank, timeout_s)
