"""``asyncgrpo plan --workload FILE --gpus N``: plan a GPU run from a description of it, without
running it first.

The workload file (:mod:`asyncgrpo.core.experiments.workload`; its ``[model] config`` path is
read here, relative to the file) gives the model, the GPUs, the batch and the lengths. Every
feasible split of the GPUs (:func:`asyncgrpo.core.experiments.gpu_plan.splits`) is screened by
its parts' steady rates, and the best ``top_splits`` are simulated with every
``max_staleness`` and ``weight_sync_steps`` the workload leaves open, the generator, trainer
and push of each split composed from the part models
(:mod:`asyncgrpo.core.experiments.generator`, :mod:`asyncgrpo.core.experiments.parts`).
:func:`~asyncgrpo.core.experiments.recommend.recommend` picks one; the synchronous setting of
the same split (``max_staleness`` 0) is simulated beside it, and the launch commands of the
chosen split are written (:mod:`asyncgrpo.core.experiments.launch`).

Long responses are simulated in units of several tokens (:data:`UNIT_SAMPLE_TOKENS` to a
mean sample), every part model counted in the same units, so that a plan takes seconds.
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
from tqdm import tqdm

from asyncgrpo.core.experiments import generator as generators
from asyncgrpo.core.experiments import gpu_plan
from asyncgrpo.core.experiments.launch import ENGINE_OF_PATH, Block, launch_blocks
from asyncgrpo.core.experiments.prediction_figures import pipeline_figures, samples_per_s
from asyncgrpo.core.experiments.recommend import (
    STALENESS_CHOICES,
    SYNC_STEP_CHOICES,
    Candidate,
    Prediction,
    paced_to_confirm,
    recommend,
)
from asyncgrpo.core.experiments.scale import SCALE_TOLERANCE, simulation_scale
from asyncgrpo.core.experiments.workload import Workload, WorkloadError, workload_from_mapping
from asyncgrpo.shell.experiments.simulate import simulate
from asyncgrpo.shell.experiments.simulation_config import SimulationConfig

UNIT_SAMPLE_TOKENS = 96
"""Simulated tokens of a mean sample: longer samples are simulated in units of several tokens."""
TICKS_PER_RESPONSE = 60
"""The tick is at most this fraction of a mean response's time, and of a step's training."""
STEPS = 12
START_STEPS = 2
"""Steps left out of the predictions: the pipeline filling up."""


def read_workload(path: str | Path) -> Workload:
    """The workload of a TOML file; a ``[model] config`` path (relative to the file) is read
    as the model's ``config.json``.

    Raises:
        WorkloadError: a file that is missing or not TOML, or a bad key (naming it).
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise WorkloadError(f"{path}: no such workload file") from None
    except tomllib.TOMLDecodeError as error:
        raise WorkloadError(f"{path}: not TOML: {error}") from error
    config = data.get("model", {}).get("config") if isinstance(data.get("model"), dict) else None
    if isinstance(config, str):
        config_path = path.parent / config
        try:
            data["model"]["config"] = json.loads(config_path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise WorkloadError(
                f"[model] config: cannot read {config_path} as an HF config.json ({error})"
            ) from error
    try:
        return workload_from_mapping(data)
    except WorkloadError as error:
        raise WorkloadError(f"{path}: {error}") from error


@attrs.frozen
class WorkloadPlan:
    """The plan and what it was chosen from.

    Attributes:
        workload: the workload planned.
        gpus: GPUs of the plan.
        recommended: the chosen setting's prediction.
        synchronous: the chosen split at ``max_staleness`` 0 and a push every step.
        colocated: every GPU generating, then training, with the chosen servers' tensor
            parallelism (:func:`colocated_config`): the synchronous baseline of most
            frameworks.
        predictions: every simulated setting, most samples per second first.
        shape: the step's settings of the chosen split.
        layout: where its roles run.
        parts: the part models' sources (generator, trainer, push), one line each.
        blocks: the launch commands.
        simulated: every simulation the plan ran, in order.
    """

    workload: Workload
    gpus: int
    recommended: Prediction
    synchronous: Prediction
    colocated: Prediction
    predictions: tuple[Prediction, ...]
    shape: gpu_plan.StepShape
    layout: gpu_plan.Layout
    parts: tuple[str, ...]
    blocks: tuple[Block, ...]
    simulated: tuple[Simulation, ...] = ()


def simulation_config(
    workload: Workload,
    split: gpu_plan.Split,
    max_staleness: int,
    weight_sync_steps: int,
    steps: int = STEPS,
    colocated: bool = False,
) -> SimulationConfig:
    """The simulation of ``split`` at these settings: lengths, generator, trainer and push
    from the part models, counted in units of several tokens (the module's docstring).
    ``colocated``: the trainer and the servers on the same GPUs (:func:`colocated_config`)."""
    shape = gpu_plan.step_shape(workload, split)
    where: gpu_plan.Layout | None
    if colocated:
        where = gpu_plan.colocated_layout(split, workload.gpus_per_node)
    else:
        gpus = split.trainer_gpus + split.server_gpus
        where = gpu_plan.layout(split, gpus, workload.gpus_per_node)
    assert where is not None, "a split comes from gpu_plan.splits, which lays each out"
    trainer = gpu_plan.trainer_part(workload, split, shape)
    push = gpu_plan.push_part(workload, split, where, colocated)
    sample = workload.prompt_lengths.mean + workload.response_lengths.mean
    unit = max(1.0, sample / UNIT_SAMPLE_TOKENS)
    generator = generators.in_units(
        gpu_plan.server_generator(workload, split.tensor_parallel), unit
    )
    prompts = workload.prompt_lengths.in_units(unit)
    responses = workload.response_lengths.in_units(unit)
    # a response's time at the servers' full concurrency, and a step's training
    per_server = shape.max_concurrent_rollouts / split.servers * gpu_plan.running_share(workload)
    footprint = per_server * (prompts.mean + responses.second_moment / (2 * responses.mean))
    response_s = responses.mean / (generator.tokens_per_s(per_server, footprint) / per_server)
    training_s = trainer.step_s(shape.forwarded_tokens)
    budget = max(math.ceil(shape.token_budget / unit), int(prompts.maximum + responses.maximum))
    return SimulationConfig(
        max_steps=steps,
        dataset_size=10_000,
        num_generations=workload.num_generations,
        max_staleness=max_staleness,
        weight_sync_steps=weight_sync_steps,
        max_concurrent_rollouts=shape.max_concurrent_rollouts,
        token_budget=budget,
        rows_per_step=split.trainer_gpus * shape.gradient_accumulation_steps,
        prompt_lengths=prompts,
        completion_lengths=responses,
        group_length_correlation=workload.response_group_correlation,
        generator=generator,
        num_servers=split.servers,
        training_tokens_per_s=trainer.tokens_per_s / unit,
        training_fixed_s=trainer.fixed_s,
        training_slowdown=workload.contention.training_slowdown,
        generation_slowdown=workload.contention.generation_slowdown,
        weight_sync_s=push.seconds,
        weight_push_overlap=not colocated,
        logging_steps=max(1, steps // 6),
        tick_s=min(response_s, training_s) / TICKS_PER_RESPONSE,
    )


def colocated_config(
    workload: Workload, gpus: int, tensor_parallel: int, steps: int = STEPS
) -> SimulationConfig:
    """The synchronous baseline most frameworks run (verl's and TRL's colocated modes): every
    one of ``gpus`` GPUs generates a step's whole batch at once, as ``gpus / tensor_parallel``
    servers, then trains, one after the other (the push waited for, within each server's
    GPUs).
    Offloading the trainer's state and waking the servers between the two is not modelled."""
    if gpus % tensor_parallel:
        raise ValueError(
            f"{gpus} GPUs do not split into servers of tensor-parallel {tensor_parallel}"
        )
    split = gpu_plan.Split(gpus, gpus // tensor_parallel, tensor_parallel)
    config = simulation_config(workload, split, 0, 1, steps, colocated=True)
    # rows enough for the whole batch, however long its responses come out
    return attrs.evolve(
        config, groups_per_step=workload.prompts_per_step, rows_per_step=2 * config.rows_per_step
    )


@attrs.frozen
class Simulation:
    """What one setting's prediction simulates.

    Attributes:
        candidate: the setting.
        config: its whole cluster's simulation.
        scale: the simulation runs ``1 / scale`` of it
            (:func:`~asyncgrpo.core.experiments.scale.simulation_scale`).
        samples_per_step: the samples of a simulated step (the run's, over ``scale``).
    """

    candidate: Candidate
    config: SimulationConfig
    scale: int
    samples_per_step: int


def simulation_of(
    workload: Workload,
    candidate: Candidate,
    steps: int = STEPS,
    colocated: bool = False,
    whole: bool = False,
) -> Simulation:
    """``candidate``'s simulation (``colocated``: its trainer's GPUs are its servers',
    :func:`colocated_config`): the whole cluster with ``whole``, else the largest share whose
    step's longest response stays within
    :data:`~asyncgrpo.core.experiments.scale.SCALE_TOLERANCE`."""
    if colocated:
        config = colocated_config(
            workload, candidate.train_devices, candidate.tensor_parallel, steps
        )
    else:
        split = gpu_plan.Split(
            candidate.train_devices, candidate.servers, candidate.tensor_parallel
        )
        config = simulation_config(
            workload, split, candidate.max_staleness, candidate.weight_sync_steps, steps
        )
    scale = 1
    if not whole:
        scale = simulation_scale(
            config.num_servers,
            config.rows_per_step,
            workload.prompts_per_step,
            workload.num_generations,
            workload.response_lengths,
            group_correlation=workload.response_group_correlation,
        )
    samples = workload.prompts_per_step * workload.num_generations
    return Simulation(candidate, config, scale, round(samples / scale))


def simulated_share(simulation: Simulation) -> str:
    """One line of the plan: how much of the cluster the recommended setting's simulation
    ran (the synchronous baseline ran the whole, the colocated one a share of its own)."""
    if simulation.scale == 1:
        return "simulated: the whole cluster"
    config = simulation.config
    return (
        f"simulated: 1/{simulation.scale} of the cluster ({config.num_servers // simulation.scale}"
        f" of {config.num_servers} servers, {simulation.samples_per_step:,} of "
        f"{simulation.samples_per_step * simulation.scale:,} samples a step, each server's "
        f"load the same, a step's longest response within {SCALE_TOLERANCE:.0%}); the "
        "synchronous baseline: the whole cluster"
    )


def predict(simulation: Simulation, output_dir: Path) -> Prediction:
    """Run ``simulation`` under ``output_dir`` and read its figures (after
    :data:`START_STEPS`)."""
    candidate = simulation.candidate
    return simulated_prediction(
        simulation.config, candidate, output_dir / candidate.label(), simulation.scale
    )


def simulated_prediction(
    config: SimulationConfig, candidate: Candidate, output_dir: Path, scale: int = 1
) -> Prediction:
    """Simulate ``config`` (``candidate``'s) and read its figures (after :data:`START_STEPS`);
    with ``scale``, ``1 / scale`` of its cluster (:meth:`SimulationConfig.scaled_down`), its
    samples counted ``scale`` times."""
    windows = simulate(config.scaled_down(scale), output_dir, progress=False)
    # the first steps are the pipeline filling up (and, at max_staleness 0, the groups the
    # first step left over dropped as stale): left out, as a run's first window is
    skip = math.ceil(START_STEPS / config.logging_steps)
    figures = pipeline_figures(windows, skip_windows=skip)
    kept = windows[skip:]
    steps_counted = kept[-1]["step"] - windows[skip - 1]["step"]

    def mean(key: str) -> float | None:
        values = [w[key] for w in kept if w.get(key) is not None]
        return sum(values) / len(values) if values else None

    dropped = sum(w.get("sample/dropped_stale_count", 0.0) for w in kept) / steps_counted
    per_step = mean("batch/samples_per_step")
    return Prediction(
        candidate,
        scale * samples_per_s(windows, skip_windows=skip),
        figures.step_s,
        figures.staleness or 0.0,
        figures.trainer_idle_frac,
        mean("sim/generator_idle_frac"),
        scale * dropped,
        None if per_step is None else scale * per_step,
    )


def planned_candidates(
    workload: Workload,
    gpus: int,
    top_splits: int = 3,
    staleness_choices: Sequence[int] = STALENESS_CHOICES,
    sync_step_choices: Sequence[int] = SYNC_STEP_CHOICES,
) -> list[Candidate]:
    """The settings :func:`plan_workload` simulates: the ``top_splits`` splits of ``gpus``
    with the fastest steady rates (:func:`~asyncgrpo.core.experiments.gpu_plan.screen`), each
    with every ``max_staleness`` and ``weight_sync_steps`` the workload leaves open (pairs with
    ``max_staleness >= weight_sync_steps - 1``)."""
    estimates = sorted(
        (gpu_plan.screen(workload, s) for s in gpu_plan.splits(workload, gpus)),
        key=lambda e: (-e.overlapped, e.split.trainer_gpus),
    )
    chosen_splits = [e.split for e in estimates[:top_splits]]
    staleness = (
        [workload.max_staleness] if workload.max_staleness is not None else list(staleness_choices)
    )
    sync = (
        [workload.weight_sync_steps]
        if workload.weight_sync_steps is not None
        else list(sync_step_choices)
    )
    settings = [(s, k) for s in staleness for k in sync if s >= k - 1]
    if not settings:
        raise ValueError(
            "no max_staleness and weight_sync_steps pair with max_staleness >= "
            "weight_sync_steps - 1 among the choices"
        )
    return [
        Candidate(split.trainer_gpus, split.servers, s, k, split.tensor_parallel)
        for split in chosen_splits
        for s, k in settings
    ]


def plan_workload(
    workload: Workload,
    gpus: int,
    output_dir: str | Path,
    top_splits: int = 3,
    staleness_choices: Sequence[int] = STALENESS_CHOICES,
    sync_step_choices: Sequence[int] = SYNC_STEP_CHOICES,
    steps: int = STEPS,
    progress: bool = True,
) -> WorkloadPlan:
    """Plan ``workload`` on ``gpus`` GPUs (the module's docstring); simulations land under
    ``output_dir``."""
    if steps < START_STEPS + 2:
        raise ValueError(
            f"simulate at least {START_STEPS + 2} steps (--max-steps): the first "
            f"{START_STEPS} are left out of the predictions"
        )
    out = Path(output_dir)
    candidates = planned_candidates(
        workload, gpus, top_splits, staleness_choices, sync_step_choices
    )
    simulated: list[Simulation] = []

    def run(
        candidate: Candidate, directory: Path = out, colocated: bool = False, whole: bool = False
    ) -> Prediction:
        simulation = simulation_of(workload, candidate, steps, colocated, whole)
        simulated.append(simulation)
        return predict(simulation, directory)

    bar = tqdm(candidates, desc="plan", unit="setting", disable=not progress)
    predictions = {c: run(c) for c in bar}
    # a paced setting simulated on a share is optimistic: where it could be chosen, whole
    whole = {s.candidate for s in simulated if s.scale == 1}
    while doubtful := paced_to_confirm(predictions.values(), whole):
        for c in doubtful:
            predictions[c] = run(c, whole=True)
            whole.add(c)
    best = recommend(list(predictions.values()))
    c = best.candidate
    sync_candidate = attrs.evolve(c, max_staleness=0, weight_sync_steps=1)
    if sync_candidate in whole:
        synchronous = predictions[sync_candidate]
    else:
        synchronous = run(sync_candidate, out / "synchronous", whole=True)
    # the colocated baseline is not paced (the whole batch at once): a share predicts it
    colocated = run(
        attrs.evolve(sync_candidate, train_devices=gpus, servers=gpus // c.tensor_parallel),
        out / "colocated",
        colocated=True,
    )
    split = gpu_plan.Split(c.train_devices, c.servers, c.tensor_parallel)
    shape = gpu_plan.step_shape(workload, split)
    where = gpu_plan.layout(split, gpus, workload.gpus_per_node)
    assert where is not None
    flags: dict[str, Any] = {
        "num_generations": workload.num_generations,
        "max_completion_length": int(workload.response_lengths.maximum),
        "max_staleness": c.max_staleness,
        "weight_sync_steps": c.weight_sync_steps,
        "token_budget": shape.token_budget,
        "gradient_accumulation_steps": shape.gradient_accumulation_steps,
        "max_concurrent_rollouts": shape.max_concurrent_rollouts,
        "weight_transfer_backend": ENGINE_OF_PATH.get(
            workload.weight_path, "disk" if workload.weight_path == "disk" else "auto"
        ),
    }
    if workload.weight_path == "delta":
        flags["weight_sync_delta"] = True
    blocks = launch_blocks(
        workload.model_name,
        where,
        workload.gpus_per_node,
        workload.max_model_len,
        workload.weight_path,
        flags,
        max_loras=c.max_staleness + 2,
    )
    trainer = gpu_plan.trainer_part(workload, split, shape)
    push = gpu_plan.push_part(workload, split, where)
    parts = (
        f"generator: {gpu_plan.server_generator(workload, split.tensor_parallel).source}",
        f"trainer: {trainer.source}: {trainer.tokens_per_s:,.0f} forwarded tokens/s, "
        f"{trainer.fixed_s:.2f} s per step besides",
        f"push: {workload.weight_path}, {push.seconds:.2f} s a sync (an assumed pause of "
        f"{push.pause_s:g} s included)",
        simulated_share(next(s for s in reversed(simulated) if s.candidate == c)),
    )
    return WorkloadPlan(
        workload,
        gpus,
        best,
        synchronous,
        colocated,
        tuple(sorted(predictions.values(), key=lambda p: -p.samples_per_s)),
        shape,
        where,
        parts,
        blocks,
        tuple(simulated),
    )


def _gpus_of(devices: Sequence[tuple[int, tuple[int, ...]]]) -> str:
    """Where a role runs, consecutive nodes holding the same GPUs given once.

    Example:
        >>> _gpus_of([(0, (0, 1)), (0, (2, 3)), (1, (0, 1)), (1, (2, 3)), (2, (0,))])
        'nodes 0-1 GPU(s) 0,1 | 2,3; node 2 GPU(s) 0'
    """
    per_node: dict[int, list[str]] = {}
    for node, ds in devices:
        per_node.setdefault(node, []).append(",".join(map(str, ds)))
    runs: list[tuple[int, int, str]] = []  # first node, last node, their GPUs
    for node, groups in per_node.items():
        gpus = " | ".join(groups)
        if runs and runs[-1][1] == node - 1 and runs[-1][2] == gpus:
            runs[-1] = (runs[-1][0], node, gpus)
        else:
            runs.append((node, node, gpus))
    return "; ".join(
        f"node {first} GPU(s) {gpus}" if first == last else f"nodes {first}-{last} GPU(s) {gpus}"
        for first, last, gpus in runs
    )


def _figures(p: Prediction) -> str:
    idle = "-" if p.generator_idle_frac is None else f"{p.generator_idle_frac:.0%}"
    return (
        f"{p.step_s:.1f} s/step, {p.samples_per_s:.2f} samples/s, trainer idle "
        f"{p.trainer_idle_frac:.0%}, generator idle {idle}, staleness {p.staleness:.2f}, "
        f"{p.dropped_per_step:.1f} samples dropped per step"
    )


def workload_report(plan: WorkloadPlan, rows: int = 10) -> str:
    """The split, the settings, the predictions and the launch commands, as markdown."""
    w, r = plan.workload, plan.recommended
    c = r.candidate
    gain = r.samples_per_s / plan.synchronous.samples_per_s
    lines = [
        f"plan for {plan.gpus} {w.gpu.name} GPUs ({plan.layout.nodes} node(s)), {w.model_name}, "
        f"{w.prompts_per_step} prompts x {w.num_generations} per step",
        f"split: the trainer on {c.train_devices} GPU(s) ({_gpus_of(plan.layout.trainer)}); "
        f"{c.servers} vLLM server(s) of tensor-parallel {c.tensor_parallel} "
        f"({_gpus_of(plan.layout.servers)})",
        f"settings: max_staleness={c.max_staleness}, weight_sync_steps={c.weight_sync_steps}, "
        f"token_budget={plan.shape.token_budget}, gradient_accumulation_steps="
        f"{plan.shape.gradient_accumulation_steps}, max_concurrent_rollouts="
        f"{plan.shape.max_concurrent_rollouts}",
        f"predicted: {_figures(r)}",
        f"synchronous on the same split (max_staleness=0): {_figures(plan.synchronous)}; the "
        f"plan gives {gain:.2f}x its samples/s",
        f"colocated on all {plan.gpus} GPUs (each generates, then trains; "
        f"{plan.gpus // c.tensor_parallel} server(s) of tensor-parallel {c.tensor_parallel}): "
        f"{_figures(plan.colocated)}; the "
        f"plan gives {r.samples_per_s / plan.colocated.samples_per_s:.2f}x its samples/s",
        *plan.parts,
        "PREDICTED from data-sheet figures and the workload, not measured: check the first "
        "steps' perf/step_s and rollout/generated_tokens_per_s.",
        "",
        "| trainer GPUs | servers x TP | max_staleness | weight_sync_steps | s/step | samples/s "
        "| trainer idle | generator idle | staleness | dropped/step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in plan.predictions[:rows]:
        k = p.candidate
        idle = "-" if p.generator_idle_frac is None else f"{p.generator_idle_frac:.0%}"
        lines.append(
            f"| {k.train_devices} | {k.servers} x {k.tensor_parallel} | "
            f"{k.max_staleness} | {k.weight_sync_steps} | {p.step_s:.1f} | "
            f"{p.samples_per_s:.2f} | {p.trainer_idle_frac:.0%} | {idle} | "
            f"{p.staleness:.2f} | {p.dropped_per_step:.1f} |"
        )
    lines += [
        "",
        "launch commands (train.toml: your dataset and reward_funcs, docs/configuration.md):",
    ]
    for block in plan.blocks:
        lines += ["", f"{block.title}:", "", "```bash", block.text, "```"]
    return "\n".join(lines)
