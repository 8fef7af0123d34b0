"""Weight transfer to the vLLM server: the disk-reload backend (CPU and any single machine).

The trainer writes the full policy as safetensors into a directory both sides can read, then
the server is paused, reloads the weights in place (``/collective_rpc reload_weights`` with
``weights_path``), drops its prefix cache (cached KV was computed by the old policy) and
resumes. Each phase is timed for ``perf/weight_sync_*``.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs
import torch
from safetensors.torch import save_file

from asyncgrpo.adapters.atomic_files import replaced_whole
from asyncgrpo.adapters.vllm.client import VLLMClient

WEIGHTS_FILE = "model.safetensors"


@attrs.frozen
class SyncTimings:
    """Seconds spent in each phase of one weight sync, and what it sent.

    Attributes:
        pause_s: asking the server to pause (its in-flight steps finish first).
        barrier_s: waiting for the trainer's other processes.
        transfer_s: from paused to resumed: the transfer or reload, the prefix-cache reset and
            the resume; generation stands still meanwhile.
        write_s: writing the weights for the server to read, before pausing it (disk path).
        sent_bytes: bytes sent to one server (0 where not counted: the disk path and adapters).
        unchanged_frac: a delta push's fraction of elements unchanged since the last push
            (``weight_sync_delta``); None for a full push.
    """

    pause_s: float
    barrier_s: float
    transfer_s: float
    write_s: float = 0.0
    sent_bytes: int = 0
    unchanged_frac: float | None = None

    @property
    def total_s(self) -> float:
        return self.pause_s + self.barrier_s + self.transfer_s + self.write_s


def write_safetensors(state_dict: Mapping[str, torch.Tensor], directory: str | Path) -> Path:
    """Write ``state_dict`` as one safetensors file (atomically renamed into place).

    Every name is written, a tensor under two names (a tied model's ``lm_head.weight`` and
    ``model.embed_tokens.weight``) as two copies: safetensors refuses shared memory, and
    vLLM's in-place reload does not tie them again, so a tied LM head left out keeps the old
    weights on the server (its log-probs then drift from the trainer's)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, tensor in state_dict.items():
        tensor = tensor.detach().to("cpu").contiguous()
        storage = tensor.untyped_storage().data_ptr()
        if storage in storages and storage != 0:
            tensor = tensor.clone()
        storages.add(storage)
        tensors[name] = tensor
    final = directory / WEIGHTS_FILE
    with replaced_whole(final) as partial:
        save_file(tensors, str(partial), metadata={"format": "pt"})
    return final


class DiskReload:
    """Sync weights by writing safetensors and asking the server to reload them in place.

    Args:
        client: the server's client.
        directory: where the weights are written (``<output_dir>/.vllm_weights``); the server
            must be able to read it.
        keep_kv_cache: leave the server's KV cache as it is (``weight_push_keeps_kv_cache``)
            instead of dropping it and recomputing the running requests' KV.
    """

    def __init__(
        self, client: VLLMClient, directory: str | Path, keep_kv_cache: bool = False
    ) -> None:
        self.client = client
        self.directory = Path(directory)
        self.keep_kv_cache = keep_kv_cache

    async def sync(
        self, state_dict: Mapping[str, torch.Tensor], barrier_s: float = 0.0
    ) -> SyncTimings:
        """Push ``state_dict`` to the server; ``barrier_s`` is the time the caller already
        spent waiting for other processes (reported as ``perf/weight_sync_barrier_s``).

        The file is written before the server is paused (it reads it only when told to
        reload), so generation stops only for the reload itself."""
        written = time.monotonic()
        write_safetensors(state_dict, self.directory)
        return await self.reload(barrier_s, write_s=time.monotonic() - written)

    async def reload(self, barrier_s: float = 0.0, write_s: float = 0.0) -> SyncTimings:
        """The server's side of :meth:`sync`, the weights already written (by one write for
        several servers): pause, reload, drop the prefix cache (unless it is kept), resume."""
        start = time.monotonic()
        await self.client.admin.pause(self.keep_kv_cache)
        paused = time.monotonic()
        try:
            await self.client.admin.collective_rpc(
                "reload_weights", kwargs={"weights_path": str(self.directory)}
            )
            if not self.keep_kv_cache:
                await self.client.admin.reset_prefix_cache()
        finally:
            await self.client.admin.resume()
        done = time.monotonic()
        return SyncTimings(
            pause_s=paused - start, barrier_s=barrier_s, transfer_s=done - paused, write_s=write_s
        )


class AdapterSync:
    """Sync LoRA adapters instead of merged weights (a server started with ``--enable-lora``).

    Each version is written to ``<directory>/v<version>`` and registered as
    ``<prefix>-v<version>``; the newest ``keep`` versions stay loaded (``max_staleness + 1``), so
    a rollout started under an older policy finishes under it. The next version is loaded
    before the oldest is released and its directory deleted. A server that restarted has none
    of them: :meth:`restore` loads the kept versions again from their directories.
    """

    def __init__(
        self, directory: str | Path, prefix: str, keep: int, remove_files: bool = True
    ) -> None:
        if keep < 1:
            raise ValueError("AdapterSync.keep must be >= 1")
        self.directory = Path(directory)
        self.prefix = prefix
        self.keep = keep
        self.remove_files = remove_files  # False: several servers share the directory
        self.loaded: list[int] = []

    def path(self, version: int) -> Path:
        """Where version ``version`` is written (the trainer writes it before :meth:`sync`)."""
        return self.directory / f"v{version}"

    def name(self, version: int) -> str:
        return adapter_name(self.prefix, version)

    async def sync(self, client: VLLMClient, version: int, barrier_s: float = 0.0) -> SyncTimings:
        """Register the adapter already written at :meth:`path` and release old versions; a
        version loaded before (pushed again after an outage) is loaded in place."""
        start = time.monotonic()
        again = version in self.loaded
        await client.admin.load_lora_adapter(self.name(version), str(self.path(version)), again)
        if not again:
            self.loaded.append(version)
        while len(self.loaded) > self.keep:
            old = self.loaded.pop(0)
            await client.admin.unload_lora_adapter(self.name(old))
            if self.remove_files:
                shutil.rmtree(self.path(old), ignore_errors=True)
        return SyncTimings(pause_s=0.0, barrier_s=barrier_s, transfer_s=time.monotonic() - start)

    async def restore(self, client: VLLMClient) -> None:
        """After the server went away and came back (it may have restarted with no adapter):
        load every kept version again, in place, so rollouts that started under an older
        policy are generated again under that same policy."""
        for version in self.loaded:
            await client.admin.load_lora_adapter(self.name(version), str(self.path(version)), True)


def adapter_name(prefix: str, version: int) -> str:
    """The served name of adapter version ``version``.

    Example:
        >>> adapter_name("policy", 3)
        'policy-v3'
    """
    return f"{prefix}-v{version}"


def slowest(timings: Sequence[SyncTimings]) -> SyncTimings:
    """The timings of one sync that reached several servers in parallel: each phase's longest
    (the write is shared), and the most sent to one server (a server that got the full policy
    while the others got a delta).

    Example:
        >>> both = slowest([SyncTimings(0.1, 0.0, 0.5, 0.2), SyncTimings(0.3, 0.0, 0.4, 0.2)])
        >>> both.pause_s, both.transfer_s, both.write_s
        (0.3, 0.5, 0.2)
    """
    if not timings:
        raise ValueError("slowest: no timings")
    return SyncTimings(
        pause_s=max(t.pause_s for t in timings),
        barrier_s=max(t.barrier_s for t in timings),
        transfer_s=max(t.transfer_s for t in timings),
        write_s=max(t.write_s for t in timings),
        sent_bytes=max(t.sent_bytes for t in timings),
        unchanged_frac=next(
            (t.unchanged_frac for t in timings if t.unchanged_frac is not None), None
        ),
    )
