"""Rank 0's push thread: snapshots land in order, a snapshot waiting behind the push in flight
is replaced by a newer one (never sent), a push that lands nowhere ends the sending, and the
only server's silence is kept for the step loop to raise.

``send`` is a fake gated by events, so the test decides when each push lands.
"""

from __future__ import annotations

import threading

import pytest

from asyncgrpo.adapters.vllm.transport import ServerNotAnswering
from asyncgrpo.shell.weights.paths import Snapshot
from asyncgrpo.shell.weights.push_thread import PushThread

WAIT_S = 10.0  # bound on any wait for the thread


class GatedSend:
    """Pushes a snapshot when its version's gate opens; ``outcome`` of a version: what the
    push lands as (default: the version), None (landed nowhere) or an exception raised."""

    def __init__(self, outcome: dict[int, object] | None = None) -> None:
        self.gates: dict[int, threading.Event] = {}
        self.started: dict[int, threading.Event] = {}
        self.sent: list[int] = []
        self.outcome = outcome or {}

    def gate(self, version: int) -> threading.Event:
        return self.gates.setdefault(version, threading.Event())

    def began(self, version: int) -> threading.Event:
        return self.started.setdefault(version, threading.Event())

    def __call__(self, snapshot: Snapshot) -> object:
        self.began(snapshot.version).set()
        assert self.gate(snapshot.version).wait(WAIT_S), f"push {snapshot.version} never let go"
        self.sent.append(snapshot.version)
        outcome = self.outcome.get(snapshot.version, snapshot.version)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def test_snapshots_land_in_order_and_a_waiting_one_is_replaced() -> None:
    send = GatedSend()
    thread: PushThread[object] = PushThread(send)
    landed: list[object] = []
    assert not thread.hand(Snapshot(1, None), landed.append)
    assert send.began(1).wait(WAIT_S)  # push 1 in flight
    assert not thread.hand(Snapshot(2, None), landed.append)
    assert thread.hand(Snapshot(3, None), landed.append)  # 2 was waiting: replaced
    for version in (1, 3):
        send.gate(version).set()
    thread.wait_landed()
    assert send.sent == [1, 3]
    assert landed == [1, 3]
    thread.raise_if_failed()  # nothing met: nothing raised


def test_a_push_that_lands_nowhere_ends_the_sending_and_drops_the_waiting_one() -> None:
    send = GatedSend({1: None})
    thread: PushThread[object] = PushThread(send)
    landed: list[object] = []
    thread.hand(Snapshot(1, None), landed.append)
    assert send.began(1).wait(WAIT_S)
    thread.hand(Snapshot(2, None), landed.append)
    send.gate(1).set()
    thread.wait_landed()
    assert (send.sent, landed) == ([1], [])
    send.gate(4).set()  # a later snapshot starts a new thread
    thread.hand(Snapshot(4, None), landed.append)
    thread.wait_landed()
    assert landed == [4]


def test_the_only_server_silent_is_raised_by_the_step_loop_not_the_thread() -> None:
    silent = ServerNotAnswering("no answer for 30 s")
    send = GatedSend({1: silent})
    thread: PushThread[object] = PushThread(send)
    landed: list[object] = []
    thread.hand(Snapshot(1, None), landed.append)
    assert send.began(1).wait(WAIT_S)
    thread.hand(Snapshot(2, None), landed.append)
    send.gate(1).set()
    thread.wait_landed()
    assert (send.sent, landed) == ([1], [])
    with pytest.raises(ServerNotAnswering) as raised:
        thread.raise_if_failed()
    assert raised.value is silent


def wait_landed_within(thread: PushThread[object], timeout_s: float) -> None:
    """``thread.wait_landed()``, failing the test instead of hanging past ``timeout_s``."""
    waiter = threading.Thread(target=thread.wait_landed, daemon=True)
    waiter.start()
    waiter.join(timeout_s)
    assert not waiter.is_alive(), "wait_landed did not return: it waits on a thread that is gone"


@pytest.mark.parametrize("where", ["send", "on_landed"])
def test_any_error_on_the_thread_ends_the_sending_and_is_raised_by_the_step_loop(where) -> None:
    """An error that is not the server's silence (a bug, a full disk in the snapshot's write)
    neither hangs wait_landed nor is lost: the step loop raises it."""
    broken = OSError("No space left on device")
    send = GatedSend({1: broken} if where == "send" else None)
    thread: PushThread[object] = PushThread(send)

    def on_landed(landed: object) -> None:
        raise broken

    send.gate(1).set()
    send.gate(2).set()
    thread.hand(Snapshot(1, None), on_landed)
    wait_landed_within(thread, WAIT_S)
    assert send.sent == [1]
    with pytest.raises(OSError, match="No space left") as raised:
        thread.raise_if_failed()
    assert raised.value is broken
