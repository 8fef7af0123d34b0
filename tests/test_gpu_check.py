"""benchmarks/gpu_check.py in its CPU dry-run mode, so the GPU script cannot rot unseen."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


@pytest.mark.slow  # a whole learner in a subprocess: 12-35 s here
def test_the_gpu_check_runs_on_cpu_and_every_check_passes() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    checks = {tuple(cell.strip() for cell in line.split("|")[1:4]) for line in table[1:]}
    for backend in ("dense", "segments"):
        assert ("parity", "float32", backend) in checks
        assert ("parity", "bfloat16", backend) in checks
        assert ("fwd+bwd tree", "bf16", backend) in checks
        assert ("fwd+bwd padding-free", "bf16", backend) in checks
        assert ("memory budget 128", "bf16", backend) in checks
    assert all(line.rstrip().endswith("| yes |") for line in table[2:]), done.stdout
