"""A run lives and dies as one: SIGTERM and SIGINT stop it cleanly with one line naming the step
and the last checkpoint; after SIGKILL of the trainer its children (the rollout process, a
server it started) notice and exit. After each signal no process of the run remains.

Every test runs the real command (``python -m asyncgrpo``) as a child, acts once the
first step is logged (never after a sleep), bounds every wait and kills what is left in
``finally``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from processes import alive_after, command_lines, described, kill_all

pytestmark = pytest.mark.server

FIRST_STEP_TIMEOUT_S = 600  # a server start and one step, on a loaded 2-core machine
CHILDREN_EXIT_TIMEOUT_S = 60


def start(args: list[str], log: Path) -> subprocess.Popen:
    """The CLI in its own session (a terminal's Ctrl-C reaches its whole process group)."""
    with log.open("w") as out:
        command = [sys.executable, "-m", "asyncgrpo", *args]
        return subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def wait_for(condition, process: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert process.poll() is None, f"the run exited early:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"not within {timeout_s} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)


def wait_all_gone(processes: list[psutil.Process], timeout_s: float) -> list[str]:
    return [described(p) for p in alive_after(processes, timeout_s)]


def run_demo_until_first_step(tmp_path: Path):
    run_dir, log = tmp_path / "run", tmp_path / "demo.log"
    process = start(
        ["demo", "--output-dir", str(run_dir), "--max-steps", "100000", "--vllm-enforce-eager"], log
    )
    metrics = run_dir / "metrics.jsonl"
    wait_for(
        lambda: metrics.exists() and metrics.read_text().strip(), process, log, FIRST_STEP_TIMEOUT_S
    )
    return process, log


def descendants(process: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(process.pid).children(recursive=True)


@pytest.mark.slow(reason="the demo command with a server of its own, then SIGTERM: 45-60 s")
def test_sigterm_stops_the_demo_its_server_and_rollout_process(tmp_path) -> None:
    process, log = run_demo_until_first_step(tmp_path)
    children = descendants(process)
    try:
        commands = " ".join(" ".join(line) for _, line in command_lines(children))
        assert "vllm.entrypoints.openai.api_server" in commands  # the server the demo started
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=120)
        assert code == 128 + signal.SIGTERM, f"exit code {code}:\n{log.read_text()[-6000:]}"
        output = log.read_text()
        last = output.strip().splitlines()[-1]
        assert last.startswith("asyncgrpo demo: training interrupted by SIGTERM at step "), last
        assert "Traceback" not in output, output[-3000:]
        assert wait_all_gone(children, CHILDREN_EXIT_TIMEOUT_S) == []
    finally:
        process.kill()
        kill_all(children)


def test_after_sigkill_of_the_trainer_its_children_exit(tmp_path) -> None:
    process, _ = run_demo_until_first_step(tmp_path)
    children = descendants(process)
    try:
        assert len(children) >= 3  # the server, its engine and the rollout process at least
        process.kill()
        process.wait(timeout=60)
        assert wait_all_gone(children, CHILDREN_EXIT_TIMEOUT_S) == []
    finally:
        kill_all(children)


def engine_sync_goes_through(server, model_path) -> None:
    """A trainer's in-memory sync (the session server's gloo engine) is accepted and served."""
    from transformers import AutoModelForCausalLM

    from asyncgrpo.adapters.transfer.engine import EngineSync, WeightStream
    from asyncgrpo.adapters.vllm.client import VLLMClient

    state = AutoModelForCausalLM.from_pretrained(model_path).state_dict
    stream = WeightStream(
        lambda: [(n, t.dtype, tuple(t.shape)) for n, t in state().items()],
        lambda: iter(state().items()),
    )
    sync = EngineSync.join(
        server.base_url,
        lambda: VLLMClient(server.base_url, server.spec.name),
        "asyncgrpo_gloo",
        stream,
        workers=1,
        rank=0,
        timeout_s=120,
    )
    try:
        assert sync.sync() is not None
    finally:
        sync.close()


def test_ctrl_c_stops_a_run_naming_its_last_checkpoint(served, tmp_path) -> None:
    """Ctrl-C reaches the trainer and its rollout process alike (one process group). The run
    syncs in memory (the session server's gloo engine); an interrupt that lands mid transfer
    waits for it to end, and the next trainer's sync goes through."""
    server, model = served
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": [{"role": "user", "content": f"Number {i}?"}]}) + "\n"
            for i in range(8)
        )
    )
    settings = tmp_path / "run.toml"
    settings.write_text(f"""
model = "{model}"
dataset = "{prompts}"
reward_funcs = ["asyncgrpo.shell.commands.demo:digit_fraction_reward"]

[asyncgrpo]
max_steps = 100000
save_steps = 1
save_total_limit = 2
num_generations = 4
max_completion_length = 8
token_budget = 256
gradient_checkpointing = false
disable_tqdm = true
weight_transfer_backend = "asyncgrpo_gloo"
""")
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    process = start(
        [
            "train",
            "--config",
            str(settings),
            "--vllm-url",
            server.base_url,
            "--output-dir",
            str(run_dir),
        ],
        log,
    )
    children: list[psutil.Process] = []
    try:
        wait_for(lambda: (run_dir / "checkpoint-1").exists(), process, log, FIRST_STEP_TIMEOUT_S)
        children = descendants(process)
        assert children  # the rollout process
        os.killpg(process.pid, signal.SIGINT)
        code = process.wait(timeout=120)
        assert code == 128 + signal.SIGINT, f"exit code {code}:\n{log.read_text()[-6000:]}"
        output = log.read_text()
        last = output.strip().splitlines()[-1]
        assert "asyncgrpo train: training interrupted by SIGINT at step " in last, last
        assert f"last checkpoint: {run_dir}/checkpoint-" in last, last
        assert "Traceback" not in output, output[-3000:]
        assert wait_all_gone(children, CHILDREN_EXIT_TIMEOUT_S) == []
        engine_sync_goes_through(server, model)
    finally:
        process.kill()
        kill_all(children)
