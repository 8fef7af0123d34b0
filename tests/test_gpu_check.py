"""benchmarks/gpu_check.py in its CPU dry-run mode, so the GPU script cannot rot unseen."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"

LEARNER_ROWS = ("fwd+bwd tree", "fwd+bwd padding-free")
BY_ROW = "dense or segments, by row"
EVERY_ROW = [
    ("weights contract", "bf16", "-"),
    ("gloo chunk round trip", "bf16", "-"),
    ("stream race", "float32", "-"),
    ("lora merged", "float32", "-"),
    ("dcp resume", "float32", "dense"),
    ("parity control", "float32", "causal"),
    ("parity control", "bfloat16", "causal"),
    *[("parity", dtype, b) for dtype in ("float32", "bfloat16") for b in ("dense", "segments")],
    *[("grad parity", "float32", b) for b in ("dense", "segments")],
    *[
        ("long-row parity", dtype, b)
        for dtype in ("float32", "bfloat16")
        for b in ("dense", "segments")
    ],
    ("recompiles", "float32", "segments"),
    *[(check, "float32", b) for check in LEARNER_ROWS for b in ("dense", "segments")],
    ("fsdp step checkpointing on", "float32", BY_ROW),
    ("fsdp step checkpointing decided", "float32", BY_ROW),
    ("tree vs padded: tree", "float32", "segments"),
    ("tree vs padded: padding-free", "float32", "segments"),
    ("tree vs padded: padded", "float32", "sdpa"),
    ("memory budget 64", "float32", BY_ROW),
    ("memory budget 128", "float32", BY_ROW),
]


@pytest.mark.slow(reason="every check of the script, learners included, in a subprocess")
def test_the_gpu_check_runs_on_cpu_and_every_check_passes() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=1500
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    table = [
        line for line in done.stdout.split("device ", 1)[-1].splitlines() if line.startswith("| ")
    ]
    rows = {tuple(cell.strip() for cell in line.split("|")[1:4]): line for line in table[1:]}
    missing = [key for key in EVERY_ROW if key not in rows]
    assert not missing, f"rows missing: {missing}\n{done.stdout}"
    assert all(line.rstrip().endswith("| yes |") for line in table[2:]), done.stdout
    plan = [line for line in done.stdout.splitlines() if line.startswith("planned: ")]
    assert plan and "s of budgets against 1200 s in all" in plan[0], done.stdout
    assert "| fwd+bwd | float32 | dense | 300 |" in done.stdout  # each check's planned time
    assert "bit-equal" in rows[("gloo chunk round trip", "bf16", "-")]
    assert "(100.0%)" in rows[("fsdp step checkpointing on", "float32", BY_ROW)]


@pytest.mark.slow(reason="starts a forkserver and three check processes")
def test_a_check_past_its_budget_is_killed_before_the_next_starts() -> None:
    """Each check runs in a process of its own: one that overruns is killed (not left running
    beside the next check, holding its GPU memory), one that dies is named with its exit
    code, and the next one still runs."""
    import multiprocessing
    import os
    import time
    from functools import partial
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = module_from_spec(spec)
    sys.modules["gpu_check"] = gpu_check  # the check processes unpickle run_check from it
    spec.loader.exec_module(gpu_check)
    units = [
        gpu_check.Check("sleeps", "-", "-", 2.0, partial(time.sleep, 3600)),
        gpu_check.Check("dies", "-", "-", 60.0, partial(os._exit, 3)),
        gpu_check.Check(
            "answers", "-", "-", 60.0, partial(list, [gpu_check.row("a", "-", "-", 1, "r", True)])
        ),
    ]
    start = time.monotonic()
    rows = gpu_check.run_all(units, budget_s=120.0, dry_run=True)
    assert time.monotonic() - start < 60
    assert [r["result"] for r in rows] == [
        "timeout: killed after 2 s",
        "error: the check's process died (exit code 3)",
        "r",
    ]
    assert [r["ok"] for r in rows] == [False, False, True]
    assert not multiprocessing.active_children()
