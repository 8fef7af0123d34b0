"""Weight transfer to the vLLM server: the disk-reload backend (CPU and any single machine).

The trainer writes the full policy as safetensors into a directory both sides can read, then
the server is paused, reloads the weights in place (``/collective_rpc reload_weights`` with
``weights_path``), drops its prefix cache (cached KV was computed by the old policy) and
resumes. Each phase is timed for ``perf/weight_sync_*``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path

import attrs
import torch
from safetensors.torch import save_file

from asyncgrpo.adapters.vllm_client import VLLMClient

WEIGHTS_FILE = "model.safetensors"


@attrs.frozen
class SyncTimings:
    """Seconds spent in each phase of one weight sync."""

    pause_s: float
    barrier_s: float
    transfer_s: float

    @property
    def total_s(self) -> float:
        return self.pause_s + self.barrier_s + self.transfer_s


def write_safetensors(state_dict: Mapping[str, torch.Tensor], directory: str | Path) -> Path:
    """Write ``state_dict`` as one safetensors file (atomically renamed into place)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in state_dict.items()}
    partial = directory / f".{WEIGHTS_FILE}.partial"
    save_file(tensors, str(partial), metadata={"format": "pt"})
    final = directory / WEIGHTS_FILE
    partial.replace(final)
    return final


class DiskReload:
    """Sync weights by writing safetensors and asking the server to reload them in place.

    Args:
        client: the server's client.
        directory: where the weights are written (``<output_dir>/.vllm_weights``); the server
            must be able to read it.
    """

    def __init__(self, client: VLLMClient, directory: str | Path) -> None:
        self.client = client
        self.directory = Path(directory)

    async def sync(
        self, state_dict: Mapping[str, torch.Tensor], barrier_s: float = 0.0
    ) -> SyncTimings:
        """Push ``state_dict`` to the server; ``barrier_s`` is the time the caller already
        spent waiting for other processes (reported as ``perf/weight_sync_barrier_s``)."""
        start = time.monotonic()
        await self.client.pause()
        paused = time.monotonic()
        try:
            write_safetensors(state_dict, self.directory)
            await self.client.collective_rpc(
                "reload_weights", kwargs={"weights_path": str(self.directory)}
            )
            await self.client.reset_prefix_cache()
        finally:
            await self.client.resume()
        done = time.monotonic()
        return SyncTimings(pause_s=paused - start, barrier_s=barrier_s, transfer_s=done - paused)
