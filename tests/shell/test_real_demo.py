"""The real demo (``asyncgrpo demo --model smollm2-135m``) and its sweep over seeds
(benchmarks/real_demo.toml) train with the same settings, so that the README's measured
numbers are the demo's; the demo's flags reach the config."""

import dataclasses
import json
from pathlib import Path

from asyncgrpo.shell.commands import real_demo
from asyncgrpo.shell.commands.cli import build_parser, demo_overrides
from asyncgrpo.shell.experiments.sweep import read_sweep, run_config
from asyncgrpo.shell.run import EVALUATIONS_FILE

ROOT = Path(__file__).resolve().parents[2]
PER_RUN = {"output_dir", "logging_dir", "vllm_server_base_url", "disable_tqdm", "seed"}


def test_the_sweep_file_trains_as_the_demo_does(tmp_path) -> None:
    sweep = read_sweep(ROOT / "benchmarks" / "real_demo.toml")
    assert sweep.model == "smollm2-135m"
    assert sweep.dataset == "asyncgrpo.shell.commands.real_demo:train_problems"
    assert sweep.eval_dataset == {
        "held_out": "asyncgrpo.shell.commands.real_demo:held_out_problems"
    }
    assert sweep.reward_funcs == ("asyncgrpo.tasks:answer_reward",)
    assert dict(sweep.server) == real_demo.SERVER
    run, *others = sweep.runs  # one setting, over seeds
    assert all(other.settings == run.settings for other in others)
    from_sweep = run_config(sweep, run, tmp_path, "http://127.0.0.1")
    demo = real_demo.real_demo_config(tmp_path, sweep.stop.max_steps, "http://127.0.0.1")
    pairs = {
        f.name: (getattr(from_sweep, f.name), getattr(demo, f.name))
        for f in dataclasses.fields(demo)
        if f.name not in PER_RUN
    }
    assert {name: pair for name, pair in pairs.items() if pair[0] != pair[1]} == {}


def test_the_held_out_split_is_every_held_out_problem_and_apart_from_training() -> None:
    held_out, train = real_demo.held_out_problems(), real_demo.train_problems()
    assert len(held_out) == len(set(held_out["problem"])) == 58
    assert not set(held_out["problem"]) & set(train["problem"])


def test_the_demo_flags_set_their_config_fields_for_both_demos() -> None:
    args = build_parser().parse_args(
        [
            "demo",
            "--output-dir",
            "x",
            "--seed",
            "3",
            "--max-staleness",
            "2",
            "--stop-after-spreadless-steps",
            "4",
        ]
    )
    overrides = demo_overrides(args)
    assert overrides == {"seed": 3, "max_staleness": 2, "stop_after_spreadless_steps": 4}
    config = real_demo.real_demo_config("x", 20, "http://127.0.0.1")
    assert dataclasses.replace(config, **overrides).stop_after_spreadless_steps == 4
    plain = demo_overrides(build_parser().parse_args(["demo", "--output-dir", "x"]))
    assert plain == {"seed": 0}


def test_the_accuracy_report_says_before_and_after_or_that_no_later_evaluation_ran(
    tmp_path,
) -> None:
    def evaluation(step: int, accuracy: float) -> str:
        row = {
            "step": step,
            "eval/held_out/prompts": 58,
            "eval/held_out/reward": accuracy,
            "eval/held_out/reward/ci_low": accuracy - 0.1,
            "eval/held_out/reward/ci_high": accuracy + 0.1,
        }
        return json.dumps(row) + "\n"

    assert real_demo.accuracy_report(tmp_path) == "no evaluation was logged"
    path = tmp_path / EVALUATIONS_FILE
    path.write_text(evaluation(0, 0.5))
    assert "0.500 [0.400, 0.600] at step 0" in real_demo.accuracy_report(tmp_path)
    assert "no evaluation after training began" in real_demo.accuracy_report(tmp_path)
    path.write_text(evaluation(0, 0.5) + evaluation(20, 0.9))
    assert real_demo.accuracy_report(tmp_path).endswith(
        "before 0.500 [0.400, 0.600] at step 0, after 0.900 [0.800, 1.000] at step 20"
    )
