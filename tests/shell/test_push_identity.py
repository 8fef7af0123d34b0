"""Before the first weight push rank 0 reads each server's identity; a read that fails is
logged with its exception, and a push that lands anyway fails naming it as the cause, instead
of a bare "restarted during the weight push" (no server: a client that answers from a list)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import httpx
from scripted_identity import ScriptedIdentity
from structlog.testing import capture_logs

from asyncgrpo.adapters.transfer.files import SyncTimings
from asyncgrpo.adapters.vllm.replies import VLLMError
from asyncgrpo.shell.servers import SharedServers
from asyncgrpo.shell.weights.push import WeightPusher

URL = "http://127.0.0.1:9"


def pusher_reading(answers: list[float | Exception]) -> WeightPusher:
    readings = iter(answers)
    return WeightPusher(
        weights=None,  # type: ignore[arg-type]  # no push is sent here
        learner=SimpleNamespace(rank=0, step=0),  # type: ignore[arg-type]
        servers=SharedServers([URL]),
        client=lambda server, **options: ScriptedIdentity(readings),
        server_timeout_s=5.0,
        uninterruptible=contextlib.nullcontext,
    )


def test_a_failed_identity_read_at_start_keeps_its_cause() -> None:
    refused = httpx.ConnectError("connection refused")
    pusher = pusher_reading([refused, 1234.5])
    with capture_logs() as logs:
        targets = pusher._targets(at_start=True)
    assert targets == {0: None}
    [warning] = [entry for entry in logs if entry["log_level"] == "warning"]
    assert warning["exc_info"] is refused
    assert warning["cause"] == "ConnectError: connection refused" and warning["server"] == URL
    landed = {0: SyncTimings(pause_s=0.0, barrier_s=0.0, transfer_s=0.0)}
    checked = pusher._check_landing(targets, landed, at_start=True)
    failure = checked[0]
    assert isinstance(failure, VLLMError) and failure.__cause__ is refused
    assert str(failure).startswith(
        "the vLLM server's identity could not be read before the first weight push "
        "(ConnectError: connection refused)"
    )


def test_an_identity_read_at_start_that_answers_logs_nothing() -> None:
    pusher = pusher_reading([1234.5, 1234.5])
    with capture_logs() as logs:
        targets = pusher._targets(at_start=True)
    assert targets == {0: 1234.5} and logs == []
    landed = {0: SyncTimings(pause_s=0.0, barrier_s=0.0, transfer_s=0.0)}
    assert pusher._check_landing(targets, landed, at_start=True) == landed
