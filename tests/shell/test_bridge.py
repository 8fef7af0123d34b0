"""The trainer's one event loop for its server calls (asyncgrpo.shell.servers.bridge)."""

from __future__ import annotations

import ast
import asyncio
import multiprocessing as mp
import os
import signal
import threading
from pathlib import Path

import anyio
import pytest

from asyncgrpo.shell.run.interrupts import Interrupted, signals_interrupt
from asyncgrpo.shell.servers import bridge
from asyncgrpo.shell.servers.bridge import (
    THREAD_NAME,
    each_server_async,
    run_async,
    start_async,
    stop_event_loop,
)

ROOT = Path(__file__).resolve().parents[2]


async def where() -> tuple[int, str]:
    return id(asyncio.get_running_loop()), threading.current_thread().name


def test_calls_from_several_threads_share_one_loop_on_its_own_thread() -> None:
    seen = [run_async(where)]
    thread = threading.Thread(target=lambda: seen.append(run_async(where)))
    thread.start()
    thread.join()
    assert len(set(seen)) == 1
    assert seen[0][1] == THREAD_NAME


def test_each_server_runs_its_calls_at_once_and_keeps_each_failure() -> None:
    arrived = 0

    async def call(index: int) -> int:
        nonlocal arrived
        arrived += 1
        with anyio.fail_after(10):  # one after another, the first would wait for the others
            while arrived < 3:
                await anyio.sleep(0.01)
        if index == 1:
            raise ConnectionError("server 1 went away")
        return index * 10

    landing = each_server_async([2, 0, 1], call)
    assert list(landing) == [2, 0, 1]
    assert landing[0] == 0 and landing[2] == 20
    assert isinstance(landing[1], ConnectionError)


def test_an_error_reaches_the_caller_with_its_type() -> None:
    async def fail() -> None:
        raise KeyError("missing")

    with pytest.raises(KeyError, match="missing"):
        run_async(fail)


def test_a_call_from_the_loops_own_thread_is_refused() -> None:
    async def nested() -> None:
        run_async(where)

    with pytest.raises(RuntimeError, match="event loop's own thread"):
        run_async(nested)


def test_a_signal_that_interrupts_the_wait_cancels_the_call() -> None:
    started, cancelled = threading.Event(), threading.Event()

    async def hang() -> None:
        started.set()
        try:
            await anyio.sleep_forever()
        finally:
            cancelled.set()

    def kill_once_started() -> None:
        started.wait(30)
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=kill_once_started)
    with signals_interrupt():
        killer.start()
        with pytest.raises(Interrupted):
            run_async(hang)
    killer.join()
    assert cancelled.wait(10), "the interrupted call went on running on the loop"


def test_stopping_the_loop_cancels_what_runs_and_a_later_call_starts_a_new_one() -> None:
    cancelled = threading.Event()

    async def forever() -> None:
        try:
            await anyio.sleep_forever()
        finally:
            cancelled.set()

    run_async(where)
    assert bridge._loop is not None
    before = bridge._loop.thread
    start_async(forever)
    stop_event_loop()
    assert cancelled.is_set()
    assert not before.is_alive()
    assert run_async(where)[1] == THREAD_NAME
    assert bridge._loop is not None and bridge._loop.thread is not before


def _call_in_child(results: mp.Queue) -> None:
    results.put(run_async(where)[1])


def test_a_forked_child_gets_a_loop_of_its_own() -> None:
    run_async(where)  # the parent's loop thread runs
    results: mp.Queue = mp.get_context("fork").Queue()
    child = mp.get_context("fork").Process(target=_call_in_child, args=(results,))
    child.start()
    try:
        assert results.get(timeout=30) == THREAD_NAME
    finally:
        child.join(30)
    assert child.exitcode == 0
    assert bridge._loop is not None and bridge._loop.pid == os.getpid()


def _anyio_run_calls(path: Path) -> list[int]:
    tree = ast.parse(path.read_text())
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "run"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "anyio"
    ]


def test_the_package_starts_event_loops_only_in_the_bridge_and_the_rollout_process() -> None:
    """Sync code reaches async code through the bridge, not an event loop per call."""
    allowed = {ROOT / "shell" / "servers" / "bridge.py", ROOT / "shell" / "rollout" / "child.py"}
    found = {
        f"{path.relative_to(ROOT)}:{line}"
        for folder in ("core", "adapters", "shell", "asyncgrpo")
        for path in (ROOT / folder).rglob("*.py")
        if path not in allowed
        for line in _anyio_run_calls(path)
    }
    assert not found
    assert _anyio_run_calls(ROOT / "shell" / "servers" / "bridge.py")  # the probe sees them
