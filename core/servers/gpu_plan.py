"""Which GPUs the vLLM servers ``asyncgrpo train`` starts run on: never one the trainer uses.

The trainer's processes take the first visible devices (local rank ``i`` trains on
``cuda:i``). A server started with the trainer's environment would take the first visible
device too, and vLLM reserves 0.9 of its memory there: the trainer then runs out of memory,
or vLLM does. Each server gets one of the devices after the trainer's, named in its own
``CUDA_VISIBLE_DEVICES``; with none left the run is refused before anything starts.
"""

from __future__ import annotations


class GpuPlanError(ValueError):
    """No GPU is left for a server the run would start."""


def visible_devices(cuda_visible_devices: str | None, device_count: int) -> tuple[str, ...]:
    """The devices this process sees, as ``CUDA_VISIBLE_DEVICES`` names them (indices or
    UUIDs); unset: ``0 .. device_count - 1``. CUDA stops at the first entry it cannot use, so
    only the first ``device_count`` entries count.

    Example:
        >>> visible_devices(None, 2)
        ('0', '1')
        >>> visible_devices("3, 1,GPU-8a2f", 2)
        ('3', '1')
    """
    if cuda_visible_devices is None:
        return tuple(str(index) for index in range(device_count))
    named = (entry.strip() for entry in cuda_visible_devices.split(","))
    return tuple(entry for entry in named if entry)[:device_count]


def server_devices(
    visible: tuple[str, ...], trainer_processes: int, servers: int
) -> tuple[str, ...]:
    """The ``CUDA_VISIBLE_DEVICES`` entry of each of ``servers`` servers: the devices after
    the ``trainer_processes`` the trainer uses, one per server, in order.

    Raises:
        GpuPlanError: fewer devices than the trainer's processes and the servers together; the
            message names ``CUDA_VISIBLE_DEVICES`` and the ways out.

    Example:
        >>> server_devices(("0", "1", "2", "3"), trainer_processes=2, servers=1)
        ('2',)
    """
    free = visible[trainer_processes:]
    if len(free) >= servers:
        return free[:servers]
    shown = ",".join(visible) if visible else "none"
    raise GpuPlanError(
        f"asyncgrpo train starts {servers} vLLM server(s), each on a GPU the trainer does not "
        f"use, but this process sees {len(visible)} GPU(s) (CUDA_VISIBLE_DEVICES: {shown}) and "
        f"the trainer's {trainer_processes} process(es) take the first {trainer_processes}. "
        f"Make {trainer_processes + servers} GPUs visible with CUDA_VISIBLE_DEVICES, run fewer "
        "trainer processes (torchrun --nproc_per_node), or start vLLM on another GPU yourself "
        "and pass its URL with --vllm_url"
    )
