"""What one learner writes into a checkpoint directory, and reads back to resume.

Under the directory :mod:`asyncgrpo.shell.run.checkpoints` hands out:

- ``dcp/``: model and optimizer states, sharded, with torch.distributed.checkpoint (so the
  number of processes may differ on resume);
- ``learner_state.pt`` (rank 0): step counter and scheduler state;
- ``rng_state_<rank>.pth``: each process's Python, numpy and torch RNG states.

:func:`check_learner_files` says, without loading the tensors, whether these files load: a
resume takes the newest checkpoint that does (:mod:`asyncgrpo.shell.run.checkpoints`).
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from asyncgrpo.adapters.checkpoint_files import (
    DamagedFile,
    check_distributed_checkpoint,
    check_torch_file,
)

CHECKPOINT_WEIGHTS = "dcp"
LEARNER_STATE = "learner_state.pt"


def save_learner(
    path: str | Path,
    model: nn.Module,
    optimizer: Optimizer,
    scheduler: LRScheduler,
    step: int,
    rank: int,
) -> None:
    """Save everything a resume needs under ``path`` (collective; see the module docstring)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save(
        {"model": model_state, "optimizer": optimizer_state},
        checkpoint_id=str(path / CHECKPOINT_WEIGHTS),
    )
    torch.save(rng_state(), path / f"rng_state_{rank}.pth")
    if rank == 0:
        torch.save({"step": step, "scheduler": scheduler.state_dict()}, path / LEARNER_STATE)
    dist.barrier()


def load_learner(
    path: str | Path, model: nn.Module, optimizer: Optimizer, scheduler: LRScheduler, rank: int
) -> int:
    """Restore what :func:`save_learner` wrote into ``model``, ``optimizer`` and ``scheduler``
    (collective) and return the saved step. RNG states are restored only on ranks that saved
    one (a warning on the others).

    Raises:
        FileNotFoundError: ``path`` is not a learner checkpoint.
    """
    path = Path(path)
    if not (path / LEARNER_STATE).is_file():
        raise FileNotFoundError(
            f"{path} holds no learner checkpoint ({LEARNER_STATE} is missing); pass a "
            "directory written by Learner.save_checkpoint"
        )
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(path / CHECKPOINT_WEIGHTS))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
    )
    learner_state = torch.load(path / LEARNER_STATE, weights_only=True)
    scheduler.load_state_dict(learner_state["scheduler"])
    rng_path = path / f"rng_state_{rank}.pth"
    if rng_path.is_file():
        set_rng_state(torch.load(rng_path, weights_only=True))
    else:
        warnings.warn(f"{rng_path} is missing: RNG states not restored", stacklevel=3)
    return int(learner_state["step"])


def check_learner_files(path: str | Path) -> None:
    """Check that what :func:`save_learner` wrote under ``path`` loads, without loading the
    tensors: ``learner_state.pt`` loads (``weights_only``) and holds the step and the
    scheduler, every ``rng_state_<rank>.pth`` loads, the sharded checkpoint's ``.metadata``
    loads and each of its data files is at least as long as the metadata says (a file cut
    short by a full disk or a copy that stopped)
    (:func:`~asyncgrpo.adapters.checkpoint_files.check_distributed_checkpoint`).

    Raises:
        DamagedFile: naming the first file that is missing or does not load, and why.
    """
    path = Path(path)
    state = check_torch_file(path / LEARNER_STATE)
    if not isinstance(state, dict) or not {"step", "scheduler"} <= state.keys():
        raise DamagedFile(path / LEARNER_STATE, "lacks the step or the scheduler state")
    for file in sorted(path.glob("rng_state_*.pth")):
        check_torch_file(file)
    check_distributed_checkpoint(path / CHECKPOINT_WEIGHTS)


def rng_state() -> dict[str, Any]:
    """Python, numpy, torch CPU and CUDA generator states (loadable with ``weights_only``)."""
    legacy = np.random.get_state()
    if not isinstance(legacy, tuple):  # a dict only for a generator other than MT19937
        raise TypeError(
            "numpy's global random state is not MT19937's, which checkpoints save; "
            "do not replace np.random's bit generator"
        )
    kind, keys, position, has_gauss, gauss = legacy
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.copy()), position, has_gauss, gauss),
        "cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    random.setstate(_as_tuples(state["python"]))
    kind, keys, position, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy(), position, has_gauss, gauss))
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuples(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return tuple(_as_tuples(v) for v in value)
    return value
