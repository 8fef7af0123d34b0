"""The arithmetic task family: splits that never share a problem, right answers, the reward's
parser, and the docstring examples of asyncgrpo.tasks and asyncgrpo.rewards."""

import doctest

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import asyncgrpo.rewards
import asyncgrpo.tasks
from asyncgrpo.tasks import _value, answer_reward, arithmetic


@pytest.mark.parametrize("module", [asyncgrpo.tasks, asyncgrpo.rewards])
def test_docstring_examples(module) -> None:
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0


@settings(max_examples=20)
@given(
    st.integers(1, 2), st.sampled_from([("+",), ("-",), ("*",), ("+", "-", "*")]), st.integers(0, 3)
)
def test_the_splits_never_share_a_problem_and_every_answer_is_right(digits, ops, seed) -> None:
    train = arithmetic(300, digits=digits, operations=ops, split="train", seed=seed)
    test = arithmetic(60, digits=digits, operations=ops, split="test", seed=seed + 1)
    assert not set(train["problem"]) & set(test["problem"])
    for row in [*train, *test]:
        assert int(row["answer"]) == eval(row["problem"]) >= 0  # the problem as written
        assert row["problem"] in row["prompt"][0]["content"]


def test_word_problems_three_operands_and_a_large_space_are_drawn() -> None:
    words = arithmetic(10, digits=2, operations=("-",), form="word", split="test")
    assert all("left?" in p[0]["content"] for p in words["prompt"])
    three = arithmetic(10, digits=1, operations=("+", "*"), operands=3)
    assert all(len(p.split()) == 5 for p in three["problem"])
    large = arithmetic(10, digits=3, operations=("*",), split="test", seed=2)
    assert len(set(large["problem"])) == 10
    assert _value((2, "+", 3, "*", 4)) == 14
    with pytest.raises(ValueError, match="operations must be some of"):
        arithmetic(5, operations=("/",))
    with pytest.raises(ValueError, match="word problems have 2 operands"):
        arithmetic(5, form="word", operands=3)


def test_the_reward_reads_the_last_integer() -> None:
    replies = ["The answer is 42.", "40 + 2 = 42", "forty-two", "-3", "1,024", ""]
    completions = [[{"role": "assistant", "content": r}] for r in replies]
    assert answer_reward(completions, ["42", "42", "42", "-3", "1024", "0"]) == [
        1.0,
        1.0,
        0.0,
        1.0,
        1.0,
        0.0,
    ]


def test_count_none_lists_every_problem_of_a_split_once() -> None:
    ops = ("+", "-", "*")
    test = arithmetic(None, digits=1, operations=ops, split="test")
    train = arithmetic(None, digits=1, operations=ops, split="train")
    every = {
        f"{a} {op} {b}"
        for a in range(10)
        for b in range(10)
        for op in ops
        if eval(f"{a} {op} {b}") >= 0
    }
    assert len(set(test["problem"])) == len(test) and len(set(train["problem"])) == len(train)
    assert set(test["problem"]) | set(train["problem"]) == every
    assert 0.1 < len(test) / len(every) < 0.3  # about 1 in 5 held out
    with pytest.raises(ValueError, match="give a count"):
        arithmetic(None, digits=3, operations=("*",), operands=3)
