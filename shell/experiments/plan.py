"""``asyncgrpo plan --calibrate RUN --devices N``: recommend ``max_staleness``,
``weight_sync_steps``, the number of servers and the split of a machine's devices, from a
calibration run.

The calibration run (a run of a sweep, on this machine) gives the task (prompt and completion
lengths, group size, token budget) and the measured throughputs
(:func:`asyncgrpo.shell.experiments.calibrate.fit_run`); ``--calibration-devices TRAIN:SERVER``
says how many devices its trainer and its server had (on 2 cores the CPU plan gives 1 and 1).
Every candidate of :func:`asyncgrpo.core.experiments.recommend.candidates` is simulated with
those throughputs scaled to its devices, and :func:`~asyncgrpo.core.experiments.recommend.recommend`
picks one. With ``--gpu NAME --parameters P`` the throughputs are predicted from the GPU's
published peak figures instead (:func:`~asyncgrpo.core.experiments.recommend.gpu_throughputs`):
a prediction for a machine that was not measured, labelled so in the report. Where the
calibration run's sweep probed its server (``[probe]``,
:mod:`~asyncgrpo.shell.experiments.generator_probe`), each server's throughput follows the
requests in flight and both sides slow each other as probed.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
from tqdm import tqdm

from asyncgrpo.core.experiments.prediction_figures import pipeline_figures, samples_per_s
from asyncgrpo.core.experiments.recommend import (
    GPUS,
    STALENESS_CHOICES,
    SYNC_STEP_CHOICES,
    Candidate,
    Prediction,
    Throughputs,
    candidates,
    gpu_throughputs,
    recommend,
    scaled_throughputs,
)
from asyncgrpo.shell.experiments.calibrate import (
    fit_run,
    fitted_per_server,
    run_config,
    simulation_of,
    with_probe,
)
from asyncgrpo.shell.experiments.generator_probe import read_probe
from asyncgrpo.shell.experiments.simulate import simulate

TICKS_PER_GROUP = 20
"""The simulation's tick is at most this fraction of a group's generation or training time."""

PUSH_BYTES_PER_S = 25e9
"""The GPU prediction's push: bf16 weights at 25 GB/s (a conservative NCCL broadcast)."""


@attrs.frozen
class Plan:
    """The recommendation and what it was chosen from.

    Attributes:
        devices: devices of the planned machine.
        source: where the throughputs come from (measured and scaled, or predicted).
        throughputs: the throughputs before scaling (per device for a GPU prediction).
        predictions: every candidate's simulated figures, best samples per second first.
        recommended: the chosen one.
        calibrated: the calibration run's own setting on its own devices, simulated (the
            reference the recommendation is compared with).
    """

    devices: int
    source: str
    throughputs: Throughputs
    predictions: tuple[Prediction, ...]
    recommended: Prediction
    calibrated: Prediction


def measured_throughputs(run: Path) -> Throughputs:
    """The calibration run's fitted throughputs, the generator's per server; a run that does
    not identify its generator (its trainer never waited) cannot be planned from, and the
    error says what to run."""
    fit = fit_run(run)
    if fit.generation_tokens_per_s is None:
        raise ValueError(f"{run}: {fit.generation.note}")
    return Throughputs(**fitted_per_server(run, fit))


def _predict(
    run: Path,
    candidate: Candidate,
    throughputs: Throughputs,
    output_dir: Path,
    max_steps: int | None,
    probe_scale: float | None = None,
) -> Prediction:
    """Simulate ``candidate`` on the calibration run's task (its steps and logging windows, or
    ``max_steps`` in 8 windows); ``probe_scale``: use the run's sweep's probe, its server's
    throughput times this, where there is one (None: not)."""
    settings: dict[str, Any] = dict(throughputs.as_settings())
    if probe_scale is not None:
        settings = with_probe(run, settings, probe_scale)
    simulation = attrs.evolve(
        simulation_of(run, settings, servers=candidate.servers),
        max_staleness=candidate.max_staleness,
        weight_sync_steps=candidate.weight_sync_steps,
        weight_push_overlap=True,
    )
    if max_steps is not None:
        simulation = attrs.evolve(
            simulation, max_steps=max_steps, logging_steps=max(1, max_steps // 8)
        )
    # ticks short enough that a group's generation or training spans TICKS_PER_GROUP of them
    # (a GPU's throughputs make a step of this task milliseconds long)
    group_tokens = simulation.num_generations * (
        simulation.prompt_tokens + simulation.completion_tokens
    )
    fastest = max(throughputs.generation_tokens_per_s, throughputs.training_tokens_per_s)
    tick_s = min(simulation.tick_s, group_tokens / fastest / TICKS_PER_GROUP)
    simulation = attrs.evolve(simulation, tick_s=tick_s)
    windows = simulate(simulation, output_dir / candidate.label(), progress=False)
    figures = pipeline_figures(windows)
    return Prediction(
        candidate,
        samples_per_s(windows),
        figures.step_s,
        figures.staleness or 0.0,
        figures.trainer_idle_frac,
    )


def plan(
    calibration_run: str | Path,
    devices: int,
    output_dir: str | Path,
    calibration_devices: tuple[int, int] = (1, 1),
    gpu: str | None = None,
    parameters: float | None = None,
    max_servers: int | None = None,
    staleness_choices: Sequence[int] = STALENESS_CHOICES,
    sync_step_choices: Sequence[int] = SYNC_STEP_CHOICES,
    max_steps: int | None = None,
    progress: bool = True,
) -> Plan:
    """Simulate every candidate on ``devices`` and recommend one (the module's docstring),
    each for the calibration run's steps (or ``max_steps``). Simulations land under
    ``output_dir``."""
    run, out = Path(calibration_run), Path(output_dir)
    config = run_config(run)
    if gpu is not None:
        if gpu not in GPUS or parameters is None:
            raise ValueError(
                f"--gpu takes one of {', '.join(GPUS)} with --parameters (the "
                f"model's parameter count), got {gpu!r}"
            )
        per_device = gpu_throughputs(
            GPUS[gpu],
            parameters,
            config.max_concurrent_rollouts,
            weight_sync_s=2 * parameters / PUSH_BYTES_PER_S,
        )
        base, base_devices = per_device, (1, 1)
        source = (
            f"PREDICTED from the {gpu}'s published peak figures for {parameters:.3g} "
            "parameters (not measured; upper bounds)"
        )
    else:
        base, base_devices = measured_throughputs(run), calibration_devices
        source = (
            f"measured by {run} on {base_devices[0]} trainer and {base_devices[1]} server "
            "device(s), per-token throughputs scaled in proportion to devices "
            "(an upper bound on CPU cores)"
        )
        if read_probe(run) is not None:
            source += (
                "; each server's throughput against the requests in flight, and the "
                "contention, from its sweep's probe"
            )
    chosen = candidates(devices, staleness_choices, sync_step_choices, max_servers)
    predictions = []
    measured = gpu is None
    for candidate in tqdm(chosen, desc="plan", unit="setting", disable=not progress):
        scaled = scaled_throughputs(base, *base_devices, candidate, devices)
        scale = scaled.generation_tokens_per_s / base.generation_tokens_per_s
        predictions.append(
            _predict(run, candidate, scaled, out, max_steps, scale if measured else None)
        )
    own = Candidate(base_devices[0], 1, config.max_staleness, config.weight_sync_steps)
    calibrated = _predict(run, own, base, out / "calibrated", max_steps, 1.0 if measured else None)
    predictions.sort(key=lambda p: -p.samples_per_s)
    return Plan(devices, source, base, tuple(predictions), recommend(predictions), calibrated)


def plan_report(result: Plan, rows: int = 10) -> str:
    """The recommendation, the source of its throughputs and the best ``rows`` candidates as
    a markdown table."""
    r = result.recommended
    lines = [
        f"recommended for {result.devices} devices: max_staleness={r.candidate.max_staleness}, "
        f"weight_sync_steps={r.candidate.weight_sync_steps}, "
        f"{r.candidate.train_devices} device(s) to the trainer, "
        f"{r.candidate.generation_devices(result.devices)} to {r.candidate.servers} server(s)",
        f"predicted: {r.samples_per_s:.2f} samples/s, step {r.step_s:.3f} s, staleness "
        f"{r.staleness:.2f}, trainer idle {r.trainer_idle_frac:.0%} (the calibration run's "
        f"setting, simulated: {result.calibrated.samples_per_s:.2f} samples/s)",
        f"throughputs: {result.source}",
        "",
        "| max_staleness | weight_sync_steps | trainer devices | servers | samples/s | step s "
        "| staleness | trainer idle |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in result.predictions[:rows]:
        c = p.candidate
        lines.append(
            f"| {c.max_staleness} | {c.weight_sync_steps} | {c.train_devices} | "
            f"{c.servers} | {p.samples_per_s:.2f} | {p.step_s:.3f} | {p.staleness:.2f} "
            f"| {p.trainer_idle_frac:.0%} |"
        )
    return "\n".join(lines)
