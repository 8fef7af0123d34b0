"""The simulator's held-out errors in the three regimes, with and without the sweep's generator
probe: calibrated on each sweep's ``max_staleness`` 0 run (the push waited), predicting its
other runs (the push beside the step), mean step time and time to N samples, each with a 90%
bootstrap interval over the measured run's steps (docs/experiments.md).

First run the three sweeps (each alone on the machine; their ``[probe]`` tables probe the
server after the runs)::

    for r in demo h512 real; do
        flock /tmp/asyncgrpo-cpu.lock .venv/bin/asyncgrpo sweep benchmarks/simulator_$r.toml \\
            --output-dir runs/simulator-$r
    done
    .venv/bin/python benchmarks/simulator_check.py runs/simulator-demo runs/simulator-h512 \\
        runs/simulator-real --output-dir runs/simulator-check
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from asyncgrpo.core.experiments.prediction_figures import pipeline_figures
from asyncgrpo.shell.experiments.calibrate import (
    fit_run,
    fitted_per_server,
    simulation_of,
    with_probe,
)
from asyncgrpo.shell.experiments.generator_probe import read_probe
from asyncgrpo.shell.experiments.simulate import simulate
from asyncgrpo.shell.run import read_metrics

CALIBRATION = "max_staleness=0_weight_push_overlap=false"
RESAMPLES = 2000


def measured_windows(run: Path) -> tuple[np.ndarray, np.ndarray]:
    """Each logged step's seconds and trained samples, after the first window (as scored)."""
    rows = [r for r in read_metrics(run) if r.get("perf/step_s") is not None][1:]
    step = np.array([r["perf/step_s"] for r in rows])
    samples = np.array([r.get("batch/samples_per_step", np.nan) for r in rows])
    return step, samples


def error_interval(
    predicted: float, values: np.ndarray, samples: np.ndarray | None, rng: np.random.Generator
) -> tuple[float, float, float]:
    """The relative error of ``predicted`` against the measured mean step (or seconds per
    sample, with ``samples``), and its 90% bootstrap interval over the steps."""

    def figure(index: np.ndarray) -> float:
        if samples is None:
            return float(values[index].mean())
        return float(values[index].sum() / samples[index].sum())

    everything = np.arange(len(values))
    point = predicted / figure(everything) - 1
    draws = [
        predicted / figure(rng.integers(0, len(values), len(values))) - 1 for _ in range(RESAMPLES)
    ]
    low, high = np.percentile(draws, [5, 95])
    return point, float(low), float(high)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweeps", nargs="+", type=Path)
    parser.add_argument("--output-dir", type=Path, required=True)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print("| sweep | run | probe | step time | time to N samples |")
    print("|---|---|---|---|---|")
    for sweep in args.sweeps:
        calibration = sweep / CALIBRATION / "seed=0"
        fitted = fitted_per_server(calibration, fit_run(calibration))
        probe = read_probe(calibration)
        ways = {"without": fitted}
        if probe is not None:
            ways["with"] = with_probe(calibration, fitted)
            print(
                f"<!-- {sweep.name}: probed "
                f"{[(p.concurrency, round(p.tokens_per_s)) for p in probe.points]}, "
                f"{probe.note} -->"
            )
        runs = sorted(p.parent for p in sweep.glob("*/seed=0/metrics.jsonl"))
        for run in runs:
            step, samples = measured_windows(run)
            for way, settings in ways.items():
                simulated = simulate(
                    simulation_of(run, settings),
                    args.output_dir / sweep.name / way / run.parent.name,
                    progress=False,
                )
                figures = pipeline_figures(simulated)
                cells = []
                figure_pairs = ((None, figures.step_s), (samples, figures.seconds_per_sample))
                for counts, predicted in figure_pairs:
                    point, low, high = error_interval(predicted, step, counts, rng)
                    cells.append(f"{point:+.1%} [{low:+.1%}, {high:+.1%}]")
                name = run.parent.name + (" (calibration)" if run == calibration else "")
                print(f"| {sweep.name} | {name} | {way} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
