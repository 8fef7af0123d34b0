"""AsyncGRPOConfig: every TrainingArguments field accepted or rejected with a reason, types
checked at construction, config files and flags read into the same fields."""

from __future__ import annotations

import dataclasses
import json
import pickle
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import TrainingArguments

from asyncgrpo.core.loss.objectives import OBJECTIVES
from asyncgrpo.core.names import spoken_list
from asyncgrpo.shell.commands import main
from asyncgrpo.shell.commands.train import (
    TrainCommandError,
    build_config,
    lora_config,
    parse_train_args,
)
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.config import docs as config_docs
from asyncgrpo.shell.config import rules as config_rules
from asyncgrpo.shell.config.checks import WEIGHT_SYNC_MARGIN_S
from asyncgrpo.shell.learner.optimization import build_optimizer, build_scheduler
from asyncgrpo.shell.servers import dtype_as_trainer, local_server_spec

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class CurriculumConfig(AsyncGRPOConfig):
    pass_rate_cap: float = 0.9


def test_every_training_arguments_field_is_used_rejected_or_script_only() -> None:
    kinds = [config_rules.USED, config_rules.REJECTED, config_rules.SCRIPT_ONLY]
    for field in dataclasses.fields(TrainingArguments):
        if field.init:
            assert sum(field.name in kind for kind in kinds) == 1, field.name
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert set().union(*kinds) <= names


def test_the_configuration_reference_is_generated_from_the_declarations() -> None:
    assert (ROOT / "docs" / "configuration.md").read_text() == config_docs.render(), (
        "regenerate: python -m asyncgrpo.shell.config.docs docs/configuration.md"
    )


def test_trl_arguments_are_accepted_with_trl_defaults() -> None:
    config = AsyncGRPOConfig(
        per_device_train_batch_size=8,
        optim="sgd",
        lr_scheduler_kwargs={"min_lr": 0.0},
        gradient_checkpointing_kwargs={"use_reentrant": True},
        logging_first_step=True,
        push_to_hub=True,
        hub_model_id="me/model",
        data_seed=3,
        full_determinism=True,
        save_strategy="epoch",
        use_cpu=True,
        do_train=True,
    )
    assert config.output_dir == "trainer_output"
    assert config.learning_rate == 1e-6 and config.logging_steps == 1
    assert config.gradient_checkpointing is None and config.bf16 is None  # decided at start
    assert config.prompt_order_seed == 3 and AsyncGRPOConfig(seed=5).prompt_order_seed == 5
    assert config.device == torch.device("cpu")
    again = pickle.loads(pickle.dumps(config))
    assert again.to_dict() == config.to_dict()
    assert dataclasses.replace(config, max_steps=7).max_steps == 7


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"torch_compile": True}, "torch_compile=True is not supported: the packed"),
        ({"per_device_train_batch_size": 4}, "set token_budget instead"),
        ({"optim": "adamw_8bit"}, "optim='adamw_8bit' is not supported"),
        ({"eval_strategy": "epoch"}, "eval_strategy='epoch' is not supported"),
        ({"per_device_eval_batch_size": 4}, "evaluations generate on the vLLM servers"),
        ({"eval_temperature": -0.5}, "eval_temperature must be >= 0"),
        ({"eval_num_generations": 0}, "eval_num_generations must be >= 1"),
        ({"save_strategy": "best"}, "save_strategy='best'"),
        ({"deepspeed": "ds.json"}, "DeepSpeed is not supported"),
        ({"report_to": "comet"}, "report_to names unknown trackers"),
        ({"lr_scheduler_type": "cosine"}, "set max_steps explicitly"),
        ({"remove_unused_columns": True}, "every column goes to the reward functions"),
        ({"max_staleness": 1, "weight_sync_steps": 3}, "max_staleness=1 is below weight_sync"),
    ],
)
def test_fields_the_trainer_cannot_honour_fail_with_the_reason(values, message) -> None:
    with pytest.raises(ValueError, match=message):
        AsyncGRPOConfig(**values)


def test_the_weight_send_timeout_defaults_well_below_the_collective_timeout() -> None:
    """A hung send is aborted on rank 0 before the other ranks' NCCL watchdog (ddp_timeout)
    ends the run: the defaults keep at least the margin between the two."""
    config = AsyncGRPOConfig()
    assert config.weight_sync_timeout == 600.0
    assert config.weight_sync_timeout + WEIGHT_SYNC_MARGIN_S <= config.ddp_timeout


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"weight_sync_timeout": 1800.0},
            r"weight_sync_timeout=1800 s leaves less than 60 s before ddp_timeout=1800 s.*"
            r"Lower weight_sync_timeout to at most 1740 or raise ddp_timeout to at least 1860",
        ),
        (
            {"weight_sync_timeout": 600.0, "ddp_timeout": 650},
            "weight_sync_timeout=600 s leaves less than 60 s before ddp_timeout=650 s",
        ),
        ({"weight_sync_timeout": 0.0}, "weight_sync_timeout must be > 0 seconds, got 0.0"),
    ],
)
def test_a_weight_send_timeout_without_a_margin_below_ddp_timeout_is_refused(
    values, message
) -> None:
    with pytest.raises(ValueError, match=message):
        AsyncGRPOConfig(**values)
    assert AsyncGRPOConfig(weight_sync_timeout=1740.0).weight_sync_timeout == 1740.0


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"learning_rate": "abc"}, r"learning_rate must be float, got 'abc' \(str\)"),
        ({"num_generations": True}, "num_generations must be int"),
        ({"max_steps": 2.5}, "max_steps must be int"),
        ({"top_k": None}, "top_k must be int"),
        ({"chat_template_kwargs": 3}, "chat_template_kwargs must be dict or str or None"),
    ],
)
def test_values_of_the_wrong_type_fail_naming_the_field(values, message) -> None:
    with pytest.raises(TypeError, match=message):
        AsyncGRPOConfig(**values)


@pytest.mark.parametrize(
    "name",
    [
        "model_init_kwargs",
        "chat_template_kwargs",
        "lr_scheduler_kwargs",
        "gradient_checkpointing_kwargs",
    ],
)
def test_keyword_argument_fields_take_a_dict_or_a_json_object_string(name) -> None:
    assert AsyncGRPOConfig(**{name: '{"a": 1}'}).keyword_arguments(name) == {"a": 1}
    assert AsyncGRPOConfig(**{name: None}).keyword_arguments(name) is None
    with pytest.raises(ValueError, match=f"{name}='a=1' is not a JSON object"):
        AsyncGRPOConfig(**{name: "a=1"})


def test_output_path_is_the_output_dir_and_names_the_field_when_unset(tmp_path) -> None:
    config = AsyncGRPOConfig(output_dir=str(tmp_path))
    assert config.output_path == tmp_path
    config.output_dir = None
    with pytest.raises(ValueError, match="output_dir is None"):
        _ = config.output_path


def test_a_subclass_adds_fields_that_are_type_checked_too() -> None:
    assert CurriculumConfig(pass_rate_cap=0.5).pass_rate_cap == 0.5
    with pytest.raises(TypeError, match="pass_rate_cap must be float"):
        CurriculumConfig(pass_rate_cap="high")


@pytest.mark.parametrize("suffix", [".toml", ".yaml", ".json"])
def test_config_files_read_top_level_fields_and_the_table(tmp_path, suffix) -> None:
    data = {"max_steps": 3, "asyncgrpo": {"learning_rate": 0.01, "report_to": ["tensorboard"]}}
    path = tmp_path / f"run{suffix}"
    if suffix == ".toml":
        path.write_text(
            'max_steps = 3\n[asyncgrpo]\nlearning_rate = 0.01\nreport_to = ["tensorboard"]\n'
        )
    elif suffix == ".yaml":
        path.write_text(
            "max_steps: 3\nasyncgrpo:\n  learning_rate: 0.01\n  report_to: [tensorboard]\n"
        )
    else:
        path.write_text(json.dumps(data))
    config = AsyncGRPOConfig.from_file(path, seed=1)
    assert (config.max_steps, config.learning_rate, config.seed) == (3, 0.01, 1)
    assert config.report_to == ["tensorboard"]


def test_config_files_fail_on_unknown_duplicate_and_mistyped_keys(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[asyncgrpo]\nlerning_rate = 0.1\n")
    with pytest.raises(ValueError, match="did you mean 'learning_rate'"):
        AsyncGRPOConfig.from_file(path)
    path.write_text("max_stps = 3\n")
    with pytest.raises(ValueError, match="did you mean 'max_steps'"):
        AsyncGRPOConfig.from_file(path)
    path.write_text("max_steps = 3\n[asyncgrpo]\nmax_steps = 4\n")
    with pytest.raises(ValueError, match="both at the top level and in"):
        AsyncGRPOConfig.from_file(path)
    path.write_text('[asyncgrpo]\nlearning_rate = "abc"\n')
    with pytest.raises(TypeError, match="learning_rate must be float"):
        AsyncGRPOConfig.from_file(path)


def test_train_flags_override_the_config_file(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(
        'model = "m"\ndataset = "d.jsonl"\nreward_funcs = ["a:b"]\n'
        "learning_rate = 0.5\n[asyncgrpo]\nmax_steps = 9\n"
    )
    settings = parse_train_args(
        [
            "--config",
            str(path),
            "--max-steps",
            "2",
            "--no_score_centering",
            "--lr_scheduler_kwargs",
            '{"num_cycles": 2}',
        ]
    )
    config = build_config(settings)
    assert (settings.model, settings.dataset, settings.rewards) == ("m", "d.jsonl", ["a:b"])
    assert (config.max_steps, config.learning_rate, config.score_centering) == (2, 0.5, False)
    assert config.lr_scheduler_kwargs == {"num_cycles": 2}


def test_trl_flat_objective_names_reach_the_chosen_objectives_record(tmp_path) -> None:
    """TRL's flat names (epsilon, epsilon_high, ...) given to the constructor, a config file or
    flags become the chosen loss_type's settings record; a setting the chosen objective does not
    read is accepted, as in TRL, and still checked."""
    config = AsyncGRPOConfig(loss_type="tis_token", epsilon_high=0.28, tis_token_cap=3.0)
    settings = config.objective_settings()
    assert type(settings) is OBJECTIVES["tis_token"].settings_type
    assert (settings.epsilon, settings.trust_region) == (0.2, (0.8, 1.28))
    assert settings.tis_token_cap == 3.0
    path = tmp_path / "run.toml"
    path.write_text(
        'model = "m"\ndataset = "d.jsonl"\nreward_funcs = ["a:b"]\ncispo_clip_max = 4.0\n'
    )
    flagged = build_config(
        parse_train_args(["--config", str(path), "--loss_type", "cispo", "--epsilon_high", "0.3"])
    )
    assert flagged.objective_settings() == OBJECTIVES["cispo"].settings_type(cispo_clip_max=4.0)
    assert flagged.epsilon_high == 0.3  # accepted, though cispo does not read it
    assert AsyncGRPOConfig(epsilon_high=0.3).trl_settings().trust_region == (0.8, 1.3)
    with pytest.raises(ValueError, match="AsyncGRPOConfig: tis_token_cap must be >= 1"):
        AsyncGRPOConfig(loss_type="cispo", tis_token_cap=0.5)


def test_train_takes_trl_lora_flags_and_starts_a_server_that_fits_the_run(
    tiny_qwen3, tmp_path
) -> None:
    base = [
        "--model",
        str(tiny_qwen3),
        "--dataset",
        "d.jsonl",
        "--reward",
        "a:b",
        "--output_dir",
        str(tmp_path),
    ]
    assert lora_config(parse_train_args(base).script) is None
    settings = parse_train_args(
        [
            *base,
            "--use_peft",
            "--lora_r",
            "24",
            "--lora_alpha",
            "48",
            "--lora_target_modules",
            "q_proj",
            "v_proj",
        ]
    )
    lora = lora_config(settings.script)
    assert (lora.r, lora.lora_alpha, lora.lora_dropout) == (24, 48, 0.05)
    assert set(lora.target_modules) == {"q_proj", "v_proj"}
    spec = local_server_spec(
        str(tiny_qwen3), build_config(settings), max_model_len=128, lora_rank=lora.r
    )
    assert spec.enable_lora and spec.max_lora_rank == 32  # vLLM takes powers of 2
    assert spec.max_model_len == 128 and spec.weight_transfer_backend is None  # auto: by disk
    gloo = dataclasses.replace(build_config(settings), weight_transfer_backend="asyncgrpo_gloo")
    longest = local_server_spec(str(tiny_qwen3), gloo, max_model_len=10**6)
    assert longest.weight_transfer_backend == "asyncgrpo_gloo"  # the engine the run drives
    assert longest.max_model_len == 4096  # cut to the model's max_position_embeddings
    assert not local_server_spec(
        str(tiny_qwen3), build_config(settings), max_model_len=128
    ).enable_lora


def test_a_server_as_the_trainer_serves_the_dtype_the_learner_computes_in(tiny_qwen3) -> None:
    """The real demo's server dtype: fp32 for a model the learner computes in fp32 on this CPU
    (a tiny one: under the size at which bf16 pays), bf16 when the run asks the learner for it."""
    config = AsyncGRPOConfig(output_dir="out", use_cpu=True)
    assert dtype_as_trainer(str(tiny_qwen3), config) == "float32"
    asked = dataclasses.replace(config, bf16=True)
    assert dtype_as_trainer(str(tiny_qwen3), asked) == "bfloat16"


def test_train_fails_naming_the_closest_flag_or_key(tmp_path, capsys) -> None:
    base = ["--model", "m", "--dataset", "d.jsonl", "--reward", "a:b"]
    with pytest.raises(TrainCommandError, match="did you mean '--learning_rate'"):
        parse_train_args([*base, "--lerning_rate", "3"])
    path = tmp_path / "run.yaml"
    path.write_text("modle: m\n")
    with pytest.raises(TrainCommandError, match="did you mean 'model'"):
        parse_train_args(["--config", str(path)])
    path.write_text("learning_rate: abc\n")
    with pytest.raises(TrainCommandError, match="learning_rate must be float"):
        build_config(parse_train_args([*base, "--config", str(path)]))
    assert main(["train", *base, "--max_stepz", "3"]) == 2
    assert "did you mean '--max_steps'" in capsys.readouterr().err


def test_train_takes_evaluation_datasets_and_rewards_by_flag_and_config_key(tmp_path) -> None:
    """``--eval_dataset [NAME=]PATH`` repeats (or takes several values) in the forms of
    ``asyncgrpo eval --dataset``; a lone unnamed one is ``eval``; ``--eval_reward`` likewise;
    the config file's ``eval_dataset`` and ``eval_reward_funcs`` say the same; flags win."""
    base = ["--model", "m", "--dataset", "d.jsonl", "--reward", "a:b", "--reward", "c:d"]
    settings = parse_train_args(
        [
            *base,
            "--eval_dataset",
            "held=h.jsonl",
            "--eval_dataset",
            "data/other.jsonl",
            "mod:fn",
            "--eval_reward",
            "e:f",
        ]
    )
    assert settings.rewards == ["a:b", "c:d"]
    assert settings.eval_datasets == {
        "held": "h.jsonl",
        "other": "data/other.jsonl",
        "mod:fn": "mod:fn",
    }
    assert settings.eval_rewards == ["e:f"]
    assert parse_train_args([*base, "--eval_dataset", "h.jsonl"]).eval_datasets == {
        "eval": "h.jsonl"
    }
    assert parse_train_args(base).eval_datasets == {}
    path = tmp_path / "run.toml"
    path.write_text(
        'model = "m"\ndataset = "d.jsonl"\nreward_funcs = ["a:b"]\n'
        'eval_reward_funcs = "e:f"\n[eval_dataset]\nheld = "h.jsonl"\n'
    )
    from_file = parse_train_args(["--config", str(path)])
    assert (from_file.eval_datasets, from_file.eval_rewards) == ({"held": "h.jsonl"}, ["e:f"])
    flagged = parse_train_args(["--config", str(path), "--eval_dataset", "x=y.jsonl"])
    assert flagged.eval_datasets == {"x": "y.jsonl"}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--eval_dataset", "a.jsonl", "--eval_dataset", "a.jsonl"],
            "--eval_dataset: the name 'a' is given twice; name each dataset with NAME=PATH",
        ),
        (["--eval_reward", "e:f"], "give the held-out prompts with --eval_dataset"),
        (["--eval_dataset", "held=h.jsonl"], "only with --eval_strategy steps"),
        (["--eval_strategy", "steps"], "give them with --eval_dataset"),
        (["--eval_on_start"], "give them with --eval_dataset"),
        (
            ["--eval_dataset", "h=missing.txt", "--eval_on_start"],
            "dataset 'missing.txt': give a .json/.jsonl file",
        ),
        (
            ["--eval_dataset", "h.jsonl", "--eval_on_start", "--eval_reward", "nomodule"],
            "--eval_reward function 'nomodule' must look like 'package.module:name'",
        ),
    ],
)
def test_train_evaluation_flags_fail_naming_the_flag_and_the_fix(
    tmp_path, capsys, flags, message
) -> None:
    """Each refusal comes before a model loads or a server starts (the model 'm' does not
    exist), from ``asyncgrpo train`` with exit status 2."""
    prompts = tmp_path / "d.jsonl"
    prompts.write_text('{"prompt": [{"role": "user", "content": "1+1?"}]}\n')
    base = [
        "--model",
        "m",
        "--dataset",
        str(prompts),
        "--reward",
        "asyncgrpo.shell.commands.demo:digit_fraction_reward",
        "--output_dir",
        str(tmp_path),
    ]
    assert main(["train", *base, *flags]) == 2
    assert message in capsys.readouterr().err


def test_train_help_shows_every_field_with_its_help(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for field in dataclasses.fields(AsyncGRPOConfig):
        assert f"--{field.name}" in text, field.name
    assert "Top log-probs requested per token for score centering." in text
    assert "only the default: the packed tree-attention forward is not compiled" in text
    assert f"The policy objective (docs/objectives.md): {spoken_list(OBJECTIVES)}." in text
    assert "score_centering, clipped_surrogate, tis_token" in text  # the registry's order


@pytest.mark.parametrize(
    ("optim", "kind", "extra"),
    [
        ("adamw_torch_fused", torch.optim.AdamW, {"fused": True}),
        ("adamw_torch", torch.optim.AdamW, {"fused": None}),
        ("sgd", torch.optim.SGD, {"momentum": 0.5}),
    ],
)
def test_optim_builds_transformers_optimizers(optim, kind, extra) -> None:
    model = torch.nn.Linear(4, 4)
    args = "momentum=0.5" if optim == "sgd" else None
    config = AsyncGRPOConfig(optim=optim, optim_args=args, learning_rate=0.1, weight_decay=0.1)
    optimizer = build_optimizer(model, config)
    assert type(optimizer) is kind
    groups = {g["params"][0].ndim: g for g in optimizer.param_groups}
    assert groups[2]["weight_decay"] == 0.1 and groups[2]["lr"] == 0.1  # the weight matrix
    assert groups[1]["weight_decay"] == 0.0  # the bias
    for key, value in extra.items():
        assert groups[2][key] == value


def test_lr_scheduler_kwargs_reach_the_schedule() -> None:
    model = torch.nn.Linear(2, 2)
    config = AsyncGRPOConfig(
        lr_scheduler_type="cosine_with_min_lr",
        max_steps=10,
        learning_rate=1.0,
        lr_scheduler_kwargs={"min_lr": 0.25},
    )
    optimizer = build_optimizer(model, config)
    scheduler = build_scheduler(optimizer, config)
    for _ in range(10):
        optimizer.step()
        scheduler.step()
    assert scheduler.get_last_lr()[0] == pytest.approx(0.25)
