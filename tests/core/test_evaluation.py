"""Evaluation metrics over held-out prompts: means over prompts with bootstrap intervals, pass@k,
and windows that keep the newest evaluation."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.experiments.evaluation import (
    PASS_REWARD,
    Evaluation,
    PromptScore,
    evaluation_metrics,
)
from asyncgrpo.core.metrics import MetricWindow, latest, merge, record, summarize

rewards = st.floats(0.0, 1.0, allow_nan=False)


@st.composite
def evaluations(draw) -> Evaluation:
    k = draw(st.integers(1, 4))
    prompts = draw(st.integers(1, 12))
    scores = []
    for row in range(prompts):
        values = draw(st.lists(rewards, min_size=k, max_size=k))
        lengths = draw(st.lists(st.integers(1, 50), min_size=k, max_size=k))
        scores.append(PromptScore(row, values, {"acc": values}, lengths))
    return Evaluation("test", draw(st.integers(0, 100)), tuple(scores))


@given(evaluations())
def test_each_metric_is_its_mean_over_prompts_inside_its_interval(evaluation) -> None:
    figures = evaluation_metrics(evaluation, resamples=200)
    k = evaluation.k
    by_prompt = {
        "reward": [sum(s.rewards) / k for s in evaluation.prompts],
        f"pass@{k}": [float(max(s.rewards) >= PASS_REWARD) for s in evaluation.prompts],
        "completions/mean_length": [sum(s.completion_tokens) / k for s in evaluation.prompts],
        "rewards/acc/mean": [sum(s.rewards) / k for s in evaluation.prompts],
    }
    for name, values in by_prompt.items():
        value = figures[f"eval/test/{name}"]
        assert value == pytest.approx(sum(values) / len(values))
        low, high = figures[f"eval/test/{name}/ci_low"], figures[f"eval/test/{name}/ci_high"]
        assert min(values) - 1e-9 <= low <= value + 1e-9 <= high + 2e-9 <= max(values) + 3e-9
    assert figures["eval/test/version"] == evaluation.version
    assert figures["eval/test/prompts"] == len(evaluation.prompts)


def test_pass_at_k_needs_one_completion_with_full_marks_and_unscored_ones_are_left_out() -> None:
    scores = (
        PromptScore(0, (0.5, 1.0), {"acc": (0.5, 1.0)}, (3, 3)),
        PromptScore(1, (0.9, None), {"acc": (0.9, None)}, (3, 4)),
    )
    figures = evaluation_metrics(Evaluation("t", 1, scores))
    assert figures["eval/t/pass@2"] == 0.5
    assert figures["eval/t/reward"] == pytest.approx((0.75 + 0.9) / 2)
    with pytest.raises(ValueError, match="2 rewards but lengths"):
        PromptScore(2, (1.0, 0.0), {"acc": (1.0,)}, (1, 1))
    with pytest.raises(ValueError, match="no prompts"):
        evaluation_metrics(Evaluation("t", 1, ()))
    assert math.isnan(PromptScore(3, (None,), {}, (2,)).rewards[0])


@given(
    st.lists(st.tuples(st.floats(-5, 5), st.integers(0, 20)), min_size=1, max_size=12), st.randoms()
)
def test_a_window_keeps_the_newest_evaluation_whatever_the_order(results, random) -> None:
    """Windows of evaluations merge in any order to the value of the highest version (the
    larger value on a tie: deterministic); a plain mean would blend versions."""
    shuffled = results[:]
    random.shuffle(shuffled)
    windows = [
        record(MetricWindow(), [latest("eval/t/reward", v, order=o + 1)]) for v, o in shuffled
    ]
    merged = MetricWindow()
    for window in windows:
        merged = merge(merged, window) if random.random() < 0.5 else merge(window, merged)
    newest = max(results, key=lambda r: (r[1], r[0]))
    assert summarize(merged)["eval/t/reward"] == newest[0]
