"""The torch.distributed process group of the trainer's processes and the device each uses.

Under ``torchrun`` every process reads its rank from the environment; a lone process makes a
1-process group on a free localhost port, so the learner's collectives run the same way with
one process as with many. The group is nccl on CUDA, gloo on the CPU; the object collectives
run on a gloo group of their own (:func:`control_group`).
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Callable
from typing import Any, TypeVar

import psutil
import torch
import torch.distributed as dist


def default_device(use_cpu: bool = False) -> torch.device:
    """``cuda:LOCAL_RANK`` when CUDA is available (and ``use_cpu``, the config's ``use_cpu``,
    is off), else the CPU."""
    if torch.cuda.is_available() and not use_cpu:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_distributed(device: torch.device, timeout_s: float = 1800) -> bool:
    """Initialise the default process group unless one exists (nccl on CUDA, gloo on CPU).

    Under ``torchrun`` it reads ``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR``/``MASTER_PORT``
    from the environment; otherwise it makes a 1-process group on a free localhost port.

    Returns:
        True when this call created the group (the caller then destroys it).
    """
    if dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(
            backend, device_id=device if device.type == "cuda" else None, timeout=timeout
        )
    else:
        address = f"tcp://127.0.0.1:{_free_port()}"
        dist.init_process_group(backend, init_method=address, rank=0, world_size=1, timeout=timeout)
    return True


Decision = TypeVar("Decision")

_CONTROL: dict[str, Any] = {}  # the default group it was made for, and the control group


def control_group() -> Any:
    """A gloo group of every rank for the trainer's object collectives (rank 0's decisions,
    the rows it scatters, the failures and metric windows the ranks gather): their pickled
    bytes stay in host memory instead of being staged through the device and NCCL on the
    group the step's gradients use. Made once per default group, at the first object
    collective (every rank reaches it at the same point); None without several ranks."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    world = dist.group.WORLD
    if _CONTROL.get("world") is not world:
        _CONTROL.update(world=world, group=dist.new_group(backend="gloo"))
    return _CONTROL["group"]


def destroy_process_groups() -> None:
    """Destroy the default group and the control group, and drop this module's hold on the
    latter: a gloo group still referenced when the interpreter finalises can abort the
    process ("terminate called without an active exception")."""
    _CONTROL.clear()
    if dist.is_initialized():
        dist.destroy_process_group()


def decided_on_rank0(
    decide: Callable[[], Decision], refusals: tuple[type[Exception], ...] = ()
) -> Decision:
    """``decide()`` run on rank 0 and its result given to every rank (one broadcast), so that
    a choice made from what a process measures (a matmul's speed, free memory, a server's
    reply) is the same on all of them; without a process group of several ranks, just
    ``decide()``. An exception of a type in ``refusals`` raised by ``decide()`` on rank 0 is
    raised on every rank (a refusal every rank must stop on, such as a config error)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return decide()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box = [decide()]
        except refusals as refused:
            box = [_Refused(refused)]
    dist.broadcast_object_list(box, src=0, group=control_group())
    if isinstance(box[0], _Refused):
        raise box[0].error
    return box[0]


def on_any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on some rank, the same answer on every rank (one all-reduce on
    the control group); without a process group of several ranks, ``flag``."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    found = torch.tensor([int(flag)])
    dist.all_reduce(found, op=dist.ReduceOp.MAX, group=control_group())
    return bool(found.item())


def launch_rank() -> int:
    """This process's rank as torchrun set it (``RANK``; 0 outside torchrun), known before the
    process group exists."""
    return int(os.environ.get("RANK", "0"))


def local_processes() -> int:
    """The trainer's processes on this node (torchrun's ``LOCAL_WORLD_SIZE``; 1 outside it),
    which share its host memory."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def scattered_from_rank0(per_rank: list[Any] | None) -> Any:
    """This rank's item of ``per_rank`` (a list with one item per rank, given on rank 0 only),
    in one scatter, so that each rank receives only its own; without a process group of
    several ranks, the first item."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        assert per_rank is not None
        return per_rank[0]
    received: list[Any] = [None]
    dist.scatter_object_list(received, per_rank, src=0, group=control_group())
    return received[0]


def first_failure(error: Exception | None) -> str | None:
    """The outcome of a collective stage on every rank: ``None`` when it succeeded on all, else
    the first failure (``"<Type>: <message>"``, rank 0's first, another rank's named), the same
    on every rank (one all-gather); without a process group of several ranks, this rank's."""
    failure = None if error is None else f"{type(error).__name__}: {error}"
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return failure
    failures: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure, group=control_group())
    return next(
        (
            f if rank == 0 else f"rank {rank}: {f}"
            for rank, f in enumerate(failures)
            if f is not None
        ),
        None,
    )


class _Refused:
    """Rank 0's refusal, in the box of :func:`decided_on_rank0` (a decision may itself be an
    exception object)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


HOST_MEMORY = "host memory"


def free_bytes(where: str) -> int | None:
    """Memory free now ``where``: :data:`HOST_MEMORY` (available RAM) or a CUDA device such as
    ``"cuda:0"``; ``None`` when it cannot be measured."""
    if where == HOST_MEMORY:
        return int(psutil.virtual_memory().available)
    if where.startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.mem_get_info(torch.device(where))[0])
    return None
