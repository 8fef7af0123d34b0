"""Children that die with their parent: Linux's parent-death signal (``PR_SET_PDEATHSIG``).

A process the trainer starts (the rollout process, a vLLM server) asks the kernel to send it a
signal when its parent exits, however the parent exits (``SIGKILL`` included), so no child
outlives a killed trainer. The kernel ties the signal to the parent *thread* that started the
child: start children from the main thread. On systems other than Linux nothing is set.

Run as a program, it sets the signal and then executes a command in its own place (the
parent-death signal survives ``exec``)::

    python -m asyncgrpo.adapters.parent_death SIGTERM <parent pid> -- python -m vllm...
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Sequence

PR_SET_PDEATHSIG = 1


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


def command_dying_with_caller(sig: signal.Signals, argv: Sequence[str]) -> list[str]:
    """``argv`` wrapped so that the process receives ``sig`` when the calling process exits.

    Example:
        >>> command_dying_with_caller(signal.SIGTERM, ["sleep", "9"])[3:4]
        ['SIGTERM']
    """
    return [sys.executable, "-m", "asyncgrpo.adapters.parent_death",
            signal.Signals(sig).name, str(os.getpid()), "--", *argv]  # fmt: skip


def main(argv: Sequence[str]) -> None:
    """``SIGNAL PARENT_PID -- COMMAND...``: set the parent-death signal, exec ``COMMAND``."""
    name, parent, separator, *command = argv
    if separator != "--" or not command:
        raise SystemExit("usage: python -m asyncgrpo.adapters.parent_death SIGNAL PID -- CMD...")
    die_with_parent(signal.Signals[name], int(parent))
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
