"""Every wait of a weight send is bounded: the watchdog around an engine's send, the server's
pause and resume around it, and several servers where one hangs.

vLLM's NCCL engine needs GPUs on both sides and blocks in a CUDA stream ``synchronize()`` with
no timeout of its own. The engines here are fakes of that behaviour (named ``Fake...``): a
send that blocks forever, one that blocks until its group is aborted (as ``ncclCommAbort``
frees NCCL's kernels), and one whose server dies mid-send. The server around them is real.
"""

import threading
import time
from types import SimpleNamespace

import httpx
import pytest
import torch

from asyncgrpo.adapters.transfer import engine as engine_module
from asyncgrpo.adapters.transfer.engine import (
    EngineSync,
    WeightHandshakeTimeout,
    WeightSendTimeout,
    WeightStream,
    send_within,
)
from asyncgrpo.adapters.transfer.files import SyncTimings
from asyncgrpo.adapters.vllm.client import VLLMClient
from asyncgrpo.core.weights.sync import GLOO
from asyncgrpo.shell.config.checks import WEIGHT_SYNC_MARGIN_S
from asyncgrpo.shell.weights.paths import EngineWeights, Snapshot, each_server

TENSORS = 6


def small_stream(gathered: list[str]) -> WeightStream:
    """A stream of ``TENSORS`` tensors that records each gather it runs (a gather stands for
    one collective of the trainer's processes)."""
    weights = [(f"w{i}", torch.full((2,), float(i))) for i in range(TENSORS)]

    def gather():
        for name, tensor in weights:
            gathered.append(name)
            yield name, tensor

    return WeightStream(lambda: [(n, t.dtype, tuple(t.shape)) for n, t in weights], gather)


class FakeStuckEngine:
    """Fake of vLLM's NCCL trainer engine whose send never returns: the server's workers stopped
    answering and NCCL waits on the stream. ``shutdown`` (the abort) frees it only if
    ``abort_frees``, else it stays blocked until the test ends."""

    def __init__(self, source: WeightStream, abort_frees: bool) -> None:
        self.source = source
        self.is_sender = True
        self.client = SimpleNamespace(timeout=60.0, shutdown_weight_transfer_engine=lambda: None)
        self.abort_frees = abort_frees
        self.aborted = threading.Event()
        self.released = threading.Event()
        self.shutdowns = 0

    def send_weights(self) -> None:
        for _ in zip(range(2), self.source, strict=False):
            pass  # two tensors packed, then NCCL waits for the server forever
        while not self.released.wait(0.05):
            if self.abort_frees and self.aborted.is_set():
                raise RuntimeError("NCCL error: communicator aborted")

    def shutdown(self) -> None:
        self.shutdowns += 1
        self.aborted.set()


class FakeDyingEngine(FakeStuckEngine):
    """Fake of vLLM's NCCL trainer engine whose server dies after three tensors: the HTTP side
    of the transfer fails (NCCL would report the peer gone)."""

    def send_weights(self) -> None:
        for _ in zip(range(3), self.source, strict=False):
            pass
        raise ConnectionResetError("the server closed the connection mid-update")


@pytest.fixture
def short_grace(monkeypatch):
    monkeypatch.setattr(engine_module, "ABORT_GRACE_S", 0.5)


def test_a_send_that_finishes_in_time_returns_and_one_that_fails_raises_its_own_error() -> None:
    aborts = []
    send_within(lambda: None, 5.0, abort=lambda: aborts.append(1), server="s")

    def dies() -> None:
        raise ConnectionResetError("gone")

    with pytest.raises(ConnectionResetError, match="gone"):
        send_within(dies, 5.0, abort=lambda: aborts.append(1), server="s")
    assert aborts == []


def test_a_send_blocked_until_the_abort_is_aborted_and_named(short_grace) -> None:
    engine = FakeStuckEngine(small_stream([]), abort_frees=True)
    with pytest.raises(WeightSendTimeout, match=r"http://x:1.*weight_sync_timeout=0.2 s") as err:
        send_within(engine.send_weights, 0.2, engine.shutdown, "http://x:1")
    assert engine.shutdowns == 1
    assert not getattr(err.value, "__notes__", None)  # the abort freed it


def test_a_send_the_abort_cannot_free_still_returns_control(short_grace) -> None:
    engine = FakeStuckEngine(small_stream([]), abort_frees=False)
    try:
        with pytest.raises(WeightSendTimeout) as err:
            send_within(engine.send_weights, 0.2, engine.shutdown, "http://x:1")
        assert engine.shutdowns == 1
        assert "still blocked" in err.value.__notes__[0]
    finally:
        engine.released.set()


def test_a_handshake_whose_server_never_joins_is_bounded_apart_from_the_send(
    monkeypatch,
) -> None:
    """A server whose workers are stuck (in an earlier transfer, say) never joins the group:
    each try of the handshake ends at its own bound, not after weight_sync_timeout (600 s
    here) and the group's store wait."""
    released = threading.Event()

    def never_joins(*args, **kwargs):  # fake of vLLM's trainer factory facing such a server
        released.wait(60)

    monkeypatch.setattr(engine_module, "HANDSHAKE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(
        engine_module, "WeightTransferTrainerFactory", SimpleNamespace(trainer_init=never_joins)
    )
    started = time.monotonic()
    try:
        with pytest.raises(WeightHandshakeTimeout, match="did not finish within 0.5 s"):
            EngineSync.join(
                "http://127.0.0.1:9",
                lambda: None,
                GLOO,
                small_stream([]),
                workers=1,
                rank=0,
                timeout_s=600,
            )
        assert time.monotonic() - started < 30
    finally:
        released.set()


def test_the_config_margin_covers_what_rank_0_does_after_a_hung_send() -> None:
    """weight_sync_timeout stays WEIGHT_SYNC_MARGIN_S below ddp_timeout; past the send's
    watchdog rank 0 still waits for the abort, the server's resume and the HTTP call that
    races the watchdog, all inside that margin."""
    after_the_watchdog_s = (
        engine_module.ABORT_GRACE_S + engine_module.LEAVE_TIMEOUT_S + engine_module.WIRE_LEAD_S
    )
    assert after_the_watchdog_s < WEIGHT_SYNC_MARGIN_S


def test_engine_sends_are_bounded_by_weight_sync_timeout_not_vllm_server_timeout(
    monkeypatch,
) -> None:
    joined: list[dict] = []

    def join(base_url, client, backend, source, **settings):
        joined.append({"base_url": base_url, **settings})
        return SimpleNamespace()

    monkeypatch.setattr(EngineSync, "join", staticmethod(join))
    export = SimpleNamespace(weight_metadata=list, iter_weights=lambda: iter(()))
    weights = EngineWeights(
        learner=SimpleNamespace(export=export, rank=0, device=torch.device("cpu")),
        args=SimpleNamespace(
            server_urls=["http://a:1", "http://b:2"],
            weight_sync_timeout=123.0,
            vllm_server_timeout=1800.0,
            server_api_key=None,
            weight_sync_delta=False,
            weight_push_keeps_kv_cache=False,
        ),
        client=lambda index: None,
        backend=GLOO,
        server_workers=1,
    )
    weights.start()
    assert [(j["base_url"], j["timeout_s"]) for j in joined] == [
        ("http://a:1", 123.0),
        ("http://b:2", 123.0),
    ]


class RefusedMerge(RuntimeError):
    """Stands for LoraPrecisionError: the learner's export refuses when called."""


class FakeRecordingEngine:
    """Fake of a trainer engine that records each send; a send iterates the source, as
    vLLM's engines do after ``/start_weight_update``."""

    def __init__(self, source: WeightStream, is_sender: bool) -> None:
        self.source, self.is_sender = source, is_sender
        self.client = SimpleNamespace(timeout=60.0, shutdown_weight_transfer_engine=lambda: None)
        self.sends = 0

    def send_weights(self) -> None:
        self.sends += 1
        for _ in self.source:
            pass

    def shutdown(self) -> None:
        pass


class FakeAdminClient:
    """Fake of :class:`VLLMClient` recording the server's pauses and resumes."""

    def __init__(self, calls: list[str]) -> None:
        async def record(name: str) -> None:
            calls.append(name)

        self.admin = SimpleNamespace(
            pause=lambda keep_kv_cache=False: record("pause"),
            resume=lambda: record("resume"),
            reset_prefix_cache=lambda: record("reset_prefix_cache"),
        )

    async def aclose(self) -> None:
        pass


@pytest.mark.parametrize("sender", [True, False])
def test_a_push_refused_by_the_export_raises_before_the_server_is_paused_or_sent_to(
    sender,
) -> None:
    """A PEFT merge refused for the server's dtype (LoraPrecisionError) raises when the export
    is called; the stream calls it before the send starts, so no server is left paused or
    waiting mid-receive, on the sending rank as on the others."""

    def refusing_export():
        raise RefusedMerge("the server's dtype loses the LoRA update")

    source = WeightStream(lambda: [("w", torch.float32, (2,))], refusing_export)
    engine = FakeRecordingEngine(source, is_sender=sender)
    calls: list[str] = []
    sync = EngineSync("http://x:1", lambda: FakeAdminClient(calls), engine, timeout_s=5.0)
    try:
        with pytest.raises(RefusedMerge):
            sync.sync()
    finally:
        sync.close()
    assert engine.sends == 0 and calls == []


def test_a_stream_begun_before_the_send_runs_that_round_once() -> None:
    """new_round calls the export once; the send's iteration, or finish_round after a failed
    send, runs that same round, never a second one."""
    rounds: list[int] = []

    def export():
        rounds.append(len(rounds))
        yield "w", torch.zeros(2)

    source = WeightStream(lambda: [("w", torch.float32, (2,))], export)
    source.new_round()
    assert [name for name, _ in source] == ["w"] and rounds == [0]
    source.finish_round()
    source.new_round()
    source.finish_round()
    assert rounds == [0, 1]


def is_paused(base_url: str) -> bool:
    return httpx.get(f"{base_url}/is_paused", timeout=30).json()["is_paused"]


@pytest.mark.server
def test_a_send_to_a_server_that_hangs_is_bounded_and_the_server_resumed(
    vllm_server, short_grace
) -> None:
    """The server's workers hang mid-send (fake engine, real server): the sync raises within
    its timeout naming the server, the group is aborted, the server is resumed and serves."""
    gathered: list[str] = []
    engine = FakeStuckEngine(small_stream(gathered), abort_frees=True)
    sync = EngineSync(
        vllm_server.base_url,
        lambda: VLLMClient(vllm_server.base_url, vllm_server.spec.name),
        engine,
        timeout_s=1.0,
    )
    try:
        started = time.monotonic()
        with pytest.raises(WeightSendTimeout, match=vllm_server.base_url):
            sync.sync()
        assert time.monotonic() - started < 30  # bounded: 1 s + the abort's grace + HTTP
        assert engine.shutdowns == 1
        assert gathered == [f"w{i}" for i in range(TENSORS)]  # the round was run to its end
        assert not is_paused(vllm_server.base_url)
    finally:
        sync.close()


@pytest.mark.server
def test_a_server_that_dies_mid_send_fails_the_sync_with_its_cause(vllm_server) -> None:
    """The fake engine's server goes away after three tensors: the sync raises that cause at
    once (no watchdog wait), runs the rest of the round's gathers, and resumes the server."""
    gathered: list[str] = []
    engine = FakeDyingEngine(small_stream(gathered), abort_frees=True)
    sync = EngineSync(
        vllm_server.base_url,
        lambda: VLLMClient(vllm_server.base_url, vllm_server.spec.name),
        engine,
        timeout_s=600.0,
    )
    try:
        with pytest.raises(ConnectionResetError, match="mid-update"):
            sync.sync()
        assert gathered == [f"w{i}" for i in range(TENSORS)]
        assert engine.shutdowns == 0
        assert not is_paused(vllm_server.base_url)
    finally:
        sync.close()


class FakeServerSync:
    """Fake of one server's :class:`EngineSync` for a push to several: its send meets the other
    servers' sends at a barrier (only sends that run at once pass it), or hangs until its
    watchdog when ``hangs``."""

    def __init__(self, meeting: threading.Barrier, hangs: bool, sent: list[int], index: int):
        self.meeting, self.hangs, self.sent, self.index = meeting, hangs, sent, index

    def send_snapshot(self, weights, ready=None) -> SyncTimings:
        if self.hangs:
            engine = FakeStuckEngine(small_stream([]), abort_frees=True)
            send_within(engine.send_weights, 0.2, engine.shutdown, f"server {self.index}")
        self.meeting.wait()
        self.sent.append(self.index)
        return SyncTimings(pause_s=0.0, barrier_s=0.0, transfer_s=0.0)


def push_to_two(backend: str, first_hangs: bool) -> tuple[dict, list[int]]:
    weights = EngineWeights(
        learner=None,
        args=SimpleNamespace(server_urls=["a", "b"], weight_sync_delta=False),
        client=None,
        backend=backend,
        server_workers=1,
    )
    # sends that run at once meet in well under 10 s; serial ones break the barrier after 2 s
    meeting = threading.Barrier(1 if first_hangs else 2, timeout=10 if backend == GLOO else 2)
    sent: list[int] = []
    weights.engines = {i: FakeServerSync(meeting, first_hangs and i == 0, sent, i) for i in (0, 1)}
    landing = weights.send(Snapshot(1, {"w": torch.zeros(1)}), servers=(0, 1))
    return landing, sent


def test_gloo_sends_to_several_servers_run_at_once() -> None:
    landing, sent = push_to_two("asyncgrpo_gloo", first_hangs=False)
    assert all(isinstance(t, SyncTimings) for t in landing.values()), landing
    assert sorted(sent) == [0, 1]


def test_nccl_sends_go_one_after_another_and_a_hung_server_costs_only_its_timeout(
    short_grace,
) -> None:
    """vLLM's NCCL engine shares its packing streams between sending threads, so its sends are
    serial: two sends never meet (the barrier of two breaks), and a first server that hangs
    times out on its own watchdog while the second still gets its weights."""
    landing, sent = push_to_two("nccl", first_hangs=False)
    assert all(isinstance(t, threading.BrokenBarrierError) for t in landing.values()), landing
    landing, sent = push_to_two("nccl", first_hangs=True)
    assert isinstance(landing[0], WeightSendTimeout) and "server 0" in str(landing[0])
    assert isinstance(landing[1], SyncTimings) and sent == [1]


def test_each_server_in_order_keeps_going_after_a_failure() -> None:
    order: list[int] = []

    def call(index: int) -> SyncTimings:
        order.append(index)
        if index == 0:
            raise ConnectionResetError("first")
        return SyncTimings(pause_s=0.0, barrier_s=0.0, transfer_s=0.0)

    landing = each_server((0, 1, 2), call, parallel=False)
    assert order == [0, 1, 2] and isinstance(landing[0], ConnectionResetError)
    assert all(isinstance(landing[i], SyncTimings) for i in (1, 2))


def test_the_nccl_engine_leaves_an_earlier_group_before_joining_a_new_one(monkeypatch) -> None:
    """vLLM's NCCL worker engine overwrote its communicator without destroying it, leaking one
    per trainer restart on each GPU; asyncgrpo's plugin makes it leave the earlier group first.
    NCCL cannot run here: the groups are fakes that record their teardown."""
    from vllm.distributed.weight_transfer import nccl_engine

    from asyncgrpo.adapters.transfer.plugin import register

    class FakeGroup:
        def __init__(self, name: str, log: list[str]) -> None:
            self.name, self.log = name, log

        def destroy(self) -> None:
            self.log.append(f"destroy {self.name}")

    log: list[str] = []

    def joined(init_info, parallel_config):
        log.append("join new")
        return FakeGroup("new", log)

    monkeypatch.setattr(nccl_engine, "worker_init_process_group", joined)
    register()
    worker = nccl_engine.NCCLWeightTransferEngine.__new__(nccl_engine.NCCLWeightTransferEngine)
    worker.parallel_config = None
    worker.model_update_group = FakeGroup("earlier", log)
    info = SimpleNamespace(packed=True, packed_buffer_size_bytes=1 << 20, packed_num_buffers=2)
    worker.init_transfer_engine(info)
    assert log == ["destroy earlier", "join new"]
    assert worker.model_update_group.name == "new"
