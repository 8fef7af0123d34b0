"""The transformers-Trainer surface of AsyncGRPOTrainer: callbacks with a real TrainerState
and TrainerControl, train(trial=...), save_model and push_to_hub (up to huggingface_hub's
upload call; no hub is reachable here)."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch
from datasets import Dataset
from huggingface_hub import constants
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.adapters.vllm.server import free_port
from asyncgrpo.shell.commands.demo import digit_fraction_reward
from asyncgrpo.shell.run import hub, read_metrics


def dataset(n: int = 8) -> Dataset:
    return Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"Number {i}?"}] for i in range(n)]}
    )


def config(tmp_path, base_url="http://127.0.0.1:9", **overrides) -> AsyncGRPOConfig:
    options = dict(
        output_dir=str(tmp_path / "run"),
        max_steps=6,
        learning_rate=1e-3,
        num_generations=4,
        max_completion_length=12,
        token_budget=256,
        gradient_checkpointing=False,
        num_sampler_logprobs=4,
        disable_tqdm=True,
        vllm_server_base_url=base_url,
    )
    return AsyncGRPOConfig(**{**options, **overrides})


class Recorder(TrainerCallback):
    """Every event with the step the TrainerState holds, and the logged metrics."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.logs: list[dict[str, float]] = []

    def __getattribute__(self, name: str):
        if name.startswith("on_"):

            def record(args, state, control, **kwargs):
                self.events.append((name, state.global_step))
                if name == "on_log":
                    self.logs.append(kwargs["logs"])

            return record
        return super().__getattribute__(name)


class EarlyStopping(TrainerCallback):
    """Stops when the logged reward reaches a threshold, or after a patience in steps;
    asks for a checkpoint at step 1 and a log at step 2 (the schedule would do neither)."""

    def __init__(self, threshold: float, patience: int) -> None:
        self.threshold, self.patience = threshold, patience

    def on_step_end(self, args, state, control, **kwargs):
        control.should_save = control.should_save or state.global_step == 1
        control.should_log = control.should_log or state.global_step == self.patience
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs["reward"] >= self.threshold or state.global_step >= self.patience:
            control.should_training_stop = True
        return control


class FakeOptunaTrial:
    """A named fake of optuna's Trial (optuna is not installed here): what train() reads."""

    params: ClassVar[dict] = {"learning_rate": 0.02, "max_steps": 5}


def test_callbacks_fire_with_state_and_control_and_stop_early(served, tmp_path) -> None:
    server, path = served
    recorder = Recorder()
    trainer = AsyncGRPOTrainer(
        model=str(path),
        reward_funcs=digit_fraction_reward,
        train_dataset=dataset(),
        args=config(tmp_path, server.base_url, logging_steps=100, save_strategy="no"),
        callbacks=[recorder, EarlyStopping(threshold=2.0, patience=2)],
    )
    out = trainer.train(trial={"learning_rate": 0.01})
    assert trainer.args.learning_rate == 0.01 and trainer.state.trial_params == {
        "learning_rate": 0.01
    }
    assert out.global_step == 2 and trainer.state.global_step == 2
    names = [name for name, _ in recorder.events]
    assert names[:2] == ["on_init_end", "on_train_begin"]
    assert recorder.events[2:] == [
        ("on_step_begin", 0),
        ("on_step_end", 1),
        ("on_save", 1),
        ("on_step_begin", 1),
        ("on_step_end", 2),
        ("on_log", 2),
        ("on_train_end", 2),
    ]
    assert {"reward", "loss", "epoch", "num_tokens"} <= set(recorder.logs[0])
    assert trainer.state.log_history[-1]["step"] == 2
    assert [row["step"] for row in read_metrics(tmp_path / "run")] == [2]
    assert (tmp_path / "run" / "checkpoint-1").is_dir()
    assert not (tmp_path / "run" / "checkpoint-2").exists()

    trainer.save_model(str(tmp_path / "saved"))
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "run")
    for (name, a), (_, b) in zip(
        saved.state_dict().items(), final.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert AutoTokenizer.from_pretrained(tmp_path / "saved").eos_token is not None


def test_trial_values_are_checked_like_config_values(tiny_qwen3, tmp_path) -> None:
    trainer = AsyncGRPOTrainer(
        model=str(tiny_qwen3),
        reward_funcs=digit_fraction_reward,
        train_dataset=dataset(),
        args=config(tmp_path),
    )
    with pytest.raises(ValueError, match="did you mean 'learning_rate'"):
        trainer.train(trial={"lerning_rate": 0.1})
    with pytest.raises(ValueError, match="'dtype', which takes effect when the trainer is built"):
        trainer.train(trial={"dtype": "bfloat16"})
    with pytest.raises(TypeError, match="max_steps must be int"):
        trainer.train(trial={"max_steps": "many"})
    trainer._apply_trial(FakeOptunaTrial())
    assert (trainer.args.learning_rate, trainer.args.max_steps) == (0.02, 5)


def test_save_model_before_training_writes_the_given_model(tiny_qwen3, tmp_path) -> None:
    trainer = AsyncGRPOTrainer(
        model=str(tiny_qwen3),
        reward_funcs=digit_fraction_reward,
        train_dataset=dataset(),
        args=config(tmp_path),
    )
    trainer.save_model(str(tmp_path / "given"))
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "given").state_dict()
    original = AutoModelForCausalLM.from_pretrained(tiny_qwen3).state_dict()
    assert all(torch.equal(saved[k], original[k]) for k in original)


class RecordingHfApi:
    """A named fake of huggingface_hub.HfApi: records create_repo and upload_folder."""

    calls: ClassVar[list[tuple[str, dict]]] = []

    def __init__(self, token=None, endpoint=None) -> None:
        self.token, self.endpoint = token, endpoint

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", {"repo_id": repo_id, "token": self.token, **kwargs}))

    def upload_folder(self, **kwargs):
        self.calls.append(("upload_folder", kwargs))
        return "commit"


def test_push_to_hub_saves_then_uploads_with_the_hub_settings(
    tiny_qwen3, tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(hub, "HfApi", RecordingHfApi)
    RecordingHfApi.calls = []
    args = config(
        tmp_path,
        push_to_hub=True,
        hub_model_id="me/tiny",
        hub_token="hf_test",
        hub_private_repo=True,
    )
    trainer = AsyncGRPOTrainer(
        model=str(tiny_qwen3),
        reward_funcs=digit_fraction_reward,
        train_dataset=dataset(),
        args=args,
    )
    assert trainer.push_to_hub(dataset_name="digits", license="apache-2.0") == "commit"
    (_, create), (_, upload) = RecordingHfApi.calls
    assert create == {"repo_id": "me/tiny", "token": "hf_test", "private": True, "exist_ok": True}
    assert upload["repo_id"] == "me/tiny" and upload["folder_path"] == str(tmp_path / "run")
    assert upload["commit_message"] == "End of training" and not upload["run_as_future"]
    assert "checkpoint-*/**" in upload["ignore_patterns"]
    assert (tmp_path / "run" / "config.json").exists()
    card = (tmp_path / "run" / "README.md").read_text()
    assert "digits" in card and "apache-2.0" in card


def test_push_to_hub_without_token_or_network_says_so(tiny_qwen3, tmp_path, monkeypatch) -> None:
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-tokens"))
    with pytest.raises(hub.HubError, match="needs a Hugging Face token"):
        AsyncGRPOTrainer(
            model=str(tiny_qwen3),
            reward_funcs=digit_fraction_reward,
            train_dataset=dataset(),
            args=config(tmp_path, push_to_hub=True),
        )
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")
    trainer = AsyncGRPOTrainer(
        model=str(tiny_qwen3),
        reward_funcs=digit_fraction_reward,
        train_dataset=dataset(),
        args=config(tmp_path),
    )
    with pytest.raises(hub.HubError, match="could not upload .*no network"):
        trainer.push_to_hub(token="hf_test")


def test_a_tracker_that_is_not_installed_fails_at_construction(tiny_qwen3, tmp_path) -> None:
    """report_to names transformers' reporting callbacks; one whose package is missing fails
    when the trainer is built, saying what to install (wandb is not installed here)."""
    args = config(tmp_path, report_to="wandb")
    with pytest.raises(RuntimeError, match="pip install wandb"):
        AsyncGRPOTrainer(
            model=str(tiny_qwen3),
            reward_funcs=digit_fraction_reward,
            train_dataset=dataset(),
            args=args,
        )
