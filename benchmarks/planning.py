"""Time the token-budget planner and tree packing on 1,024 samples of realistic shapes, and
the step queue's planning cost per step as its buffer grows.

Planner: 128 groups of G=8 rollouts, 256-token prompts, completions uniform in 64-512 tokens,
token budget 4,096, 2 processes x 4 accumulation steps per plan. Prints medians over repeats.

Re-planning (:mod:`asyncgrpo.core.run.step_queue`): 8-sample groups of ~330 tokens, budget 16,384,
4 processes; with 64 to 8,192 samples buffered, re-planning the whole buffer with ``plan_step``
(what the trainer did after every drain before the queue kept its plan), the queue's cost for
one group to arrive, and for one step to be taken (the next step is planned afresh); then the
total planning work to fill one step from empty, group by group, both ways.

    .venv/bin/python benchmarks/planning.py
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from asyncgrpo.core.packing.tree import pack_row
from asyncgrpo.core.records import TrainingSample, TrainingSequence
from asyncgrpo.core.run import step_queue
from asyncgrpo.core.run.planner import batch_metrics, plan_step


def make_samples(
    rng: np.random.Generator,
    groups: int = 128,
    group_size: int = 8,
    prompt_len: int = 256,
    completions: tuple[int, int] = (64, 512),
):
    samples = []
    for group in range(groups):
        prompt = rng.integers(0, 32_000, prompt_len)
        for member in range(group_size):
            completion = rng.integers(0, 32_000, int(rng.integers(*completions) + 1))
            tokens = np.concatenate([prompt, completion])
            mask = np.r_[np.zeros(prompt_len, np.int8), np.ones(len(completion), np.int8)]
            logprobs = np.where(mask == 1, -1.0, 0.0)
            seq = TrainingSequence(tokens, mask, logprobs)
            samples.append(TrainingSample(seq, 1.0, 0, group, group, group, f"{group}-{member}"))
    return samples


def main(repeats: int = 5) -> None:
    rng = np.random.default_rng(0)
    samples = make_samples(rng)
    budget, processes, accumulation = 4096, 2, 4
    plan_times, pack_times = [], []
    placed = 0
    for _ in range(repeats):
        remaining = list(samples)
        start = time.perf_counter()
        plans = []
        while remaining:
            plan = plan_step(remaining, budget, processes, accumulation)
            plans.append((plan, remaining))
            remaining = [remaining[i] for i in plan.leftover]
        plan_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        rows = [
            [
                [pack_row([batch[i] for i in row.samples]) for row in mb if row.samples]
                for mb in plan.micro_batches
            ]
            for plan, batch in plans
        ]
        pack_times.append(time.perf_counter() - start)
        placed = sum(len(p.placed) for p, _ in plans)
    metrics = batch_metrics(rows[0], budget)
    steps = len(plans)
    imbalance = statistics.mean(batch_metrics(r, budget)["batch/row_imbalance"] for r in rows)
    print(
        f"samples {len(samples)}, placed {placed}, steps {steps}, "
        f"packing_ratio {metrics['batch/packing_ratio']:.2f}, "
        f"samples_per_row {metrics['batch/samples_per_row']:.2f}, "
        f"row_fill_frac {metrics['batch/row_fill_frac']:.2f}, "
        f"row_imbalance (mean over steps) {imbalance:.3f}"
    )
    print(
        f"plan all 1,024 samples: median {statistics.median(plan_times) * 1e3:.1f} ms "
        f"({statistics.median(plan_times) / steps * 1e3:.1f} ms per step)"
    )
    print(
        f"pack all rows:          median {statistics.median(pack_times) * 1e3:.1f} ms "
        f"({statistics.median(pack_times) / steps * 1e3:.1f} ms per step)"
    )


def _timed(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def replanning(buffer_sizes=(64, 256, 1024, 4096, 8192), repeats: int = 5) -> None:
    """Planning cost with ``buffer_sizes`` samples buffered, and for filling one step."""
    settings = step_queue.QueueSettings(
        16_384, num_processes=4, gradient_accumulation_steps=1, max_staleness=4
    )
    rng = np.random.default_rng(1)
    pool = make_samples(
        rng, groups=max(buffer_sizes) // 8 + 8, prompt_len=128, completions=(64, 340)
    )
    print("buffered  re-plan the buffer  arrive 1 group  take 1 step   (medians, ms)")
    for size in buffer_sizes:
        queue = step_queue.StepQueue(settings)
        for start in range(0, size, 8):
            queue = step_queue.arrive(queue, pool[start : start + 8], version=0).queue
        extra = pool[size : size + 8]
        fresh = _timed(lambda q=queue: plan_step(q.buffer, 16_384, 4), repeats)
        arrive = _timed(lambda q=queue, g=extra: step_queue.arrive(q, g, version=0), repeats)
        take = _timed(lambda q=queue: step_queue.take_step(q), repeats)
        print(f"{size:8d}  {fresh * 1e3:18.1f}  {arrive * 1e3:14.2f}  {take * 1e3:11.1f}")

    def fill_by_replanning() -> None:  # what the trainer did: re-plan after every arrival
        buffer: list = []
        for start in range(0, len(pool), 8):
            buffer += pool[start : start + 8]
            if plan_step(buffer, 16_384, 4).complete:
                return

    def fill_incrementally() -> None:
        queue = step_queue.StepQueue(settings)
        for start in range(0, len(pool), 8):
            queue = step_queue.arrive(queue, pool[start : start + 8], version=0).queue
            if step_queue.ready(queue, step_queue.InFlight.of([0]), behind=0):
                step_queue.take_step(queue)
                return

    old, new = _timed(fill_by_replanning, 3), _timed(fill_incrementally, 3)
    print(
        f"fill one step group by group: re-planning after each group {old * 1e3:.0f} ms, "
        f"incremental {new * 1e3:.0f} ms"
    )


if __name__ == "__main__":
    main()
    replanning()
