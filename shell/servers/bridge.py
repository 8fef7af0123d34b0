"""The trainer process's one event loop for its calls to the servers.

The trainer's code is synchronous (the step loop, the push thread, torch's collectives); its
calls to the servers are async (:class:`~asyncgrpo.adapters.vllm.client.VLLMClient`). Each one
goes through :func:`run_async`, or :func:`each_server_async` for one call per server at once,
onto a single event loop that runs on a thread of its own for the life of the process (an
anyio :class:`~anyio.from_thread.BlockingPortal`), instead of a new event loop per call::

    step loop ───── run_async(read) ───────────┐
    push thread ─── each_server_async(load) ───┤   asyncgrpo-server-calls thread: one loop
    server watch ── start_async(watch) ────────┘──► read(), load(0), load(1), watch(), ...

The caller's thread waits for its call; when a signal interrupts that wait
(:mod:`asyncgrpo.shell.run.interrupts`: Ctrl-C, SIGTERM) the call is cancelled on the loop and
the interruption goes on in the caller. A process forked from the trainer (a data loader's
worker) starts a loop of its own on its first call: the parent's thread is not in the child.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

import anyio
from anyio.from_thread import BlockingPortal

T = TypeVar("T")
THREAD_NAME = "asyncgrpo-server-calls"


class _LoopThread:
    """An event loop on a daemon thread, reached through its portal."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._ready = threading.Event()
        self._portal: BlockingPortal | None = None
        self._failure: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name=THREAD_NAME, daemon=True)
        self.thread.start()
        self._ready.wait()
        if self._failure is not None:
            raise RuntimeError("the event loop for server calls did not start") from self._failure

    @property
    def portal(self) -> BlockingPortal:
        assert self._portal is not None
        return self._portal

    def _main(self) -> None:
        async def serve() -> None:
            async with BlockingPortal() as portal:
                self._portal = portal
                self._ready.set()
                await portal.sleep_until_stopped()

        try:
            anyio.run(serve)
        except BaseException as error:
            self._failure = error
        finally:
            self._ready.set()

    def stop(self) -> None:
        """Cancel what still runs on the loop and end its thread."""
        if self.thread.is_alive() and threading.current_thread() is not self.thread:
            self.portal.call(self.portal.stop, True)
            self.thread.join()


_lock = threading.Lock()
_loop: _LoopThread | None = None


def _portal() -> BlockingPortal:
    global _loop
    with _lock:
        if _loop is None or _loop.pid != os.getpid() or not _loop.thread.is_alive():
            _loop = _LoopThread()
        return _loop.portal


def run_async(func: Callable[..., Awaitable[T]], *args: object) -> T:
    """``await func(*args)`` on the trainer's event loop; its result, or its exception.

    Example:
        >>> async def add(a, b):
        ...     return a + b
        >>> run_async(add, 2, 3)
        5
    """
    if threading.current_thread().name == THREAD_NAME:
        raise RuntimeError(
            "run_async called from the event loop's own thread: await the call instead"
        )
    portal = _portal()
    call = _CancellableCall()
    try:
        return portal.start_task_soon(call.run, func, *args).result()
    except BaseException:
        call.cancel(portal)  # a signal interrupted the wait: the call stops too
        raise


class _CancellableCall:
    """A call on the loop that its waiting thread can cancel at any point: before the loop
    has started it (a signal can arrive while the call is handed over), while it runs, or
    after it ended (then nothing happens)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._scope: anyio.CancelScope | None = None
        self._cancelled = False

    async def run(self, func: Callable[..., Awaitable[T]], *args: object) -> T:
        with anyio.CancelScope() as scope:
            with self._lock:
                self._scope = scope
                if self._cancelled:
                    scope.cancel()
            return await func(*args)
        raise RuntimeError("the call was cancelled by the thread that waited for it")

    def cancel(self, portal: BlockingPortal) -> None:
        with self._lock:
            self._cancelled = True
            scope = self._scope
        if scope is not None:
            with contextlib.suppress(RuntimeError):  # the loop has stopped: nothing runs
                portal.start_task_soon(scope.cancel)


def start_async(func: Callable[..., Awaitable[object]], *args: object) -> Future[object]:
    """Start ``func(*args)`` on the trainer's event loop and return at once; the future's
    ``cancel()`` stops it, ``result()`` waits for it."""
    return _portal().start_task_soon(func, *args)


def each_server_async(
    servers: Sequence[int], call: Callable[[int], Awaitable[T]]
) -> dict[int, T | Exception]:
    """``await call(i)`` for every server ``i`` at once on the trainer's event loop: each
    server's result, or the exception its call raised (one server's failure does not cancel
    the others'), in the order of ``servers``.

    Example:
        >>> async def double(i):
        ...     if i == 2:
        ...         raise ValueError("server 2 is down")
        ...     return 2 * i
        >>> each_server_async([0, 1, 2], double)
        {0: 0, 1: 2, 2: ValueError('server 2 is down')}
    """
    results: dict[int, T | Exception] = {}

    async def one(index: int) -> None:
        try:
            results[index] = await call(index)
        except Exception as error:  # that server's outcome; the others go on
            results[index] = error

    async def every() -> None:
        async with anyio.create_task_group() as group:
            for index in servers:
                group.start_soon(one, index)

    run_async(every)
    return {i: results[i] for i in servers}


def stop_event_loop() -> None:
    """End the trainer's event loop, cancelling what still runs on it (a later call starts a
    new one). The run calls this when it ends; a process that exits without it loses nothing:
    the loop's thread is a daemon."""
    global _loop
    with _lock:
        loop, _loop = _loop, None
    if loop is not None and loop.pid == os.getpid():
        loop.stop()
