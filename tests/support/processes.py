"""Which processes of a test's run are still running, and killing them (for tests that signal
a run and then check that nothing of it is left)."""

from __future__ import annotations

import contextlib
import time

import psutil


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    """Those of ``processes`` still running (a zombie has exited)."""
    left = []
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                left.append(process)
    return left


def command_lines(processes: list[psutil.Process]) -> list[tuple[psutil.Process, list[str]]]:
    """``(process, command line)`` of those of ``processes`` still running. A process can exit,
    or be a zombie not yet reaped, between the listing of a parent's children and the read of
    its command line (``psutil.ZombieProcess``); such a process is left out, never raised."""
    lines = []
    for process in alive(processes):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            lines.append((process, process.cmdline()))
    return lines


def alive_after(processes: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Those of ``processes`` still running once they all exited or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while (left := alive(processes)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def described(process: psutil.Process) -> str:
    """``"pid command"`` of ``process`` (its pid alone once it has gone)."""
    with contextlib.suppress(psutil.Error):
        return f"{process.pid} {' '.join(process.cmdline())[:120]}"
    return str(process.pid)


def kill_all(processes: list[psutil.Process]) -> None:
    """``SIGKILL`` to those of ``processes`` still running (cleanup after a test)."""
    for process in alive(processes):
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
