"""``asyncgrpo_gloo``: a vLLM weight-transfer engine that broadcasts weights over gloo (CPU).

vLLM's NCCL engine needs CUDA on both sides. This backend runs the same protocol
(``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``) over a torch.distributed gloo group, so a CPU server takes the
trainer's weights in memory, without a shared filesystem. The trainer is rank 0 of the group
and the server's workers follow it; each parameter is one gloo broadcast, loaded through vLLM's
layerwise reload exactly as the NCCL engine loads it.

Start the server with ``--weight-transfer-config '{"backend": "asyncgrpo_gloo"}'``; the backend
is registered in every vLLM process by asyncgrpo's ``vllm.general_plugins`` entry point
(:mod:`asyncgrpo.adapters.transfer.plugin`). This module imports vLLM and is loaded only when the
backend is used.
"""

from __future__ import annotations

import gc
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, ClassVar, Protocol, Self, runtime_checkable

import torch
from torch.distributed import PrefixStore, ProcessGroup, TCPStore
from vllm.distributed.utils import init_gloo_process_group
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from asyncgrpo.adapters.transfer.background import Background
from asyncgrpo.adapters.transfer.chunks import pack, padded_nbytes, unpack
from asyncgrpo.adapters.transfer.delta import (
    KeptPolicy,
    Patch,
    patch_metas,
    patch_sizes,
    wire_metas,
)
from asyncgrpo.core.weights.sync import GLOO, chunk_bounds

TRANSPORT = "gloo"
DEFAULT_CHUNK_BYTES = 256 * 2**20


@dataclass(kw_only=True)
class GlooWorkerInitInfo(WeightTransferInitInfo):
    """What a server worker needs to join the group (sent to ``/init_weight_transfer_engine``).

    ``transport`` is required and must be ``"gloo"``: an NCCL engine rejects this payload as an
    unknown field, and this engine rejects an NCCL payload for lacking it, so a trainer and a
    server configured for different backends fail at the handshake instead of hanging in it.
    """

    transport: str
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.transport != TRANSPORT:
            raise ValueError(f"GlooWorkerInitInfo.transport must be {TRANSPORT!r}")


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One round's parameters, in broadcast order (sent to ``/update_weights``).

    A full round sends every tensor whole and leaves ``counts`` and ``checksums`` None; with
    ``keep_baseline`` the server keeps what it received, for the deltas that follow. A delta
    round (:mod:`asyncgrpo.adapters.transfer.delta`) sends patches: ``counts`` holds each
    patch's :attr:`~asyncgrpo.adapters.transfer.delta.Patch.count` (its sparse entries, -1 for
    a dense one), ``shapes`` the full shapes, and ``checksums`` each tensor's checksum once
    patched.
    """

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    keep_baseline: bool = False
    counts: list[int] | None = None
    checksums: list[int] | None = None

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"GlooUpdateInfo: names, dtype_names and shapes differ in length "
                f"({len(self.names)}, {len(self.dtype_names)}, {len(self.shapes)})"
            )
        if (self.counts is None) != (self.checksums is None):
            raise ValueError("GlooUpdateInfo: a delta round gives both counts and checksums")
        if self.counts is not None and len(self.counts) != len(self.names):
            raise ValueError(
                f"GlooUpdateInfo: {len(self.counts)} counts for {len(self.names)} patches"
            )


class DeltaRefused(RuntimeError):
    """The server cannot take a delta round: it keeps no earlier policy, or a patched tensor's
    checksum differs from the trainer's. The push fails on that server, which then gets the
    full policy."""


def open_group(
    address: str, port: int, rank: int, world_size: int, timeout_s: float
) -> ProcessGroup:
    """Join a gloo group of ``world_size`` ranks whose rank 0 hosts the store at address:port.

    The group is private (not the default process group), so a trainer that already runs one
    (FSDP) keeps it untouched."""
    timeout = timedelta(seconds=timeout_s)
    store = TCPStore(
        address, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False
    )
    return init_gloo_process_group(
        PrefixStore("asyncgrpo-weights", store), rank, world_size, timeout
    )


@runtime_checkable
class LoadsWeights(Protocol):
    """A vLLM model, which loads ``(name, tensor)`` pairs (every vLLM model has the method)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any: ...


class GlooWeightTransferEngine(WeightTransferEngine[GlooWorkerInitInfo, GlooUpdateInfo]):
    """The server-side engine: receives each parameter by broadcast and loads it layerwise."""

    init_info_cls = GlooWorkerInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: ProcessGroup | None = None
        self.chunk_bytes = DEFAULT_CHUNK_BYTES
        self.reloading = False  # this round began vLLM's layerwise reload
        self.kept: KeptPolicy | None = None  # the last policy, kept for deltas

    def init_transfer_engine(self, init_info: GlooWorkerInitInfo) -> None:
        """Join a trainer's group, leaving the group of an earlier trainer that never said
        goodbye (killed, say) first."""
        self.shutdown()
        self.chunk_bytes = init_info.chunk_bytes
        parallel = self.parallel_config
        worker = parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.group = open_group(
            init_info.master_address,
            init_info.master_port,
            worker + init_info.rank_offset,
            init_info.world_size,
            init_info.timeout_s,
        )

    def start_weight_update(self) -> None:
        """Nothing yet: the round begins vLLM's layerwise reload once it knows what it loads
        (a delta round first checks its patches)."""
        self.reloading = False

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self.reloading:
            finalize_layerwise_reload(self.model, self.model_config)
            self.reloading = False

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receive and load one round (synchronous on CPU: no accelerator to wait for)."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        group = self.group
        if group is None:
            raise RuntimeError("asyncgrpo_gloo: update_weights before init_weight_transfer_engine")
        model = self.model
        if not isinstance(model, LoadsWeights):
            raise TypeError(
                f"asyncgrpo_gloo: the server's model ({type(model).__name__}) has no "
                "load_weights to receive the weights with"
            )
        try:
            if update_info.counts is not None:
                self._receive_patches(model, group, update_info)
            else:
                self._receive_full(model, group, update_info)
        except BaseException:
            # the trainer went away, or a receive outlived timeout_s, or a delta was refused:
            # leave its group, so the trainer's side fails too and the next trainer's
            # handshake starts afresh; the policy kept for deltas is no longer known
            self.kept = None
            self.shutdown()
            raise

    def _reload(self) -> None:
        """Begin vLLM's layerwise reload (finished by :meth:`finish_weight_update`)."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if not self.reloading:
            initialize_layerwise_reload(self.model)
            self.reloading = True

    def _receive_full(
        self, model: LoadsWeights, group: ProcessGroup, update_info: GlooUpdateInfo
    ) -> None:
        """Receive every tensor and load it layer by layer; keep the policy (host memory)
        when the trainer will send deltas."""
        self._reload()
        self.kept = None
        received: list[tuple[str, torch.Tensor]] = []
        metas = [
            (name, getattr(torch, dtype), tuple(shape))
            for name, dtype, shape in zip(
                update_info.names, update_info.dtype_names, update_info.shapes, strict=True
            )
        ]
        sizes = [padded_nbytes(dtype, shape) for _, dtype, shape in metas]
        for start, stop in chunk_bounds(sizes, self.chunk_bytes):
            buffer = torch.empty(sum(sizes[start:stop]), dtype=torch.uint8)
            group.broadcast(buffer, 0).wait()  # bounded by the group's timeout_s
            tensors = unpack(buffer, metas[start:stop])
            if update_info.keep_baseline:
                received += tensors  # views of this chunk's buffer, copied once at the end
            model.load_weights((name, tensor.to(self.device)) for name, tensor in tensors)
        if update_info.keep_baseline:
            self.kept = KeptPolicy(received)

    def _receive_patches(
        self, model: LoadsWeights, group: ProcessGroup, update_info: GlooUpdateInfo
    ) -> None:
        """Receive a delta round's patches, apply them to the policy kept from the last push,
        check each patched tensor against the trainer's checksum, and only then reload the
        model from the whole policy, as a full round does.

        Raises:
            DeltaRefused: the server holds no policy to patch (it took no full round with
                ``keep_baseline`` since it joined), or a patched tensor's checksum differs
                from the trainer's; the model still serves the previous policy.
        """
        assert update_info.counts is not None and update_info.checksums is not None
        kept = self.kept
        if kept is None:
            raise DeltaRefused(
                "asyncgrpo_gloo: a delta arrived but this server keeps no earlier policy to "
                "apply it to (it took no full push meant for deltas since it joined)"
            )
        dtypes = [getattr(torch, name) for name in update_info.dtype_names]
        metas = [
            patch_metas(name, dtype, shape, count)
            for name, dtype, shape, count in zip(
                update_info.names, dtypes, update_info.shapes, update_info.counts, strict=True
            )
        ]
        sizes = patch_sizes(metas)
        for start, stop in chunk_bounds(sizes, self.chunk_bytes):
            buffer = torch.empty(sum(sizes[start:stop]), dtype=torch.uint8)
            group.broadcast(buffer, 0).wait()  # bounded by the group's timeout_s
            tensors = iter(unpack(buffer, [m for patch in metas[start:stop] for m in patch]))
            for index in range(start, stop):
                name = update_info.names[index]
                dense = update_info.counts[index] < 0
                indices = None if dense else next(tensors)[1]
                values = next(tensors)[1]
                shape = tuple(update_info.shapes[index])
                if name not in kept.tensors:
                    raise DeltaRefused(
                        f"asyncgrpo_gloo: a delta for {name!r}, not in the policy kept"
                    )
                total = kept.apply(Patch(name, shape, values, indices))
                expected = update_info.checksums[index]
                if total != expected:
                    raise DeltaRefused(
                        f"asyncgrpo_gloo: {name!r} once patched has checksum {total}, the "
                        f"trainer's is {expected}: the server gets the full policy next"
                    )
        self._reload()
        model.load_weights((name, tensor.to(self.device)) for name, tensor in kept.tensors.items())

    def shutdown(self) -> None:
        close_group(self)


def close_group(engine: GlooWeightTransferEngine | GlooTrainerWeightTransferEngine) -> None:
    """Drop ``engine``'s group. gloo's ``shutdown()`` and ``abort()`` leave the connections
    open; they close when the group is freed, and only then does the other side's receive
    fail (``Connection closed by peer``) instead of waiting out the group's timeout."""
    group, engine.group = engine.group, None
    if group is not None:
        group.shutdown()
        del group
        gc.collect()  # a reference cycle (a kept traceback's frames) may still hold it


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """The trainer's side: where it hosts the rendezvous and how many ranks join.

    ``world_size`` is 1 (the trainer's sender) plus the server's workers
    (tensor x pipeline x data parallel)."""

    backend: ClassVar[str] = GLOO

    master_address: str
    master_port: int
    world_size: int
    timeout_s: float = 600.0
    chunk_bytes: int = DEFAULT_CHUNK_BYTES


def trainer_init_info(
    address: str, port: int, world_size: int, rank: int, timeout_s: float
) -> GlooTrainerInitInfo:
    """The trainer's handshake (:data:`asyncgrpo.core.weights.sync.ENGINES` names this module):
    it hosts the rendezvous at ``address:port`` for ``world_size`` ranks (itself and the
    server's workers) and waits ``timeout_s`` for them; ``rank`` is the trainer process's rank
    (0 sends)."""
    return GlooTrainerInitInfo(address, port, world_size, timeout_s, rank=rank)


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """The trainer-side engine: rank 0 broadcasts every parameter of its :class:`WeightSource`;
    other trainer ranks only iterate the source (the FSDP gather is a collective)."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(
        self, *, timeout_s: float = 600.0, chunk_bytes: int = DEFAULT_CHUNK_BYTES, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_bytes
        self.group: ProcessGroup | None = None
        self.keep_baseline = False  # full rounds ask the server to keep them, for deltas

    @classmethod
    def trainer_init(
        cls,
        init_info: GlooTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        if source is None:
            raise ValueError("asyncgrpo_gloo needs a WeightSource")
        engine = cls(
            client=client,
            source=source,
            is_sender=init_info.is_sender,
            timeout_s=init_info.timeout_s,
            chunk_bytes=init_info.chunk_bytes,
        )
        if not engine.is_sender:
            return engine
        worker = GlooWorkerInitInfo(
            transport=TRANSPORT,
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            rank_offset=1,
            world_size=init_info.world_size,
            chunk_bytes=init_info.chunk_bytes,
            timeout_s=init_info.timeout_s,
        )
        address, port, size = init_info.master_address, init_info.master_port, worker.world_size
        group, _ = concurrently(
            lambda: open_group(address, port, 0, size, init_info.timeout_s),
            lambda: client.init_weight_transfer_engine(asdict(worker)),
            timeout_s=init_info.timeout_s,
        )
        engine.group = group
        return engine

    def send_weights(self) -> None:
        assert self.source is not None
        meta = self.source.metadata()
        if not self.is_sender:
            for _ in self.source:
                pass
            return
        update = GlooUpdateInfo(
            names=[m.name for m in meta],
            dtype_names=[str(m.dtype).removeprefix("torch.") for m in meta],
            shapes=[list(m.shape) for m in meta],
            keep_baseline=self.keep_baseline,
        )
        self.client.start_weight_update()
        receiving = Background(lambda: self.client.update_weights(asdict(update)))
        try:
            self._broadcast(checked(self.source, meta), meta, receiving)
            receiving.result(self.timeout_s)
        except BaseException:
            # The workers wait for the rest of the round: closing the group's connections
            # fails their receive now, instead of after the group's timeout (while it lasted,
            # the next trainer's handshake would queue behind it). Join again to send again.
            self.shutdown()
            raise
        self.client.finish_weight_update()

    def send_patches(self, patches: list[Patch]) -> None:
        """Rank 0: send a delta round (:mod:`asyncgrpo.adapters.transfer.delta`), packed into
        chunks that never split a patch, with each patched tensor's checksum for the server to
        check. No other rank takes part: the patches were computed from a push rank 0 holds."""
        if not self.is_sender:
            raise RuntimeError("asyncgrpo_gloo: only the sending rank sends patches")
        metas = wire_metas(patches)
        sizes = patch_sizes(metas)
        chunks = []
        for start, stop in chunk_bounds(sizes, self.chunk_bytes):
            tensors = [t for patch in patches[start:stop] for t in patch.tensors()]
            laid = [meta for patch in metas[start:stop] for meta in patch]
            tensor_sizes = [padded_nbytes(dtype, shape) for _, dtype, shape in laid]
            chunks.append(pack(tensors, tensor_sizes).cpu())  # gloo sends from host memory
        update = GlooUpdateInfo(
            names=[patch.name for patch in patches],
            dtype_names=[str(patch.values.dtype).removeprefix("torch.") for patch in patches],
            shapes=[list(patch.shape) for patch in patches],
            counts=[patch.count for patch in patches],
            checksums=[patch.checksum for patch in patches],
        )
        if self.group is None:
            raise RuntimeError(
                "asyncgrpo_gloo: no transfer group (closed after a failed send, or never "
                "joined): join again (trainer_init) before sending"
            )
        self.client.start_weight_update()
        receiving = Background(lambda: self.client.update_weights(asdict(update)))
        try:
            for chunk in chunks:
                self._wait(self.group.broadcast(chunk, 0), receiving)
            receiving.result(self.timeout_s)
        except BaseException:
            self.shutdown()  # as a failed full round: the workers' receive fails at once
            raise
        self.client.finish_weight_update()

    def _broadcast(
        self,
        pairs: Iterator[tuple[str, torch.Tensor]],
        meta: list[ParamMeta],
        receiving: Background,
    ) -> None:
        """Broadcast the tensors packed into chunks, from this (the calling) thread, which the
        source's collective gathers need; stop at once if the server's side fails."""
        if self.group is None:
            raise RuntimeError(
                "asyncgrpo_gloo: no transfer group (closed after a failed send, or never "
                "joined): join again (trainer_init) before sending"
            )
        sizes = [padded_nbytes(m.dtype, m.shape) for m in meta]
        for start, stop in chunk_bounds(sizes, self.chunk_bytes):
            chunk = [tensor for _, tensor in itertools.islice(pairs, stop - start)]
            packed = pack(chunk, sizes[start:stop]).cpu()  # gloo sends from host memory
            self._wait(self.group.broadcast(packed, 0), receiving)
        next(pairs, None)  # runs the source's end-of-round check

    def _wait(self, work: Any, receiving: Background) -> None:
        deadline = time.monotonic() + self.timeout_s
        try:
            while not work.is_completed():
                receiving.raise_if_failed()
                if self.group is None:  # aborted by the send's watchdog (shutdown)
                    raise RuntimeError("asyncgrpo_gloo: the transfer group was closed mid-send")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"a weight broadcast took longer than {self.timeout_s} s")
                time.sleep(0.001)
            work.wait()
        except BaseException:
            del work  # it holds the group's connections open while the traceback is kept
            raise

    def shutdown(self) -> None:
        """Leave the group: its connections close (gloo closes them only when the last
        reference to the group goes), so a worker still receiving fails at once."""
        close_group(self)


def checked(source: WeightSource, meta: list[ParamMeta]) -> Iterator[tuple[str, torch.Tensor]]:
    """Iterate ``source``, raising at the first tensor that differs from what ``meta`` told the
    server to expect (the server sizes its receive buffers from ``meta``)."""
    sent = 0
    for name, tensor in source:
        expected = meta[sent] if sent < len(meta) else None
        got = (name, tensor.dtype, tuple(tensor.shape))
        if expected is None or got != (expected.name, expected.dtype, tuple(expected.shape)):
            raise ValueError(
                f"WeightSource yielded {got} at index {sent} but metadata() declared "
                f"{expected}; metadata() and iteration must list the same tensors in order"
            )
        sent += 1
        yield name, tensor
    if sent != len(meta):
        raise ValueError(f"WeightSource yielded {sent} tensors, metadata() declared {len(meta)}")


def concurrently(
    first: Callable[[], Any], second: Callable[[], Any], timeout_s: float
) -> tuple[Any, Any]:
    """Run two blocking calls that rendezvous with each other (joining a group and the RPC that
    makes the server join it); return both results, or raise the first failure at once."""
    calls = Background(first), Background(second)
    deadline = time.monotonic() + timeout_s
    while not all(call.done for call in calls):
        for call in calls:
            call.raise_if_failed()
        if time.monotonic() > deadline:
            raise TimeoutError(f"the weight-transfer handshake took over {timeout_s} s")
        time.sleep(0.01)
    return calls[0].result(0.0), calls[1].result(0.0)
