"""``asyncgrpo simulate --calibrate RUN [--predict RUN ...]``: fit the simulator to a real run, then
predict other runs of the same task and score the predictions.

The fit (:func:`asyncgrpo.core.experiments.calibration.calibrate`) reads the run's
``metrics.jsonl``: training throughput per forwarded token with a fixed and a per-sample cost where
the data supports them, the push's seconds, and the generator's throughput (identified when the
trainer waited for samples, always so at ``max_staleness`` 0). Each predicted run is simulated
with its own settings (from the ``run_spec.json`` of a sweep's run: ``max_staleness``,
``num_generations``, ...; its prompt and completion lengths from its metrics) and the fitted
throughputs, and its step time, staleness and trainer idle are compared with the measured
ones (:func:`asyncgrpo.core.experiments.prediction_figures.compare_figures`).

The generator's throughput is fitted per server (the calibration run's over its number of
servers), and each run is simulated with its own number of servers; ``--predict-servers N
...`` also simulates the calibration run's settings with each number of servers, a throughput
curve (:func:`predict_servers`; docs/scaling.md).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from asyncgrpo.core.experiments.calibration import Calibration, calibrate
from asyncgrpo.core.experiments.generator import fit_concurrency
from asyncgrpo.core.experiments.prediction_figures import (
    FigureError,
    PipelineFigures,
    compare_figures,
    pipeline_figures,
)
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.experiments.generator_probe import Probe, read_probe
from asyncgrpo.shell.experiments.simulate import SimulationConfig, simulate
from asyncgrpo.shell.experiments.sweep import RUN_SPEC, SweepError
from asyncgrpo.shell.run import read_metrics

SIMULATED_PROMPTS = 10_000  # enough prompts that no simulated run ends an epoch


@attrs.frozen
class Prediction:
    """One predicted run: its settings, and each figure predicted against measured."""

    run: str
    settings: Mapping[str, Any]
    errors: tuple[FigureError, ...]


RUN_SETTINGS = "run_settings.json"
"""Written by ``asyncgrpo train`` and ``asyncgrpo demo`` into the run's directory: the settings
a calibration reads (:data:`SETTINGS_READ`), so that any run can be planned from."""
SETTINGS_READ = (
    "output_dir",
    "num_generations",
    "max_staleness",
    "weight_sync_steps",
    "weight_push_overlap",
    "max_concurrent_rollouts",
    "token_budget",
    "gradient_accumulation_steps",
    "logging_steps",
    "max_completion_length",
    "vllm_server_base_url",
    "seed",
)


def record_run_settings(config: AsyncGRPOConfig) -> Path:
    """Write the settings a calibration reads into ``config.output_dir``/:data:`RUN_SETTINGS`."""
    out = config.output_path
    out.mkdir(parents=True, exist_ok=True)
    values = {name: getattr(config, name) for name in SETTINGS_READ}
    (out / RUN_SETTINGS).write_text(json.dumps({"config": values}, indent=1))
    return out / RUN_SETTINGS


def run_config(run_dir: Path) -> AsyncGRPOConfig:
    """A run's config: a sweep run's ``run_spec.json``, or the :data:`RUN_SETTINGS` that
    ``asyncgrpo train`` and ``asyncgrpo demo`` write."""
    for name in (RUN_SPEC, RUN_SETTINGS):
        if (run_dir / name).exists():
            return AsyncGRPOConfig(**json.loads((run_dir / name).read_text())["config"])
    raise SweepError(
        f"{run_dir}: neither {RUN_SPEC} (a run of asyncgrpo sweep) nor {RUN_SETTINGS} (written by "
        "asyncgrpo train and asyncgrpo demo since 2026-12-05): calibrate from a run that "
        f"recorded its settings (run it again), or write {run_dir / RUN_SETTINGS} as "
        '{"config": {"max_staleness": ..., "num_generations": ..., ...}} with its '
        "AsyncGRPOConfig fields"
    )


def simulation_of(
    run_dir: Path,
    fitted: Mapping[str, Any],
    seed: int = 0,
    servers: int | None = None,
    knobs: Mapping[str, Any] | None = None,
) -> SimulationConfig:
    """The simulation of a run: its settings, its measured lengths, the fitted throughputs
    (the generator's per server), with the run's number of servers or ``servers``.

    ``knobs`` adds what a run's metrics do not tell, as :class:`SimulationConfig` knobs: say
    ``completion_lengths`` (a distribution in place of the one drawn from the shortest, mean
    and longest completion), ``group_length_correlation`` (how alike a group's lengths are; 0
    without it) or ``skill_per_step`` (0 for a policy that barely moves)."""
    config = run_config(run_dir)
    rows = read_metrics(run_dir)

    def median(key: str, default: float) -> float:
        values = [r[key] for r in rows if r.get(key) is not None]
        return statistics.median(values) if values else default

    completion = median("completions/mean_length", config.max_completion_length)
    # a sample's own tokens, its prompt unshared
    sample = median("sample/forwarded_tokens_mean", 0.0)
    if sample:
        prompt = max(1, round(sample - completion))
    else:  # a step's forwarded tokens: each group's prompt once, for the group's samples
        forwarded = median("batch/forwarded_tokens_per_step", 0.0)
        per_sample = forwarded / max(median("batch/samples_per_step", 1.0), 1.0)
        prompt = max(1, round((per_sample - completion) * config.num_generations))
    # the longest prompt, from the longest sample against the mean completion (at most 2x the
    # mean prompt less one: the simulator draws prompts symmetric around the mean)
    longest_samples = [r.get("sample/forwarded_tokens_max") for r in rows]
    longest_sample = max((s for s in longest_samples if s is not None), default=0.0)
    longest_prompt = min(max(prompt, round(longest_sample - completion)), 2 * prompt - 1)
    shortest = max(1, round(median("completions/min_length", completion)))
    longest = max(shortest, round(median("completions/max_length", completion)))
    budget = config.token_budget or (longest_prompt + config.max_completion_length)
    return SimulationConfig(
        max_steps=int(rows[-1]["step"]),
        dataset_size=SIMULATED_PROMPTS,
        num_generations=config.num_generations,
        max_staleness=config.max_staleness,
        weight_sync_steps=config.weight_sync_steps,
        weight_push_overlap=config.weight_push_overlap,
        max_concurrent_rollouts=max(config.max_concurrent_rollouts, config.num_generations),
        token_budget=max(budget, longest_prompt + longest),
        rows_per_step=config.gradient_accumulation_steps,
        prompt_tokens=prompt,
        longest_prompt_tokens=longest_prompt if longest_prompt > prompt else None,
        min_completion_tokens=shortest,
        max_completion_tokens=longest,
        mean_completion_tokens=min(max(completion, shortest), longest),
        logging_steps=int(config.logging_steps) if config.logging_steps >= 1 else 1,
        seed=seed,
        num_servers=servers or len(config.server_urls),
        **fitted,
        **(knobs or {}),
    )


def fit_run(run_dir: Path) -> Calibration:
    config = run_config(run_dir)
    return calibrate(
        read_metrics(run_dir),
        max_staleness=config.max_staleness,
        weight_sync_steps=config.weight_sync_steps,
    )


def fitted_per_server(run_dir: Path, fit: Calibration) -> dict[str, float]:
    """The simulator's settings fitted to a run, the generator's throughput per server (the
    run's over its number of servers)."""
    fitted = fit.simulator_settings(with_fixed_costs=True)
    if "generation_tokens_per_s" in fitted:
        fitted["generation_tokens_per_s"] /= len(run_config(run_dir).server_urls)
    return fitted


def with_probe(run_dir: Path, fitted: Mapping[str, float], scale: float = 1.0) -> dict[str, Any]:
    """``fitted`` with the probe of the run's sweep where there is one
    (:mod:`~asyncgrpo.shell.experiments.generator_probe`): the generator's throughput as a
    function of the requests in flight (in place of the one throughput fitted from the run),
    ``scale`` times the probed server's, and each side's slowdown beside the other. Unchanged
    without a probe."""
    probe = read_probe(run_dir)
    if probe is None:
        return dict(fitted)
    settings: dict[str, Any] = {k: v for k, v in fitted.items() if k != "generation_tokens_per_s"}
    concurrencies = ", ".join(str(p.concurrency) for p in probe.points)
    settings["generator"] = fit_concurrency(
        [(p.concurrency, scale * p.tokens_per_s) for p in probe.points],
        source=f"probed at {concurrencies} requests in flight",
    )
    settings["training_slowdown"] = probe.training_slowdown
    settings["generation_slowdown"] = probe.generation_slowdown
    return settings


def calibrate_and_predict(
    calibration_run: str | Path,
    predict: Sequence[str | Path],
    output_dir: str | Path,
    knobs: Mapping[str, Any] | None = None,
) -> tuple[Calibration, list[Prediction]]:
    """Fit on ``calibration_run``; simulate and score each of ``predict`` (the calibration run
    itself is scored too, as the in-sample check), with ``knobs`` as in
    :func:`simulation_of`. Simulations land under ``output_dir``."""
    fit = fit_run(Path(calibration_run))
    fitted = with_probe(Path(calibration_run), fitted_per_server(Path(calibration_run), fit))
    predictions = []
    for run in [Path(calibration_run), *map(Path, predict)]:
        simulation = simulation_of(run, fitted, knobs=knobs)
        # a sweep's runs are <settings>/seed=<n>: both name the simulation's directory
        simulated = simulate(
            simulation, Path(output_dir) / run.parent.name / run.name, progress=False
        )
        errors = compare_figures(pipeline_figures(simulated), pipeline_figures(read_metrics(run)))
        settings = {
            "max_staleness": simulation.max_staleness,
            "num_servers": simulation.num_servers,
        }
        predictions.append(Prediction(str(run), settings, tuple(errors)))
    return fit, predictions


def simulated_seeds(
    run_dir: str | Path,
    output_dir: str | Path,
    seeds: Sequence[int],
    knobs: Mapping[str, Any] | None = None,
    skip_windows: int = 1,
) -> list[PipelineFigures]:
    """The run simulated with its own fit (and its sweep's probe, where there is one), once
    per seed of ``seeds``, each simulation's figures (its stale drops among them): how far the
    simulator's chance spreads a figure, to set a measured one against. ``knobs`` as in
    :func:`simulation_of`; the figures leave out the first ``skip_windows`` windows (as
    :func:`~asyncgrpo.core.experiments.prediction_figures.pipeline_figures`); simulations land
    under ``output_dir/seed=N``."""
    run = Path(run_dir)
    fitted = with_probe(run, fitted_per_server(run, fit_run(run)))
    return [
        pipeline_figures(
            simulate(
                simulation_of(run, fitted, seed=seed, knobs=knobs),
                Path(output_dir) / f"seed={seed}",
                progress=False,
            ),
            skip_windows=skip_windows,
        )
        for seed in seeds
    ]


@attrs.frozen
class ServerPoint:
    """One point of the predicted throughput curve: the calibration run's settings with
    ``servers`` servers (each with the fitted per-server throughput)."""

    servers: int
    step_s: float
    samples_per_s: float
    trainer_idle_frac: float


def predict_servers(
    calibration_run: str | Path, counts: Sequence[int], output_dir: str | Path
) -> list[ServerPoint]:
    """Simulate the calibration run's settings with each number of servers in ``counts``."""
    run = Path(calibration_run)
    fitted = with_probe(run, fitted_per_server(run, fit_run(run)))
    points = []
    for count in counts:
        simulated = simulate(
            simulation_of(run, fitted, servers=count),
            Path(output_dir) / f"servers={count}",
            progress=False,
        )
        figures = pipeline_figures(simulated)
        samples = statistics.median(
            w["batch/samples_per_step"] for w in simulated[1:] if "batch/samples_per_step" in w
        )
        points.append(
            ServerPoint(count, figures.step_s, samples / figures.step_s, figures.trainer_idle_frac)
        )
    return points


def servers_report(points: Sequence[ServerPoint]) -> str:
    """The predicted curve as a markdown table."""
    lines = [
        "| servers | predicted step s | predicted samples/s | predicted trainer idle |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {p.servers} | {p.step_s:.3f} | {p.samples_per_s:.1f} | {p.trainer_idle_frac:.0%} |"
        for p in points
    ]
    return "\n".join(lines)


def report(fit: Calibration, predictions: Sequence[Prediction], probe: Probe | None = None) -> str:
    """The fitted values (and the sweep's probe, where the simulations used one) and a markdown
    table of predicted against measured figures."""
    fitted = fit.simulator_settings(with_fixed_costs=True)
    lines = ["fitted: " + ", ".join(f"{k}={v:.4g}" for k, v in fitted.items())]
    if probe is not None:
        points = ", ".join(f"{p.tokens_per_s:.0f} at {p.concurrency}" for p in probe.points)
        lines.append(
            f"probed (used instead of generation_tokens_per_s): tokens/s {points}; "
            f"training_slowdown={probe.training_slowdown:.3g}, generation_slowdown="
            f"{probe.generation_slowdown:.3g} ({probe.note})"
        )
    lines += [
        "",
        "| run | figure | predicted | measured | relative error |",
        "|---|---|---|---|---|",
    ]
    for prediction in predictions:
        for error in prediction.errors:
            relative = "-" if error.relative is None else f"{error.relative:+.1%}"
            lines.append(
                f"| {prediction.run} | {error.name} | {_number(error.predicted)} | "
                f"{_number(error.measured)} | {relative} |"
            )
    return "\n".join(lines)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"
