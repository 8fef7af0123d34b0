"""The simulator's stale drops against the trainer's, on a long-tailed task whose lengths the
prompt sets (``benchmarks/pacing_check.toml``: half the groups 4 tokens, one in sixteen 128).

Each run of the sweep is simulated with its own fit (``asyncgrpo simulate --calibrate``'s),
once per simulation seed, three ways: a group's lengths alike (``group_length_correlation``
1, as the task draws them); drawn alone (0, the simulator's default); and, the control, alike
under a pacing that does not count the groups in flight. One line per run: the share of
generated samples dropped as stale, measured and simulated (the median and range over the
simulation seeds), over the whole run and after the first 5 steps (the trainer's warm-up,
which the simulator does not model)::

    flock /tmp/asyncgrpo-cpu.lock .venv/bin/asyncgrpo sweep benchmarks/pacing_check.toml \\
        --output-dir runs/pacing-check
    .venv/bin/python benchmarks/pacing_check.py runs/pacing-check
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tasks import long_tail_lengths  # benchmarks/tasks.py, beside this script

from asyncgrpo.core.experiments.prediction_figures import pipeline_figures
from asyncgrpo.core.rollout import pacing
from asyncgrpo.shell.experiments.calibrate import simulated_seeds
from asyncgrpo.shell.run import read_metrics

WARM_UP_STEPS = 5


@contextlib.contextmanager
def unpaced() -> Iterator[None]:
    """The control: the simulator's pacing with no group in flight counted."""
    counted = pacing.GenerationLedger.in_flight_tokens
    pacing.GenerationLedger.in_flight_tokens = lambda ledger: 0  # type: ignore[method-assign]
    try:
        yield
    finally:
        pacing.GenerationLedger.in_flight_tokens = counted  # type: ignore[method-assign]


SIMULATIONS = {
    "alike": (1.0, contextlib.nullcontext),
    "alone": (0.0, contextlib.nullcontext),
    "alike, unpaced (control)": (1.0, unpaced),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path, help="the output directory of the sweep")
    parser.add_argument("--simulation-seeds", type=int, default=12)
    args = parser.parse_args()
    seeds = range(args.simulation_seeds)
    settings = sorted(p for p in args.sweep.iterdir() if p.is_dir() and any(p.glob("seed=*")))
    for setting in settings:
        for run in sorted(setting.glob("seed=*")):
            rows = read_metrics(run)
            whole, steady = (
                pipeline_figures(rows, skip_windows=skip).stale_drop_frac or 0.0
                for skip in (1, WARM_UP_STEPS)
            )
            parts = [f"{setting.name} {run.name}: measured {whole:.2%}, steady {steady:.2%}"]
            for name, (correlation, pacing_used) in SIMULATIONS.items():
                knobs = {
                    "completion_lengths": long_tail_lengths(),
                    "group_length_correlation": correlation,
                    "skill_per_step": 0.0,  # the run's policy barely moves
                }
                shares = []
                for skip in (1, WARM_UP_STEPS):
                    with tempfile.TemporaryDirectory() as out, pacing_used():
                        figures = simulated_seeds(run, out, seeds, knobs, skip_windows=skip)
                    shares.append([f.stale_drop_frac or 0.0 for f in figures])
                parts.append(
                    f"{name} {np.median(shares[0]):.2%}, steady {np.median(shares[1]):.2%} "
                    f"[{min(shares[1]):.1%}, {max(shares[1]):.1%}]"
                )
            print("; ".join(parts), flush=True)


if __name__ == "__main__":
    main()
