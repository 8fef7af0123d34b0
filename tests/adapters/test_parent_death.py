"""A program run under the parent-death supervisor ends with the process that started it, even
one that ignores ``SIGTERM`` (as a vLLM server whose graceful shutdown hangs does in effect),
and its exit status passes through when it ends on its own.

The "trainer" here is a small Python process that starts the supervised program and then
waits; the program writes a file once its ``SIGTERM`` handling is in place, and the test acts
only after that file exists. Every wait is bounded; what is left is killed in ``finally``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from processes import alive, kill_all

from asyncgrpo.adapters.parent_death import command_dying_with_caller

WAIT_S = 60  # generous bounds for a loaded 2-core machine; the checks do not depend on them

STUBBORN = """
import pathlib, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # a grandchild
pathlib.Path(sys.argv[1]).write_text("ready")
time.sleep(600)
"""

TRAINER = """
import subprocess, sys, time
from asyncgrpo.adapters.parent_death import command_dying_with_caller
program = [sys.executable, "-c", sys.argv[1], sys.argv[2]]
supervisor = subprocess.Popen(command_dying_with_caller(program, grace_s=float(sys.argv[3])),
                              start_new_session=True)
print(supervisor.pid, flush=True)
time.sleep(600)
"""


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {WAIT_S} s"
        time.sleep(0.1)


def start_trainer(tmp_path: Path, grace_s: float):
    """The trainer, and the supervisor with the program and its grandchild once ready."""
    ready = tmp_path / "ready"
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, STUBBORN, str(ready), str(grace_s)],
        stdout=subprocess.PIPE,
        text=True,
    )
    supervisor = psutil.Process(int(trainer.stdout.readline()))
    wait_until(ready.exists, "the program did not start")
    wait_until(lambda: len(supervisor.children(recursive=True)) == 2, "no grandchild")
    return trainer, [supervisor, *supervisor.children(recursive=True)]


def test_sigkill_of_the_caller_ends_a_program_that_ignores_sigterm(tmp_path) -> None:
    trainer, group = start_trainer(tmp_path, grace_s=1.0)
    try:
        assert len({os.getpgid(p.pid) for p in group}) == 1  # one process group
        trainer.kill()
        trainer.wait(timeout=WAIT_S)
        wait_until(lambda: not alive(group), "the supervised processes outlived the caller")
    finally:
        trainer.kill()
        kill_all(group)


def test_sigterm_to_the_group_ends_a_program_that_ignores_it(tmp_path) -> None:
    """What :meth:`VLLMServer.stop` sends: the supervisor escalates after its grace."""
    trainer, group = start_trainer(tmp_path, grace_s=1.0)
    try:
        os.killpg(group[0].pid, signal.SIGTERM)
        wait_until(lambda: not alive(group), "SIGTERM to the group did not end it")
        assert trainer.poll() is None  # the caller is not in the group
    finally:
        trainer.kill()
        kill_all(group)


def test_the_programs_exit_status_passes_through() -> None:
    for script, status in (("raise SystemExit(3)", 3), ("import os; os.abort()", 134)):
        command = command_dying_with_caller([sys.executable, "-c", script], grace_s=1.0)
        result = subprocess.run(command, timeout=WAIT_S, stderr=subprocess.DEVNULL)
        assert result.returncode == status


def test_a_caller_already_gone_never_starts_the_program(tmp_path) -> None:
    """Started with a parent pid that is not its parent (the caller died first), the supervisor
    ends its group without running the program."""
    marker = tmp_path / "ran"
    command = command_dying_with_caller(["touch", str(marker)], grace_s=1.0)
    command[3] = str(os.getppid())  # not the supervisor's parent: this process is
    result = subprocess.run(command, timeout=WAIT_S, start_new_session=True)
    assert result.returncode == -signal.SIGKILL
    assert not marker.exists()
