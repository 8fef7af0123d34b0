"""The servers wing without a server: the rerouting gate, the rollout side's pool of servers,
the records shared with the rollout process, a push's fan-out to several servers, and a
server gone before its transfer group opens."""

from __future__ import annotations

import threading

import anyio
import pytest

from asyncgrpo.adapters.models.causal_lm import load_causal_lm
from asyncgrpo.adapters.transfer.files import SyncTimings
from asyncgrpo.adapters.vllm.replies import ServerMetrics, VLLMError
from asyncgrpo.adapters.vllm.server import free_port
from asyncgrpo.core.rollout.pacing import LoadCap, ServerLoad
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.learner import Learner
from asyncgrpo.shell.servers import (
    RolloutGate,
    ServerOut,
    ServerPool,
    ServerSettings,
    SharedServers,
)
from asyncgrpo.shell.weights.paths import EngineWeights, each_server, landed_timings


def test_a_rerouting_gate_sends_the_group_elsewhere_instead_of_waiting() -> None:
    servers = SharedServers(["http://a:1", "http://b:2"])
    gate = RolloutGate(servers.trusts[1], timeout_s=60.0, reroute=True)

    async def scenario() -> None:
        assert await gate.enter() == 0  # trusted: requests go
        with pytest.raises(ServerOut, match="http://b:2 is out of routing: OSError: gone"):
            await gate.unreachable(OSError("gone"))
        with pytest.raises(ServerOut, match="an outage is pending"):
            await gate.enter()

    anyio.run(scenario)
    assert servers.out() == (1,) and servers.routable(0)
    assert servers.all_gone_since() is None
    servers.trusts[0].outage("gone too", "test")
    since = servers.all_gone_since()
    assert since is not None and since == max(t.down_since() for t in servers.trusts)
    servers.trusts[1].pushed(servers.trusts[1].read().outages)
    assert servers.out() == (0,)


def test_versions_are_kept_per_server() -> None:
    servers = SharedServers(["http://a:1", "http://b:2", "http://c:3"])
    servers.set_version(1, 7)
    assert [servers.version(i) for i in range(3)] == [0, 7, 0]


def pool(count: int, ceiling: int, routable=lambda i: True, versions=lambda i: 0) -> ServerPool:
    return ServerPool([None] * count, ceiling, versions, routable)  # type: ignore[list-item]


def test_the_pool_routes_to_the_least_loaded_and_keeps_the_ceiling_over_all_servers() -> None:
    servers = pool(2, ceiling=16)
    for server in servers.servers:
        server.cap = LoadCap(12)
    chosen = []
    for _ in range(4):  # groups of 4 rollouts
        index = servers.route(steps_taken=0, max_staleness=0)
        assert index is not None
        servers[index].reserved += 4
        chosen.append(index)
    assert sorted(chosen) == [0, 0, 1, 1]
    assert servers.route(0, 0) is None  # 16 reserved: the ceiling of both together
    servers[0].in_flight = 12
    assert not servers.admits(0) and servers.admits(1)  # its own cap
    servers[1].in_flight = 4
    assert not servers.admits(1)  # 16 in flight over both


def test_the_pool_skips_a_server_out_of_routing_or_behind() -> None:
    out = {1}
    servers = pool(3, 64, routable=lambda i: i not in out, versions=lambda i: 2 if i == 2 else 3)
    assert servers.route(steps_taken=3, max_staleness=0) == 0
    servers[0].reserved = 8
    assert servers.route(steps_taken=3, max_staleness=0) == 0  # 1 is out, 2 is behind
    assert servers.route(steps_taken=3, max_staleness=1) == 2
    assert pool(1, 64).observations(1.0) == []  # one server: the rollout/* metrics are its own
    names = {o.name for o in servers.observations(1.0)}
    assert "rollout/server/2/generated_tokens_per_s" in names


class CountingClient:
    """The counters of a :class:`VLLMClient` that a report reads (a fake: no server)."""

    retry_count = 0
    dropped_connection_count = 0
    regenerated_count = 0


def test_a_report_gives_the_counts_since_the_last_one_and_the_servers_load() -> None:
    clients = [CountingClient(), CountingClient()]
    servers = ServerPool(clients, 16, lambda i: 0, lambda i: True)  # type: ignore[arg-type]
    clients[0].retry_count, clients[1].dropped_connection_count = 3, 2
    servers[0].in_flight, servers[1].in_flight = 2, 5
    servers[0].snapshot = ServerMetrics(ServerLoad(0.25, 2, 1), preemptions=4, kv_cache_tokens=None)
    first = {o.name: o for o in servers.report(2.0, generated_tokens=100)}
    assert first["rollout/generated_tokens_per_s"].amount == 100
    assert first["rollout/generated_tokens_per_s"].weight == 2.0
    assert first["rollout/vllm_retry_count"].amount == 3
    assert first["rollout/vllm_dropped_connection_count"].amount == 2  # a reply cut, sent again
    assert first["rollout/concurrency"].amount == 7
    # the server's count before this run's first /metrics is not the run's: the baseline
    assert first["rollout/vllm_preemption_count"].amount == 0
    assert first["rollout/vllm_kv_cache_usage_frac"].amount == 0.25
    assert "rollout/server/1/in_flight" in first  # several servers: each one's own
    clients[0].retry_count, clients[1].regenerated_count = 5, 1
    servers[0].snapshot = ServerMetrics(ServerLoad(0.5, 1, 0), preemptions=6, kv_cache_tokens=None)
    second = {o.name: o for o in servers.report(1.0, generated_tokens=130)}
    assert second["rollout/generated_tokens_per_s"].amount == 30
    assert second["rollout/vllm_retry_count"].amount == 2
    assert second["rollout/vllm_dropped_connection_count"].amount == 0
    assert second["rollout/vllm_regenerated_count"].amount == 1
    assert second["rollout/vllm_preemption_count"].amount == 2


def test_a_push_reaches_every_server_in_parallel_and_keeps_each_outcome() -> None:
    started, release = threading.Barrier(3), threading.Event()

    def push(index: int) -> SyncTimings:
        started.wait(10)  # all three are in flight together
        if index == 1:
            raise OSError("server 1 gone")
        release.wait(0)
        return SyncTimings(0.1 * index, 0.0, 0.5, 0.2)

    landing = each_server([0, 1, 2], push)
    assert list(landing) == [0, 1, 2] and isinstance(landing[1], OSError)
    assert landed_timings(landing) == SyncTimings(0.2, 0.0, 0.5, 0.2)
    assert landed_timings({0: OSError("x")}) is None


def test_a_server_gone_before_its_transfer_group_opens_is_named_with_the_fix(tiny_qwen3) -> None:
    """A server of the run went away between the run's check and the opening of its
    weight-transfer group: the start fails naming that server, the call's cause and --resume
    (a chaos run found it failing with a bare requests.ConnectionError)."""
    gone = f"http://127.0.0.1:{free_port()}"
    other = f"http://127.0.0.1:{free_port()}"
    args = AsyncGRPOConfig(vllm_server_base_url=[gone, other], vllm_server_timeout=5)
    learner = Learner(load_causal_lm(tiny_qwen3), args)
    settings = ServerSettings.of(args)
    weights = EngineWeights(
        learner,
        args,
        lambda server=0: settings.client("m", server),
        backend="asyncgrpo_gloo",
        server_workers=1,
    )
    with pytest.raises(VLLMError) as raised:
        weights.start()
    message = str(raised.value)
    assert f"the vLLM server at {gone} did not open its weight-transfer group" in message
    assert "ConnectionError" in message and "asyncgrpo train --resume" in message
    assert """--weight-transfer-config '{"backend": "asyncgrpo_gloo"}'""" in message
