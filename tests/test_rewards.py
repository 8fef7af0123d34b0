import concurrent.futures
import doctest

import asyncgrpo.rewards
from asyncgrpo.rewards import accuracy_reward, format_reward


def reply(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def test_accuracy_reward_compares_mathematically_and_skips_bad_references() -> None:
    rewards = accuracy_reward(
        [reply(r"so \boxed{\frac{1}{2}}"), reply(r"\boxed{3}"), reply("7")],
        solution=["$0.5$", "$4$", "not math at all ]["],
    )
    assert rewards == [1.0, 0.0, None]


def test_format_reward() -> None:
    assert format_reward([reply("<think>x</think><answer>1</answer>"), reply("1")]) == [1.0, 0.0]
    assert doctest.testmod(asyncgrpo.rewards).failed == 0


def test_accuracy_reward_runs_in_a_worker_thread_as_the_rollout_worker_calls_it() -> None:
    """math-verify's timeouts use signal.alarm, which raises outside the main thread."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        rewards = pool.submit(accuracy_reward, [reply("$4$"), reply("5")], solution=["4", "4"])
    assert rewards.result(timeout=60) == [1.0, 0.0]
