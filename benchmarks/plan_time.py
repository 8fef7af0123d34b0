"""How long ``asyncgrpo plan --workload`` takes against the GPUs it plans, and what simulating a
fraction of the cluster costs the predictions (docs/experiments.md, "How long a plan takes").

Plan time: the whole plan (every setting simulated, the synchronous and colocated baselines)
of each workload on 8, 32, 128 and 1,024 GPUs, one process on one core, with the settings
simulated, the share of the cluster each ran (:mod:`asyncgrpo.core.experiments.scale`) and
the samples simulated in all.

``--check-scale``: for the recommended, synchronous and colocated settings of a plan, the
prediction simulated at the plan's scale beside the whole cluster's, and the difference of
each figure (the whole cluster is the reference, so this takes as long as the plans used to).

    .venv/bin/python benchmarks/plan_time.py examples/workload_math_1.5b.toml \
        examples/workload_math_7b.toml
    .venv/bin/python benchmarks/plan_time.py examples/workload_math_1.5b.toml --gpus 32 128 \
        --check-scale
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import attrs

from asyncgrpo.core.experiments.recommend import Prediction
from asyncgrpo.shell.experiments.workload_plan import (
    plan_workload,
    read_workload,
    simulated_prediction,
    simulation_of,
)

GPU_COUNTS = (8, 32, 128, 1024)


def plan_time(workload_file: str, gpus: int) -> None:
    workload = read_workload(workload_file)
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        plan = plan_workload(workload, gpus, out, progress=False)
        seconds = time.perf_counter() - start
    simulated = sum(s.samples_per_step * s.config.max_steps for s in plan.simulated)
    shares = sorted({s.scale for s in plan.simulated})
    whole = sum(s.scale == 1 for s in plan.simulated)
    r = plan.recommended
    print(
        f"| {Path(workload_file).name} | {gpus} | {seconds:.1f} | {len(plan.simulated)} "
        f"({whole} whole) | {', '.join(f'1/{s}' for s in shares)} | {simulated:,} | "
        f"{r.candidate.train_devices} : {r.candidate.servers} x {r.candidate.tensor_parallel}, "
        f"max_staleness {r.candidate.max_staleness} | {r.step_s:.1f} |",
        flush=True,
    )


def _figures(p: Prediction) -> tuple[float, ...]:
    return (p.step_s, p.samples_per_s, p.staleness, p.trainer_idle_frac, p.dropped_per_step)


def check_scale(workload_file: str, gpus: int) -> None:
    workload = read_workload(workload_file)
    with tempfile.TemporaryDirectory() as out:
        plan = plan_workload(workload, gpus, out, progress=False)
        c = plan.recommended.candidate
        sync = attrs.evolve(c, max_staleness=0, weight_sync_steps=1)
        colocated = attrs.evolve(sync, train_devices=gpus, servers=gpus // c.tensor_parallel)
        for name, candidate, together in (
            ("recommended", c, False),
            ("synchronous", sync, False),
            ("colocated", colocated, True),
        ):
            simulation = simulation_of(workload, candidate, colocated=together)
            rows = []
            for scale in (simulation.scale, 1):
                start = time.perf_counter()
                p = simulated_prediction(
                    simulation.config, candidate, Path(out) / f"{name}-{scale}", scale
                )
                rows.append((scale, time.perf_counter() - start, _figures(p)))
            (scale, fast_s, fast), (_, whole_s, whole) = rows
            differences = ", ".join(
                f"{label} {a:.2f} / {b:.2f} ({a / b - 1:+.1%})"
                if b
                else f"{label} {a:.1f} / {b:.1f}"
                for label, a, b in zip(
                    ("s/step", "samples/s", "staleness", "trainer idle", "dropped/step"),
                    fast,
                    whole,
                    strict=True,
                )
            )
            print(
                f"{Path(workload_file).name}, {gpus} GPUs, {name} ({candidate.label()}): "
                f"1/{scale} in {fast_s:.1f} s against the whole in {whole_s:.1f} s: "
                f"{differences}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="+", help="workload files")
    parser.add_argument("--gpus", type=int, nargs="+", default=list(GPU_COUNTS))
    parser.add_argument(
        "--check-scale", action="store_true", help="compare against the whole cluster"
    )
    args = parser.parse_args()
    if not args.check_scale:
        print(
            "| workload | GPUs | plan s | settings simulated | share simulated | samples "
            "simulated | recommended split | s/step |"
        )
        print("|---|---|---|---|---|---|---|---|")
    for workload_file in args.workloads:
        for gpus in args.gpus:
            (check_scale if args.check_scale else plan_time)(workload_file, gpus)


if __name__ == "__main__":
    main()
