"""A training script without its ``if __name__ == "__main__":`` guard fails fast, naming the
guard and the script, instead of building the trainer again in the rollout process (which
imports the main script) and, under torchrun, blocking on a rendezvous.

The script builds the trainer at its top level and then starts the rollout process as
``train()`` does once the vLLM server answers (no server here: the child fails while importing
the script, before it would contact one)."""

from __future__ import annotations

import pytest

from asyncgrpo.shell.run.trainer import refuse_top_level_run
from scripts import run_script

UNGUARDED_SCRIPT = """
import sys, time
from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.shell.rollout import AsyncRolloutLoop, LoopSpec, RolloutProcess

def zero_reward(completion_ids, **kwargs):
    return [0.0] * len(completion_ids)

rows = [{"prompt": [{"role": "user", "content": "hi"}]}]
config = AsyncGRPOConfig(output_dir="out", num_generations=2, max_steps=1,
                         vllm_server_base_url="http://127.0.0.1:9")
trainer = AsyncGRPOTrainer(model=sys.argv[1], reward_funcs=zero_reward, train_dataset=rows,
                           args=config)
spec = LoopSpec(
    loop_cls=AsyncRolloutLoop, config=config, model_name=sys.argv[1], dataset=rows,
    reward_funcs=(zero_reward,), processing_class=trainer.processing_class,
    max_model_len=1024, token_budget=1024, rows_per_step=1,
)
process = RolloutProcess(spec, timeout_s=60, restarts=3, resume_cursor=lambda: None).start()
try:
    deadline = time.monotonic() + 100
    while time.monotonic() < deadline:
        process.get(wait_s=0.5)
    print("the rollout process neither failed nor produced anything")
finally:
    process.stop(grace_s=5)
"""


@pytest.mark.slow  # two Python processes loading transformers and a tiny model: about 20 s
def test_a_script_that_builds_the_trainer_at_top_level_fails_naming_the_guard(
    tiny_qwen3, tmp_path
) -> None:
    script = tmp_path / "train_unguarded.py"
    done = run_script(UNGUARDED_SCRIPT, tmp_path, script.name, str(tiny_qwen3), timeout_s=120)
    told = done.stdout + done.stderr
    assert done.returncode != 0, told
    # the rollout process: the trainer's constructor refuses to run there
    assert f"{script} builds AsyncGRPOTrainer(...) at its top level" in done.stderr, told
    # the trainer: a start failure, not restarted as a killed process would be
    assert "RolloutWorkerError: the rollout process exited with code 1 before" in told, told
    assert f"main script {script}" in told and 'if __name__ == "__main__":' in told, told
    assert "restarting it" not in told, told


def test_a_trainer_built_outside_a_reimported_script_is_not_refused() -> None:
    refuse_top_level_run("builds AsyncGRPOTrainer(...)")  # the test module is no __mp_main__


def test_a_reimported_scripts_top_level_is_refused_however_deep_the_call() -> None:
    top_level = compile(
        "def build():\n    refuse('builds AsyncGRPOTrainer(...)')\nbuild()\n",
        "/scripts/train.py",
        "exec",
    )
    with pytest.raises(RuntimeError, match=r'/scripts/train.py builds .* `if __name__ == "__m'):
        exec(top_level, {"__name__": "__mp_main__", "refuse": refuse_top_level_run})
    exec(top_level, {"__name__": "__main__", "refuse": refuse_top_level_run})
