"""Which path a run's weights take to its servers, built: :func:`open_weight_sync` asks the
first server which engine it runs (rank 0), lets
:func:`~asyncgrpo.core.weights.sync.choose_weight_transfer` choose, and builds the
:class:`~asyncgrpo.shell.weights.paths.WeightSync` on every rank."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from asyncgrpo.adapters.process_group import decided_on_rank0
from asyncgrpo.adapters.vllm.client import VLLMClient
from asyncgrpo.adapters.vllm.replies import ServerTransfer
from asyncgrpo.core.weights import sync as weight_sync
from asyncgrpo.core.weights.delta import delta_refusal
from asyncgrpo.shell.servers import ServerSettings, run_async
from asyncgrpo.shell.weights.lora_path import AdapterWeights
from asyncgrpo.shell.weights.paths import DiskWeights, EngineWeights, WeightSync

if TYPE_CHECKING:
    from asyncgrpo.shell.learner import Learner

log = structlog.get_logger("asyncgrpo.weight_sync")


def open_weight_sync(learner: Learner, args: Any, model_name: str, output_dir: Path) -> WeightSync:
    """Choose the run's path (rank 0 asks the first server, whose flags every other server
    shares: :func:`~asyncgrpo.shell.servers.check_servers_match`; every rank gets the choice,
    or the error, e.g. a backend the server lacks) and build it, not yet started."""
    settings = ServerSettings.of(args)

    def client(server: int = 0) -> VLLMClient:
        # with other servers to turn to, a hung one fails its push after the stall timeout
        return settings.client(model_name, server, stall_outage=settings.count > 1)

    def choose() -> tuple[weight_sync.TransferChoice, int]:
        server = run_async(_describe_server, client)
        choice = weight_sync.choose_weight_transfer(
            args.weight_transfer_backend,
            server.backend if server else None,
            trainer_on_cuda=learner.device.type == "cuda",
        )
        log.info("weight sync", backend=choice.backend, reason=choice.reason)
        refusal = args.weight_sync_delta and delta_refusal(choice.backend, learner.is_peft)
        if refusal:
            raise ValueError(refusal)
        return choice, server.workers if server else 1

    choice, server_workers = decided_on_rank0(choose, refusals=(ValueError,))
    merged: WeightSync
    if choice.backend == weight_sync.DISK:
        merged = DiskWeights(
            learner, client, output_dir / ".vllm_weights", args.weight_push_keeps_kv_cache
        )
    else:
        merged = EngineWeights(learner, args, client, choice.backend, server_workers)
    if not learner.is_peft:
        return merged
    return AdapterWeights(
        learner,
        client,
        output_dir / ".vllm_lora",
        keep=args.max_staleness + 1,
        merged=merged,
        servers=settings.count,
    )


async def _describe_server(client: Callable[[], VLLMClient]) -> ServerTransfer | None:
    async with client() as c:
        return await c.weight_transfer()
