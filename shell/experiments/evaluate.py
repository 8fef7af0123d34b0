"""``asyncgrpo eval``: held-out prompts scored for any model, saved run or checkpoint.

What can be evaluated (:func:`served_model`):

- a model as ``train`` takes it: a checkpoint directory of ``save_pretrained`` (a run's
  ``output_dir`` after training), a hub id, a packaged model's name (``smollm2-135m``) or a
  ``.gguf`` file;
- a LoRA adapter directory (``adapter_config.json``, what ``save_model`` writes for a PEFT run):
  the server serves its base model and loads the adapter, and the adapter is evaluated;
- a run's ``checkpoint-<step>`` directory: its sharded weights are loaded into the model its
  ``model_source.json`` names (with its LoRA config) and exported once beside it, as a model,
  or as an adapter on its base model for a LoRA run.

The evaluation runs in this process with the trainer's rollout loop
(:func:`~asyncgrpo.shell.rollout.evaluate_now`) on a server started here, or on a running one
(``--vllm-url``: the model's weights are pushed to it first, by disk, or the adapter loaded on
it), and prints each metric with its bootstrap interval over the prompts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import structlog
import torch

from asyncgrpo.adapters.atomic_files import replaced_whole
from asyncgrpo.adapters.checkpoint_files import DamagedFile, check_safetensors
from asyncgrpo.adapters.models.causal_lm import checkpoint_named, load_causal_lm
from asyncgrpo.adapters.models.packaged import resolve_model
from asyncgrpo.adapters.transfer.files import DiskReload, adapter_name
from asyncgrpo.adapters.vllm.auth import new_api_key
from asyncgrpo.core.experiments.evaluation import evaluation_metrics
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.learner import Learner
from asyncgrpo.shell.rollout import AsyncRolloutLoop, LoopSpec, evaluate_now
from asyncgrpo.shell.run import checkpoints
from asyncgrpo.shell.servers import (
    ServerSettings,
    local_server_spec,
    local_servers,
    run_async,
    servers_cpus_for,
    servers_gpus_for,
)

log = structlog.get_logger("asyncgrpo.evaluate")

EXPORTED = "exported"  # beside a checkpoint: its weights as a model (or an adapter)
ADAPTER_PREFIX = "evaluated"


@attrs.frozen
class ServedModel:
    """What the server serves for an evaluation: ``model`` (a directory or id), and the LoRA
    adapter directory evaluated on it, if any."""

    model: str
    adapter: str | None = None


def served_model(model: str, dtype: str = "float32") -> ServedModel:
    """What to serve for ``model`` (see the module docstring); a checkpoint is exported into
    ``<checkpoint>/exported`` on first use.

    Raises:
        CheckpointError: a checkpoint without its model record.
    """
    path = Path(model)
    if (path / checkpoints.ROLLOUT_STATE).is_file():
        return _exported_checkpoint(path, dtype)
    config = path / "adapter_config.json"
    if config.is_file():
        base = json.loads(config.read_text())["base_model_name_or_path"]
        return ServedModel(resolve_model(str(base)), str(path))
    return ServedModel(resolve_model(model))


def _exported_checkpoint(path: Path, dtype: str) -> ServedModel:
    checkpoints.check_loads(path)  # CheckpointError naming a damaged file
    base, peft = checkpoints.read_model_source(path)
    base = resolve_model(base)
    out = path / EXPORTED
    _drop_damaged_export(out)
    if not (out / "config.json").is_file() and not (out / "adapter_config.json").is_file():
        from peft import LoraConfig
        from transformers import AutoTokenizer

        with replaced_whole(out) as partial:
            config = AsyncGRPOConfig(
                output_dir=str(partial), dtype=dtype, use_cpu=True, gradient_checkpointing=False
            )
            lora = (
                LoraConfig(
                    **{
                        k: v
                        for k, v in peft.items()
                        if k in LoraConfig.__dataclass_fields__
                        and k
                        not in (
                            "peft_type",
                            "task_type",
                            "base_model_name_or_path",
                            "revision",
                            "auto_mapping",
                        )
                    },
                    task_type="CAUSAL_LM",
                )
                if peft
                else None
            )
            with Learner(
                load_causal_lm(base, dtype), config, peft_config=lora, device=torch.device("cpu")
            ) as learner:
                learner.load_checkpoint(path)
                learner.export.save_pretrained(
                    partial, AutoTokenizer.from_pretrained(base), adapter_only=lora is not None
                )
    if (out / "adapter_config.json").is_file():
        return ServedModel(base, str(out))
    return ServedModel(str(out))


def _drop_damaged_export(out: Path) -> None:
    """Remove the export ``out`` of a checkpoint when a safetensors file of it is damaged (an
    export or a copy that stopped): it is exported again from the checkpoint's sharded weights."""
    for weights in sorted(out.glob("*.safetensors")):
        try:
            check_safetensors(weights)
        except DamagedFile as error:
            log.warning("a damaged export of a checkpoint: exported again", problem=str(error))
            shutil.rmtree(out)
            return


@contextlib.contextmanager
def evaluation_servers(
    served: ServedModel,
    config: AsyncGRPOConfig,
    vllm_url: str | None,
    max_model_len: int,
    enforce_eager: bool,
) -> Iterator[tuple[AsyncGRPOConfig, str]]:
    """The config with the servers to evaluate on, and the name requests give the model: a
    local server started here for ``served`` (LoRA enabled for an adapter), or ``vllm_url``
    with ``served``'s weights pushed to it."""
    if vllm_url:
        args = dataclasses.replace(config, vllm_server_base_url=vllm_url)
        name = run_async(_served_name, ServerSettings.of(args))
        if served.adapter is None:
            weights = load_causal_lm(served.model, config.dtype)
            run_async(
                _push,
                ServerSettings.of(args),
                name,
                weights,
                config.output_path / ".vllm_weights",
            )
        yield args, name
        return
    spec = local_server_spec(
        served.model,
        config,
        max_model_len=max_model_len,
        enforce_eager=enforce_eager,
        api_key=new_api_key(),
    )
    if served.adapter is not None:
        rank = json.loads((Path(served.adapter) / "adapter_config.json").read_text()).get("r", 8)
        spec = attrs.evolve(spec, enable_lora=True, max_lora_rank=max(spec.max_lora_rank, rank))
    out = config.output_path
    out.mkdir(parents=True, exist_ok=True)
    with local_servers(
        spec, servers_cpus_for(config, 1), out, servers_gpus_for(config, 1)
    ) as started:
        yield (
            dataclasses.replace(
                config, vllm_server_base_url=started[0].base_url, vllm_server_api_key=spec.api_key
            ),
            spec.name,
        )


async def _served_name(settings: ServerSettings) -> str:
    async with settings.client("") as client:
        names = await client.served_models()
    if not names:
        raise RuntimeError(f"the vLLM server at {settings.base_url} serves no model")
    return names[0]


async def _push(settings: ServerSettings, name: str, model: Any, directory: Path) -> None:
    weights = checkpoint_named(model, model.state_dict())
    for server in range(settings.count):
        async with settings.client(name, server) as client:
            await DiskReload(client, directory).sync(weights)


def evaluate_model(
    model: str,
    datasets: Mapping[str, Any],
    reward_funcs: Sequence[Any],
    config: AsyncGRPOConfig,
    *,
    vllm_url: str | None = None,
    max_model_len: int = 4096,
    enforce_eager: bool = False,
) -> dict[str, float]:
    """Evaluate ``model`` (anything :func:`served_model` takes) on ``datasets`` with
    ``config``'s evaluation settings; the metrics (``eval/<name>/...``).

    Raises:
        RuntimeError: the evaluation failed (its cause).
    """
    from transformers import AutoTokenizer

    served = served_model(model, config.dtype)
    with evaluation_servers(served, config, vllm_url, max_model_len, enforce_eager) as (
        args,
        name,
    ):
        lora = None
        if served.adapter is not None:
            lora = ADAPTER_PREFIX
            _load_adapter(args, name, served.adapter, adapter_name(lora, 0))
        longest = ServerSettings.of(args).max_model_len(name)
        spec = LoopSpec(
            loop_cls=AsyncRolloutLoop,
            config=args,
            model_name=name,
            dataset=None,
            reward_funcs=tuple(reward_funcs),
            processing_class=AutoTokenizer.from_pretrained(served.adapter or served.model),
            max_model_len=longest,
            token_budget=longest,
            rows_per_step=1,
            lora_name=lora,
            eval_datasets=dict(datasets),
        )
        outcome = evaluate_now(spec, version=0, step=0)
    if outcome.error:
        raise RuntimeError(f"the evaluation of {model} failed: {outcome.error}")
    figures: dict[str, float] = {}
    for evaluation in outcome.evaluations:
        figures.update(evaluation_metrics(evaluation))
    return figures


def _load_adapter(args: AsyncGRPOConfig, model: str, adapter: str, name: str) -> None:
    settings = ServerSettings.of(args)

    async def load() -> None:
        for server in range(settings.count):
            async with settings.client(model, server) as client:
                await client.admin.load_lora_adapter(name, str(Path(adapter).resolve()))

    run_async(load)


def evaluation_table(figures: Mapping[str, float]) -> str:
    """A Markdown table: a row per metric, its value and its interval.

    Example:
        >>> print(evaluation_table({"eval/test/reward": 0.5, "eval/test/reward/ci_low": 0.25,
        ...                         "eval/test/reward/ci_high": 0.75, "eval/test/version": 0.0}))
        | metric | value | 90% interval |
        |---|---|---|
        | eval/test/reward | 0.5 | [0.25, 0.75] |
        | eval/test/version | 0 | |
    """
    lines = ["| metric | value | 90% interval |", "|---|---|---|"]
    for name, value in figures.items():
        if name.endswith(("/ci_low", "/ci_high")):
            continue
        low, high = figures.get(name + "/ci_low"), figures.get(name + "/ci_high")
        interval = f"[{low:.4g}, {high:.4g}]" if low is not None and high is not None else ""
        lines.append(f"| {name} | {value:.4g} | {interval} |")
    return "\n".join(lines)
