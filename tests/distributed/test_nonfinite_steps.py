"""A step whose gradient norm is not finite is skipped by every process of an FSDP2 run alike
(torchrun, 2 processes, gloo): the weights and the optimizer's state stay those of the last
finite step, and no collective is left unpaired (the run ends)."""

import math
import os
import subprocess
import sys
from pathlib import Path

import torch

WORKER = Path(__file__).with_name("nonfinite_worker.py")


def test_every_process_skips_a_nonfinite_step_and_keeps_its_shards(tiny_qwen3, tmp_path) -> None:
    out = tmp_path / "steps.pt"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(WORKER),
        str(tiny_qwen3),
        str(out),
    ]
    support = os.pathsep.join([str(Path(__file__).parents[1] / "support"), str(WORKER.parent)])
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": support}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    first, second = torch.load(out, weights_only=True)
    assert first["skipped"] == [False, False] and math.isfinite(first["grad_norm"])
    assert second["skipped"] == [True, True] and math.isnan(second["grad_norm"])
    assert all(torch.equal(second["weights"][k], t) for k, t in first["weights"].items())
    assert all(bool(t.isfinite().all()) for t in second["weights"].values())
    assert len(second["optimizer"]) == len(first["optimizer"]) > 0
    assert all(
        torch.equal(a, b) for a, b in zip(first["optimizer"], second["optimizer"], strict=True)
    )
