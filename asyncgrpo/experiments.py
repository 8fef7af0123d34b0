"""Experiments as code: sweeps over settings and seeds, comparisons with intervals, claims,
and recommended settings for a machine (``plan``).

    from asyncgrpo.experiments import compare, run_sweep

    run_sweep("benchmarks/async_vs_sync.toml", "runs/async-vs-sync")
    report = compare(["runs/async-vs-sync"])
    print(report.table)          # medians over seeds with bootstrap intervals
    report.exit_status           # 1 when a claim of the sweep file fails

The same as ``asyncgrpo sweep``, ``asyncgrpo compare`` and ``asyncgrpo plan``
(docs/experiments.md). The
statistics are pure functions in :mod:`asyncgrpo.core.experiments.stats`,
:mod:`asyncgrpo.core.experiments.curves`, :mod:`asyncgrpo.core.experiments.claims` and
:mod:`asyncgrpo.core.experiments.verdicts`.
"""

from __future__ import annotations

from asyncgrpo.shell.experiments import (
    Comparison,
    Plan,
    StopRule,
    Sweep,
    SweepError,
    SweepResult,
    WorkloadPlan,
    compare,
    load_runs,
    plan,
    plan_report,
    plan_workload,
    read_index,
    read_sweep,
    read_workload,
    run_sweep,
    workload_report,
)

__all__ = [
    "Comparison",
    "Plan",
    "StopRule",
    "Sweep",
    "SweepError",
    "SweepResult",
    "WorkloadPlan",
    "compare",
    "load_runs",
    "plan",
    "plan_report",
    "plan_workload",
    "read_index",
    "read_sweep",
    "read_workload",
    "run_sweep",
    "workload_report",
]
