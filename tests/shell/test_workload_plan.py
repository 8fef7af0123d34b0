"""``asyncgrpo plan --workload FILE --gpus N`` and what it is built on: the simulator's
per-request generator (a long tail of response lengths costs a synchronous step), and any run
as a calibration run."""

import importlib.util
import json
import re
import sys
from pathlib import Path

import attrs
import pytest

from asyncgrpo.core.experiments import generator as generators
from asyncgrpo.core.experiments import gpu_plan, lengths
from asyncgrpo.core.experiments.prediction_figures import pipeline_figures
from asyncgrpo.core.experiments.recommend import PACED_STALENESS, Candidate
from asyncgrpo.shell.commands import main
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.experiments import SweepError, record_run_settings
from asyncgrpo.shell.experiments.calibrate import run_config
from asyncgrpo.shell.experiments.generator_probe import PROBE_FILE, Probe, ProbePoint
from asyncgrpo.shell.experiments.simulate import SimulationConfig, simulate
from asyncgrpo.shell.experiments.workload_plan import (
    colocated_config,
    plan_workload,
    planned_candidates,
    read_workload,
    simulated_prediction,
    simulation_config,
    simulation_of,
)
from asyncgrpo.shell.run import read_metrics

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "workload_math_7b.toml"
LONG = ROOT / "examples" / "workload_math_1.5b.toml"
QUICK = [
    "--top-splits",
    "1",
    "--max-staleness",
    "0",
    "2",
    "--weight-sync-steps",
    "1",
    "--max-steps",
    "6",
    "--no-progress",
]


def launch_rules():
    """tests/test_launch_commands.py, the rules every launch command in the docs follows."""
    if "launch_rules" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "launch_rules", ROOT / "tests" / "test_launch_commands.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["launch_rules"] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules["launch_rules"]


def planned_devices(text: str) -> int:
    """GPUs the printed launch commands use: each server's devices, and the trainer's devices
    times its nodes."""
    rules = launch_rules()
    total = 0
    for index, block in enumerate(re.findall(r"```bash\n(.*?)```", text, re.S)):
        for launch in rules.shell_launches(block, 1, "plan", host=f"block {index}"):
            nodes = int(str(rules.option(launch.argv, "--nnodes", "1")))
            total += len(launch.devices) * (nodes if launch.role == "trainer" else 1)
    return total


@pytest.mark.parametrize("gpus", [8, 16])
def test_plan_prints_split_settings_predictions_and_commands_for_all_gpus(capsys, gpus):
    assert main(["plan", "--workload", str(EXAMPLE), "--gpus", str(gpus), *QUICK]) == 0
    out = capsys.readouterr().out
    for part in (
        "split: the trainer on",
        "settings: max_staleness=",
        "predicted:",
        "generator idle",
        "samples dropped per step",
        "synchronous on the same split",
        f"colocated on all {gpus} GPUs",
        "ROOFLINE",
        "vllm serve Qwen/Qwen2.5-7B",
        "torchrun",
    ):
        assert part in out, part
    assert planned_devices(out) == gpus
    assert ("job.sbatch" in out) == (gpus > 8)  # 8 GPUs a node: 16 span two
    assert launch_rules().problems_in("# plan\n\n" + out, "plan output") == []


def test_plan_errors_name_the_key_and_the_fix(tmp_path, capsys) -> None:
    workload = tmp_path / "w.toml"
    workload.write_text(EXAMPLE.read_text())  # its config.json is not beside it
    assert main(["plan", "--workload", str(workload), "--gpus", "8", "--no-progress"]) == 2
    assert "[model] config: cannot read" in capsys.readouterr().err
    config = EXAMPLE.parent / "qwen2.5-7b-config.json"
    (tmp_path / config.name).write_text(config.read_text())
    workload.write_text(EXAMPLE.read_text().replace('gpu = "h100"', 'gpu = "h1000"'))
    assert main(["plan", "--workload", str(workload), "--gpus", "8", "--no-progress"]) == 2
    assert "[cluster] gpu: 'h1000' is not one of" in capsys.readouterr().err
    workload.write_text(EXAMPLE.read_text())
    assert main(["plan", "--workload", str(workload), "--gpus", "1", "--no-progress"]) == 2
    assert "no split of 1 h100 GPUs fits" in capsys.readouterr().err


def test_the_colocated_baseline_generates_on_every_gpu_then_trains_on_them(tmp_path) -> None:
    """Colocated on 16 GPUs: 4 servers of tensor-parallel 4 generating a step's whole batch at
    once, then the trainer on all 16, its push within the servers' GPUs. Against the paced
    synchronous setting of a split of the same GPUs (8 to the trainer, 2 servers) it trains
    and generates faster."""
    workload = read_workload(EXAMPLE)
    config = colocated_config(workload, 16, 4, steps=6)
    assert (config.num_servers, config.max_staleness, config.weight_push_overlap) == (4, 0, False)
    assert config.rows_per_step % 16 == 0 and config.groups_per_step == 64
    split = gpu_plan.Split(8, 2, 4)
    dedicated = simulation_config(workload, split, 0, 1, steps=6)
    assert config.weight_sync_s < dedicated.weight_sync_s  # one gather, not one send a server
    together = simulated_prediction(config, Candidate(16, 4, 0, 1, 4), tmp_path / "colocated")
    apart = simulated_prediction(dedicated, Candidate(8, 2, 0, 1, 4), tmp_path / "split")
    phases = {
        name: (p.trainer_idle_frac * p.step_s, (1 - p.trainer_idle_frac) * p.step_s)
        for name, p in (("together", together), ("apart", apart))
    }
    assert phases["together"][1] < 0.7 * phases["apart"][1], phases  # training
    assert phases["together"][0] < 0.7 * phases["apart"][0], phases  # generation
    with pytest.raises(ValueError, match="16 GPUs do not split into servers of tensor-parallel 3"):
        colocated_config(workload, 16, 3)


@pytest.mark.parametrize("gpus", [128, 1024])
def test_a_large_plan_simulates_a_bounded_number_of_samples(gpus) -> None:
    """The work of a plan: 24 settings of 12 steps, each simulated on 1/4 to 1/8 of the
    cluster, at most 2,048 of the step's 8,192 samples (512 prompts x 16 at any GPU count),
    whatever the GPUs; at most the paced settings (max_staleness <= 1) and the synchronous
    baseline run whole (the control: 8,192 samples a step)."""
    workload = read_workload(LONG)
    simulations = [simulation_of(workload, c) for c in planned_candidates(workload, gpus)]
    assert len(simulations) == 24
    assert max(s.samples_per_step for s in simulations) <= 2048, [
        (s.candidate.label(), s.scale) for s in simulations
    ]
    paced = [s for s in simulations if s.candidate.max_staleness <= PACED_STALENESS]
    assert len(paced) == 9
    whole = simulation_of(workload, simulations[0].candidate, whole=True)
    assert (whole.scale, whole.samples_per_step) == (1, 8192)


def test_a_groups_length_correlation_reaches_its_simulations_and_their_share() -> None:
    """A workload whose prompt sets its responses' lengths is simulated so, on a larger share
    of the cluster (a step's longest response is that of fewer draws)."""
    alone = read_workload(LONG)
    alike = attrs.evolve(alone, response_group_correlation=1.0)
    candidate = planned_candidates(alone, 128)[0]
    by_itself, by_prompt = simulation_of(alone, candidate), simulation_of(alike, candidate)
    assert by_itself.config.group_length_correlation == 0.0
    assert by_prompt.config.group_length_correlation == 1.0
    assert by_prompt.scale < by_itself.scale


def test_a_share_of_the_cluster_predicts_a_running_ahead_setting_and_overrates_a_paced_one(
    tmp_path,
) -> None:
    """32 GPUs of the 7B math run, simulated whole and on 1/4 of the cluster (one server of
    four, a quarter of the rows and prompts): running ahead (max_staleness 4) the step time
    agrees within 5%; synchronous and paced (max_staleness 0), the share ends its steps
    sooner (fewer groups admitted last), which is why the plan simulates such settings whole
    wherever it could choose them."""
    workload = read_workload(EXAMPLE)
    figures = {}
    for staleness, sync in ((4, 2), (0, 1)):
        simulation = simulation_of(workload, Candidate(24, 4, staleness, sync, 2), whole=True)
        for scale in (4, 1):
            p = simulated_prediction(
                simulation.config, simulation.candidate, tmp_path / f"{staleness}-{scale}", scale
            )
            figures[staleness, scale] = p
    ahead, ahead_whole = figures[4, 4], figures[4, 1]
    assert ahead.step_s == pytest.approx(ahead_whole.step_s, rel=0.05)
    assert ahead.samples_per_step == pytest.approx(ahead_whole.samples_per_step, rel=0.1)
    assert figures[0, 4].samples_per_s > 1.2 * figures[0, 1].samples_per_s


def test_a_share_of_the_cluster_predicts_the_colocated_baseline(tmp_path) -> None:
    """The colocated baseline of the 1.5B math run on 128 GPUs (32 servers of tensor-parallel
    4, each step's 8,192 samples at once) on the share a plan simulates it on: not paced, its
    step agrees with the whole cluster's within 5%, which is why a plan simulates it there."""
    workload = read_workload(LONG)
    candidate = Candidate(128, 32, 0, 1, 4)
    simulation = simulation_of(workload, candidate, colocated=True, steps=6)
    assert simulation.scale > 1
    share, whole = (
        simulated_prediction(simulation.config, candidate, tmp_path / f"{scale}", scale)
        for scale in (simulation.scale, 1)
    )
    assert share.step_s == pytest.approx(whole.step_s, rel=0.05)
    assert share.samples_per_s == pytest.approx(whole.samples_per_s, rel=0.05)


def test_paced_settings_that_could_be_chosen_and_the_synchronous_baseline_run_whole(
    tmp_path,
) -> None:
    """The 1.5B math run with 128 prompts a step on 32 GPUs: the settings are screened on a
    share of the cluster, the synchronous baseline and any paced setting near the best run
    whole; the colocated baseline, not paced, runs on a share."""
    workload = attrs.evolve(read_workload(LONG), prompts_per_step=128)
    plan = plan_workload(
        workload,
        32,
        tmp_path,
        top_splits=1,
        staleness_choices=(0, 4),
        sync_step_choices=(1,),
        steps=6,
        progress=False,
    )
    scales = {(s.candidate, s.config.groups_per_step is not None): s.scale for s in plan.simulated}
    sync = plan.synchronous.candidate
    assert scales[sync, False] == 1 and scales[plan.colocated.candidate, True] > 1
    best = max(p.samples_per_s for p in plan.predictions)
    for p in plan.predictions:
        last = next(s for s in reversed(plan.simulated) if s.candidate == p.candidate)
        if p.candidate.max_staleness <= PACED_STALENESS and p.samples_per_s >= 0.95 * best:
            assert last.scale == 1, p
    assert any(s.scale > 1 for s in plan.simulated)  # the screen ran on a share
    assert plan.parts[-1].startswith("simulated: ")


def tail_config(completions: lengths.Lengths, max_staleness: int) -> SimulationConfig:
    """A server whose decode step costs mostly a fixed weight read: its throughput grows with
    the requests it runs."""
    return SimulationConfig(
        max_steps=12,
        logging_steps=3,
        max_staleness=max_staleness,
        num_generations=8,
        max_concurrent_rollouts=64,
        token_budget=8192,
        rows_per_step=1,
        prompt_tokens=32,
        completion_lengths=completions,
        generator=generators.Generator(compute_s_per_request=2e-4, weight_read_s=0.01),
        training_tokens_per_s=200_000.0,
        dataset_size=10_000,
        tick_s=0.02,
    )


def test_a_synchronous_step_waits_for_its_longest_response(tmp_path) -> None:
    """Responses of the same mean, all alike or with a long tail to 8x the mean: at
    max_staleness 0 the tail's steps are much longer (each waits for its longest response
    while the server runs fewer and fewer requests), and running ahead recovers most of it."""
    even = lengths.constant(96)
    tail = lengths.from_quantiles({0.5: 60.0, 0.9: 200.0}, maximum=768.0, mean=96.0)
    step = {}
    for name, completions in (("even", even), ("tail", tail)):
        for staleness in (0, 2):
            windows = simulate(
                tail_config(completions, staleness),
                tmp_path / f"{name}-{staleness}",
                progress=False,
            )
            step[name, staleness] = pipeline_figures(windows).step_s
    assert step["tail", 0] > 1.5 * step["even", 0], step
    assert step["tail", 2] / step["even", 2] < 0.8 * step["tail", 0] / step["even", 0], step


def test_any_run_with_recorded_settings_calibrates_a_plan(tmp_path, capsys) -> None:
    """A run of asyncgrpo train or demo records its settings (run_settings.json): a plan
    calibrates from it as from a sweep's run; a run without either file says what to do."""
    run = tmp_path / "run"
    with pytest.raises(SweepError, match="run_settings.json"):
        run_config(run)
    simulate(
        SimulationConfig(
            max_steps=20,
            max_staleness=0,
            logging_steps=5,
            dataset_size=10_000,
            generation_tokens_per_s=1500.0,
        ),
        run,
        progress=False,
    )
    rows = [
        dict(
            r,
            **{
                "completions/mean_length": 68.0,
                "completions/min_length": 8.0,
                "completions/max_length": 128.0,
            },
        )
        for r in read_metrics(run)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    record_run_settings(
        AsyncGRPOConfig(
            output_dir=str(run),
            max_staleness=0,
            num_generations=8,
            token_budget=4096,
            logging_steps=5,
        )
    )
    assert run_config(run).max_staleness == 0
    argv = [
        "plan",
        "--calibrate",
        str(run),
        "--devices",
        "2",
        "--max-staleness",
        "0",
        "1",
        "--weight-sync-steps",
        "1",
        "--no-progress",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("recommended for 2 devices: max_staleness=") and "probe" not in out
    probe = Probe(
        (ProbePoint(1, 400.0, 10, 1.0), ProbePoint(16, 3000.0, 90, 1.0)),
        training_slowdown=1.5,
        generation_slowdown=1.3,
        note="measured",
    )
    (run / PROBE_FILE).write_text(json.dumps(probe.as_json()))
    assert main(argv) == 0
    assert "contention, from its sweep's probe" in capsys.readouterr().out
