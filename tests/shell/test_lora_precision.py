"""A PEFT learner's merged pushes into a lower-precision server: a real tiny Qwen3 with LoRA
(rank 4 on every linear layer, fp32, FSDP2 over a 1-process gloo group), one real step, and
the merged weights rounded to bf16 as a bf16 server holds them.

A bf16 server is not started here (it would cost a server start): the server's dtype enters as
``/server_info`` reports it, through ``WeightExport.check_merged_pushes``, the call weight sync
makes when the server refuses adapters (checked against the session's fp32 server, which has no
``--enable-lora``).
"""

import pytest
import torch
from on_policy import on_policy
from packing_strategies import make_sample
from peft import LoraConfig

from asyncgrpo.adapters.models.causal_lm import load_causal_lm
from asyncgrpo.adapters.vllm.client import VLLMClient
from asyncgrpo.core.packing.tree import pack_row
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.learner import Learner
from asyncgrpo.shell.learner.export import LoraPrecisionError
from asyncgrpo.shell.weights.lora_path import AdapterWeights
from asyncgrpo.shell.weights.paths import DiskWeights

PROMPT = [11, 12, 13, 14, 15]
K = 4

pytestmark = pytest.mark.usefixtures("process_group")


def lora_learner(path, learning_rate: float, steps: int) -> Learner:
    """A LoRA learner after ``steps`` AdamW steps on two on-policy samples."""
    model = load_causal_lm(path)
    samples = [
        on_policy(model, make_sample(PROMPT + tokens, [0] * len(PROMPT) + [1] * 3, 0, adv), K)
        for tokens, adv in (([21, 22, 23], 1.0), ([31, 32, 33], -1.0))
    ]
    config = AsyncGRPOConfig(learning_rate=learning_rate, num_sampler_logprobs=K, seed=0)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    learner = Learner(load_causal_lm(path), config, peft_config=lora)
    for _ in range(steps):
        learner.train_step([pack_row(samples)])
    return learner


def unchanged_in_bf16(path, learner: Learner) -> tuple[float, int]:
    """Of the entries the merged update changes (in fp32), the share whose bf16 rounding equals
    the base checkpoint's bf16 rounding (what a bf16 server already holds), and how many
    changed."""
    base = load_causal_lm(path).state_dict()
    merged = learner.export.full_state_dict()  # fp32: the learner trains in fp32 here
    changed = same = 0
    for name, weight in merged.items():
        moved = weight != base[name]
        changed += int(moved.sum())
        same += int((moved & (weight.bfloat16() == base[name].bfloat16())).sum())
    return same / max(changed, 1), changed


def test_a_small_lora_update_vanishes_in_bf16_and_its_merged_push_is_refused(tiny_qwen3) -> None:
    learner = lora_learner(tiny_qwen3, learning_rate=1e-5, steps=1)
    fraction, changed = unchanged_in_bf16(tiny_qwen3, learner)
    print(f"lr 1e-5, 1 step: {fraction:.1%} of {changed:,} changed weights unchanged in bf16")
    assert changed > 100_000 and fraction > 0.8
    learner.export.check_merged_pushes("torch.bfloat16")
    with pytest.raises(LoraPrecisionError, match="--enable-lora") as refused:
        learner.export.synced_state_dict()
    assert f"of the {changed:,} weight entries" in str(refused.value)
    assert f"({fraction:.1%}" in str(refused.value)
    assert "the vLLM server's dtype is bfloat16" in str(refused.value)
    # the engine's stream calls iter_weights before its send starts: the call itself refuses,
    # before a first tensor is asked for (and so before anything reaches the server)
    with pytest.raises(LoraPrecisionError, match="--enable-lora"):
        learner.export.iter_weights()
    # a float32 server holds every change: the same push goes through, unchanged
    learner.export.check_merged_pushes("torch.float32")
    pushed = learner.export.synced_state_dict()
    full = learner.export.full_state_dict()
    assert pushed.keys() == full.keys()
    assert all(torch.equal(pushed[name], full[name]) for name in full)


def test_a_fresh_adapter_and_a_large_update_push_into_bf16(tiny_qwen3) -> None:
    """B = 0 at the first push: nothing changed, nothing refused. A larger update reaches the
    bf16 server."""
    fresh = lora_learner(tiny_qwen3, learning_rate=1e-2, steps=0)
    fresh.export.check_merged_pushes("torch.bfloat16")
    assert fresh.export.synced_state_dict()
    assert unchanged_in_bf16(tiny_qwen3, fresh) == (0.0, 0)
    learner = lora_learner(tiny_qwen3, learning_rate=1e-2, steps=1)
    fraction, changed = unchanged_in_bf16(tiny_qwen3, learner)
    print(f"lr 1e-2, 1 step: {fraction:.1%} of {changed:,} changed weights unchanged in bf16")
    assert changed > 100_000 and fraction < 0.5
    learner.export.check_merged_pushes("torch.bfloat16")
    assert learner.export.synced_state_dict()


@pytest.mark.server
@pytest.mark.slow(reason="a learner step and two merged pushes through the session server")
def test_merged_sync_checks_its_pushes_against_the_servers_dtype(served, tmp_path) -> None:
    """The session server refuses adapters: weight sync falls back to merged weights and arms
    the check with the dtype the server reports (float32, which holds even a 1e-5 update)."""
    server, path = served
    learner = lora_learner(path, learning_rate=1e-5, steps=1)

    def client(index: int = 0) -> VLLMClient:
        return VLLMClient(server.base_url, str(path))

    weights = AdapterWeights(
        learner,
        client,
        tmp_path / "lora",
        keep=1,
        merged=DiskWeights(learner, client, tmp_path / "weights"),
    )
    weights.start()
    try:
        weights.sync(1)
        assert weights.adapter_mode is False
        assert learner.export.merged_checked
        assert learner.export.server_dtype == "torch.float32"
        weights.sync(2)  # checked again, and held by a float32 server
    finally:
        weights.close()
