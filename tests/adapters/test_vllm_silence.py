"""A frozen server, as the client meets it: a socket that takes connections (the kernel's
backlog does that for a SIGSTOPped process) and never answers. The client names the silence
(``ServerNotAnswering``: the URL, the call, the seconds, the setting, ``--resume``), never a bare
read timeout with a retry count it did not make, and counts the silence in total across calls
(the calls of one push). The end-to-end SIGSTOP runs are in tests/shell/test_server_faults.py."""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator

import anyio
import pytest

from asyncgrpo.adapters.vllm.client import VLLMClient, VLLMError
from asyncgrpo.adapters.vllm.server import free_port
from asyncgrpo.adapters.vllm.transport import ServerNotAnswering

TIMEOUT_S = 3.0  # vllm_server_timeout
STALL_S = 0.5  # vllm_server_stall_timeout


@pytest.fixture
def frozen_url() -> Iterator[str]:
    """A listener that never accepts: connections complete in the backlog, nothing answers."""
    with socket.create_server(("127.0.0.1", 0), backlog=64) as listener:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def silent_seconds(error: BaseException) -> int:
    found = re.search(r"has not answered for (\d+) s", str(error))
    assert found, str(error)
    return int(found.group(1))


def test_a_frozen_server_is_named_as_silent_not_as_a_read_timeout(frozen_url) -> None:
    async def main() -> tuple[BaseException, int]:
        async with VLLMClient(
            frozen_url, "m", timeout_s=TIMEOUT_S, stall_s=STALL_S, max_retries=5, backoff_s=0.01
        ) as client:
            with pytest.raises(VLLMError) as raised:
                await client.admin.pause()
            return raised.value, client.retry_count

    error, retries = anyio.run(main)
    assert isinstance(error, ServerNotAnswering), f"{type(error).__name__}: {error}"
    message = str(error)
    assert frozen_url in message and "POST /pause" in message
    assert silent_seconds(error) >= TIMEOUT_S
    assert f"vllm_server_timeout={TIMEOUT_S:.0f} s" in message and "--resume" in message
    assert "retries" not in message and "ReadTimeout" not in message
    assert retries == 0


def test_the_silence_is_counted_in_total_across_the_calls_of_one_operation(frozen_url) -> None:
    """The push's ``/resume`` after its failed ``/collective_rpc`` does not wait out the
    timeout again: the server has been silent since the first call."""

    async def main() -> tuple[BaseException, BaseException]:
        async with VLLMClient(
            frozen_url, "m", timeout_s=TIMEOUT_S, stall_s=STALL_S, max_retries=5, backoff_s=0.01
        ) as client:
            with pytest.raises(ServerNotAnswering) as first:
                await client.admin.pause()
            with pytest.raises(ServerNotAnswering) as then:
                await client.admin.resume()
            return first.value, then.value

    first, then = anyio.run(main)
    assert "POST /resume" in str(then)
    assert silent_seconds(then) >= silent_seconds(first) >= TIMEOUT_S


def test_a_failure_without_retries_does_not_claim_any() -> None:
    """A refused connection with ``max_retries=0``: one try, and the message says none."""

    async def main() -> None:
        async with VLLMClient(
            f"http://127.0.0.1:{free_port()}", "m", timeout_s=2, max_retries=0
        ) as client:
            await client.admin.pause()

    with pytest.raises(VLLMError) as raised:
        anyio.run(main)
    assert "retries" not in str(raised.value)
    assert "ConnectError" in str(raised.value)
