"""The learner's failures, on one process (FSDP2 over a 1-process gloo group, the tiny Qwen3 in
fp32 on the CPU): a step whose gradient norm is not finite is skipped and leaves everything as
it was; an optimizer step that makes the weights non-finite stops; a row that does not fit in
the memory left (a real ``RLIMIT_AS`` on a learner in its own process) is named with the
settings that size it, and the checkpoint saved before still loads."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from on_policy import on_policy
from packing_strategies import make_sample

from asyncgrpo.adapters.models.causal_lm import load_causal_lm
from asyncgrpo.core.packing.tree import pack_row
from asyncgrpo.core.run.divergence import NONFINITE_STEP_COUNT
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.learner import DivergedError, Learner, check_learner_files

pytestmark = pytest.mark.usefixtures("process_group")
PROMPT = [11, 12, 13, 14, 15]
SUPPORT = Path(__file__).parents[1] / "support"
ABSURD_LEARNING_RATE = 1e12
"""Adam's first step moves each weight by about the learning rate: at 1e12 the next forward
overflows float32 and the gradient norm is NaN. (At 1e6 the tiny model's RMS norms keep the
forward finite: its policy only flattens.)"""


def a_row(path):
    stock = load_causal_lm(path)
    samples = [
        on_policy(stock, make_sample(PROMPT + tokens, [0] * 5 + [1] * len(tokens), 0, advantage), 4)
        for tokens, advantage in (([21, 22, 23], 1.0), ([31, 32, 33], -1.0))
    ]
    return pack_row(samples)


def config(**overrides) -> AsyncGRPOConfig:
    fields = dict(output_dir="unused", learning_rate=1e-2, num_sampler_logprobs=4, seed=0)
    return AsyncGRPOConfig(**(fields | overrides))


def tensors_of(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value.detach().clone()]
    if isinstance(value, dict):
        return [t for key in sorted(value, key=str) for t in tensors_of(value[key])]
    return []


def test_a_step_with_a_nonfinite_gradient_norm_is_skipped_and_changes_nothing(tiny_qwen3) -> None:
    row = a_row(tiny_qwen3)
    learner = Learner(load_causal_lm(tiny_qwen3), config(learning_rate=ABSURD_LEARNING_RATE))
    first = learner.train_step([row])
    assert not first.skipped and first.metrics[NONFINITE_STEP_COUNT] == 0
    weights = dict(learner.export.full_state_dict())
    optimizer_state = tensors_of(learner.optimizer.state_dict()["state"])
    schedule = learner.scheduler.state_dict()
    second = learner.train_step([row])
    assert second.skipped and not torch.isfinite(torch.tensor(second.metrics["grad_norm"]))
    assert second.metrics[NONFINITE_STEP_COUNT] == 1 and learner.step == 2
    assert "entropy" not in second.metrics  # the skipped step's forward is not logged
    assert "loss" not in second.window.stats and "grad_norm" not in second.window.stats
    after = learner.export.full_state_dict()
    assert all(torch.equal(after[name], tensor) for name, tensor in weights.items())
    assert all(torch.isfinite(tensor).all() for tensor in after.values())
    kept = tensors_of(learner.optimizer.state_dict()["state"])
    assert len(kept) == len(optimizer_state)
    assert all(torch.equal(a, b) for a, b in zip(kept, optimizer_state, strict=True))
    assert learner.scheduler.state_dict() == schedule
    assert all(p.grad is None for p in learner.model.parameters())


def test_an_optimizer_step_that_makes_the_weights_nonfinite_stops(tiny_qwen3) -> None:
    """A learning rate beyond float32 turns the first update itself into inf and NaN, on
    finite gradients: the learner stops before those weights can be pushed or saved."""
    learner = Learner(load_causal_lm(tiny_qwen3), config(learning_rate=1e39, max_grad_norm=0.0))
    with pytest.raises(DivergedError, match=r"step 1 made the weights non-finite") as raised:
        learner.train_step([a_row(tiny_qwen3)])
    assert "Lower learning_rate (now 1e+39" in str(raised.value)
    assert "turn gradient clipping on (max_grad_norm=0" in str(raised.value)


def test_a_row_too_large_for_the_memory_left_is_named_and_the_checkpoint_loads(
    tiny_qwen3, tmp_path
) -> None:
    """A learner in its own process limits its address space (``RLIMIT_AS``) to what it maps
    after a first step plus 1 GiB: the small row trains again, the 8,192-token row fails with
    the error naming the row, ``token_budget`` and ``gradient_checkpointing`` instead of torch's
    ``DefaultCPUAllocator`` error, its gradients dropped; the checkpoint it saved before loads
    here and holds the weights it had."""
    environment = os.environ | {"PYTHONPATH": str(SUPPORT), "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            str(SUPPORT / "memory_limited_learner.py"),
            str(tiny_qwen3),
            str(tmp_path),
        ],
        env=environment,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads((tmp_path / "result.json").read_text())
    print(
        f"limit {result['limit_mib']} MiB; detected in {result.get('detected_s')} s; "
        f"process {time.monotonic() - started:.1f} s"
    )
    assert result["small_row_fits"] and result["grads_released"]
    message = result["error"]
    assert result["cause"] == "RuntimeError" and "DefaultCPUAllocator" in message
    assert "row of 8,192 tokens" in message and "token_budget=8192" in message
    assert "gradient_checkpointing off" in message
    assert "Turn gradient_checkpointing on" in message and "lower token_budget" in message
    checkpoint = tmp_path / "checkpoint-1"
    check_learner_files(checkpoint)
    learner = Learner(load_causal_lm(tiny_qwen3), config(loss_type="clipped_surrogate"))
    learner.load_checkpoint(checkpoint)
    assert learner.step == 1
    saved = torch.load(tmp_path / "weights-1.pt", weights_only=True)
    loaded = learner.export.full_state_dict()
    assert all(torch.equal(loaded[name], tensor) for name, tensor in saved.items())
