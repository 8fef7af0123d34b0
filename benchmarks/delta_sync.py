"""Full weight pushes against delta pushes (``weight_sync_delta``), from a sweep's runs.

Run ``benchmarks/delta_sync.toml`` first (the real model at the real demo's settings, each
seed full then delta, through the ``asyncgrpo_gloo`` engine), then::

    .venv/bin/python benchmarks/delta_sync.py runs/delta-sync

For each setting, over every push after the first (which is full either way) of every seed:
the fraction of elements unchanged since the last push, the bytes sent to the server, the
server's paused time (``perf/weight_sync_transfer_s``: the transfer, the reload, the
prefix-cache reset), the push's own time beside the step (``perf/weight_push_s``: snapshot,
diff and send) and the step's time (``perf/step_s``), each a median with its 90% bootstrap
interval; then the ratios of the medians, delta over full.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from asyncgrpo.core.experiments.stats import bootstrap_interval
from asyncgrpo.shell.run import read_metrics

FIGURES = (
    ("perf/weight_sync_unchanged_frac", "unchanged", 1.0),
    ("perf/weight_sync_sent_bytes", "MiB sent", 2**-20),
    ("perf/weight_sync_transfer_s", "server paused ms", 1e3),
    ("perf/weight_push_s", "push ms", 1e3),
    ("perf/step_s", "step s", 1.0),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path)
    args = parser.parse_args()
    settings = sorted(p for p in args.sweep_dir.iterdir() if p.is_dir())
    medians: dict[str, dict[str, float]] = {}
    for setting in settings:
        seeds = sorted(setting.glob("seed=*"))
        rows = [row for seed in seeds for row in read_metrics(seed) if row["step"] > 1]
        print(f"{setting.name} ({len(seeds)} seeds, steps 2 and later: {len(rows)} rows)")
        medians[setting.name] = {}
        for key, label, scale in FIGURES:
            values = [row[key] * scale for row in rows if key in row]
            if not values:
                print(f"  {label:>17s}: not logged")
                continue
            interval = bootstrap_interval(values, rng=0)
            medians[setting.name][key] = interval.estimate
            print(
                f"  {label:>17s}: median {interval.estimate:10.4g} "
                f"[{interval.low:.4g}, {interval.high:.4g}] over {len(values)}"
            )
    full, delta = (medians.get(f"weight_sync_delta={v}", {}) for v in ("false", "true"))
    for key, label, _ in FIGURES[1:]:
        if key in full and key in delta:
            print(f"delta / full, {label}: {delta[key] / full[key]:.3f}")


if __name__ == "__main__":
    main()
