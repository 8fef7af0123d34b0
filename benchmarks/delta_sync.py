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

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from setting_figures import each_setting

FIGURES = (
    ("perf/weight_sync_unchanged_frac", "unchanged", 1.0),
    ("perf/weight_sync_sent_bytes", "MiB sent", 2**-20),
    ("perf/weight_sync_transfer_s", "server paused ms", 1e3),
    ("perf/weight_push_s", "push ms", 1e3),
    ("perf/step_s", "step s", 1.0),
)


def main() -> None:
    medians = {
        setting.name: found
        for setting, _, _, found in each_setting(__doc__.splitlines()[0], FIGURES)
    }
    full, delta = (medians.get(f"weight_sync_delta={v}", {}) for v in ("false", "true"))
    for key, label, _ in FIGURES[1:]:
        if key in full and key in delta:
            print(f"delta / full, {label}: {delta[key] / full[key]:.3f}")


if __name__ == "__main__":
    main()
