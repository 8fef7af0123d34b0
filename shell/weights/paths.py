"""How the trainer's weights reach the vLLM server: one :class:`WeightSync` object per run.

Three implementations share the protocol (``start``, ``sync(version)``, ``reconnect``,
``close`` and what they report):

- :class:`DiskWeights`: the full policy as safetensors, reloaded by the server
  (:class:`~asyncgrpo.adapters.weight_transfer.DiskReload`);
- :class:`EngineWeights`: streamed through the server's weight-transfer engine, ``nccl`` or
  ``asyncgrpo_gloo`` (:class:`~asyncgrpo.adapters.engine_transfer.EngineSync`);
- :class:`AdapterWeights`: a PEFT model's LoRA adapter, loaded by a server started with
  ``--enable-lora`` (:class:`~asyncgrpo.adapters.weight_transfer.AdapterSync`); it falls back
  to merged weights through another :class:`WeightSync` if the server refuses the first adapter.

:func:`open_weight_sync` asks the server which engine it runs (rank 0) and builds the object on
every rank; :func:`~asyncgrpo.core.weight_sync.choose_weight_transfer` makes the choice. Every
method is a collective over the trainer's processes; rank 0 talks to the server and gets the
timings.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import attrs
import psutil
import structlog
import torch
import torch.distributed as dist
from torch import Tensor

from asyncgrpo.adapters.vllm_client import VLLMClient
from asyncgrpo.adapters.vllm_replies import ServerTransfer, VLLMError
from asyncgrpo.adapters.weight_transfer import AdapterSync, DiskReload, SyncTimings
from asyncgrpo.core import weight_sync
from asyncgrpo.shell.servers import ServerSettings

if TYPE_CHECKING:
    from asyncgrpo.adapters.engine_transfer import EngineSync
    from asyncgrpo.shell.learner import Learner

log = structlog.get_logger("asyncgrpo.weight_sync")

ADAPTER_PREFIX = "asyncgrpo-policy"
ADAPTER = "adapter"
HOST_MEMORY = "host memory"


class WeightSync(Protocol):
    """The trainer's side of one weight-sync path.

    Attributes:
        backend: what the run reports: ``"disk"``, ``"nccl"``, ``"asyncgrpo_gloo"`` or
            ``"adapter"`` (known after the first sync for a PEFT model).
        lora_name: the adapter prefix rollouts must name in their requests, else ``None``.
    """

    backend: str
    lora_name: str | None

    def start(self) -> None:
        """Open what the path needs for the run (collective)."""

    def sync(self, version: int, barrier_s: float = 0.0) -> SyncTimings | None:
        """Push the current policy as ``version`` (collective); rank 0 returns the timings,
        ``barrier_s`` being the time already spent waiting for the other processes."""

    def snapshot(self, version: int) -> Snapshot | None:
        """Copy what a push of ``version`` sends, so that training may go on while it is sent
        (collective; rank 0 gets the copy, the others ``None``). Only after a first
        :meth:`sync`."""

    def send(self, snapshot: Snapshot) -> SyncTimings:
        """Push a snapshot to the server (rank 0 only, from any thread)."""

    def snapshot_size(self) -> tuple[int, str]:
        """The bytes a snapshot takes, and where it lives (for the overlap decision)."""

    def reconnect(self) -> None:
        """After the server went away and came back: open the path again (collective)."""

    def close(self) -> None:
        """Release what :meth:`start` opened; the server keeps serving."""


@attrs.frozen(eq=False)
class Snapshot:
    """What one push sends, copied out of the learner: ``weights`` (name to tensor, in send
    order) for merged weights, ``None`` for an adapter already written to disk."""

    version: int
    weights: dict[str, Tensor] | None


def _copied(weights: Iterable[tuple[str, Tensor]]) -> dict[str, Tensor]:
    """Own copies: an exported tensor may share storage with a parameter (one process, the
    export dtype), which the next optimizer step changes."""
    return {name: tensor.detach().clone() for name, tensor in weights}


def free_bytes(where: str) -> int | None:
    """Memory free now ``where`` a snapshot would live: :data:`HOST_MEMORY` (available RAM) or
    a CUDA device such as ``"cuda:0"``; ``None`` when it cannot be measured."""
    if where == HOST_MEMORY:
        return int(psutil.virtual_memory().available)
    if where.startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info(torch.device(where))[0])
    return None


def _synced_bytes(learner: Learner) -> int:
    return sum(dtype.itemsize * math.prod(shape)
               for _, dtype, shape in learner.export.weight_metadata())  # fmt: skip


class DiskWeights:
    """Merged weights through safetensors in ``directory`` and the server's reload."""

    backend = weight_sync.DISK
    lora_name = None

    def __init__(self, learner: Learner, client: Callable[[], VLLMClient], directory: Path):
        self.learner = learner
        self.client = client
        self.directory = directory

    def start(self) -> None:
        pass

    def sync(self, version: int, barrier_s: float = 0.0) -> SyncTimings | None:
        state = self.learner.export.synced_state_dict()  # a collective on every rank
        if self.learner.rank != 0:
            return None
        return self._push(state, barrier_s)

    def snapshot(self, version: int) -> Snapshot | None:
        state = self.learner.export.synced_state_dict()  # a collective on every rank
        return Snapshot(version, _copied(state.items())) if self.learner.rank == 0 else None

    def send(self, snapshot: Snapshot) -> SyncTimings:
        assert snapshot.weights is not None
        return self._push(snapshot.weights, 0.0)

    def snapshot_size(self) -> tuple[int, str]:
        return _synced_bytes(self.learner), HOST_MEMORY

    def _push(self, state: dict[str, Tensor], barrier_s: float) -> SyncTimings:
        async def push() -> SyncTimings:
            async with self.client() as client:
                return await DiskReload(client, self.directory).sync(state, barrier_s)

        return anyio.run(push)

    def reconnect(self) -> None:
        pass

    def close(self) -> None:
        pass


class EngineWeights:
    """Merged weights streamed through the server's weight-transfer engine."""

    lora_name = None

    def __init__(self, learner: Learner, args: Any, client: Callable[[], VLLMClient],
                 backend: str, server_workers: int) -> None:  # fmt: skip
        self.learner = learner
        self.args = args
        self.client = client
        self.backend = backend
        self.server_workers = server_workers
        self.engine: EngineSync | None = None

    def start(self) -> None:
        from asyncgrpo.adapters.engine_transfer import EngineSync, WeightStream

        source = WeightStream(self.learner.export.weight_metadata, self.learner.export.iter_weights)
        self.engine = EngineSync(self.args.vllm_server_base_url, self.client, self.backend,
                                 source, workers=self.server_workers, rank=self.learner.rank,
                                 timeout_s=self.args.vllm_server_timeout,
                                 api_key=self.args.server_api_key)  # fmt: skip

    def sync(self, version: int, barrier_s: float = 0.0) -> SyncTimings | None:
        if self.engine is None:
            raise RuntimeError("EngineWeights.sync called before start()")
        return self.engine.sync(barrier_s)

    def snapshot(self, version: int) -> Snapshot | None:
        weights = self.learner.export.iter_weights()  # a collective on every rank
        if self.learner.rank != 0:
            for _ in weights:
                pass
            return None
        return Snapshot(version, _copied(weights))

    def send(self, snapshot: Snapshot) -> SyncTimings:
        if self.engine is None:
            raise RuntimeError("EngineWeights.send called before start()")
        assert snapshot.weights is not None
        return self.engine.send_snapshot(list(snapshot.weights.items()))

    def snapshot_size(self) -> tuple[int, str]:
        where = str(self.learner.device) if self.backend == weight_sync.NCCL else HOST_MEMORY
        return _synced_bytes(self.learner), where

    def reconnect(self) -> None:
        """A restarted server has no group with the trainer: leave the old one, join anew."""
        self.close()
        self.engine = None
        self.start()

    def close(self) -> None:
        if self.engine is None:
            return
        try:
            self.engine.close()
        except Exception as error:  # the run's outcome stands; the server keeps serving
            log.warning("could not leave the weight-transfer group", error=str(error)[:300])


class AdapterWeights:
    """A PEFT model's LoRA adapter, one served version per sync; ``merged`` takes over if the
    server refuses the first adapter (no ``--enable-lora``)."""

    def __init__(self, learner: Learner, client: Callable[[], VLLMClient], directory: Path,
                 keep: int, merged: WeightSync) -> None:  # fmt: skip
        self.learner = learner
        self.client = client
        self.adapters = AdapterSync(directory, ADAPTER_PREFIX, keep=keep)
        self.merged = merged
        self.adapter_mode: bool | None = None  # None until the first sync decides

    @property
    def backend(self) -> str:
        return self.merged.backend if self.adapter_mode is False else ADAPTER

    @property
    def lora_name(self) -> str | None:
        return ADAPTER_PREFIX if self.adapter_mode else None

    def start(self) -> None:
        self.merged.start()

    def sync(self, version: int, barrier_s: float = 0.0) -> SyncTimings | None:
        if self.adapter_mode is None:
            return self._first_sync(version, barrier_s)
        if self.adapter_mode:
            return self._adapter_sync(version, barrier_s)
        return self.merged.sync(version, barrier_s)

    def snapshot(self, version: int) -> Snapshot | None:
        if self.adapter_mode is None:
            raise RuntimeError("AdapterWeights.snapshot before the first sync")
        if not self.adapter_mode:
            return self.merged.snapshot(version)
        self.learner.export.save_pretrained(self.adapters.path(version), adapter_only=True)
        return Snapshot(version, None) if self.learner.rank == 0 else None

    def send(self, snapshot: Snapshot) -> SyncTimings:
        if not self.adapter_mode:
            return self.merged.send(snapshot)
        return self._load(snapshot.version, 0.0)

    def snapshot_size(self) -> tuple[int, str]:
        if self.adapter_mode is False:
            return self.merged.snapshot_size()
        return 0, HOST_MEMORY  # the adapter is written to disk, nothing stays in memory

    def _adapter_sync(self, version: int, barrier_s: float) -> SyncTimings | None:
        self.learner.export.save_pretrained(self.adapters.path(version), adapter_only=True)
        if self.learner.rank != 0:
            return None
        return self._load(version, barrier_s)

    def _load(self, version: int, barrier_s: float) -> SyncTimings:
        async def load() -> SyncTimings:
            async with self.client() as client:
                return await self.adapters.sync(client, version, barrier_s)

        return anyio.run(load)

    def _first_sync(self, version: int, barrier_s: float) -> SyncTimings | None:
        outcome: list[Any] = [None]
        try:
            outcome = [self._adapter_sync(version, barrier_s)]
        except VLLMError as error:
            log.warning("the server refused a LoRA adapter; syncing merged weights instead "
                        "(start vLLM with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 "
                        f"for adapter sync, --max-loras >= {self.adapters.keep + 1})",
                        error=str(error)[:300])  # fmt: skip
            outcome = [False]
        if self.learner.world_size > 1:
            dist.broadcast_object_list(outcome, src=0)
        self.adapter_mode = outcome[0] is not False
        if self.adapter_mode:
            return outcome[0] if self.learner.rank == 0 else None
        return self.merged.sync(version, barrier_s)

    def reconnect(self) -> None:
        """Open the merged path again and (rank 0) load the kept adapter versions again: a
        restarted server has none, and rollouts name the version they started under."""
        self.merged.reconnect()
        if not self.adapter_mode or self.learner.rank != 0:
            return

        async def restore() -> None:
            async with self.client() as client:
                await self.adapters.restore(client)

        anyio.run(restore)

    def close(self) -> None:
        self.merged.close()


def open_weight_sync(learner: Learner, args: Any, model_name: str,
                     output_dir: Path) -> WeightSync:  # fmt: skip
    """Choose the run's path (rank 0 asks the server; every rank gets the choice, or the
    error, e.g. a backend the server lacks) and build it, not yet started."""

    def client() -> VLLMClient:
        return ServerSettings.of(args).client(model_name)

    outcome: list[Any] = [None, None]  # [choice or error, server workers]
    if learner.rank == 0:
        try:
            server = anyio.run(_describe_server, client)
            choice = weight_sync.choose_weight_transfer(
                args.weight_transfer_backend, server.backend if server else None,
                trainer_on_cuda=learner.device.type == "cuda",
            )  # fmt: skip
            outcome = [choice, server.workers if server else 1]
            log.info("weight sync", backend=choice.backend, reason=choice.reason)
        except ValueError as error:
            outcome = [error, None]
    if learner.world_size > 1:
        dist.broadcast_object_list(outcome, src=0)
    if isinstance(outcome[0], ValueError):
        raise outcome[0]
    choice, server_workers = outcome
    merged: WeightSync
    if choice.backend == weight_sync.DISK:
        merged = DiskWeights(learner, client, output_dir / ".vllm_weights")
    else:
        merged = EngineWeights(learner, args, client, choice.backend, server_workers)
    if not learner.is_peft:
        return merged
    return AdapterWeights(learner, client, output_dir / ".vllm_lora",
                          keep=args.max_staleness + 1, merged=merged)  # fmt: skip


async def _describe_server(client: Callable[[], VLLMClient]) -> ServerTransfer | None:
    async with client() as c:
        return await c.weight_transfer()
