"""A fault-injecting TCP proxy on loopback, between a trainer (and its rollout process) and a
vLLM server, for the tests and ``benchmarks/chaos.py``.

No library that installs as a Python package does this with the faults a run must survive:
toxiproxy needs its Go binary; ``faulty`` (PyPI, alpha) drops random chunks of a stream and has
neither resets nor truncation; ``toxic-proxy`` listens on every interface; ``vaurien`` is
Python 2. This one is an asyncio server on ``127.0.0.1`` that runs on a thread of its own (so
the test's thread may block in ``train()`` meanwhile) and takes its faults from any thread,
at run time:

* :meth:`FaultProxy.add_latency`: ``seconds`` added in the middle of a response (half of its
  first chunk goes out, then the wait, then the rest);
* :meth:`FaultProxy.reset_after`: a response is cut by a TCP reset (RST) after ``after_bytes``
  bytes of it;
* :meth:`FaultProxy.truncate_after`: a response is cut by a clean close (FIN) after
  ``after_bytes`` bytes of it;
* :meth:`FaultProxy.black_hole`: for ``seconds``, connections are accepted and kept but
  nothing is forwarded either way; what was sent meanwhile is delivered after it, as TCP
  delivers dropped packets once they are sent again;
* :meth:`FaultProxy.cap_bandwidth`: bytes per second through the link, each way, shared by all
  its connections.

A response fault may be limited to the responses of one kind of request (``requests``: the
start of the request line, e.g. ``"POST /v1/completions"``; the proxy reads it from the first
bytes a request sends, which is enough for HTTP/1.1 without pipelining, as ``httpx`` and
``requests`` send) and to its next ``times`` responses (``None``: every one until
:meth:`FaultProxy.clear`). What struck is counted in :attr:`FaultProxy.struck`, so a test can
fail if a fault never happened.

Only the connections to the proxy's port pass through it: a vLLM server's HTTP API (generation,
``/metrics``, ``/health``, the control calls of a weight push: ``/pause``, ``/collective_rpc``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``, ``/resume``), never
the weight-transfer engine's own data connections (gloo's or NCCL's), which the server's
workers open to the trainer's address directly.

Example::

    with FaultProxy(server_port) as proxy:
        client = VLLMClient(proxy.url, model)
        proxy.reset_after(100, requests="POST /v1/completions", times=1)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
import socket
import struct
import threading
import time
from typing import Any

import attrs

METHODS = (b"GET ", b"POST ", b"PUT ", b"DELETE ", b"HEAD ", b"PATCH ", b"OPTIONS ")
CHUNK_BYTES = 64 * 1024
RATE_SLICE_S = 0.05
"""Under a bandwidth cap a chunk goes out in slices of about this many seconds' worth of
bytes, so that a response trickles rather than arriving in one late burst."""


@attrs.frozen
class ResponseFault:
    """A fault of the responses: ``kind`` (``"latency"``, ``"reset"`` or ``"truncate"``), its
    ``seconds`` (latency) or ``after_bytes`` (a cut), for the responses whose request line
    starts with ``requests`` (``None``: any)."""

    kind: str
    seconds: float = 0.0
    after_bytes: int = 0
    requests: str | None = None

    def applies_to(self, request_line: bytes) -> bool:
        return self.requests is None or request_line.startswith(self.requests.encode())


class _Connection:
    """One client connection's state: the request line of the request it sent last and the
    bytes of the response to it forwarded so far."""

    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.client = client
        self.server: asyncio.StreamWriter | None = None
        self.request_line = b""
        self.response_bytes = 0


class FaultProxy:
    """A TCP proxy from ``127.0.0.1:<port>`` to ``target_host:target_port``, on a thread of
    its own (:meth:`start`, :meth:`stop`, or ``with``).

    Args:
        target_port: the server's port.
        target_host: the server's host; a loopback address (the proxy refuses any other).

    Attributes:
        struck: faults that struck, by kind: ``"latency"``, ``"reset"``, ``"truncate"``
            (responses), ``"black_hole"`` (chunks held by it), ``"capped"`` (chunks slowed).
        connections: connections accepted so far.
        forwarded: bytes forwarded so far, by way: ``"up"`` (client to server) and
            ``"down"`` (server to client); a piece is counted as it is handed to the socket,
            so a byte the peer has read is always counted.
        struck_at: when each kind of fault first struck since it was last armed
            (``time.monotonic()``).
        requests_seen: ``(time.monotonic(), request line)`` of every request that reached the
            proxy, in order (to time how soon a client sent a request again, or probed).
    """

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        if not target_host.startswith("127.") and target_host not in ("localhost", "::1"):
            raise ValueError(f"FaultProxy forwards to loopback only, not to {target_host!r}")
        self.target = (target_host, target_port)
        self.port: int | None = None
        self.struck: collections.Counter[str] = collections.Counter()
        self.connections = 0
        self.forwarded = {"up": 0, "down": 0}
        self.struck_at: dict[str, float] = {}
        self.requests_seen: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._faults: dict[str, tuple[ResponseFault, int | None]] = {}  # kind -> (fault, left)
        self._hole_until = 0.0  # time.monotonic()
        self._rate: float | None = None  # bytes/s each way
        self._free_at = {"up": 0.0, "down": 0.0}  # when each way's link is free again
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._open: set[_Connection] = set()

    @property
    def url(self) -> str:
        """The proxy's base URL, to give the client instead of the server's."""
        if self.port is None:
            raise RuntimeError("FaultProxy.url before start()")
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        """Listen on a free loopback port (:attr:`port`) and forward from now on."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="fault-proxy", daemon=True
        )
        self._thread.start()
        self._server = self._call(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        """Stop listening, close every connection and the proxy's thread."""
        if self._loop is None or self._thread is None:
            return

        async def close() -> None:
            assert self._server is not None
            self._server.close()
            for connection in list(self._open):
                for writer in (connection.client, connection.server):
                    if writer is not None:
                        writer.transport.abort()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self._call(close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10.0)
        self._loop.close()
        self._loop = self._thread = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- faults, on command from any thread ------------------------------------------------

    def add_latency(
        self, seconds: float, requests: str | None = None, times: int | None = None
    ) -> None:
        """Add ``seconds`` in the middle of each of the next ``times`` responses (to requests
        starting with ``requests``)."""
        self._arm(ResponseFault("latency", seconds=seconds, requests=requests), times)

    def reset_after(
        self, after_bytes: int, requests: str | None = None, times: int | None = 1
    ) -> None:
        """Reset (RST) the connection of each of the next ``times`` responses once
        ``after_bytes`` bytes of it have gone through (0: before any byte of it)."""
        self._arm(ResponseFault("reset", after_bytes=after_bytes, requests=requests), times)

    def truncate_after(
        self, after_bytes: int, requests: str | None = None, times: int | None = 1
    ) -> None:
        """Close (FIN) the connection of each of the next ``times`` responses once
        ``after_bytes`` bytes of it have gone through."""
        self._arm(ResponseFault("truncate", after_bytes=after_bytes, requests=requests), times)

    def black_hole(self, seconds: float = math.inf) -> None:
        """Forward nothing, either way, for ``seconds`` from now (connections are accepted and
        kept; what they send is delivered afterwards); ``math.inf``: until :meth:`clear`."""
        with self._lock:
            self._hole_until = time.monotonic() + seconds
            self.struck_at.pop("black_hole", None)

    def cap_bandwidth(self, bytes_per_s: float | None) -> None:
        """Let at most ``bytes_per_s`` through each way (all connections together); ``None``
        lifts the cap."""
        if bytes_per_s is not None and not bytes_per_s > 0:
            raise ValueError(f"cap_bandwidth: bytes_per_s must be > 0 or None, got {bytes_per_s}")
        with self._lock:
            self._rate = bytes_per_s
            self.struck_at.pop("capped", None)

    def clear(self) -> None:
        """Lift every fault: a black hole ends now, and what it held is delivered."""
        with self._lock:
            self._faults.clear()
            self._hole_until = 0.0
            self._rate = None
            self.struck_at.clear()

    def _arm(self, fault: ResponseFault, times: int | None) -> None:
        if times is not None and times < 1:
            raise ValueError(f"{fault.kind}: times must be >= 1 or None, got {times}")
        with self._lock:
            self._faults[fault.kind] = (fault, times)
            self.struck_at.pop(fault.kind, None)

    def _claim(self, kind: str, request_line: bytes) -> ResponseFault | None:
        """The fault of ``kind`` for a response to ``request_line``, taking one of its times
        (``None`` when none is armed for it, or none is left)."""
        with self._lock:
            armed = self._faults.get(kind)
            if armed is None or not armed[0].applies_to(request_line):
                return None
            fault, left = armed
            if left is not None:
                if left <= 1:
                    del self._faults[kind]
                else:
                    self._faults[kind] = (fault, left - 1)
            self.struck[kind] += 1
            self.struck_at.setdefault(kind, time.monotonic())
            return fault

    def _armed(self, kind: str, request_line: bytes) -> ResponseFault | None:
        with self._lock:
            armed = self._faults.get(kind)
        return armed[0] if armed is not None and armed[0].applies_to(request_line) else None

    # --- the proxy's loop ------------------------------------------------------------------

    def _call(self, coroutine: Any) -> Any:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=30.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.CancelledError):  # the handler's end: stop() cancels
            await self._connect(reader, writer)

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = _Connection(writer)
        self._open.add(connection)
        self.connections += 1
        try:
            try:  # in a black hole too: it holds what the connection carries (_forward)
                server_reader, connection.server = await asyncio.open_connection(*self.target)
            except OSError:
                return  # the server is gone: the client sees its connection closed
            up = asyncio.create_task(self._pump_up(reader, connection))
            try:  # a client that closes its side still gets the rest of the response
                await self._pump_down(server_reader, connection)
            finally:
                up.cancel()
                await asyncio.gather(up, return_exceptions=True)
        finally:
            self._open.discard(connection)
            for side in (connection.client, connection.server):
                if side is not None and not side.transport.is_closing():
                    side.close()

    async def _pump_up(self, reader: asyncio.StreamReader, connection: _Connection) -> None:
        """Client to server; notes each request line (a chunk that starts one)."""
        assert connection.server is not None
        with contextlib.suppress(OSError):  # the client or the server went: the pump ends
            while chunk := await reader.read(CHUNK_BYTES):
                if chunk.startswith(METHODS):
                    connection.request_line = chunk.split(b"\r\n", 1)[0]
                    connection.response_bytes = 0
                    line = connection.request_line.decode("latin-1")
                    self.requests_seen.append((time.monotonic(), line))
                await self._forward(chunk, connection.server, "up")
            connection.server.write_eof()

    async def _pump_down(self, reader: asyncio.StreamReader, connection: _Connection) -> None:
        """Server to client, through the response faults."""
        client = connection.client
        with contextlib.suppress(OSError):
            while chunk := await reader.read(CHUNK_BYTES):
                line = connection.request_line
                if connection.response_bytes == 0 and (fault := self._claim("latency", line)):
                    half = max(1, len(chunk) // 2)
                    await self._forward(chunk[:half], client, "down")
                    connection.response_bytes += half
                    chunk = chunk[half:]
                    await asyncio.sleep(fault.seconds)
                for kind in ("reset", "truncate"):
                    fault = self._armed(kind, line)
                    left = None if fault is None else fault.after_bytes - connection.response_bytes
                    if left is not None and left < len(chunk):  # the response goes past it
                        if self._claim(kind, line) is None:
                            continue  # another connection took its last time
                        await self._forward(chunk[: max(left, 0)], client, "down")
                        self._cut(connection, reset=kind == "reset")
                        return
                await self._forward(chunk, client, "down")
                connection.response_bytes += len(chunk)
            client.write_eof()

    @staticmethod
    def _cut(connection: _Connection, reset: bool) -> None:
        """End both sides: by RST (``reset``, ``SO_LINGER`` 0 makes the close send it) or by
        a clean close after what was written."""
        for side in (connection.client, connection.server):
            if side is None:
                continue
            if reset:
                sock = side.get_extra_info("socket")
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                side.transport.abort()
            else:
                side.close()

    async def _forward(self, chunk: bytes, to: asyncio.StreamWriter, way: str) -> None:
        """Write ``chunk`` once the black hole is over, at most at the capped rate."""
        while chunk:
            await self._through_hole()
            with self._lock:
                rate = self._rate
            piece = chunk if rate is None else chunk[: max(1, int(rate * RATE_SLICE_S))]
            chunk = chunk[len(piece) :]
            if rate is not None:
                now = time.monotonic()
                start = max(now, self._free_at[way])
                self._free_at[way] = start + len(piece) / rate
                self.struck["capped"] += 1
                self.struck_at.setdefault("capped", now)
                await asyncio.sleep(self._free_at[way] - now)
            self.forwarded[way] += len(piece)  # before the write: a byte read is counted
            to.write(piece)
            await to.drain()

    async def _through_hole(self) -> None:
        """Return once no black hole is on (counting the chunks it held)."""
        with self._lock:
            held = time.monotonic() < self._hole_until
        if held:
            self.struck["black_hole"] += 1
            self.struck_at.setdefault("black_hole", time.monotonic())
        while True:
            with self._lock:
                left = self._hole_until - time.monotonic()
            if left <= 0:
                return
            await asyncio.sleep(min(left, 0.05))
