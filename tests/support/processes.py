"""Which processes of a test's run are still running, and killing them (for tests that signal
a run and then check that nothing of it is left)."""

from __future__ import annotations

import contextlib

import psutil


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of ``processes`` still running (a zombie has exited)."""
    left = []
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                left.append(process)
    return left


def kill_all(processes: list[psutil.Process]) -> None:
    """``SIGKILL`` to those of ``processes`` still running (cleanup after a test)."""
    for process in alive(processes):
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
