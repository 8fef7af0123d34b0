"""``reward_funcs`` and ``eval_reward_funcs`` as the trainer takes them: a bare string is one
entry (a reward model's id, refused as TRL's AsyncGRPOTrainer refuses it), never its
characters; the check runs before any model is loaded or server reached."""

from __future__ import annotations

import re

import pytest
from datasets import Dataset

from asyncgrpo import AsyncGRPOConfig, AsyncGRPOTrainer
from asyncgrpo.shell.commands.demo import digit_fraction_reward
from asyncgrpo.shell.run.inputs import REWARD_MODEL_REFUSAL, reward_function_list


def refusal(argument: str, entry: object) -> str:
    """The whole message, as a pattern matching nothing else."""
    return f"^{re.escape(f'{argument} entry {entry!r}: {REWARD_MODEL_REFUSAL}')}$"


def test_a_bare_string_is_one_reward_model_id_not_its_characters(tmp_path) -> None:
    rows = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Number 1?"}]]})
    args = AsyncGRPOConfig(output_dir=str(tmp_path / "run"), disable_tqdm=True)
    with pytest.raises(TypeError, match=refusal("reward_funcs", "some/reward-model")):
        AsyncGRPOTrainer(
            model="never/loaded",
            reward_funcs="some/reward-model",
            args=args,
            train_dataset=rows,
        )
    with pytest.raises(TypeError, match=refusal("eval_reward_funcs", "./judge-model")):
        AsyncGRPOTrainer(
            model="never/loaded",
            reward_funcs=digit_fraction_reward,
            args=args,
            train_dataset=rows,
            eval_dataset=rows,
            eval_reward_funcs="./judge-model",
        )


def test_reward_function_list_takes_none_one_or_several() -> None:
    assert reward_function_list(None, "reward_funcs") == []
    assert reward_function_list(digit_fraction_reward, "reward_funcs") == [digit_fraction_reward]
    several = (digit_fraction_reward, len)
    assert reward_function_list(several, "reward_funcs") == list(several)
    with pytest.raises(TypeError, match=refusal("reward_funcs", "org/model")):
        reward_function_list([digit_fraction_reward, "org/model"], "reward_funcs")
    with pytest.raises(TypeError, match=r"^reward_funcs entry 3 is not a Python callable: "):
        reward_function_list(3, "reward_funcs")
