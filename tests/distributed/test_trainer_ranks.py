"""The trainer on 2 processes (torchrun, gloo): rank 0 plans and scatters rows, both ranks
train, sync in memory (the server's gloo engine: rank 0 sends, rank 1 joins the gathers),
checkpoint and save together, and parity at staleness 0 holds."""

import os
import subprocess
import sys
from pathlib import Path

from asyncgrpo.shell.run import read_metrics

WORKER = Path(__file__).with_name("trainer_worker.py")


def test_two_ranks_train_sync_and_checkpoint(served, tmp_path) -> None:
    server, model = served
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(WORKER),
        str(model),
        server.base_url,
        str(tmp_path),
    ]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3], done.stderr[-3000:]
    for row in rows:
        assert row["batch/microbatches_per_step"] == 1, row
        assert row["sampling/sampling_logp_difference/max"] < 1e-4, (row, done.stderr[-3000:])
    assert (tmp_path / "checkpoint-3" / "rollout_state.json").exists()
    assert (tmp_path / "model.safetensors").exists()
