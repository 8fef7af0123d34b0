"""``asyncgrpo train``: a run from a TOML file and flags.

The TOML file may hold ``model``, ``dataset``, ``reward_funcs`` (``"module:function"``
strings) and an ``[asyncgrpo]`` table of :class:`AsyncGRPOConfig` fields; flags override it::

    model = "runs/demo/initial-model"
    dataset = "prompts.jsonl"
    reward_funcs = ["asyncgrpo.shell.demo:digit_fraction_reward"]

    [asyncgrpo]
    max_steps = 20
    learning_rate = 1e-2
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncgrpo.adapters.vllm_server import ServerSpec, VLLMServer
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.cpu_sharing import server_cpus_for
from asyncgrpo.shell.trainer import AsyncGRPOTrainer, TrainOutput


class TrainCommandError(ValueError):
    """A missing or invalid setting of ``asyncgrpo train``."""


def import_callable(spec: str) -> Callable[..., Any]:
    """``"package.module:function"`` -> the function."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise TrainCommandError(f"reward {spec!r} must look like 'package.module:function'")
    try:
        return getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise TrainCommandError(f"cannot import reward {spec!r}: {error}") from error


def load_prompts(path: str) -> Any:
    """A dataset from a JSON/JSONL file or a ``save_to_disk`` folder."""
    from datasets import load_dataset, load_from_disk

    if Path(path).is_dir():
        return load_from_disk(path)
    if path.endswith((".json", ".jsonl")):
        return load_dataset("json", data_files=path, split="train")
    raise TrainCommandError(f"dataset {path!r}: give a .json/.jsonl file or a dataset folder")


def run_train(args: argparse.Namespace) -> TrainOutput:
    """Run ``asyncgrpo train`` with parsed command-line ``args``."""
    settings: dict[str, Any] = {}
    if args.config:
        settings = tomllib.loads(Path(args.config).read_text())
    table = dict(settings.pop("asyncgrpo", {}))
    model = args.model or settings.get("model")
    dataset = args.dataset or settings.get("dataset")
    rewards = args.reward or settings.get("reward_funcs", [])
    if not model or not dataset or not rewards:
        raise TrainCommandError("model, dataset and at least one reward are required "
                                "(--model/--dataset/--reward or the --config file)")  # fmt: skip
    if args.output_dir:
        table["output_dir"] = args.output_dir
    if args.max_steps is not None:
        table["max_steps"] = args.max_steps
    known = {f.name for f in dataclasses.fields(AsyncGRPOConfig)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise TrainCommandError(f"unknown AsyncGRPOConfig fields {unknown}")
    reward_funcs = [import_callable(spec) for spec in rewards]
    prompts = load_prompts(dataset)

    def train(base_url: str) -> TrainOutput:
        config = AsyncGRPOConfig(**{**table, "vllm_server_base_url": base_url})
        trainer = AsyncGRPOTrainer(model=model, reward_funcs=reward_funcs, args=config,
                                   train_dataset=prompts)  # fmt: skip
        return trainer.train(resume_from_checkpoint=True if args.resume else None)

    if args.vllm_url:
        return train(args.vllm_url)
    spec = ServerSpec(model=str(model), max_model_len=args.max_model_len,
                      dtype=table.get("dtype", "float32"),
                      max_logprobs=max(20, table.get("num_sampler_logprobs", 8)),
                      cpus=server_cpus_for(AsyncGRPOConfig(**table)))  # fmt: skip
    output_dir = Path(table.get("output_dir") or "trainer_output")
    output_dir.mkdir(parents=True, exist_ok=True)
    with VLLMServer(spec, log_path=output_dir / "vllm-server.log") as server:
        return train(server.base_url)
