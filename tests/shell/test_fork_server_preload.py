"""The fork server's preload list is process-wide: importing asyncgrpo leaves it as the program
set it, and the rollout process's context sets it when its first process starts."""

from __future__ import annotations

import multiprocessing.forkserver
import multiprocessing.process
import subprocess
import sys

import pytest

from asyncgrpo.shell.rollout import child

IMPORT_AND_COMPARE = """
import multiprocessing.forkserver as forkserver
forkserver.set_forkserver_preload(["json"])  # the program's own choice
import asyncgrpo
from asyncgrpo import AsyncGRPOTrainer, AsyncRolloutLoop
import asyncgrpo.shell.rollout.child
print(forkserver._forkserver._preload_modules)
"""


@pytest.mark.slow(reason="imports the trainer in a fresh Python: 5-20 s")
def test_importing_asyncgrpo_leaves_the_fork_server_preload_list_alone() -> None:
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_AND_COMPARE],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert done.stdout.strip().splitlines()[-1] == "['json']", done.stderr[-3000:]


def test_the_first_rollout_process_started_sets_the_preload_list_once(monkeypatch) -> None:
    preloads: list[list[str]] = []
    monkeypatch.setattr(multiprocessing.forkserver, "set_forkserver_preload", preloads.append)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", lambda self: None)
    child._preload_fork_server.cache_clear()
    try:
        assert preloads == []  # building the context set nothing
        child.CONTEXT.Process(target=print).start()
        child.CONTEXT.Process(target=print).start()
    finally:
        child._preload_fork_server.cache_clear()  # the next real start sets the real list
    assert preloads == [list(child.PRELOADED)]
