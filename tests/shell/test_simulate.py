import json

import pytest

from asyncgrpo.shell.commands import main
from asyncgrpo.shell.experiments.simulate import SimulationConfig, simulate
from asyncgrpo.shell.run import read_metrics


@pytest.mark.parametrize("max_staleness", [0, 1, 4])
def test_simulation_respects_staleness_and_learns(tmp_path, max_staleness) -> None:
    config = SimulationConfig(max_steps=40, max_staleness=max_staleness, logging_steps=10)
    windows = simulate(config, tmp_path, progress=False)
    assert [w["step"] for w in windows] == [10, 20, 30, 40]
    assert all(w["sample/staleness_max"] <= max_staleness for w in windows)
    assert windows[-1]["reward"] > windows[0]["reward"]
    rows = read_metrics(tmp_path)
    assert [(r["step"], r["reward"]) for r in rows] == [(w["step"], w["reward"]) for w in windows]


def test_metrics_file_writes_nan_as_null(tmp_path) -> None:
    simulate(
        SimulationConfig(max_steps=5, dataset_size=8, logging_steps=5), tmp_path, progress=False
    )
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        json.loads(line)  # strict JSON: no NaN tokens
        assert "NaN" not in line


def test_cli_runs_and_rejects_bad_config_with_the_field_name(tmp_path, capsys) -> None:
    assert (
        main(["simulate", "--output-dir", str(tmp_path), "--max-steps", "5", "--no-progress"]) == 0
    )
    assert "simulated 5 steps" in capsys.readouterr().out
    optional = ["--mean-completion-tokens", "30", "--longest-prompt-tokens", "80"]  # None defaults
    assert (
        main(
            [
                "simulate",
                "--output-dir",
                str(tmp_path),
                "--max-steps",
                "2",
                "--no-progress",
                *optional,
            ]
        )
        == 0
    )
    assert main(["simulate", "--output-dir", str(tmp_path), "--token-budget", "8"]) == 2
    assert "token_budget" in capsys.readouterr().err


def test_plot_writes_a_png_of_a_run(tmp_path, capsys) -> None:
    simulate(SimulationConfig(max_steps=10), tmp_path, progress=False)
    assert main(["plot", str(tmp_path)]) == 0
    png = (tmp_path / "metrics.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "metrics.jsonl" in capsys.readouterr().err


def test_several_simulated_servers_share_the_groups_and_shorten_a_generation_bound_step(
    tmp_path,
) -> None:
    """Generation-bound (max_staleness 0, a slow generator): a second server of the same
    throughput takes groups and the step gets shorter; one server logs no per-server metric."""
    from asyncgrpo.core.experiments.prediction_figures import pipeline_figures

    steps = {}
    for servers in (1, 2):
        config = SimulationConfig(
            max_steps=30,
            max_staleness=0,
            num_servers=servers,
            generation_tokens_per_s=1500.0,
            logging_steps=10,
        )
        windows = simulate(config, tmp_path / str(servers), progress=False)
        steps[servers] = pipeline_figures(windows).step_s
        groups = [
            sum(w.get(f"rollout/server/{i}/groups_count", 0) for w in windows) for i in range(2)
        ]
        assert (min(groups) > 0) == (servers == 2), groups
    assert steps[2] < 0.8 * steps[1], steps


def measured_run(run, max_steps=40, **throughputs):
    """A "measured" run: a simulation of known throughputs at max_staleness 0, written as a
    sweep's run (its run_spec.json, and the lengths a real run logs)."""
    simulate(
        SimulationConfig(
            max_steps=max_steps,
            max_staleness=0,
            logging_steps=5,
            dataset_size=10_000,
            **throughputs,
        ),
        run,
        progress=False,
    )
    # what a real run logs and the simulator does not: the simulated completion lengths
    lengths = {
        "completions/mean_length": 68.0,
        "completions/min_length": 8.0,
        "completions/max_length": 128.0,
    }
    rows = [dict(row, **lengths) for row in read_metrics(run)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = {
        "output_dir": str(run),
        "max_staleness": 0,
        "num_generations": 8,
        "token_budget": 4096,
        "logging_steps": 5,
    }
    (run / "run_spec.json").write_text(json.dumps({"config": config}))
    return run


def test_a_calibrated_run_predicts_a_throughput_curve_against_the_number_of_servers(
    tmp_path, capsys
) -> None:
    """A "measured" run (a simulation of known throughputs written as a sweep run) calibrates
    the simulator; the curve predicts that run's step time at its own number of servers and
    shorter steps with more, down to what training alone costs."""
    from asyncgrpo.shell.experiments.calibrate import predict_servers

    run = measured_run(tmp_path / "measured", generation_tokens_per_s=2000.0)
    points = predict_servers(run, [1, 2, 4], tmp_path / "predicted")
    measured = read_metrics(run)
    from asyncgrpo.core.experiments.prediction_figures import pipeline_figures

    assert abs(points[0].step_s / pipeline_figures(measured).step_s - 1) < 0.1
    assert points[0].step_s > points[1].step_s > points[2].step_s
    assert points[0].samples_per_s < points[1].samples_per_s < points[2].samples_per_s
    argv = [
        "simulate",
        "--output-dir",
        str(tmp_path / "cli"),
        "--calibrate",
        str(run),
        "--predict-servers",
        "1",
        "2",
    ]
    assert main(argv) == 0
    assert "| servers | predicted step s |" in capsys.readouterr().out


def test_plot_draws_a_panel_per_server_metric_of_a_run_with_several(tmp_path) -> None:
    from asyncgrpo.shell.experiments.plot import server_panels

    simulate(
        SimulationConfig(max_steps=10, num_servers=3, logging_steps=5), tmp_path, progress=False
    )
    panels = server_panels(read_metrics(tmp_path))
    assert panels[0] == (
        "groups per window, by server",
        [f"rollout/server/{i}/groups_count" for i in range(3)],
    )
    assert main(["plot", str(tmp_path)]) == 0


@pytest.mark.parametrize(("sync_steps", "max_staleness"), [(1, 0), (1, 1), (2, 1), (3, 4)])
def test_pushes_every_weight_sync_steps_and_beside_the_step_shortens_it(
    tmp_path, sync_steps, max_staleness
) -> None:
    """Trainer-bound with a long push: a push every ``weight_sync_steps`` steps, the servers'
    lag never trains a sample past max_staleness, and the push beside the step takes its time
    off the step (waited for only without overlap)."""
    from asyncgrpo.core.experiments.prediction_figures import pipeline_figures

    steps, sync_s = {}, 0.5
    for overlap in (False, True):
        config = SimulationConfig(
            max_steps=24,
            logging_steps=6,
            max_staleness=max_staleness,
            weight_sync_steps=sync_steps,
            weight_push_overlap=overlap,
            weight_sync_s=sync_s,
            training_tokens_per_s=1500.0,
        )
        windows = simulate(config, tmp_path / str(overlap), progress=False)
        assert all(w["sample/staleness_max"] <= max_staleness for w in windows)
        waited = sum(6 * w["perf/weight_sync_s"] for w in windows)  # a mean over steps
        assert waited == pytest.approx(0.0 if overlap else 24 // sync_steps * sync_s)
        if overlap:  # logged per push, as the trainer does
            assert all(w["perf/weight_push_s"] == pytest.approx(sync_s) for w in windows)
        steps[overlap] = pipeline_figures(windows).step_s
    if max_staleness >= sync_steps:  # else the next samples wait for the push to land anyway
        assert steps[True] < steps[False] - 0.5 * sync_s / sync_steps, steps
    else:
        assert steps[True] == pytest.approx(steps[False], rel=0.05), steps


def test_simulate_takes_boolean_flags_both_ways(tmp_path) -> None:
    from asyncgrpo.shell.commands.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["simulate", "--output-dir", "x"]).weight_push_overlap is True
    no_overlap = parse(["simulate", "--output-dir", "x", "--no-weight-push-overlap"])
    assert no_overlap.weight_push_overlap is False


def test_plan_gives_devices_to_the_side_that_bounds_the_step_and_runs_ahead(tmp_path, capsys):
    """Calibrated on a generation-bound run (a slow server), the plan for 4 cores gives more
    of them to the servers than calibrated on a training-bound one; both recommend running
    ahead (max_staleness > 0) since at 0 each side waits for the other, and the plan's own
    simulation of the calibration run's setting reproduces its measured step time."""
    from asyncgrpo.core.experiments.prediction_figures import pipeline_figures
    from asyncgrpo.shell.experiments import plan

    generation_bound = measured_run(tmp_path / "gen", 20, generation_tokens_per_s=1500.0)
    training_bound = measured_run(
        tmp_path / "train", 20, generation_tokens_per_s=20_000.0, training_tokens_per_s=1500.0
    )
    chosen = {}
    for name, run in (("gen", generation_bound), ("train", training_bound)):
        result = plan(
            run,
            4,
            tmp_path / f"plan-{name}",
            staleness_choices=(0, 2),
            sync_step_choices=(1,),
            progress=False,
        )
        measured = pipeline_figures(read_metrics(run)).step_s
        assert result.calibrated.step_s == pytest.approx(measured, rel=0.1)
        assert result.recommended.candidate.max_staleness == 2
        assert result.recommended.samples_per_s >= 0.95 * result.predictions[0].samples_per_s
        chosen[name] = result.recommended.candidate.train_devices
    assert chosen["gen"] < chosen["train"], chosen
    capsys.readouterr()
    argv = [
        "plan",
        "--calibrate",
        str(generation_bound),
        "--devices",
        "2",
        "--no-progress",
        "--output-dir",
        str(tmp_path / "cli"),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("recommended for 2 devices: max_staleness=") and "| samples/s |" in out
    assert main([*argv[:-2], "--output-dir", str(tmp_path / "cli"), "--gpu", "tpu"]) == 2
    assert "--gpu takes one of a100" in capsys.readouterr().err


def test_a_push_stops_the_servers_only_for_its_pause_and_its_write_slows_the_next_step(
    tmp_path,
) -> None:
    """Generation-bound, the push beside the step: servers that stand still for a tenth of the
    push generate more, and the step is shorter, than servers stopped for all of it.
    Training-bound, the push's file written on the trainer's cores lengthens the step it runs
    beside by about that much; a pause longer than the push is refused."""
    from asyncgrpo.core.experiments.prediction_figures import pipeline_figures

    def step_s(name: str, push_s: float = 1.5, **settings) -> float:
        config = SimulationConfig(
            max_steps=30,
            max_staleness=2,
            logging_steps=10,
            weight_push_overlap=True,
            weight_sync_s=push_s,
            **settings,
        )
        return pipeline_figures(simulate(config, tmp_path / name, progress=False)).step_s

    slow_generator = {"generation_tokens_per_s": 1500.0}
    assert step_s("paused-0.15", server_pause_s=0.15, **slow_generator) < 0.85 * step_s(
        "paused-all", **slow_generator
    )
    slow_trainer = {"training_tokens_per_s": 1000.0, "push_s": 0.3, "server_pause_s": 0.05}
    alone, writing = (
        step_s("no-write", **slow_trainer),
        step_s("write", push_trainer_s=0.2, **slow_trainer),
    )
    assert writing - alone == pytest.approx(0.2, abs=0.05), (alone, writing)
    with pytest.raises(ValueError, match=r"server_pause_s \(0.5\) must lie between 0 and "):
        SimulationConfig(weight_sync_s=0.3, server_pause_s=0.5)


def test_a_colocated_baseline_starts_each_steps_whole_batch_together(tmp_path) -> None:
    """groups_per_step (verl's and TRL's colocated trainers): the step's 8 groups start at
    once after the last step, past the pacing's cap of 2 groups in flight; with a server whose
    throughput grows with the requests it runs, a sample costs less time than paced."""
    from asyncgrpo.core.experiments.generator import Generator
    from asyncgrpo.core.experiments.prediction_figures import pipeline_figures

    figures, concurrency = {}, {}
    for name, batch in (("paced", None), ("batch", 8)):
        config = SimulationConfig(
            max_steps=12,
            logging_steps=3,
            max_staleness=0,
            num_generations=8,
            max_concurrent_rollouts=16,
            groups_per_step=batch,
            token_budget=4096,
            rows_per_step=2,
            generator=Generator(compute_s_per_request=2e-4, weight_read_s=0.01),
        )
        windows = simulate(config, tmp_path / name, progress=False)
        figures[name] = pipeline_figures(windows)
        concurrency[name] = max(w["rollout/concurrency"] for w in windows)
    assert concurrency["paced"] <= 16 < concurrency["batch"], concurrency
    per_sample = {name: f.seconds_per_sample for name, f in figures.items()}
    assert per_sample["batch"] < 0.8 * per_sample["paced"], per_sample


def test_the_packing_shares_a_prompt_within_its_group_only(tmp_path) -> None:
    """Each simulated group has its own prompt, as a dataset's rows do: a step forwards the
    prompt of every group it holds samples of once (shared by those samples) and every
    completion; prompts of different groups share nothing (were they one prompt, the packing
    would forward it once a row). A step holds whole groups and at most two parts of groups
    (the token budget ends it within one, the next step takes the rest). A prompt's last
    token is each sample's own (it predicts the sample's first token)."""
    prompt, completion, group = 64, 40, 8
    config = SimulationConfig(
        max_steps=6,
        logging_steps=1,
        prompt_tokens=prompt,
        min_completion_tokens=completion,
        max_completion_tokens=completion,
    )
    simulate(config, tmp_path, progress=False)
    for window in read_metrics(tmp_path):
        samples = int(window["batch/samples_per_step"])
        whole_groups = samples // group
        own = samples * (completion + 1)
        forwarded = window["batch/forwarded_tokens_per_step"]
        assert whole_groups * (prompt - 1) + own <= forwarded, window
        assert forwarded <= (whole_groups + 2) * (prompt - 1) + own, window
