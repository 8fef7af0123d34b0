"""Run AsyncGRPOTrainer under torchrun: rank 0 owns the rollout process and sends every rank
its rows (see tests/distributed/test_trainer_ranks.py)."""

import sys

from datasets import Dataset

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.shell.demo import digit_fraction_reward


def main() -> None:
    model, base_url, output_dir = sys.argv[1:4]
    prompts = [[{"role": "user", "content": f"Number {i}?"}] for i in range(8)]
    trainer = AsyncGRPOTrainer(
        model=model,
        reward_funcs=digit_fraction_reward,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        args=AsyncGRPOConfig(
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
        ),
    )
    trainer.train()


if __name__ == "__main__":
    main()
