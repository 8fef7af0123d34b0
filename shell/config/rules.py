"""What :class:`~asyncgrpo.AsyncGRPOConfig` does with each field it inherits from
``transformers.TrainingArguments``, and the checks every field goes through.

Each inherited field is in exactly one of three kinds (``tests/shell/test_config.py`` checks
that every ``TrainingArguments`` field of the installed transformers is listed):

- ``USED``: the trainer honours it with transformers' meaning (the note says how);
- ``REJECTED``: the trainer cannot honour it; any value other than the default fails at
  construction with the reason;
- ``SCRIPT_ONLY``: transformers' ``Trainer`` does not read it either (``do_train``, ...); it is
  accepted for scripts that set it.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Mapping
from typing import Any

USED: dict[str, str] = {
    "output_dir": "run directory: metrics, checkpoints, final model, sync caches",
    "per_device_train_batch_size": "only the default 8: rows are packed under token_budget "
    "(as many samples as fit); set token_budget instead",
    "num_train_epochs": "passes over the prompts, counted in distinct prompts trained",
    "max_steps": "optimizer steps; when > 0 it replaces the epoch stop",
    "learning_rate": "the optimizer's learning rate",
    "lr_scheduler_type": "transformers.get_scheduler; decaying schedules need max_steps > 0",
    "lr_scheduler_kwargs": "extra arguments of the schedule (scheduler_specific_kwargs)",
    "warmup_steps": "warmup optimizer steps; a value < 1 is a fraction of max_steps",
    "optim": "adamw_torch, adamw_torch_fused, sgd, adagrad, rmsprop or adafactor, built as "
    "transformers' Trainer builds them",
    "optim_args": "extra optimizer arguments, 'key=value,key=value'",
    "weight_decay": "on parameters with 2 or more dimensions (not biases and norms)",
    "adam_beta1": "AdamW beta1",
    "adam_beta2": "AdamW beta2",
    "adam_epsilon": "AdamW epsilon",
    "gradient_accumulation_steps": "micro-batches per optimizer step",
    "average_tokens_across_devices": "only True: each micro-batch's loss is divided by its "
    "trained tokens summed over all processes",
    "max_grad_norm": "gradient clipping; 0 turns it off",
    "bf16": "FSDP2 mixed precision: bf16 compute, fp32 master weights (None: on with CUDA, "
    "and on a CPU with fast bf16 for models of 50M parameters or more)",
    "tf32": "TF32 matmuls on Ampere or newer GPUs, set by TrainingArguments",
    "gradient_checkpointing": "activation checkpointing of the decoder layers (None: by the "
    "activations a row keeps against the free memory)",
    "gradient_checkpointing_kwargs": "passed to gradient_checkpointing_enable "
    "(default {'use_reentrant': False})",
    "logging_strategy": "steps, epoch (counted in prompts) or no (only the last window)",
    "logging_steps": "a window every N optimizer steps; < 1 is a fraction of max_steps",
    "logging_first_step": "also log the window of the first step",
    "log_on_each_node": "rank 0 writes the logs either way",
    "log_level": "the level of the 'asyncgrpo' and 'transformers' loggers on rank 0 "
    "(passive: asyncgrpo's stays as set, info if unset; docs/metrics.md#console-logs)",
    "log_level_replica": "the level of the 'asyncgrpo' and 'transformers' loggers on the other "
    "ranks; asyncgrpo's also in the rollout process",
    "disable_tqdm": "hide the progress bar",
    "report_to": "transformers' reporting integrations (tensorboard, wandb, trackio, mlflow, ...), "
    "all or none; each logged window goes to them, under transformers' names (train/<metric>)",
    "run_name": "the run's name in the trackers",
    "project": "the trackio project",
    "save_strategy": "steps, epoch (counted in prompts) or no",
    "save_steps": "a checkpoint every N optimizer steps; < 1 is a fraction of max_steps",
    "save_total_limit": (
        "older complete checkpoints beyond this many are deleted, once a new one is whole; "
        "damaged ones do not count"
    ),
    "push_to_hub": "push the saved model at every save or at the end (hub_strategy)",
    "hub_token": "token for push_to_hub (else the huggingface_hub login)",
    "hub_private_repo": "create the hub repository private",
    "hub_model_id": "repository of push_to_hub (default: the output_dir's name)",
    "hub_strategy": "end, every_save, checkpoint or all_checkpoints",
    "hub_always_push": "push even while an earlier upload is unfinished",
    "hub_revision": "branch of the hub repository to push to",
    "ignore_data_skip": "must stay True: a resume restores the prompt cursor instead",
    "full_determinism": "transformers.enable_full_determinism(seed) instead of set_seed",
    "seed": "torch/numpy/python RNGs, LoRA initialisation, per-request sampling seeds",
    "data_seed": "the order of the prompts in each epoch (default: seed)",
    "use_cpu": "train on the CPU even when CUDA is available",
    "remove_unused_columns": "must stay False: every column goes to the reward functions",
    "train_sampling_strategy": "only random: each epoch is a seeded permutation of the prompts",
    "ddp_timeout": "timeout of the process group's collectives, in seconds",
    "resume_from_checkpoint": "a checkpoint directory, or True for the newest in output_dir",
    "eval_strategy": "no, or steps: evaluate eval_dataset every eval_steps optimizer steps, "
    "at that step's weights, on the vLLM servers beside training (docs/evaluation.md)",
    "eval_steps": "an evaluation every N optimizer steps; None: logging_steps; < 1 is a "
    "fraction of max_steps",
    "eval_on_start": "also evaluate the starting weights, before the first step",
}

_EVAL_ON_SERVERS = (
    "evaluations generate on the vLLM servers and score with the reward functions "
    "(docs/evaluation.md); there is no evaluation forward pass in the trainer"
)
_NO_DATALOADER = "prompts are read by the rollout process, not by a torch DataLoader"
_FSDP2 = "sharding is always FSDP2 over the torchrun processes (a unit per decoder layer)"

REJECTED: dict[str, str] = {
    "optim_target_modules": "GaLore/APOLLO optimizers are not supported",
    "label_smoothing_factor": "there are no labels: the loss is a policy-gradient loss",
    "fp16": "fp16 is not supported; use bf16 (GPU) or fp32",
    "bf16_full_eval": _EVAL_ON_SERVERS,
    "fp16_full_eval": _EVAL_ON_SERVERS,
    "torch_compile": "the packed tree-attention forward is not compiled",
    "torch_compile_backend": "the packed tree-attention forward is not compiled",
    "torch_compile_mode": "the packed tree-attention forward is not compiled",
    "use_liger_kernel": "use_liger_kernel=True is not supported by AsyncGRPOTrainer",
    "liger_kernel_config": "use_liger_kernel is not supported by AsyncGRPOTrainer",
    "use_cache": "the packed training forward keeps no KV cache",
    "neftune_noise_alpha": "NEFTune noise is not applied to the packed forward",
    "torch_empty_cache_steps": "the learner does not empty the CUDA cache on a schedule",
    "auto_find_batch_size": "rows are packed under token_budget; set token_budget instead",
    "logging_nan_inf_filter": "windows are logged as measured; a NaN loss shows as NaN",
    "include_num_input_tokens_seen": "num_tokens (forwarded tokens) is always logged",
    "trackio_space_id": "the trackio tracker logs locally; no Space is deployed",
    "trackio_bucket_id": "the trackio tracker logs locally; no bucket is used",
    "trackio_static_space_id": "the trackio tracker logs locally; no Space is deployed",
    "eval_delay": _EVAL_ON_SERVERS,
    "per_device_eval_batch_size": _EVAL_ON_SERVERS,
    "prediction_loss_only": _EVAL_ON_SERVERS,
    "eval_do_concat_batches": _EVAL_ON_SERVERS,
    "eval_use_gather_object": _EVAL_ON_SERVERS,
    "eval_accumulation_steps": _EVAL_ON_SERVERS,
    "include_for_metrics": _EVAL_ON_SERVERS,
    "batch_eval_metrics": _EVAL_ON_SERVERS,
    "load_best_model_at_end": _EVAL_ON_SERVERS,
    "metric_for_best_model": _EVAL_ON_SERVERS,
    "greater_is_better": _EVAL_ON_SERVERS,
    "save_only_model": "checkpoints keep the optimizer state so that a run can resume",
    "save_on_each_node": "rank 0 writes the model; each process writes its own shard",
    "enable_jit_checkpoint": "checkpoints are written on the save schedule only",
    "restore_callback_states_from_checkpoint": "callback states are not saved in checkpoints",
    "accelerator_config": "the learner drives FSDP2 directly, not through accelerate",
    "parallelism_config": "context and sequence parallelism are not supported; " + _FSDP2,
    "dataloader_drop_last": _NO_DATALOADER,
    "dataloader_num_workers": _NO_DATALOADER,
    "dataloader_pin_memory": _NO_DATALOADER,
    "dataloader_persistent_workers": _NO_DATALOADER,
    "dataloader_prefetch_factor": _NO_DATALOADER,
    "dataloader_multiprocessing_context": _NO_DATALOADER,
    "dataloader_in_order": _NO_DATALOADER,
    "label_names": "there are no labels: the loss is a policy-gradient loss",
    "length_column_name": "group_by_length sampling is not supported",
    "ddp_find_unused_parameters": _FSDP2,
    "ddp_bucket_cap_mb": _FSDP2,
    "ddp_broadcast_buffers": _FSDP2,
    "ddp_static_graph": _FSDP2,
    "ddp_backend": "the process group is nccl on CUDA and gloo on CPU",
    "fsdp": _FSDP2 + "; remove fsdp",
    "fsdp_config": _FSDP2 + "; remove fsdp_config",
    "deepspeed": "DeepSpeed is not supported; sharded training uses FSDP2",
    "debug": "transformers' debug options are not supported",
    "skip_memory_metrics": "memory metrics are not collected",
}

SCRIPT_ONLY: dict[str, str] = {
    "do_train": "not read by transformers' Trainer either",
    "do_eval": "not read by transformers' Trainer either",
    "do_predict": "not read by transformers' Trainer either",
    "local_rank": "set by launchers; the learner reads LOCAL_RANK from the environment",
}

CHOICES: dict[str, tuple[str | int | bool, ...]] = {
    "optim": ("adamw_torch", "adamw_torch_fused", "sgd", "adagrad", "rmsprop", "adafactor"),
    "lr_scheduler_type": (
        "constant",
        "constant_with_warmup",
        "linear",
        "cosine",
        "cosine_with_restarts",
        "polynomial",
        "inverse_sqrt",
        "cosine_with_min_lr",
        "cosine_warmup_with_min_lr",
        "warmup_stable_decay",
    ),
    "logging_strategy": ("steps", "epoch", "no"),
    "save_strategy": ("steps", "epoch", "no"),
    "eval_strategy": ("no", "steps"),
    "per_device_train_batch_size": (8,),
    "average_tokens_across_devices": (True,),
    "train_sampling_strategy": ("random",),
    "ignore_data_skip": (True,),
    "remove_unused_columns": (False,),
}
"""Fields whose value must be one of these (an enum member counts as its value)."""


def check_choices(config: Any) -> None:
    """Raise a ``ValueError`` naming the field when a value is outside :data:`CHOICES`."""
    for name, allowed in CHOICES.items():
        value = getattr(config, name)
        value = value.value if isinstance(value, enum.Enum) else value
        if value not in allowed:
            raise ValueError(
                f"AsyncGRPOConfig.{name}={value!r} is not supported: {USED[name]} "
                f"(allowed: {', '.join(map(repr, allowed))})"
            )


def reject_unhonoured(config: Any, defaults: Mapping[str, Any]) -> None:
    """Raise a ``ValueError`` for the first :data:`REJECTED` field set to a non-default value.

    Call it on the values as given, before ``TrainingArguments.__post_init__`` derives some
    of them (``metric_for_best_model``, ``dataloader_pin_memory``, ...)."""
    for name, why in REJECTED.items():
        value, default = getattr(config, name), defaults[name]
        if value != default and not (value in (None, "", []) and default in (None, "", [])):
            raise ValueError(f"AsyncGRPOConfig.{name}={value!r} is not supported: {why}")


def field_defaults(cls: type) -> dict[str, Any]:
    """Each init field's default value (a default factory is called)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def check_types(config: Any) -> None:
    """Raise a ``TypeError`` naming the first field whose value does not match its annotation.

    An ``int`` is accepted where a ``float`` is declared (TOML and JSON write ``1`` for 1.0);
    a ``bool`` is never an ``int``."""
    try:
        hints = typing.get_type_hints(type(config))
    except NameError:  # a subclass declared where its annotations cannot be resolved
        hints = {f.name: f.type for f in dataclasses.fields(config) if not isinstance(f.type, str)}
    for f in dataclasses.fields(config):
        if not f.init or f.name not in hints:
            continue
        value = getattr(config, f.name)
        if not matches(value, hints[f.name]):
            raise TypeError(
                f"AsyncGRPOConfig.{f.name} must be {describe(hints[f.name])}, "
                f"got {value!r} ({type(value).__name__})"
            )


def matches(value: Any, annotation: Any) -> bool:
    """Whether ``value`` fits the type ``annotation`` (unions, Optional, list[...], dict[...],
    Literal, enums, classes)."""
    if annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(matches(value, arg) for arg in typing.get_args(annotation))
    if origin is typing.Literal:
        return value in typing.get_args(annotation)
    if annotation is type(None) or annotation is None:
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin in (list, tuple) or annotation in (list, tuple):
        args = typing.get_args(annotation)
        return isinstance(value, (list, tuple)) and all(
            not args or matches(item, args[0]) for item in value
        )
    if origin is dict or annotation is dict:
        return isinstance(value, Mapping)
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return True  # an annotation this check does not model (a TypeVar, a Protocol, ...)


def describe(annotation: Any) -> str:
    """A readable name of a type annotation (``"float"``, ``"int or None"``)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return "None"
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(annotation)))
    return getattr(annotation, "__name__", str(annotation))


def field_names(cls: type) -> list[str]:
    """The init fields of a config class (``AsyncGRPOConfig`` or a subclass)."""
    return [f.name for f in dataclasses.fields(cls) if f.init]
