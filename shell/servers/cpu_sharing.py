"""Apply :mod:`asyncgrpo.core.servers.cpu_plan` to this process and to a server started on this
host.

The trainer enters :func:`cpus_shared_with_server` for a ``train()`` call, before it builds
its learner (and restores this process's affinity and threads after it): on CPU,
with the vLLM server on this host and ``cpu_sharing="auto"``, it pins this rank to its cores and
sets torch's intra-op threads to match. ``asyncgrpo demo`` and ``asyncgrpo train`` call
:func:`server_cpus_for` to start their server on the complementary cores. The rollout process
is spawned after the pinning and given every core back (:func:`release_process`): it mostly
waits on HTTP and should run wherever a core is idle.

Pinning needs ``os.sched_getaffinity`` and ``os.sched_setaffinity`` (Linux; macOS and Windows
have neither): without them the plan counts every core of the machine, torch's threads are
still set by it, and no process is pinned (:func:`can_pin`).
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from urllib.parse import urlsplit

import structlog
import torch

from asyncgrpo.core.servers.cpu_plan import (
    CpuPlan,
    format_cpu_list,
    is_local_host,
    plan_cpus,
    split_server_cpus,
)
from asyncgrpo.shell.config import AsyncGRPOConfig

log = structlog.get_logger("asyncgrpo.cpu")


def local_ranks() -> int:
    """Trainer processes on this machine (torchrun's ``LOCAL_WORLD_SIZE``, else 1)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def server_on_host(base_url: str) -> bool:
    """Whether ``base_url`` points at this machine."""
    host = urlsplit(base_url).hostname or ""
    return is_local_host(host, (socket.gethostname(), socket.getfqdn()))


def can_pin() -> bool:
    """Whether this platform lets a process choose the cores it runs on."""
    return hasattr(os, "sched_getaffinity") and hasattr(os, "sched_setaffinity")


def visible_cpus() -> list[int]:
    """The cores this process may run on: its affinity where the platform has one, else every
    core of the machine."""
    if can_pin():
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def plan_for(config: AsyncGRPOConfig, server_local: bool) -> CpuPlan:
    """The plan from this process's visible cores and the config's settings."""
    return plan_cpus(
        visible_cpus(),
        local_ranks(),
        server_local,
        config.cpu_sharing,
        config.server_cpus,
    )


def server_cpus_for(config: AsyncGRPOConfig) -> tuple[int, ...]:
    """The cores a server started on this host by asyncgrpo gets (empty: vLLM's own binding)."""
    return plan_for(config, server_local=True).server_cpus


def servers_cpus_for(config: AsyncGRPOConfig, servers: int) -> tuple[tuple[int, ...], ...]:
    """The cores of each of ``servers`` local servers asyncgrpo starts: the plan's server
    cores split between them (:func:`~asyncgrpo.core.servers.cpu_plan.split_server_cpus`)."""
    return split_server_cpus(server_cpus_for(config), servers)


@contextlib.contextmanager
def cpus_shared_with_server(
    config: AsyncGRPOConfig, device: torch.device
) -> Iterator[CpuPlan | None]:
    """:func:`share_cpus_with_server` for the duration of a ``with`` block; this process's
    affinity (where it has one) and torch threads are restored after it."""
    affinity = os.sched_getaffinity(0) if can_pin() else None
    threads = torch.get_num_threads()
    try:
        yield share_cpus_with_server(config, device)
    finally:
        if affinity is not None:
            os.sched_setaffinity(0, affinity)
        torch.set_num_threads(threads)


def share_cpus_with_server(config: AsyncGRPOConfig, device: torch.device) -> CpuPlan | None:
    """Pin this rank and set torch's threads by the plan (CPU training only); logs the plan.

    Returns the plan applied, or None on an accelerator (nothing to share)."""
    if device.type != "cpu":
        return None
    plan = plan_for(config, any(server_on_host(url) for url in config.server_urls))
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    pinned = can_pin()
    if plan.rank_cpus and pinned:
        os.sched_setaffinity(0, plan.rank_cpus[rank])
    if plan.rank_threads[rank] > 0:
        torch.set_num_threads(plan.rank_threads[rank])
    log.info(
        "cpu sharing",
        plan=plan.reason,
        local_rank=rank,
        trainer_cpus=(
            format_cpu_list(visible_cpus())
            if pinned
            else "any (this platform has no os.sched_setaffinity: not pinned)"
        ),
        torch_threads=torch.get_num_threads(),
        vllm_cpu_omp_threads_bind=plan.vllm_bind(),
    )
    if plan.server_cpus and rank == 0:
        log.info(
            "a vLLM CPU server on this host should stay off the trainer's cores: start it "
            f"with VLLM_CPU_OMP_THREADS_BIND={plan.vllm_bind()} (asyncgrpo demo and "
            "asyncgrpo train do this for the server they start)"
        )
    return plan


def release_process(pid: int | None, plan: CpuPlan | None) -> None:
    """Let a child spawned by a pinned trainer run on every core of the plan."""
    if pid is not None and plan is not None and plan.rank_cpus and can_pin():
        os.sched_setaffinity(pid, set(plan.server_cpus).union(*plan.rank_cpus))
