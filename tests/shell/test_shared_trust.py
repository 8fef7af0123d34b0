"""The trust record the trainer and the rollout process share survives a process that dies
holding its lock (a SIGKILLed rollout process): the other side takes the lock over."""

import multiprocessing as mp
import os
import signal

import pytest

from asyncgrpo.shell.servers import SharedTrust, outages


def die_holding_the_lock(trust: SharedTrust) -> None:
    trust._lock.acquire()
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow  # waits out the lock timeout: about 6 s
def test_a_process_killed_holding_the_lock_does_not_block_the_other(monkeypatch) -> None:
    monkeypatch.setattr(outages, "LOCK_TIMEOUT_S", 0.5)
    trust = SharedTrust()
    trust.outage("a test outage", "test")
    child = mp.get_context("spawn").Process(target=die_holding_the_lock, args=(trust,))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    assert trust.read().outages == 1  # taken over after the timeout instead of hanging
    trust.pushed(covering=1)
    assert trust.read().trusted == 1
