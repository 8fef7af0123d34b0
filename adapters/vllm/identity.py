"""The vLLM server's identity: a value that changes when the server restarts.

It is the API server process's start time, ``process_start_time_seconds`` in ``/metrics``
(Prometheus' process collector, in every vLLM server with one API server process; one with
several keeps a multiprocess registry that exports no ``process_*`` samples, and has none).
Asked for alone (:data:`IDENTITY_QUERY`) the reply is a few hundred bytes instead of the full
scrape's ~55 kB. The decisions over it are :mod:`asyncgrpo.core.servers.outage`'s
(``identity_seen``, ``push_landed``).

:class:`FreshIdentity` reads it for a caller that needs a reading taken after a moment (a
generation that just finished): readings run one at a time, and the callers that asked while
one was in flight share the next one, so many generations finishing together cost one or two.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Awaitable, Callable

import anyio

IDENTITY_SAMPLE = "process_start_time_seconds"
IDENTITY_QUERY = {"name[]": IDENTITY_SAMPLE}  # Prometheus: export only these samples


class FreshIdentity:
    """Readings of the server's identity, each begun after the caller asked.

    Args:
        read: one reading (an HTTP request to the server). A bound method (the client's own
            ``server_identity``) is held weakly: the client holds this object, and a strong
            reference back would make every client a reference cycle, freed (with its
            connection pool and TLS context) only by a full garbage collection. A trainer
            makes a client per weight push; held in cycles they grew its memory by about
            17 KB per client (benchmarks/soak.py, docs/reliability.md).

    Attributes:
        readings: readings made so far.
    """

    def __init__(self, read: Callable[[], Awaitable[float | None]]) -> None:
        self._read: Callable[[], Callable[[], Awaitable[float | None]] | None] = (
            weakref.WeakMethod(read) if inspect.ismethod(read) else lambda: read
        )
        self._lock = anyio.Lock()
        self.readings = 0
        self._last_reading = 0  # the number of the last reading finished
        self._last_identity: float | None = None

    async def after_now(self) -> float | None:
        """The identity from a reading begun after this call (maybe shared with others)."""
        asked = self.readings
        async with self._lock:
            if self._last_reading > asked:  # a reading begun after we asked has finished
                return self._last_identity
            self.readings += 1
            reading = self.readings
            read = self._read()
            if read is None:
                raise RuntimeError("FreshIdentity: the client that reads the identity is gone")
            identity = await read()
            self._last_reading, self._last_identity = reading, identity
            return identity
