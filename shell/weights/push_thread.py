"""Rank 0's push thread: sends weight snapshots to the servers beside the training step.

:class:`PushThread` knows nothing of servers or ranks: it is handed snapshots and a ``send``
that pushes one (the :class:`~asyncgrpo.shell.weights.push.WeightPusher` gives its own). Pushes
land in order: while one is in flight the newest snapshot waits for it (an older waiting one is
replaced, never sent), so the step never waits for the servers and at most two snapshots exist.
The thread ends when no snapshot waits, when a push landed nowhere (the run pushes anew when it
resyncs), or when a push raised: the run's only server stayed silent (:class:`ServerNotAnswering`)
or anything else went wrong. That error is kept for :meth:`PushThread.raise_if_failed`, which the
step loop calls: it ends the run with its cause, and no wait is left on a thread that is gone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from asyncgrpo.shell.weights.paths import Snapshot

Landed = TypeVar("Landed")


class PushThread(Generic[Landed]):
    """Sends the snapshots handed to it, one at a time, on a thread of its own (rank 0).

    Args:
        send: pushes one snapshot and waits for it; returns what landed (``Landed``), or None
            when it landed on no server (nothing more is sent); raises
            :class:`ServerNotAnswering` when the run's only server stayed silent (any error it
            raises ends the sending and is kept for :meth:`raise_if_failed`).
        name: the thread's name (in stack dumps and profiles).
    """

    def __init__(
        self, send: Callable[[Snapshot], Landed | None], name: str = "asyncgrpo-weight-push"
    ) -> None:
        self._send = send
        self._name = name
        self._queue_lock = threading.Lock()
        self._waiting: Snapshot | None = None  # the next snapshot to send
        self._sender: threading.Thread | None = None  # the thread, while it sends
        self._failed: Exception | None = None  # raised by a push: fails the run

    def hand(self, snapshot: Snapshot, on_landed: Callable[[Landed], None]) -> bool:
        """Send ``snapshot`` once the push in flight (if any) has landed, and return at once;
        the thread calls ``on_landed`` with what each push landed as, in order. A thread
        already sending keeps the ``on_landed`` it started with.

        Returns:
            whether a waiting snapshot was replaced (it is never sent).
        """
        with self._queue_lock:
            replaced = self._waiting is not None
            self._waiting = snapshot
            if self._sender is None:
                self._sender = threading.Thread(
                    target=self._send_waiting, args=(on_landed,), name=self._name, daemon=True
                )
                self._sender.start()
        return replaced

    def _send_waiting(self, on_landed: Callable[[Landed], None]) -> None:
        """The thread: send the waiting snapshots in order until none waits, a push lands
        nowhere or a push raises; report each that landed."""
        while True:
            with self._queue_lock:
                snapshot, self._waiting = self._waiting, None
                if snapshot is None:
                    self._sender = None
                    return
            try:
                landed = self._send(snapshot)
                if landed is None:  # recorded as outages: the resync pushes anew
                    self._stop_sending()
                    return
                on_landed(landed)
            except Exception as error:  # kept for the step loop, which ends the run with it
                self._failed = error
                self._stop_sending()
                return

    def _stop_sending(self) -> None:
        with self._queue_lock:
            self._waiting, self._sender = None, None

    def raise_if_failed(self) -> None:
        """Raise the error a push raised on the thread, if one did: the run's only server
        answered nothing for ``vllm_server_timeout`` seconds (:class:`ServerNotAnswering`), or
        a fault the push does not count as an outage."""
        if self._failed is not None:
            raise self._failed

    def wait_landed(self) -> float:
        """Wait until every snapshot handed over has landed or failed; the seconds waited."""
        started = time.monotonic()
        while True:
            with self._queue_lock:
                sender = self._sender
            if sender is None:
                return time.monotonic() - started
            sender.join()
