"""A PEFT model's LoRA adapter as the run's :class:`~asyncgrpo.shell.weights.paths.WeightSync`:
one served version per sync, written once and loaded on each server started with
``--enable-lora`` (:class:`~asyncgrpo.adapters.transfer.files.AdapterSync`); merged weights
through another path take over if the servers refuse the first adapter."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch.distributed as dist

from asyncgrpo.adapters.process_group import HOST_MEMORY, control_group
from asyncgrpo.adapters.transfer.files import AdapterSync, SyncTimings
from asyncgrpo.adapters.vllm.replies import VLLMError
from asyncgrpo.shell.servers import each_server_async, run_async
from asyncgrpo.shell.weights.paths import Client, Landing, Snapshot, WeightSync

if TYPE_CHECKING:
    from asyncgrpo.shell.learner import Learner

log = structlog.get_logger("asyncgrpo.weight_sync")

ADAPTER_PREFIX = "asyncgrpo-policy"
ADAPTER = "adapter"


class AdapterWeights:
    """A PEFT model's LoRA adapter, one served version per sync, written once and loaded on
    each server; ``merged`` takes over if the servers refuse the first adapter (no
    ``--enable-lora``)."""

    def __init__(
        self,
        learner: Learner,
        client: Client,
        directory: Path,
        keep: int,
        merged: WeightSync,
        servers: int = 1,
    ) -> None:
        self.learner = learner
        self.client = client
        self.keep = keep
        # one record of loaded versions per server; with several, the directories go when no
        # server needs them any more (_prune), not when one server unloads them
        self.loaded = [
            AdapterSync(directory, ADAPTER_PREFIX, keep=keep, remove_files=servers == 1)
            for _ in range(servers)
        ]
        self.merged = merged
        self.adapter_mode: bool | None = None  # None until the first sync decides

    @property
    def adapters(self) -> AdapterSync:
        """The first server's adapter versions (the only one of a run with one server)."""
        return self.loaded[0]

    @property
    def backend(self) -> str:
        return self.merged.backend if self.adapter_mode is False else ADAPTER

    @property
    def lora_name(self) -> str | None:
        return ADAPTER_PREFIX if self.adapter_mode else None

    def start(self) -> None:
        self.merged.start()

    def sync(
        self, version: int, barrier_s: float = 0.0, servers: Sequence[int] = (0,)
    ) -> Landing | None:
        if self.adapter_mode is None:
            return self._first_sync(version, barrier_s, servers)
        if self.adapter_mode:
            return self._adapter_sync(version, barrier_s, servers)
        return self.merged.sync(version, barrier_s, servers)

    def snapshot(self, version: int) -> Snapshot | None:
        if self.adapter_mode is None:
            raise RuntimeError("AdapterWeights.snapshot before the first sync")
        if not self.adapter_mode:
            return self.merged.snapshot(version)
        self.learner.export.save_pretrained(self.adapters.path(version), adapter_only=True)
        return Snapshot(version, None) if self.learner.rank == 0 else None

    def send(self, snapshot: Snapshot, servers: Sequence[int] = (0,)) -> Landing:
        if not self.adapter_mode:
            return self.merged.send(snapshot, servers)
        return self._load(snapshot.version, 0.0, servers)

    def snapshot_size(self) -> tuple[int, str]:
        if self.adapter_mode is False:
            return self.merged.snapshot_size()
        return 0, HOST_MEMORY  # the adapter is written to disk, nothing stays in memory

    def _adapter_sync(
        self, version: int, barrier_s: float, servers: Sequence[int]
    ) -> Landing | None:
        self.learner.export.save_pretrained(self.adapters.path(version), adapter_only=True)
        if self.learner.rank != 0:
            return None
        return self._load(version, barrier_s, servers)

    def _load(self, version: int, barrier_s: float, servers: Sequence[int]) -> Landing:
        async def load(index: int) -> SyncTimings:
            async with self.client(index) as client:
                return await self.loaded[index].sync(client, version, barrier_s)

        landing = each_server_async(servers, load)
        self._prune()
        return landing

    def _prune(self) -> None:
        """Remove the directories of versions older than the oldest any server keeps: the ones
        each server unloaded (with several servers they share the directory), and any written
        for a push that never landed (the server went away first). A newer version written
        for a push still to come stays."""
        kept = self._kept()
        if not kept:
            return
        oldest = min(kept)
        for path in self.adapters.directory.glob("v*"):
            number = path.name[1:]
            if number.isdigit() and int(number) < oldest:
                shutil.rmtree(path, ignore_errors=True)

    def _kept(self) -> list[int]:
        held = sorted(set().union(*(set(a.loaded) for a in self.loaded)))
        return held[-self.keep :]

    def _first_sync(self, version: int, barrier_s: float, servers: Sequence[int]) -> Landing | None:
        outcome: list[Any] = [None, None]  # the landing (False: merged), the servers' dtype
        try:
            landing = self._adapter_sync(version, barrier_s, servers)
            refused = [e for e in (landing or {}).values() if isinstance(e, VLLMError)]
            if refused:
                raise refused[0]
            outcome = [landing, None]
        except VLLMError as error:
            log.warning(
                "the server refused a LoRA adapter; syncing merged weights instead "
                "(start vLLM with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 "
                f"for adapter sync, --max-loras >= {self.keep + 1})",
                error=str(error)[:300],
            )
            outcome = [False, self._served_dtype(servers[0])]
        if self.learner.world_size > 1:
            dist.broadcast_object_list(outcome, src=0, group=control_group())
        self.adapter_mode = outcome[0] is not False
        if self.adapter_mode:
            return outcome[0] if self.learner.rank == 0 else None
        # merged pushes from now on: refused where the servers' dtype loses the LoRA update
        self.learner.export.check_merged_pushes(outcome[1])
        return self.merged.sync(version, barrier_s, servers)

    def _served_dtype(self, server: int) -> str | None:
        """The server's ``model_config.dtype`` (``/server_info``); None when it does not say.
        Every server of a run serves the same (:func:`~asyncgrpo.shell.servers.check_servers_match`
        checks it at start)."""

        async def read() -> str | None:
            async with self.client(server) as client:
                config = await client.server_config()
            return str((config or {}).get("model_config", {}).get("dtype") or "") or None

        return run_async(read)

    def reconnect(self, servers: Sequence[int] = (0,)) -> None:
        """Open the merged path again and (rank 0) load the kept adapter versions again: a
        restarted server has none, and rollouts name the version they started under."""
        self.merged.reconnect(servers)
        if not self.adapter_mode or self.learner.rank != 0:
            return
        if len(self.loaded) > 1:  # what the servers in routing hold: the kept versions
            for index in servers:
                self.loaded[index].loaded = self._kept()

        async def restore(index: int) -> None:
            async with self.client(index) as client:
                await self.loaded[index].restore(client)

        for index in servers:
            run_async(restore, index)

    def close(self) -> None:
        self.merged.close()
