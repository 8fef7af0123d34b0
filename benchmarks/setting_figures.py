"""Per-setting figures of a sweep's runs, for the benchmark scripts that compare two settings
(``benchmarks/delta_sync.py``, ``benchmarks/kv_across_push.py``)."""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from asyncgrpo.core.experiments.stats import bootstrap_interval
from asyncgrpo.shell.run import read_metrics

Figure = tuple[str, str, float]
"""A metric's key, its printed label and the scale it is printed at."""


def settings_of(sweep_dir: Path) -> list[Path]:
    """The sweep's setting directories (those holding ``seed=*`` runs), sorted."""
    return sorted(p for p in sweep_dir.iterdir() if p.is_dir() and any(p.glob("seed=*")))


def rows_after_the_first_step(setting: Path) -> tuple[list[Path], list[dict[str, Any]]]:
    """The setting's seed directories and their logged windows after step 1 (whose push and
    start-up are the run's own); prints a heading for the setting."""
    seeds = sorted(setting.glob("seed=*"))
    rows = [row for seed in seeds for row in read_metrics(seed) if row["step"] > 1]
    print(f"{setting.name} ({len(seeds)} seeds, steps 2 and later: {len(rows)} rows)")
    return seeds, rows


def print_medians(rows: Sequence[dict[str, Any]], figures: Sequence[Figure]) -> dict[str, float]:
    """Print each figure's median over ``rows`` with its 90% bootstrap interval (seeded);
    returns the medians by key (a figure not logged is left out)."""
    medians: dict[str, float] = {}
    for key, label, scale in figures:
        values = [row[key] * scale for row in rows if key in row]
        if not values:
            print(f"  {label:>17s}: not logged")
            continue
        interval = bootstrap_interval(values, rng=0)
        medians[key] = interval.estimate
        print(
            f"  {label:>17s}: median {interval.estimate:10.4g} "
            f"[{interval.low:.4g}, {interval.high:.4g}] over {len(values)}"
        )
    return medians


def each_setting(
    description: str, figures: Sequence[Figure]
) -> Iterator[tuple[Path, list[Path], list[dict[str, Any]], dict[str, float]]]:
    """Read the sweep directory from the command line and, per setting, print its figures'
    medians: yields the setting, its seed directories, its windows after step 1 and the
    medians (which the caller may add to)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("sweep_dir", type=Path)
    args = parser.parse_args()
    for setting in settings_of(args.sweep_dir):
        seeds, rows = rows_after_the_first_step(setting)
        yield setting, seeds, rows, print_medians(rows, figures)
