"""Experiments as code, the library behind :mod:`asyncgrpo.experiments`: sweeps over settings
and seeds (:mod:`.sweep`; each run's process: :mod:`.sweep_run`), comparisons with intervals
and claims (:mod:`.compare`), the pipeline simulator (:mod:`.simulate`) and its calibration
from a real run (:mod:`.calibrate`) with a sweep's probe of its server
(:mod:`.generator_probe`, its training load: :mod:`.training_load`), recommended settings
for a machine (:mod:`.plan`) or for a GPU run described by a workload file
(:mod:`.workload_plan`), a run's plots (:mod:`.plot`) and evaluations of any model or
checkpoint (:mod:`.evaluate`).

It sits above the run wing (a sweep's run is a trainer) and below the commands, which are
argparse glue over it.
"""

from __future__ import annotations

from asyncgrpo.core.experiments.recommend import STALENESS_CHOICES, SYNC_STEP_CHOICES
from asyncgrpo.shell.experiments.calibrate import (
    RUN_SETTINGS,
    calibrate_and_predict,
    predict_servers,
    record_run_settings,
    report,
    servers_report,
)
from asyncgrpo.shell.experiments.compare import Comparison, compare, load_runs
from asyncgrpo.shell.experiments.evaluate import evaluate_model, evaluation_table, served_model
from asyncgrpo.shell.experiments.generator_probe import Probe, read_probe
from asyncgrpo.shell.experiments.plan import Plan, plan, plan_report
from asyncgrpo.shell.experiments.plot import plot_run, server_panels
from asyncgrpo.shell.experiments.simulate import SimulationConfig, simulate
from asyncgrpo.shell.experiments.sweep import (
    StopRule,
    Sweep,
    SweepError,
    SweepResult,
    read_index,
    read_sweep,
    run_sweep,
)
from asyncgrpo.shell.experiments.workload_plan import (
    WorkloadPlan,
    plan_workload,
    read_workload,
    workload_report,
)

__all__ = [
    "RUN_SETTINGS",
    "STALENESS_CHOICES",
    "SYNC_STEP_CHOICES",
    "Comparison",
    "Plan",
    "Probe",
    "SimulationConfig",
    "StopRule",
    "Sweep",
    "SweepError",
    "SweepResult",
    "WorkloadPlan",
    "calibrate_and_predict",
    "compare",
    "evaluate_model",
    "evaluation_table",
    "load_runs",
    "plan",
    "plan_report",
    "plan_workload",
    "plot_run",
    "predict_servers",
    "read_index",
    "read_probe",
    "read_sweep",
    "read_workload",
    "record_run_settings",
    "report",
    "run_sweep",
    "served_model",
    "server_panels",
    "servers_report",
    "simulate",
    "workload_report",
]
