"""Targets for rollout processes forked by the fork server (tests/shell/test_fork_server.py):
importable, as every target the fork server runs must be."""

from __future__ import annotations

import os
import signal
import time

from asyncgrpo.adapters.parent_death import die_with_forking_parent
from asyncgrpo.shell.rollout.child import adopt_environment


def report(answers, environment: dict[str, str] | None) -> None:
    """Put what this child sees (after adopting ``environment``, when given) on ``answers``:
    the test's environment variable, whether the test's module imports, the working
    directory."""
    if environment is not None:
        adopt_environment(environment)
    try:
        import marked_module  # noqa: F401  (on a path the trainer added after the first child)

        imported = True
    except ImportError:
        imported = False
    answers.put(
        {
            "mark": os.environ.get("ASYNCGRPO_FORK_MARK"),
            "imported": imported,
            "cwd": os.getcwd(),
            "parent": os.getppid(),
        }
    )


def wait_for_the_trainer(answers, trainer_pid: int) -> None:
    """Die with the trainer, as a rollout process does; say so, then wait."""
    die_with_forking_parent(signal.SIGKILL, trainer_pid)
    answers.put({"pid": os.getpid(), "parent": os.getppid()})
    time.sleep(600)
