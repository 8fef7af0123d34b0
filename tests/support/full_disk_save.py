"""Run as a script inside a private mount namespace (``unshare --mount``): mount a small tmpfs,
save a real learner's checkpoint into it twice through the run's save path
(:func:`asyncgrpo.shell.run.checkpoints.save` around ``Learner.save_checkpoint`` and the rollout
state, as ``TrainingRun`` does), and print what happened as JSON.

Usage: python full_disk_save.py MODEL_DIR MOUNT_POINT SIZE_BYTES
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from asyncgrpo.adapters.models.causal_lm import load_causal_lm
from asyncgrpo.adapters.process_group import init_distributed
from asyncgrpo.core.rollout.cursor import PromptCursor
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.learner import Learner
from asyncgrpo.shell.run import checkpoints


def main(model: str, mount_point: str, size: int) -> dict:
    where = Path(mount_point)
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    torch.set_num_threads(1)
    init_distributed(torch.device("cpu"))
    learner = Learner(load_causal_lm(model), AsyncGRPOConfig(num_sampler_logprobs=4, seed=0))

    def write(path: Path) -> None:
        learner.save_checkpoint(path)
        checkpoints.write_rollout_state(path, PromptCursor(), version=0, step=learner.step)

    result: dict = {"first": str(checkpoints.save(where, 1, write, keep=None))}
    try:
        checkpoints.save(where, 2, write, keep=None)
    except checkpoints.CheckpointError as error:
        result["error"] = str(error)
        result["cause"] = type(error.__cause__).__name__
    result["left"] = sorted(p.name for p in where.iterdir())
    checkpoints.check_loads(where / "checkpoint-1")
    result["first_loads"] = True
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
