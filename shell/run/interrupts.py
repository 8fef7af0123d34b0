"""Stopping a run by a signal: SIGTERM and SIGINT end it cleanly, children included.

Python's default SIGTERM ends the process at once, without ``finally`` blocks, so the rollout
process and a server the run started would be left behind. Inside :func:`signals_interrupt`,
SIGTERM (and SIGINT) raise :class:`Interrupted` instead, as Ctrl-C raises
``KeyboardInterrupt``: the ``finally`` blocks stop the children, then the trainer re-raises it as
:class:`TrainingInterrupted`, whose one-line message says where the run stopped and where its
last checkpoint is. Children die with the trainer even when it is killed outright
(:mod:`asyncgrpo.adapters.parent_death`).

Some work must not be cut in the middle: a checkpoint being written (torch's distributed
checkpoint wraps an exception raised inside it into its own error) or a weight transfer the
server is taking part in. Inside :func:`interrupts_deferred` the first signal is held and raised
when the block ends; a second one is raised at once (pressing Ctrl-C twice stops at once).

A run that is already stopping on an error keeps that error: inside
:func:`failures_outrank_signals`, once the error is named, a first signal lets the teardown
finish and is noted on the error instead of replacing it. torchrun, for one, sends SIGTERM to
every rank as soon as one rank exits, though the others are stopping on the same error.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """The run was asked to stop by signal ``signum``."""

    def __init__(self, signum: int, message: str | None = None) -> None:
        self.signum = int(signum)
        self.message = message or f"interrupted by {signal_name(self.signum)}"
        super().__init__(self.message)

    def __reduce__(self) -> tuple[type, tuple[int, str]]:
        """Picklable (torch.distributed gathers a rank's exception as a pickle).

        Example:
            >>> import pickle
            >>> pickle.loads(pickle.dumps(Interrupted(15))).signum
            15
        """
        return type(self), (self.signum, self.message)


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


class _Deferral:
    """How many :func:`interrupts_deferred` blocks are open, and the signal held for them."""

    depth = 0
    held: int | None = None
    failing: BaseException | None = None  # the error the run is stopping on
    noted = False  # a signal was noted on ``failing``


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    if _Deferral.failing is not None and not _Deferral.noted:
        _Deferral.noted = True
        _Deferral.failing.add_note(
            f"{signal_name(signum)} arrived while the run was stopping on this error; "
            "its teardown went on to the end"
        )
        return
    if _Deferral.depth and _Deferral.held is None:
        _Deferral.held = signum
        return
    raise Interrupted(signum)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold the first SIGTERM/SIGINT that arrives inside until the block ends, then raise it.

    Only signals handled by :func:`signals_interrupt` are held; a second signal is raised at
    once. Blocks nest: the held signal is raised when the outermost one ends. Signal handlers
    run in the main thread, so use it there."""
    _Deferral.depth += 1
    try:
        yield
    finally:
        _Deferral.depth -= 1
        held = _Deferral.held if _Deferral.depth == 0 else None
        if _Deferral.depth == 0:
            _Deferral.held = None
    if held is not None:
        raise Interrupted(held)


@contextlib.contextmanager
def failures_outrank_signals() -> Iterator[Callable[[BaseException], None]]:
    """Yields ``failing``: once ``failing(error)`` is called (the run is stopping on ``error``),
    the first SIGTERM/SIGINT until the block ends no longer raises; it is added to ``error`` as
    a note and the teardown (``finally`` blocks, context exits) goes on, so the run ends with
    the error it failed on. A second signal is raised at once.

    Example (the exits of the contexts entered after this one are the teardown)::

        with signals_interrupt(), failures_outrank_signals() as failing, Resource():
            try:
                work()
            except Exception as error:
                failing(error)
                raise
    """

    def failing(error: BaseException) -> None:
        if _Deferral.failing is error:  # told again (the teardown goes on): keep what was noted
            return
        _Deferral.failing, _Deferral.noted = error, False

    try:
        yield failing
    finally:
        _Deferral.failing, _Deferral.noted = None, False


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
