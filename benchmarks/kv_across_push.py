"""The KV cache across a weight push (``weight_push_keeps_kv_cache``) against today's default,
from a sweep's runs.

Run ``benchmarks/kv_across_push.toml`` (or ``kv_across_push_real.toml``) first, then::

    .venv/bin/python benchmarks/kv_across_push.py runs/kv-across-push

For each setting, over the steps after the first of every seed:

* the requests the server preempted, per push (``rollout/vllm_preemption_count`` summed over
  the windows after the first that reports it, divided by the pushes): by default every
  request running at a push;
* generated tokens per second (``rollout/generated_tokens_per_s``), the share of trained tokens
  the importance-sampling keep range dropped (``sampling/masked_mean``), the server's paused
  time (``perf/weight_sync_transfer_s``) and the step's time (``perf/step_s``).

Medians with their 90% bootstrap intervals (preemptions: the rate over all pushes), then the
ratios of the medians, kept over default. Time to a reward is ``asyncgrpo compare``'s, which the
sweep prints when it ends.
"""

from __future__ import annotations

import sys
from pathlib import Path

from asyncgrpo.shell.run import read_metrics

sys.path.insert(0, str(Path(__file__).parent))
from setting_figures import each_setting

FIGURES = (
    ("rollout/generated_tokens_per_s", "generated tok/s", 1.0),
    ("sampling/masked_mean", "IS masked frac", 1.0),
    ("perf/weight_sync_transfer_s", "server paused ms", 1e3),
    ("perf/step_s", "step s", 1.0),
)
PREEMPTIONS = "rollout/vllm_preemption_count"


def counted_preemptions(run: Path) -> float:
    """A run's preemptions after its first window that reports them: that window is the
    baseline of the server's counter (which counts from the server's start, a shared server's
    earlier runs included)."""
    counts = [row[PREEMPTIONS] for row in read_metrics(run) if PREEMPTIONS in row]
    return sum(counts[1:])


def main() -> None:
    medians: dict[str, dict[str, float]] = {}
    for setting, seeds, rows, found in each_setting(__doc__.splitlines()[0], FIGURES):
        medians[setting.name] = found
        pushes = sum(1 for row in rows if "perf/weight_sync_transfer_s" in row)
        preempted = sum(counted_preemptions(seed) for seed in seeds)
        if pushes:
            rate = preempted / pushes
            medians[setting.name][PREEMPTIONS] = rate
            print(f"  {'preempted/push':>17s}: {rate:.3g} ({preempted:g} in {pushes} pushes)")
    default, kept = (medians.get(f"weight_push_keeps_kv_cache={v}", {}) for v in ("false", "true"))
    for key, label in [(PREEMPTIONS, "preempted/push"), *((k, n) for k, n, _ in FIGURES)]:
        if key in default and key in kept and default[key]:
            print(f"kept / default, {label}: {kept[key] / default[key]:.3f}")


if __name__ == "__main__":
    main()
