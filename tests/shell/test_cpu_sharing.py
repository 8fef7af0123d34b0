"""CPU sharing applied for real: a fresh process pins itself and sets torch's threads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from asyncgrpo.adapters.vllm.server import ServerSpec
from asyncgrpo.core.servers.cpu_plan import plan_cpus
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.servers.cpu_sharing import (
    can_pin,
    cpus_shared_with_server,
    release_process,
    server_cpus_for,
    server_on_host,
)

CHILD = """
import json, os, sys, torch
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.servers.cpu_sharing import share_cpus_with_server
config = AsyncGRPOConfig(vllm_server_base_url=sys.argv[1], cpu_sharing=sys.argv[2])
plan = share_cpus_with_server(config, torch.device("cpu"))
print(json.dumps({"cpus": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads(),
                  "server": list(plan.server_cpus)}))
"""


def run_child(url: str, mode: str) -> dict:
    env = {**os.environ, "LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    env.pop("OMP_NUM_THREADS", None)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, url, mode],
        env=env,
        timeout=120,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a learner in a subprocess: about 9 s
def test_a_trainer_beside_a_local_server_runs_on_its_own_cores_with_matching_threads() -> None:
    cores = sorted(os.sched_getaffinity(0))
    assert len(cores) >= 2, "CI machines have two cores or more"
    plan = plan_cpus(cores, 1, server_on_host=True)
    seen = run_child("http://127.0.0.1:8000", "auto")
    assert seen["cpus"] == list(plan.rank_cpus[0]) and seen["threads"] == len(seen["cpus"])
    assert seen["server"] == list(plan.server_cpus)
    assert not set(seen["cpus"]) & set(seen["server"])
    config = AsyncGRPOConfig(vllm_server_base_url="http://127.0.0.1:8000")
    assert server_cpus_for(config) == plan.server_cpus


@pytest.mark.slow  # a learner in a subprocess: about 9 s
def test_off_and_remote_servers_leave_the_affinity_alone() -> None:
    cores = sorted(os.sched_getaffinity(0))
    assert run_child("http://127.0.0.1:8000", "off")["cpus"] == cores
    assert run_child("http://10.255.255.1:8000", "auto")["cpus"] == cores
    assert not server_on_host("http://10.255.255.1:8000") and server_on_host("http://localhost:1")


def test_a_server_spec_with_cores_binds_vllm_to_them() -> None:
    spec = ServerSpec(model="m", cpus=(2, 0))
    assert spec.environment()["VLLM_CPU_OMP_THREADS_BIND"] == "0,2"
    assert ServerSpec(model="m").environment().get("VLLM_CPU_OMP_THREADS_BIND") == (
        os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    )


def test_bad_cpu_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="cpu_sharing"):
        AsyncGRPOConfig(cpu_sharing="always")
    with pytest.raises(ValueError, match="server_cpus"):
        AsyncGRPOConfig(server_cpus=0)


def test_a_platform_without_cpu_affinity_trains_unpinned(monkeypatch) -> None:
    """As on macOS (no ``os.sched_getaffinity`` / ``os.sched_setaffinity``): the plan counts
    every core, torch's threads follow it and are restored after, nothing is pinned."""
    monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.delattr(os, "sched_setaffinity")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    config = AsyncGRPOConfig(vllm_server_base_url="http://127.0.0.1:8000", cpu_sharing="auto")
    threads = torch.get_num_threads()
    assert not can_pin()
    with cpus_shared_with_server(config, torch.device("cpu")) as plan:
        assert plan is not None
        assert plan == plan_cpus(list(range(os.cpu_count() or 1)), 1, server_on_host=True)
        if plan.rank_threads[0] > 0:
            assert torch.get_num_threads() == plan.rank_threads[0]
        release_process(os.getpid(), plan)
    assert torch.get_num_threads() == threads
    assert server_cpus_for(config) == plan.server_cpus
