"""A local server's port comes from below the kernel's ephemeral range, so that no outgoing
connection is handed it between the server's stop and its restart on the same port."""

import socket

from asyncgrpo.adapters.vllm.server import EPHEMERAL_PORTS_FILE, free_port


def test_a_free_port_is_below_the_ephemeral_range_and_can_be_bound() -> None:
    low = int(EPHEMERAL_PORTS_FILE.read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(port < low for port in ports), (sorted(ports), low)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", next(iter(ports))))
