"""The trainer both torchrun workers run: the demo's reward on 8 prompts, 3 steps at staleness
0, syncing through the server's in-memory gloo engine (tests/distributed/trainer_worker.py,
tests/distributed/push_death_worker.py)."""

from datasets import Dataset

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.shell.commands.demo import digit_fraction_reward


def tiny_run(model: str, base_url: str, output_dir: str, **overrides) -> AsyncGRPOTrainer:
    """The trainer; ``overrides`` replace :class:`AsyncGRPOConfig` fields."""
    prompts = [[{"role": "user", "content": f"Number {i}?"}] for i in range(8)]
    fields = dict(
        output_dir=output_dir,
        max_steps=3,
        max_staleness=0,
        learning_rate=1e-3,
        num_generations=4,
        max_completion_length=12,
        token_budget=128,
        gradient_checkpointing=False,
        num_sampler_logprobs=4,
        save_steps=3,
        vllm_server_base_url=base_url,
        weight_transfer_backend="asyncgrpo_gloo",
        disable_tqdm=True,
    )
    return AsyncGRPOTrainer(
        model=model,
        reward_funcs=digit_fraction_reward,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        args=AsyncGRPOConfig(**{**fields, **overrides}),
    )
