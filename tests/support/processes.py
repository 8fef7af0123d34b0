"""Which processes of a test's run are still running (for tests that signal a run and then
check that nothing of it is left)."""

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
