"""The spawned rollout process: pickling checks, messages, crashes, hangs, shutdown."""

from __future__ import annotations

import functools
import os
import signal
import time

import pytest
from transformers import AutoTokenizer

from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.rollout_loop import AsyncRolloutLoop, GroupOutcome
from asyncgrpo.shell.rollout_process import LoopSpec, RolloutProcess, RolloutWorkerError

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
        with pytest.raises(RolloutWorkerError, match="exited with code -9"):
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
