"""The KV cache across a weight push (``weight_push_keeps_kv_cache``) against today's default,
from a sweep's runs.

Run ``benchmarks/kv_across_push.toml`` (or ``kv_across_push_real.toml``) first, then::

    .venv/bin/python benchmarks/kv_across_push.py runs/kv-across-push

For each setting, over the steps after the first of every seed:

* the KV tokens the server's requests held when a push paused it
  (``perf/weight_sync_held_kv_tokens``): by default the push drops them and the requests
  compute them again (the recomputed prefill of a push, less the prompt blocks a group's
  requests share once recomputed); kept with the setting;
* the requests the server preempted, per push (``rollout/vllm_preemption_count`` summed over
  the windows, divided by the pushes): by default every request running at a push;
* generated tokens per second (``rollout/generated_tokens_per_s``), the share of trained tokens
  the importance-sampling keep range dropped (``sampling/masked_mean``), the server's paused
  time (``perf/weight_sync_transfer_s``) and the step's time (``perf/step_s``).

Medians with their 90% bootstrap intervals (preemptions: the rate over all pushes), then the
ratios of the medians, kept over default. Time to a reward is ``asyncgrpo compare``'s, which the
sweep prints when it ends.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from asyncgrpo.core.experiments.stats import bootstrap_interval
from asyncgrpo.shell.run import read_metrics

FIGURES = (
    ("perf/weight_sync_held_kv_tokens", "held KV tokens", 1.0),
    ("rollout/generated_tokens_per_s", "generated tok/s", 1.0),
    ("sampling/masked_mean", "IS masked frac", 1.0),
    ("perf/weight_sync_transfer_s", "server paused ms", 1e3),
    ("perf/step_s", "step s", 1.0),
)
PREEMPTIONS = "rollout/vllm_preemption_count"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep_dir", type=Path)
    args = parser.parse_args()
    medians: dict[str, dict[str, float]] = {}
    for setting in sorted(p for p in args.sweep_dir.iterdir() if p.is_dir()):
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
        pushes = sum(1 for row in rows if "perf/weight_sync_transfer_s" in row)
        preempted = sum(row.get(PREEMPTIONS, 0.0) for row in rows)
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
