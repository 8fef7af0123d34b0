"""``nccl``: vLLM's own weight-transfer engine, for GPU servers and a trainer on CUDA.

vLLM ships both sides of the engine; this module builds the trainer's side of the handshake
(:data:`asyncgrpo.core.weights.sync.ENGINES` names it).
"""

from __future__ import annotations

from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo


def trainer_init_info(
    address: str, port: int, world_size: int, rank: int, timeout_s: float
) -> NCCLTrainerInitInfo:
    """The trainer's handshake: it hosts the rendezvous at ``address:port`` for ``world_size``
    ranks (itself and the server's workers); ``rank`` is the trainer process's rank (0 sends).
    NCCL's engine has no handshake timeout of its own, so ``timeout_s`` is not passed on."""
    return NCCLTrainerInitInfo(address, port, world_size, rank=rank)
