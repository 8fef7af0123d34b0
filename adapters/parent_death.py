"""Children that die with their parent, however the parent exits (``SIGKILL`` included).

Two ways, one per kind of child:

- :func:`die_with_parent`, called inside a child the trainer spawned: Linux's parent-death
  signal (``PR_SET_PDEATHSIG``). The kernel ties it to the parent *thread* that started the
  child, so start such children from the main thread; on systems other than Linux nothing is
  set. :func:`die_with_forking_parent` does the same for a child a fork server started (the
  rollout process): the fork server ends with the trainer, and the child with it.
- :func:`command_dying_with_caller`, for a program the trainer runs (a vLLM server): a small
  supervisor starts the program, watches its parent (every 0.2 s, so any thread may start
  it), and when the parent is gone (or it is sent ``SIGTERM``) stops the program: ``SIGTERM``,
  then ``SIGKILL`` to the whole process group after a grace period. A parent-death
  ``SIGTERM`` alone is not enough for a server: its graceful shutdown can hang, with nobody
  left to escalate::

      python -m asyncgrpo.adapters.parent_death <parent pid> <grace s> -- python -m vllm...

  The supervisor leads a process group of its own (or its own session, when the caller
  starts it with ``start_new_session=True``); the program and its children share that group,
  so signalling the group reaches them all.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import NoReturn

PR_SET_PDEATHSIG = 1
PARENT_POLL_S = 0.2


def die_with_parent(sig: signal.Signals, parent_pid: int) -> bool:
    """Ask for ``sig`` when the parent exits; if the parent ``parent_pid`` is already gone
    (it died before the request was made), send ``sig`` now. ``False`` where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
    return True


def die_with_forking_parent(sig: signal.Signals, trainer_pid: int) -> bool:
    """:func:`die_with_parent` for a child that a fork server forked on the trainer's behalf
    (``multiprocessing``'s ``forkserver``): the signal comes when the fork server exits, which
    it does once no process holds its "alive" pipe. ``multiprocessing`` hands every child a
    copy (so that it could start children there too); this child closes its copy, so the
    trainer ``trainer_pid`` is the last holder and the server ends with it. A trainer already
    gone sends ``sig`` now. ``False`` where unsupported."""
    from multiprocessing import forkserver

    server = forkserver._forkserver  # the pipe's end has no public handle
    if (alive := getattr(server, "_forkserver_alive_fd", None)) is not None:
        os.close(alive)
        # a private attribute, which typeshed does not declare
        server._forkserver_alive_fd = None  # type: ignore[attr-defined]
    if not die_with_parent(sig, os.getppid()):
        return False
    try:
        os.kill(trainer_pid, 0)
    except ProcessLookupError:
        os.kill(os.getpid(), sig)
    return True


def command_dying_with_caller(argv: Sequence[str], grace_s: float = 10.0) -> list[str]:
    """``argv`` run under a supervisor that stops it when the calling process exits:
    ``SIGTERM``, then ``SIGKILL`` to its process group after ``grace_s`` seconds.

    Example:
        >>> command_dying_with_caller(["sleep", "9"], grace_s=5)[4:]
        ['5', '--', 'sleep', '9']
    """
    return [
        sys.executable,
        "-m",
        "asyncgrpo.adapters.parent_death",
        str(os.getpid()),
        str(grace_s),
        "--",
        *argv,
    ]


def supervise(command: Sequence[str], parent_pid: int, grace_s: float) -> int:
    """Run ``command`` until it exits, and return its exit status (128 + N for signal N).

    If the parent ``parent_pid`` is gone first, or this process is sent ``SIGTERM`` or
    ``SIGINT``, :func:`end_group` instead: this process does not return."""
    if os.getpgrp() != os.getpid():  # lead a group of its own, so ending it spares the caller
        os.setpgid(0, 0)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if os.getppid() != parent_pid:  # the parent died before this process could watch it
        end_group(None, grace_s)
    child = subprocess.Popen(command)
    while child.poll() is None and not stop.is_set() and os.getppid() == parent_pid:
        stop.wait(PARENT_POLL_S)
    if child.returncode is None:
        end_group(child, grace_s)
    return child.returncode if child.returncode >= 0 else 128 - child.returncode


def end_group(child: subprocess.Popen | None, grace_s: float) -> NoReturn:
    """``SIGTERM`` to ``child``; once it has exited, or after ``grace_s``, ``SIGKILL`` to this
    process group: whatever the program left running, and this process."""
    if child is not None:
        child.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=grace_s)
    os.killpg(os.getpgrp(), signal.SIGKILL)
    raise SystemExit(128 + signal.SIGKILL)  # not reached: the SIGKILL ends this process too


def main(argv: Sequence[str]) -> None:
    """``PARENT_PID GRACE_S -- COMMAND...``: run ``COMMAND`` under :func:`supervise`."""
    parent, grace, separator, *command = argv
    if separator != "--" or not command:
        raise SystemExit("usage: python -m asyncgrpo.adapters.parent_death PID GRACE_S -- CMD...")
    sys.exit(supervise(command, int(parent), float(grace)))


if __name__ == "__main__":
    main(sys.argv[1:])
