"""A blocking call on a daemon thread, waited for with a bound: the weight transfer's
handshakes and sends, whose other side may never answer."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Background:
    """A blocking call on a daemon thread (it may stay blocked in a collective whose other side
    failed, and must not keep the process alive then).

    Example:
        >>> Background(lambda: 2 + 3).result(1.0)
        5
    """

    def __init__(self, call: Callable[[], Any], name: str = "asyncgrpo-background") -> None:
        self._finished = threading.Event()
        self._ok = False
        self._value: Any = None
        threading.Thread(target=self._run, args=(call,), name=name, daemon=True).start()

    def _run(self, call: Callable[[], Any]) -> None:
        try:
            self._value, self._ok = call(), True
        except BaseException as error:  # handed to the caller by result()
            self._value = error
        self._finished.set()

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout_s: float) -> bool:
        """Wait at most ``timeout_s`` seconds for the call to end; whether it did."""
        return self._finished.wait(timeout_s)

    def raise_if_failed(self) -> None:
        if self.done and not self._ok:
            raise self._value

    def result(self, timeout_s: float) -> Any:
        """The call's return value; its exception is raised here."""
        if not self.wait(timeout_s):
            raise TimeoutError(f"the server's side of the weight transfer took over {timeout_s} s")
        self.raise_if_failed()
        return self._value
