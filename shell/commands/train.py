"""``asyncgrpo train``: a run from a config file and flags.

Every :class:`AsyncGRPOConfig` field is a flag (``--learning_rate`` or ``--learning-rate``),
built by transformers' ``HfArgumentParser`` from the same declarations as the config, so
``asyncgrpo train --help`` shows each field's help. A config file (TOML, YAML or JSON) holds
``model``, ``dataset``, ``reward_funcs`` (``"module:function"`` strings), optionally
``eval_dataset`` and ``eval_reward_funcs``, and config fields, at the top level or in an
``asyncgrpo`` table; flags override it::

    model = "runs/demo/initial-model"
    dataset = "prompts.jsonl"
    reward_funcs = ["asyncgrpo.shell.commands.demo:digit_fraction_reward"]
    eval_dataset = ["held=held_out.jsonl"]    # or "held_out.jsonl", or a table NAME = PATH

    [asyncgrpo]
    max_steps = 20
    learning_rate = 1e-2
    eval_strategy = "steps"
    eval_steps = 5

Evaluation during training (docs/evaluation.md): ``--eval_dataset [NAME=]PATH``, repeatable, in
the forms of ``asyncgrpo eval --dataset`` (a lone unnamed one is ``eval``), evaluated as
``--eval_strategy steps`` (every ``--eval_steps``) and ``--eval_on_start`` say; scored by the
training rewards, or by ``--eval_reward module:function`` (repeatable) where evaluation scores
differently. A misspelt flag or key fails naming the closest one.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from transformers import HfArgumentParser
from transformers.hf_argparser import DataClassType

from asyncgrpo.core.names import did_you_mean
from asyncgrpo.shell.config import (
    AsyncGRPOConfig,
    NamedObjectError,
    eval_dataset_specs,
    field_names,
    import_named,
    load_eval_datasets,
    load_named_dataset,
    read_config,
)
from asyncgrpo.shell.config import rules as config_rules

SCRIPT_KEYS = ("model", "dataset", "reward_funcs", "eval_dataset", "eval_reward_funcs")
"""Top-level keys of a config file that are not config fields."""


class TrainCommandError(ValueError):
    """A missing or invalid setting of ``asyncgrpo train``."""


@dataclass
class TrainScriptArguments:
    """The flags of ``asyncgrpo train`` that are not config fields."""

    config: str | None = field(
        default=None,
        metadata={
            "help": "TOML, YAML or JSON file: model, dataset, reward_funcs and "
            "AsyncGRPOConfig fields (top level or an 'asyncgrpo' table)"
        },
    )
    model: str | None = field(default=None, metadata={"help": "model id or directory"})
    dataset: str | None = field(
        default=None, metadata={"help": "a .json/.jsonl file or a datasets.save_to_disk folder"}
    )
    reward: list[str] | None = field(
        default=None,
        metadata={
            "help": "module:function of each reward function (repeatable)",
            "action": "extend",
            "metavar": "MODULE:FUNCTION",
        },
    )
    eval_dataset: list[str] | None = field(
        default=None,
        metadata={
            "help": "held-out prompts evaluated during training, as asyncgrpo eval "
            "--dataset takes them: a .json/.jsonl file, a save_to_disk folder or "
            "module:function, named NAME= (metrics eval/NAME/...; a lone unnamed "
            "one is 'eval'); repeatable. When: --eval_strategy steps, --eval_steps, "
            "--eval_on_start",
            "action": "extend",
            "metavar": "[NAME=]PATH",
        },
    )
    eval_reward: list[str] | None = field(
        default=None,
        metadata={
            "help": "module:function of each reward function that scores evaluations "
            "(repeatable); default: the training rewards",
            "action": "extend",
            "metavar": "MODULE:FUNCTION",
        },
    )
    vllm_url: str | None = field(
        default=None,
        metadata={
            "help": "use this vLLM server instead of starting one (several: URLs "
            "separated by commas)"
        },
    )
    vllm_servers: int = field(
        default=1,
        metadata={
            "help": "local vLLM servers to start (each on its share of the server "
            "cores; docs/scaling.md); unused with --vllm_url"
        },
    )
    max_model_len: int = field(
        default=4096, metadata={"help": "--max-model-len of the server it starts"}
    )
    vllm_enforce_eager: bool = field(
        default=False,
        metadata={
            "help": "start the local servers without torch.compile (vLLM's "
            "--enforce-eager): ready 10-40 s sooner, 10-20%% fewer tokens/s"
        },
    )
    resume: bool = field(default=False, metadata={"help": "resume from the last checkpoint"})
    use_peft: bool = field(
        default=False,
        metadata={
            "help": "train LoRA adapters instead of the whole model (TRL's ModelConfig flags)"
        },
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank (with --use_peft)"})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (with --use_peft)"})
    lora_dropout: float = field(default=0.05, metadata={"help": "LoRA dropout (with --use_peft)"})
    lora_target_modules: list[str] | None = field(
        default=None,
        metadata={
            "help": "modules that get adapters (with --use_peft); default: peft's choice "
            "for the architecture"
        },
    )


@dataclass
class TrainSettings:
    """What ``asyncgrpo train`` runs: script settings and the config fields to build."""

    script: TrainScriptArguments
    config_values: dict[str, Any]
    model: str
    dataset: str
    rewards: list[str]
    eval_datasets: dict[str, str] = field(default_factory=dict)  # name -> PATH
    eval_rewards: list[str] = field(default_factory=list)  # empty: the training rewards


def build_parser() -> HfArgumentParser:
    """``HfArgumentParser`` over :class:`TrainScriptArguments` and :class:`AsyncGRPOConfig`;
    the help of a ``TrainingArguments`` field says what this trainer does with it."""
    parser = HfArgumentParser(
        # transformers declares the dataclasses as its NewType DataClassType
        (DataClassType(TrainScriptArguments), DataClassType(AsyncGRPOConfig)),
        prog="asyncgrpo train",
        description="Train with AsyncGRPOTrainer. Starts a local vLLM server for the model "
        "unless --vllm_url is given. Every AsyncGRPOConfig field is a flag.",
        usage="asyncgrpo train [--help] [--config FILE] [--model M] [--dataset D] "
        "[--reward module:function ...] [--eval_dataset [NAME=]PATH ...] "
        "[--eval_reward module:function ...] [--<AsyncGRPOConfig field> VALUE ...]",
        formatter_class=argparse.HelpFormatter,
    )
    for action in parser._actions:
        if action.dest == "help":
            continue
        # The default is shown in the help and left to the dataclasses: parsing then returns
        # only the flags given, which override the config file.
        action.help = f"{action.help or ''} (default: {action.default})".replace("%", "%%")
        action.default = argparse.SUPPRESS
        if action.dest == "vllm_server_base_url":  # one value; several URLs by commas
            action.nargs, action.type = None, str
        if action.dest in config_rules.REJECTED:
            note = f"only the default: {config_rules.REJECTED[action.dest]}"
        elif action.dest in config_rules.USED and action.dest in config_rules.CHOICES:
            note = config_rules.USED[action.dest]
        else:
            continue
        action.help += f" [AsyncGRPOTrainer: {note}]".replace("%", "%%")
    return parser


def parse_train_args(argv: Sequence[str]) -> TrainSettings:
    """Parse ``asyncgrpo train`` flags over the config file they name: the file's values, then
    the flags given (the parser has no defaults, so it returns only those), then
    AsyncGRPOConfig's own defaults.

    Raises:
        TrainCommandError: an unknown flag or key (naming the closest), a missing model,
            dataset or reward.
    """
    parser = build_parser()
    namespace, unknown = parser.parse_known_args(list(argv))
    if unknown:
        flags = [u.split("=")[0] for u in unknown if u.startswith("-")]
        known = [o for a in parser._actions for o in a.option_strings]
        first = flags[0] if flags else unknown[0]
        raise TrainCommandError(f"unknown argument {first!r}" + did_you_mean(first, known))
    given = vars(namespace)
    script = TrainScriptArguments(
        **{k: v for k, v in given.items() if k in TrainScriptArguments.__dataclass_fields__}
    )
    values: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    if script.config:
        try:
            values, extra = read_config(script.config, AsyncGRPOConfig)
        except (OSError, ValueError) as error:
            raise TrainCommandError(str(error)) from error
        stray = sorted(set(extra) - set(SCRIPT_KEYS))
        if stray:
            raise TrainCommandError(
                f"{script.config}: {stray[0]!r} is neither an AsyncGRPOConfig field nor one of "
                f"{', '.join(SCRIPT_KEYS)}"
                + did_you_mean(stray[0], [*SCRIPT_KEYS, *field_names(AsyncGRPOConfig)])
            )
    values.update({k: v for k, v in given.items() if k in set(field_names(AsyncGRPOConfig))})
    if script.vllm_servers < 1:
        raise TrainCommandError(f"--vllm_servers must be >= 1, got {script.vllm_servers}")
    model = script.model or extra.get("model")
    dataset = script.dataset or extra.get("dataset")
    rewards = script.reward or extra.get("reward_funcs") or []
    if not model or not dataset or not rewards:
        raise TrainCommandError(
            "model, dataset and at least one reward are required "
            "(--model/--dataset/--reward or the --config file)"
        )
    evaluation = eval_settings(script, extra)
    return TrainSettings(script, values, str(model), str(dataset), list(rewards), *evaluation)


def eval_settings(
    script: TrainScriptArguments, extra: dict[str, Any]
) -> tuple[dict[str, str], list[str]]:
    """The evaluation datasets (name -> PATH) and evaluation rewards of the flags, else of
    the config file's ``eval_dataset`` and ``eval_reward_funcs``.

    Raises:
        TrainCommandError: a bad ``--eval_dataset``; evaluation rewards without evaluation
            datasets.
    """
    given = script.eval_dataset or extra.get("eval_dataset")
    what = "--eval_dataset" if script.eval_dataset else f"{script.config}: eval_dataset"
    try:
        datasets = eval_dataset_specs(given, what) if given else {}
    except NamedObjectError as error:
        raise TrainCommandError(str(error)) from error
    rewards = script.eval_reward or extra.get("eval_reward_funcs") or []
    rewards = [rewards] if isinstance(rewards, str) else list(rewards)
    if rewards and not datasets:
        raise TrainCommandError(
            "--eval_reward (eval_reward_funcs) scores evaluations: give "
            "the held-out prompts with --eval_dataset [NAME=]PATH"
        )
    return datasets, rewards


def check_evaluation(settings: TrainSettings, config: AsyncGRPOConfig) -> None:
    """Evaluation datasets and the config's schedule agree.

    Raises:
        TrainCommandError: datasets that would never be evaluated (``eval_strategy`` "no"
            without ``eval_on_start``), or ``eval_strategy`` "steps" or ``eval_on_start``
            without them.
    """
    scheduled = config.eval_strategy == "steps" or config.eval_on_start
    if settings.eval_datasets and not scheduled:
        raise TrainCommandError(
            "--eval_dataset is evaluated only with --eval_strategy steps (every --eval_steps "
            "steps; default: logging_steps) or --eval_on_start; give one of them"
        )
    if scheduled and not settings.eval_datasets:
        raise TrainCommandError(
            "--eval_strategy steps and --eval_on_start evaluate held-out "
            "prompts: give them with --eval_dataset [NAME=]PATH (or "
            "eval_dataset in the --config file)"
        )


def build_config(
    settings: TrainSettings, base_url: str | None = None, api_key: str | None = None
) -> AsyncGRPOConfig:
    """The run's config; a bad value fails naming its field (a ``TrainCommandError``)."""
    values = dict(settings.config_values)
    if base_url is not None:
        values["vllm_server_base_url"] = base_url
    if api_key is not None:
        values["vllm_server_api_key"] = api_key
    try:
        return AsyncGRPOConfig(**values)
    except (TypeError, ValueError) as error:
        raise TrainCommandError(str(error)) from error


def lora_config(script: TrainScriptArguments) -> Any:
    """The LoRA config the flags ask for (TRL's ``--use_peft``), or None."""
    if not script.use_peft:
        return None
    from peft import LoraConfig

    return LoraConfig(
        r=script.lora_r,
        lora_alpha=script.lora_alpha,
        lora_dropout=script.lora_dropout,
        task_type="CAUSAL_LM",
        target_modules=script.lora_target_modules or None,
    )


def run_train(argv: Sequence[str]) -> Any:
    """Run ``asyncgrpo train`` with its command-line arguments; returns the TrainOutput."""
    from asyncgrpo.adapters.models.packaged import resolve_model
    from asyncgrpo.adapters.vllm.auth import new_api_key
    from asyncgrpo.core.servers.gpu_plan import GpuPlanError
    from asyncgrpo.shell.experiments import record_run_settings
    from asyncgrpo.shell.run import AsyncGRPOTrainer
    from asyncgrpo.shell.servers import (
        local_server_spec,
        local_servers,
        servers_cpus_for,
        servers_gpus_for,
    )

    settings = parse_train_args(argv)
    config = build_config(settings)  # fail at the door, before a server starts
    check_evaluation(settings, config)
    try:  # a server on the trainer's own GPU would take 0.9 of its memory
        gpus = (
            None
            if settings.script.vllm_url
            else servers_gpus_for(config, settings.script.vllm_servers)
        )
    except GpuPlanError as error:
        raise TrainCommandError(str(error)) from None
    try:
        reward_funcs = [import_named(spec, "reward function") for spec in settings.rewards]
        eval_reward_funcs = [
            import_named(spec, "--eval_reward function") for spec in settings.eval_rewards
        ] or None
        prompts = load_named_dataset(settings.dataset)
        eval_datasets = load_eval_datasets(settings.eval_datasets) or None
    except NamedObjectError as error:
        raise TrainCommandError(str(error)) from error

    model = resolve_model(settings.model)  # a packaged model's name or a .gguf file: a checkpoint
    peft_config = lora_config(settings.script)

    def train(base_url: str, api_key: str | None = None) -> Any:  # URLs separated by commas
        args = build_config(settings, base_url, api_key)
        record_run_settings(args)  # any run can calibrate a plan (asyncgrpo plan --calibrate)
        trainer = AsyncGRPOTrainer(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=prompts,
            peft_config=peft_config,
            eval_dataset=eval_datasets,
            eval_reward_funcs=eval_reward_funcs,
        )
        return trainer.train(resume_from_checkpoint=True if settings.script.resume else None)

    if settings.script.vllm_url:
        return train(settings.script.vllm_url)
    spec = local_server_spec(
        model,
        config,
        max_model_len=settings.script.max_model_len,
        enforce_eager=settings.script.vllm_enforce_eager,
        api_key=new_api_key(),  # every route of the servers the run starts needs it
        lora_rank=peft_config.r if peft_config is not None else None,
    )
    output_dir = config.output_path
    output_dir.mkdir(parents=True, exist_ok=True)
    cpus = servers_cpus_for(config, settings.script.vllm_servers)
    with local_servers(spec, cpus, output_dir, gpus) as servers:
        return train(",".join(server.base_url for server in servers), spec.api_key)
