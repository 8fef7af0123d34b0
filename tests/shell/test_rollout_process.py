"""The spawned rollout process: pickling checks, messages, crashes, hangs, shutdown."""

from __future__ import annotations

import functools
import os
import re
import signal
import threading
import time

import pytest
from structlog.testing import capture_logs
from transformers import AutoTokenizer

from asyncgrpo.core.rollout import cursor
from asyncgrpo.core.rollout.cursor import PromptCursor
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.rollout import (
    AsyncRolloutLoop,
    GroupOutcome,
    LoopSpec,
    RolloutProcess,
    RolloutWorkerError,
)
from scripts import run_script

PROMPTS = [{"prompt": [{"role": "user", "content": f"Count to {i}."}]} for i in range(4)]


def length_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def scaled_reward(completion_ids, scale, **kwargs):
    return [scale * len(ids) for ids in completion_ids]


class CrashingLoop(AsyncRolloutLoop):
    def filter_prompt(self, row_index, row, epoch):
        raise OSError("disk on fire")


class HangingLoop(AsyncRolloutLoop):
    def filter_prompt(self, row_index, row, epoch):
        time.sleep(3600)  # blocks the event loop: no heartbeat
        return True


def spec_for(server, path, loop_cls=AsyncRolloutLoop, reward_funcs=(length_reward,), **kw):
    config = AsyncGRPOConfig(
        num_generations=2,
        max_completion_length=8,
        max_staleness=1,
        num_sampler_logprobs=2,
        max_concurrent_rollouts=8,
        vllm_server_base_url=server.base_url,
    )
    return LoopSpec(
        loop_cls=loop_cls,
        config=config,
        model_name=server.spec.name,
        dataset=PROMPTS,
        reward_funcs=tuple(reward_funcs),
        processing_class=AutoTokenizer.from_pretrained(path),
        max_model_len=1024,
        token_budget=1024,
        rows_per_step=1,
        **kw,
    )


def test_lambdas_and_closures_are_named_at_start(vllm_server, tiny_qwen3) -> None:
    with pytest.raises(TypeError, match="reward function '<lambda>'"):
        RolloutProcess(spec_for(vllm_server, tiny_qwen3, reward_funcs=[lambda **kw: [0.0]]))

    def local_tool(a: int) -> int:
        return a

    with pytest.raises(TypeError, match="tool 'local_tool'.*lambdas and closures"):
        RolloutProcess(spec_for(vllm_server, tiny_qwen3, tools=(local_tool,)))
    with pytest.raises(TypeError, match="environment factory .*key 'game'"):
        RolloutProcess(
            spec_for(vllm_server, tiny_qwen3, environment_factory={"game": lambda: object()})
        )
    RolloutProcess(
        spec_for(
            vllm_server, tiny_qwen3, reward_funcs=[functools.partial(scaled_reward, scale=2.0)]
        )
    )


def test_process_streams_outcomes_and_stops_cleanly(vllm_server, tiny_qwen3) -> None:
    process = RolloutProcess(spec_for(vllm_server, tiny_qwen3), timeout_s=120).start()
    outcomes = []
    try:
        deadline = time.monotonic() + 180
        while len(outcomes) < 3 and time.monotonic() < deadline:
            message = process.get(wait_s=1.0)
            if isinstance(message, GroupOutcome):
                outcomes.append(message)
                process.samples_taken(message.forwarded_tokens)
                process.step_consumed(max(message.forwarded_tokens, 1))
    finally:
        pid = process.pid
        started = time.monotonic()
        process.stop()
        assert time.monotonic() - started < 30
    assert len(outcomes) >= 3
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_crash_comes_back_with_the_childs_traceback(vllm_server, tiny_qwen3) -> None:
    process = RolloutProcess(spec_for(vllm_server, tiny_qwen3, loop_cls=CrashingLoop)).start()
    try:
        with pytest.raises(RolloutWorkerError, match=r"(?s)OSError: disk on fire.*filter_prompt"):
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                process.get(wait_s=0.5)
    finally:
        process.stop()


def test_a_killed_process_is_reported(vllm_server, tiny_qwen3) -> None:
    process = RolloutProcess(spec_for(vllm_server, tiny_qwen3)).start()
    try:
        os.kill(process.pid, signal.SIGKILL)
        with pytest.raises(
            RolloutWorkerError,
            match=r"exited with code -9 \(killed by SIGKILL\)"
            r".*asyncgrpo train --resume",
        ):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                process.get(wait_s=0.5)
    finally:
        process.stop()


def next_outcome(process: RolloutProcess, *, timeout_s: float = 180) -> GroupOutcome:
    """The next group outcome (loop reports passed over), within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        message = process.get(wait_s=0.5)
        if isinstance(message, GroupOutcome):
            return message
    raise AssertionError(f"no group outcome in {timeout_s} s: {process.activity()}")


def test_a_killed_process_is_restarted_from_the_trainers_cursor_up_to_the_limit(
    vllm_server, tiny_qwen3
) -> None:
    """SIGKILL once: a new child starts from the cursor the trainer holds (positions whose
    outcome arrived are not generated again), and the restart is counted; SIGKILL again with
    no restart left: the run fails naming the signal and --resume."""
    held = PromptCursor()
    started: list[int] = []
    process = RolloutProcess(
        spec_for(vllm_server, tiny_qwen3),
        timeout_s=120,
        restarts=1,
        resume_cursor=lambda: held,
        on_start=started.append,
    ).start()
    try:
        first = next_outcome(process)
        held = cursor.group_outcome(held, first.position, len(first.samples))
        process.samples_taken(first.forwarded_tokens)
        old_pid = process.pid
        os.kill(old_pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        report = None
        while report is None:
            assert time.monotonic() < deadline, "the death was not noticed"
            message = process.get(wait_s=0.5)
            if isinstance(message, GroupOutcome):  # sent before it died: the trainer takes it
                held = cursor.group_outcome(held, message.position, len(message.samples))
            elif message is not None and any(
                o.name == "rollout/process_restart_count" for o in message.observations
            ):
                report = message
        assert started == [old_pid, process.pid] and process.pid != old_pid
        assert {o.name: o.amount for o in report.observations}["rollout/process_restart_count"] == 1
        seen = {first.position}
        for _ in range(3):  # the new child skips what the trainer holds
            outcome = next_outcome(process)
            assert outcome.position not in seen and not held.is_consumed(outcome.position)
            assert outcome.position not in held.pending
            seen.add(outcome.position)
        os.kill(process.pid, signal.SIGKILL)
        with pytest.raises(
            RolloutWorkerError,
            match=r"exited with code -9 \(killed by SIGKILL\)"
            r".* after 1 restart\(s\) \(rollout_worker_restarts=1\).*--resume",
        ):
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                process.get(wait_s=0.5)
    finally:
        process.stop()


def test_a_hung_process_raises_within_the_worker_timeout(vllm_server, tiny_qwen3) -> None:
    process = RolloutProcess(
        spec_for(vllm_server, tiny_qwen3, loop_cls=HangingLoop), timeout_s=5
    ).start()
    started = time.monotonic()
    try:
        with pytest.raises(RolloutWorkerError, match="no heartbeat"):
            while time.monotonic() - started < 120:
                process.get(wait_s=0.5)
        assert time.monotonic() - started < 60
    finally:
        process.stop(grace_s=2)


def blocking_reward(completion_ids, **kwargs):
    threading.Event().wait(3600)  # never returns: only its worker thread blocks
    return [0.0] * len(completion_ids)


def test_a_blocked_reward_function_is_named_when_no_sample_comes(vllm_server, tiny_qwen3) -> None:
    """The worker timeout is armed only once the reward function is seen blocked, so a server
    slow to generate the first group (a loaded machine) cannot trip it first."""
    process = RolloutProcess(
        spec_for(vllm_server, tiny_qwen3, reward_funcs=(blocking_reward,)), timeout_s=3600
    ).start()
    try:
        deadline = time.monotonic() + 180
        while "blocking_reward" not in process.activity():
            assert time.monotonic() < deadline, f"reward never called: {process.activity()}"
            process.get(wait_s=0.5)
        process.timeout_s = 5.0
        process.restart_wait_clock()
        deadline = time.monotonic() + 120
        with capture_logs() as logs, pytest.raises(RolloutWorkerError) as raised:
            while time.monotonic() < deadline:
                process.get(wait_s=0.5)
        message = str(raised.value)
        assert "no sample reached the trainer" in message, message
        assert "nothing at all for" in message, message
        assert re.search(
            r"reward function 'blocking_reward' for \d+ s on group \d+ \(row \d\)", message
        ), message
        waits = [e for e in logs if e["event"] == "waiting for samples"]
        assert waits and "blocking_reward" in waits[0]["rollout"]
        stopping = time.monotonic()
        process.stop()  # the default grace: a hung child is not waited for
        assert time.monotonic() - stopping < 15, "stopping the hung child waited for it"
    finally:
        process.stop(grace_s=2)


def constant_reward(completion_ids, **kwargs):
    return [1.0] * len(completion_ids)  # no spread: every group is dropped


def test_groups_that_are_all_dropped_are_not_a_hang_and_are_counted(
    vllm_server, tiny_qwen3
) -> None:
    """Every group has zero reward spread, so no sample ever reaches the trainer: past the
    worker timeout the wait is logged with the counts ("producing groups, but every one is
    dropped"), never raised as a hang. The timeout is armed once the first dropped group has
    arrived, so a server slow to generate it cannot trip it."""
    process = RolloutProcess(
        spec_for(vllm_server, tiny_qwen3, reward_funcs=(constant_reward,)), timeout_s=3600
    ).start()
    try:
        first = next_outcome(process)
        assert first.samples == () and first.dropped == "zero_reward_spread"
        # 10 s, not less: on 2 busy cores (a CI machine) the server, the child and this process
        # can all stall for 5 s, which is a hang by this rule; the wait runs past it once.
        process.timeout_s = 10.0
        process.restart_wait_clock()
        deadline = time.monotonic() + 180
        with capture_logs() as logs:
            told: list = []
            while not any(e["waited_s"] > process.timeout_s for e in told):
                assert time.monotonic() < deadline, f"not told in time: {logs}"
                message = process.get(wait_s=0.5)
                assert not (isinstance(message, GroupOutcome) and message.samples)
                told = [
                    e
                    for e in logs
                    if e["event"].startswith(
                        "waiting for samples: the rollout process is producing groups"
                    )
                ]
        assert re.search(
            r"\d+ groups? arrived, none with a sample to train: \d+ dropped for "
            r"zero reward spread",
            told[-1]["dropped"],
        ), told[-1]
        assert re.search(
            r"\d+ groups published \(\d+ dropped for zero reward spread\)", process.activity()
        ), process.activity()
    finally:
        process.stop(grace_s=5)


SCRIPT = """
import sys, time
from transformers import AutoTokenizer
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.rollout import AsyncRolloutLoop
from asyncgrpo.shell.rollout import LoopSpec, RolloutProcess, RolloutWorkerError

if __name__ == "__main__":
    def reward_in_main(completion_ids, **kwargs):
        return [0.0] * len(completion_ids)

    spec = LoopSpec(
        loop_cls=AsyncRolloutLoop, config=AsyncGRPOConfig(num_generations=2),
        model_name="m", dataset=[{"prompt": [{"role": "user", "content": "hi"}]}],
        reward_funcs=(reward_in_main,), processing_class=AutoTokenizer.from_pretrained(sys.argv[1]),
        max_model_len=1024, token_budget=1024, rows_per_step=1,
    )
    process = RolloutProcess(spec, timeout_s=60).start()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            process.get(wait_s=0.5)
    except RolloutWorkerError as error:
        print(error)
    finally:
        process.stop(grace_s=5)
"""


@pytest.mark.slow  # a spawned rollout process: about 10 s
def test_a_reward_function_defined_under_the_main_guard_is_named_with_the_fix(
    tiny_qwen3, tmp_path
) -> None:
    done = run_script(SCRIPT, tmp_path, "train_script.py", str(tiny_qwen3), timeout_s=300)
    assert "could not load what the trainer sent it" in done.stdout, done.stdout + done.stderr
    assert "reward_in_main" in done.stdout and "Define them at module level" in done.stdout
