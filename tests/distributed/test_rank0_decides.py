"""``decided_on_rank0`` on 2 processes (torchrun, gloo): every rank gets rank 0's decision,
rank 0's refusal is raised on every rank, and a decision that is an exception object is
handed over as a value, not raised."""

import json
import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("rank0_decides_worker.py")


def test_every_rank_gets_rank_0s_decision_and_its_refusal(tmp_path) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(WORKER),
        str(tmp_path),
    ]
    done = subprocess.run(
        command,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        assert got == {
            "value": {"rank": 0},
            "refusal": "weight_transfer_backend: rank 0 refuses",
            "exception_as_value": "ValueError: a decision made on rank 0",
        }, (rank, got)
