"""A CPU server that asyncgrpo starts forks its engine and worker processes
(:mod:`asyncgrpo.adapters.vllm.fork_start`): vLLM's CPU platform would spawn them, each
importing vLLM anew."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from asyncgrpo.adapters.vllm.fork_start import FORK_ENV
from asyncgrpo.adapters.vllm.server import ServerSpec

# vLLM's own config check, as its API server runs it, before and after the plugin is asked
# to fork; in a process of its own, since both change the process's environment and vLLM's
# CPU platform class.
METHODS = """
import os, sys
from vllm.engine.arg_utils import EngineArgs
from asyncgrpo.adapters.transfer.plugin import register

def method():
    EngineArgs(model=sys.argv[1], enforce_eager=True, max_model_len=256).create_engine_config()
    return os.environ["VLLM_WORKER_MULTIPROC_METHOD"]

register()
print("without", method())
os.environ["{env}"] = "1"
register()
register()  # idempotent
print("with", method())
"""


@pytest.mark.slow(reason="imports vLLM in a process of its own: 10-15 s")
def test_the_plugin_leaves_a_cpu_server_to_fork_only_when_asked(tiny_qwen3) -> None:
    env = {
        k: v for k, v in os.environ.items() if k not in (FORK_ENV, "VLLM_WORKER_MULTIPROC_METHOD")
    }
    script = textwrap.dedent(METHODS).replace("{env}", FORK_ENV)
    result = subprocess.run(
        [sys.executable, "-c", script, str(tiny_qwen3)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith(("without", "with"))]
    assert lines == ["without spawn", "with fork"], result.stdout[-2000:]


def test_a_server_spec_asks_for_fork_unless_told_not_to(monkeypatch) -> None:
    monkeypatch.setenv(FORK_ENV, "1")  # the trainer's own environment does not leak through
    assert ServerSpec(model="m").environment()[FORK_ENV] == "1"
    assert FORK_ENV not in ServerSpec(model="m", fork_processes=False).environment()
