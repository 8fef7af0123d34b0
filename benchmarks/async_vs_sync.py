"""Asynchrony against no overlap: one of the ``async_vs_sync_*.toml`` sweeps, its comparison, and
the most overlap can gain per step on this machine.

The sweep runs the same task at ``max_staleness`` 0, 1, 2 and 4 over its seeds
(``asyncgrpo sweep``; run again, it finishes what is left). The comparison
(``asyncgrpo compare``) gives, per setting, time and steps to the threshold with bootstrap 90%
intervals, the ratio to max_staleness 0, the runs that collapsed, the step's time parts
(``perf/weight_sync_s`` is what the step waits for the push, ``perf/weight_push_s`` the push's
own time) and the verdicts of the sweep file's claims. At ``max_staleness=0`` generation runs
only while the trainer waits, so its runs' medians of T_gen (``perf/rollout_wait_s``), T_train
(the rest of the step) and T_sync (``perf/weight_sync_s``) give the **ceiling** of overlap per
step on two cores, ``(T_gen + T_train + T_sync) / (max(T_gen, T_train) + T_sync)``::

    .venv/bin/python benchmarks/async_vs_sync.py benchmarks/async_vs_sync_demo.toml runs/avs-demo
    .venv/bin/python benchmarks/async_vs_sync.py benchmarks/async_vs_sync_demo.toml runs/avs-demo \
        --report   # the comparison only

The exit status is 1 when a claim of the sweep file fails.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from asyncgrpo.experiments import compare, read_index, run_sweep
from asyncgrpo.shell.run import read_metrics


def ceiling(gen_s: float, train_s: float, sync_s: float) -> float:
    """The most overlap can gain on two cores: per step ``T_gen + T_train + T_sync`` becomes
    ``max(T_gen, T_train) + T_sync`` (the sync pauses the server, so it never overlaps)."""
    return (gen_s + train_s + sync_s) / (max(gen_s, train_s) + sync_s)


def step_parts(out: Path) -> tuple[float, float, float] | None:
    """Medians over the max_staleness=0 runs' steps of T_gen, T_train and T_sync (seconds)."""
    gen, train, sync = [], [], []
    for entry in read_index(out):
        if entry["status"] != "finished" or str(entry["settings"].get("max_staleness")) != "0":
            continue
        for row in read_metrics(out / entry["name"]):
            step, wait = row.get("perf/step_s"), row.get("perf/rollout_wait_s") or 0.0
            push = row.get("perf/weight_sync_s") or 0.0
            if step is not None:
                gen.append(wait)
                train.append(step - wait - push)
                sync.append(push)
    if not gen:
        return None
    return statistics.median(gen), statistics.median(train), statistics.median(sync)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_file")
    parser.add_argument("output_dir")
    parser.add_argument("--report", action="store_true", help="compare the saved runs only")
    args = parser.parse_args()
    out = Path(args.output_dir)
    if not args.report:
        run_sweep(args.sweep_file, out)
    comparison = compare([out])
    print(comparison.table)
    parts = step_parts(out)
    if parts is not None:
        gen, train, sync = parts
        print(
            f"ceiling of overlap per step (from max_staleness 0): {ceiling(*parts):.2f}x "
            f"(T_gen {gen:.3f} s, T_train {train:.3f} s, T_sync {sync:.3f} s)"
        )
    return comparison.exit_status


if __name__ == "__main__":
    sys.exit(main())
