"""The examples of TRL's AsyncGRPOTrainer documentation run here as scripts, unchanged except
for the import lines (``asyncgrpo`` for ``trl``), the model and dataset (tiny and local) and
the server (the CPU server of the fixture, through ``args``).

Each example is kept below as the documentation prints it (``DOC_*``); :func:`adapt` applies the
listed replacements, each of which must match exactly once, so any other drift from the
documentation shows as a failing replacement. Where the documentation prints a fragment (a
``trainer = AsyncGRPOTrainer(..., ...)`` without a script around it, or helper functions it
leaves undefined), the lines the test adds are marked ``# test:``. A script runs as
``__main__`` (``runpy``), so its rollout worker re-imports it as TRL's does, for two optimizer
steps against :func:`replying_served` (the session's server under a second name), whose tiny
model answers with a few fixed replies so that rewards differ within groups
(tests/support/replying_model.py).
"""

from __future__ import annotations

import json
import runpy
import textwrap
from pathlib import Path

import pytest

from asyncgrpo.shell.run import read_metrics

DOC_QUICK_START = """\
# train_async_grpo.py
from datasets import load_dataset
from trl import AsyncGRPOTrainer
from trl.rewards import accuracy_reward

if __name__ == "__main__":  # the rollout worker is a spawned process that re-imports this script
    dataset = load_dataset("trl-lib/DeepMath-103K", split="train")

    trainer = AsyncGRPOTrainer(
        model="Qwen/Qwen3.5-2B",
        reward_funcs=accuracy_reward,
        train_dataset=dataset,
    )
    trainer.train()
"""

DOC_MULTI_TASK = """\
from datasets import Dataset
from trl import AsyncGRPOTrainer

# Define a dataset that contains both math and coding problems
dataset = Dataset.from_list(
    [
        {"prompt": [{"role": "user", "content": "What is 2+2?"}], "task": "math"},
        {"prompt": [{"role": "user", "content": "Write a function that returns the sum of two numbers."}], "task": "code"},
        {"prompt": [{"role": "user", "content": "What is 3*4?"}], "task": "math"},
        {"prompt": [{"role": "user", "content": "Write a function that returns the product of two numbers."}], "task": "code"},
    ]
)

# Math-specific reward function
def math_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "math":
            # Calculate math-specific reward
            correct = check_math_solution(prompt, completion)
            reward = 1.0 if correct else -1.0
            rewards.append(reward)
        else:
            # Return None for non-math tasks
            rewards.append(None)
    return rewards

# Coding-specific reward function
def coding_reward_func(prompts, completions, task, **kwargs):
    rewards = []
    for prompt, completion, t in zip(prompts, completions, task):
        if t == "code":
            # Calculate coding-specific reward
            works = test_code_solution(prompt, completion)
            reward = 1.0 if works else -1.0
            rewards.append(reward)
        else:
            # Return None for non-coding tasks
            rewards.append(None)
    return rewards

# Use both task-specific reward functions
if __name__ == "__main__":
    trainer = AsyncGRPOTrainer(
        model="Qwen/Qwen2.5-0.5B-Instruct",
        reward_funcs=[math_reward_func, coding_reward_func],
        train_dataset=dataset,
    )

    trainer.train()
"""  # noqa: E501 (printed as the documentation prints it)

DOC_LONGER_COMPLETIONS = '''\
def reward_func(completion_ids, **kwargs):
    """Reward function that assigns higher scores to longer completions (in terms of token count)."""
    return [float(len(ids)) for ids in completion_ids]
'''  # noqa: E501

DOC_ASYNC_REWARD = """\
import asyncio

async def async_reward_func(prompts, completions, **kwargs):
    # Simulate an I/O-bound call (e.g., HTTP request, database lookup)
    await asyncio.sleep(0.01)
    # Simple toy reward: 1.0 if the completion is non-empty, else 0.0
    return [1.0 if completion else 0.0 for completion in completions]
"""

DOC_PASSING_REWARDS = """\
from trl import AsyncGRPOTrainer

trainer = AsyncGRPOTrainer(
    reward_funcs=[reward_func, async_reward_func1, async_reward_func2],
    ...,
)
"""

DOC_CURRICULUM = """\
from dataclasses import dataclass

import numpy as np

from trl import AsyncGRPOConfig, AsyncGRPOTrainer
from trl.trainer.async_grpo_trainer import AsyncRolloutLoop


@dataclass
class CurriculumConfig(AsyncGRPOConfig):
    pass_rate_cap: float = 0.9


class CurriculumRolloutLoop(AsyncRolloutLoop):
    def filter_prompt(self, row_index, row, epoch):
        return self.pass_rates.get(row_index, 0.0) < self.config.pass_rate_cap

    async def setup(self):
        self.pass_rates = {}

    def compute_advantages(self, group):
        scored = group.rewards[~np.isnan(group.rewards)]
        if len(scored):
            self.pass_rates[group.row_index] = float(np.mean(scored > 0))
        return super().compute_advantages(group)


class CurriculumTrainer(AsyncGRPOTrainer):
    loop_cls = CurriculumRolloutLoop
"""

DOC_TOOLS = '''\
from trl import AsyncGRPOTrainer

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

async def async_add(a: int, b: int) -> int:
    """
    Asynchronously adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of the two integers.
    """
    return a + b

trainer = AsyncGRPOTrainer(
    tools=[multiply, async_add],
    ...,
)
'''

DOC_ENVIRONMENT = '''\
import random

from trl import AsyncGRPOConfig, AsyncGRPOTrainer

class IncrementEnv:
    # Reserved methods
    def reset(self, **kwargs) -> str | None:  # required; called at the start of each rollout
        self.counter = 0
        self.target = random.randint(1, 6)  # self-sample the task
        return f"Increment the counter by {self.target}."  # returned string becomes the prompt

    def get_reward(self) -> float:  # optional: the environment scores itself from its own state
        return float(self.counter == self.target)

    # Public methods (exposed as tools)
    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter

if __name__ == "__main__":
    trainer = AsyncGRPOTrainer(
        model="Qwen/Qwen3-0.6B",
        args=AsyncGRPOConfig(max_steps=1000, chat_template_kwargs={"enable_thinking": False}),
        environment_factory=IncrementEnv,
    )
    trainer.train()
'''

TRL_IMPORTS = [
    ("from trl import AsyncGRPOTrainer\n", "from asyncgrpo import AsyncGRPOTrainer\n"),
    (
        "from trl.rewards import accuracy_reward\n",
        "from asyncgrpo.rewards import accuracy_reward\n",
    ),
]
ARGS_AFTER_DATASET = (
    "        train_dataset=dataset,\n    )",
    "        train_dataset=dataset,\n        args=AsyncGRPOConfig(**TINY_ARGS),\n    )",
)


def fragment_args(*extra: str) -> tuple[str, str]:
    """Fill the documentation's ``...`` of a ``trainer = AsyncGRPOTrainer(..., ...)``."""
    lines = [
        "    model=TINY_MODEL,  # test: the documentation's `...`",
        *(f"    {line},  # test" for line in extra),
        "    train_dataset=load_dataset('json', data_files=TINY_DATASET, split='train'),  # test",
        "    args=AsyncGRPOConfig(**TINY_ARGS),  # test",
    ]
    return "    ...,\n)", "\n".join(lines) + "\n)"


def adapt(text: str, replacements: list[tuple[str, str]]) -> str:
    """``text`` with each ``(old, new)`` applied; ``old`` must occur exactly once."""
    for old, new in replacements:
        assert text.count(old) == 1, f"not exactly once in the example: {old!r}"
        text = text.replace(old, new)
    return text


def as_script(fragment: str) -> str:
    """A documentation fragment that builds ``trainer`` at module level, as a script: under
    ``if __name__ == "__main__":`` (the spawned worker re-imports the script), then trained."""
    body = textwrap.indent(fragment, "    ")
    return f'if __name__ == "__main__":  # test\n{body}    trainer.train()  # test\n'


def quick_start() -> str:
    return adapt(
        DOC_QUICK_START,
        [
            *TRL_IMPORTS,
            (
                'load_dataset("trl-lib/DeepMath-103K", split="train")',
                'load_dataset("json", data_files=TINY_DATASET, split="train")',
            ),
            ('model="Qwen/Qwen3.5-2B"', "model=TINY_MODEL"),
            ARGS_AFTER_DATASET,
        ],
    )


def multi_task() -> str:
    stand_ins = (
        "# test: the documentation leaves these two undefined\n"
        "def check_math_solution(prompt, completion):\n"
        "    return '$4$' in completion[-1]['content']\n\n"
        "def test_code_solution(prompt, completion):\n"
        "    return completion[-1]['content'].startswith('The answer')\n\n"
    )
    return stand_ins + adapt(
        DOC_MULTI_TASK,
        [
            TRL_IMPORTS[0],
            ('model="Qwen/Qwen2.5-0.5B-Instruct"', "model=TINY_MODEL"),
            ARGS_AFTER_DATASET,
        ],
    )


def async_reward() -> str:
    glue = (
        "import functools  # test: the documentation's list names two async functions\n"
        "from datasets import load_dataset  # test\n"
        "async_reward_func1 = async_reward_func  # test\n"
        "async_reward_func2 = functools.partial(async_reward_func)  # test: the same name\n"
    )
    trainer = adapt(DOC_PASSING_REWARDS, [TRL_IMPORTS[0], fragment_args()])
    return "\n".join([DOC_LONGER_COMPLETIONS, DOC_ASYNC_REWARD, glue, as_script(trainer)])


def curriculum() -> str:
    main = (
        'if __name__ == "__main__":  # test: the documentation gives the classes only\n'
        "    from asyncgrpo.rewards import accuracy_reward\n"
        "    from datasets import load_dataset\n"
        "    trainer = CurriculumTrainer(\n"
        "        model=TINY_MODEL,\n"
        "        reward_funcs=accuracy_reward,\n"
        "        train_dataset=load_dataset('json', data_files=TINY_DATASET, split='train'),\n"
        "        args=CurriculumConfig(**TINY_ARGS),\n"
        "    )\n"
        "    trainer.train()\n"
    )
    return (
        adapt(
            DOC_CURRICULUM,
            [
                (
                    "from trl import AsyncGRPOConfig, AsyncGRPOTrainer\n",
                    "from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer\n",
                ),
                (
                    "from trl.trainer.async_grpo_trainer import AsyncRolloutLoop\n",
                    "from asyncgrpo import AsyncRolloutLoop\n",
                ),
            ],
        )
        + "\n"
        + main
    )


def tools() -> str:
    glue = (
        "from asyncgrpo.rewards import accuracy_reward  # test\n"
        "from datasets import load_dataset  # test\n"
    )
    head, fragment = DOC_TOOLS.split("trainer = AsyncGRPOTrainer(")
    trainer = adapt(
        "trainer = AsyncGRPOTrainer(" + fragment, [fragment_args("reward_funcs=accuracy_reward")]
    )
    return adapt(head, [TRL_IMPORTS[0]]) + glue + "\n" + as_script(trainer)


def environment() -> str:
    return adapt(
        DOC_ENVIRONMENT,
        [
            (
                "from trl import AsyncGRPOConfig, AsyncGRPOTrainer\n",
                "from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer\n",
            ),
            ('model="Qwen/Qwen3-0.6B"', "model=TINY_MODEL"),
            ("max_steps=1000", "**TINY_ARGS"),
        ],
    )


EXAMPLES = {
    "quick_start": quick_start,
    "multi_task_reward": multi_task,
    "async_reward": async_reward,
    "custom_rollout_loop": curriculum,
    "tools": tools,
    "environment_factory": environment,
}


@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory) -> Path:
    """DeepMath-shaped rows (conversational ``prompt``, ``solution``), as a local JSON file."""
    path = tmp_path_factory.mktemp("data") / "math.jsonl"
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {a}+{b}?"}], "solution": str(a + b)}
        for a, b in ((2, 2), (1, 3), (2, 3), (0, 4))
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# Multi-turn tool conversations grow past 600 tokens: these keep the default token_budget
# (the server's max_model_len); the others take a step of a few groups instead of dozens.
WITH_TOOLS = ("tools", "environment_factory")


def prelude(model: Path, dataset: Path, server_url: str, output_dir: Path, name: str) -> str:
    args = dict(
        output_dir=str(output_dir),
        vllm_server_base_url=server_url,
        max_steps=2,
        num_generations=4,
        max_completion_length=32,
        disable_tqdm=True,
    )
    if name not in WITH_TOOLS:
        args["token_budget"] = 256
    return (
        "# test: the tiny local model and dataset, the CPU server and a two-step run\n"
        "from asyncgrpo import AsyncGRPOConfig\n"
        f"TINY_MODEL = {str(model)!r}\n"
        f"TINY_DATASET = {str(dataset)!r}\n"
        f"TINY_ARGS = {args!r}\n\n"
    )


@pytest.mark.slow(reason="each example trains 2 steps; multi-turn ones take up to 60 s")
@pytest.mark.parametrize("name", list(EXAMPLES))
def test_documentation_example_trains_two_steps(
    name, replying_served, tiny_dataset, tmp_path
) -> None:
    server, model = replying_served
    script = tmp_path / f"{name}.py"
    output_dir = tmp_path / "run"
    script.write_text(
        prelude(model, tiny_dataset, server.base_url, output_dir, name) + EXAMPLES[name]()
    )
    namespace = runpy.run_path(str(script), run_name="__main__")
    assert type(namespace["trainer"]).__name__ in ("AsyncGRPOTrainer", "CurriculumTrainer")
    rows = read_metrics(output_dir)
    assert [r["step"] for r in rows] == [1, 2]
    if name == "tools":
        assert sum(r.get("tools/call_frequency", 0.0) for r in rows) > 0
    if name == "environment_factory":
        assert all("rewards/IncrementEnv/mean" in r for r in rows)
    if name == "async_reward":
        assert {"rewards/async_reward_func/mean", "rewards/async_reward_func_2/mean"} <= set(
            rows[0]
        )
