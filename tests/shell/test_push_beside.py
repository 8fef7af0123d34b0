"""A push beside the step, through :class:`WeightPusher` and its push thread: rank 0 hands the
snapshot over and returns; the thread reads the server's identity, sends, reads it again and
reports the landing; the only server silent ends the run when the step loop looks (no
server: a client that answers from a list, a sync path that records what it sent)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
from scripted_identity import ScriptedIdentity

from asyncgrpo.adapters.transfer.files import SyncTimings
from asyncgrpo.adapters.vllm.transport import ServerNotAnswering
from asyncgrpo.shell.servers import SharedServers
from asyncgrpo.shell.weights import Pushed, WeightPusher
from asyncgrpo.shell.weights.paths import Snapshot

URL = "http://127.0.0.1:9"
TIMINGS = SyncTimings(pause_s=0.1, barrier_s=0.0, transfer_s=0.2)


class RecordingSync:
    """A sync path whose snapshots are empty and whose sends land on every server given."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, tuple[int, ...]]] = []

    def snapshot(self, version: int) -> Snapshot:
        return Snapshot(version, None)

    def send(self, snapshot: Snapshot, servers: tuple[int, ...]) -> dict[int, SyncTimings]:
        self.sent.append((snapshot.version, servers))
        return dict.fromkeys(servers, TIMINGS)


def _pusher(answers: list[float | Exception], step: int) -> tuple[WeightPusher, RecordingSync]:
    readings = iter(answers)
    weights = RecordingSync()
    servers = SharedServers([URL])
    servers.trusts[0].pushed(0, 7.0)  # the push at start landed on identity 7.0
    pusher = WeightPusher(
        weights=weights,  # type: ignore[arg-type]
        learner=SimpleNamespace(rank=0, step=step),  # type: ignore[arg-type]
        servers=servers,
        client=lambda server, **options: ScriptedIdentity(readings),
        server_timeout_s=5.0,
        uninterruptible=contextlib.nullcontext,
    )
    return pusher, weights


def test_a_push_beside_the_step_lands_and_is_reported_by_the_thread() -> None:
    pusher, weights = _pusher([7.0, 7.0], step=3)
    landed: list[Pushed] = []
    assert not pusher.push_beside(landed.append)
    pusher.wait_landed()
    pusher.raise_if_failed()
    assert weights.sent == [(3, (0,))]
    [pushed] = landed
    assert (pushed.version, pushed.servers, pushed.timings) == (3, (0,), TIMINGS)
    assert pushed.push_s is not None and pushed.push_s >= 0.0


def test_the_only_server_silent_before_a_push_beside_ends_the_run_at_the_next_look() -> None:
    silent = ServerNotAnswering("no answer for 5 s")
    pusher, weights = _pusher([silent], step=3)
    landed: list[Pushed] = []
    pusher.push_beside(landed.append)
    pusher.wait_landed()
    assert (weights.sent, landed) == ([], [])
    with pytest.raises(ServerNotAnswering) as raised:
        pusher.raise_if_failed()
    assert raised.value is silent
    with pytest.raises(ServerNotAnswering):  # and no later push beside the step is made
        pusher.push_beside(landed.append)
