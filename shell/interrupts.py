"""Stopping a run by a signal: SIGTERM and SIGINT end it cleanly, children included.

Python's default SIGTERM ends the process at once, without ``finally`` blocks, so the rollout
process and a server the run started would be left behind. Inside :func:`signals_interrupt`,
SIGTERM (and SIGINT) raise :class:`Interrupted` instead, as Ctrl-C raises
``KeyboardInterrupt``: the ``finally`` blocks stop the children, then the trainer re-raises it as
:class:`TrainingInterrupted`, whose one-line message says where the run stopped and where its
last checkpoint is. Children die with the trainer even when it is killed outright
(:mod:`asyncgrpo.adapters.parent_death`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """The run was asked to stop by signal ``signum``."""

    def __init__(self, signum: int, message: str | None = None) -> None:
        self.signum = int(signum)
        super().__init__(message or f"interrupted by {signal_name(self.signum)}")


class TrainingInterrupted(Interrupted):
    """Training stopped on a signal; the message says at which step and the last checkpoint."""


def signal_name(signum: int) -> str:
    """``2`` -> ``'SIGINT'``.

    Example:
        >>> signal_name(15)
        'SIGTERM'
    """
    return signal.Signals(signum).name


def signum_of(error: KeyboardInterrupt) -> int:
    """The signal behind ``error`` (a bare ``KeyboardInterrupt`` is Ctrl-C: SIGINT)."""
    return error.signum if isinstance(error, Interrupted) else int(signal.SIGINT)


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def signals_interrupt() -> Iterator[None]:
    """While inside, SIGTERM and SIGINT raise :class:`Interrupted` in the main thread.

    Handlers someone else installed are kept (only the defaults are replaced), and the previous
    handlers come back on exit. Outside the main thread (where Python cannot set handlers) this
    does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {}
    for sig in SIGNALS:
        if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
            previous[sig] = signal.signal(sig, _raise_interrupted)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
