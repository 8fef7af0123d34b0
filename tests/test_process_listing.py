"""The tests that walk a run's processes read command lines from children that may exit, or be
zombies not yet reaped, while they look (``tests/support/processes.py``)."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest
from processes import alive_after, command_lines, described


def test_a_zombie_child_is_left_out_of_the_command_lines_not_raised() -> None:
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        zombie = psutil.Process(exited.pid)
        # exited and not reaped (no wait() yet): a zombie, as the rollout process is between
        # its kill and the trainer's reaping of it
        assert alive_after([zombie], 30) == []
        assert zombie.status() == psutil.STATUS_ZOMBIE
        with pytest.raises(psutil.ZombieProcess):
            zombie.cmdline()  # what the tests did before: the race of the fresh-clone suite
        lines = command_lines([psutil.Process(running.pid), zombie])
        assert [(p.pid, line[-1]) for p, line in lines] == [
            (running.pid, "import time; time.sleep(60)")
        ]
        assert described(zombie) == str(exited.pid)
    finally:
        running.kill()
        running.wait()
        exited.wait()
