import math

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from asyncgrpo.core.rollout.advantages import (
    duplicate_frac,
    has_signal,
    score_group,
    standardize_rewards,
    sum_rewards,
)

reward_values = st.floats(-100.0, 100.0, allow_nan=False)
maybe_reward = st.one_of(st.none(), reward_values)


@st.composite
def reward_sources(draw):
    g = draw(st.integers(1, 12))
    n_sources = draw(st.integers(0, 4))
    return g, [draw(st.lists(maybe_reward, min_size=g, max_size=g)) for _ in range(n_sources)]


@given(reward_sources())
def test_sum_rewards_ignores_none_and_marks_unscored_nan(case) -> None:
    g, sources = case
    total = sum_rewards(sources, g)
    for i in range(g):
        scores = [col[i] for col in sources if col[i] is not None]
        if scores:
            assert total[i] == pytest.approx(sum(scores))
        else:
            assert math.isnan(total[i])


def test_sum_rewards_rejects_wrong_length_and_nan() -> None:
    with pytest.raises(ValueError, match="returned 2 rewards for 3 rollouts"):
        sum_rewards([[1.0, 2.0]], 3)
    with pytest.raises(ValueError, match="return None"):
        sum_rewards([[1.0, float("nan")]], 2)


group_rewards = arrays(
    np.float64,
    st.integers(2, 16),
    elements=st.one_of(st.just(np.nan), st.floats(-50, 50).map(lambda x: round(x, 3))),
)


@given(group_rewards)
def test_advantages_have_zero_mean_over_scored_and_zero_elsewhere(rewards) -> None:
    adv = standardize_rewards(rewards)
    scored = ~np.isnan(rewards)
    assert np.all(adv[~scored] == 0.0)
    if has_signal(rewards):
        assert adv[scored].mean() == pytest.approx(0.0, abs=1e-9)
        assert adv[scored].std(ddof=1) == pytest.approx(1.0, rel=1e-9)
    else:
        assert np.all(adv == 0.0)


@given(group_rewards, st.floats(-20, 20), st.floats(0.01, 50))
def test_advantages_invariant_to_shift_and_positive_scale(rewards, shift, scale) -> None:
    transformed = rewards * scale + shift
    assume(has_signal(transformed) == has_signal(rewards))
    np.testing.assert_allclose(
        standardize_rewards(transformed), standardize_rewards(rewards), atol=1e-6
    )


@given(group_rewards, st.randoms(use_true_random=False))
def test_advantages_are_permutation_equivariant(rewards, rng) -> None:
    order = list(range(len(rewards)))
    rng.shuffle(order)
    np.testing.assert_allclose(
        standardize_rewards(rewards[order]), standardize_rewards(rewards)[order], atol=1e-12
    )


@given(group_rewards)
def test_group_kept_iff_two_scored_unequal_rewards(rewards) -> None:
    score = score_group(rewards)
    scored = rewards[~np.isnan(rewards)]
    assert score.kept == (len(scored) >= 2 and len(set(scored.tolist())) > 1)
    if not score.kept:
        assert np.all(score.advantages == 0.0)


def test_score_group_uses_rewards_not_advantages_to_drop() -> None:
    always_one = score_group(np.array([1.0, 1.0]), lambda r: np.ones_like(r))
    assert not always_one.kept
    assert always_one.advantages.tolist() == [0.0, 0.0]
    custom = score_group(np.array([0.0, 1.0]), lambda r: r * 10)
    assert custom.kept and custom.advantages.tolist() == [0.0, 10.0]
    with pytest.raises(ValueError, match="one advantage per rollout"):
        score_group(np.array([0.0, 1.0]), lambda r: r[:1])


def test_group_std_is_nan_with_one_scored_rollout() -> None:
    assert math.isnan(score_group(np.array([1.0, np.nan])).group_std)


@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), min_size=1, max_size=16))
def test_duplicate_frac_counts_repeats_of_earlier_rollouts(keys) -> None:
    frac = duplicate_frac(keys)
    repeats = sum(1 for i, k in enumerate(keys) if k in keys[:i])
    assert frac == pytest.approx(repeats / len(keys))
    assert 0.0 <= frac <= (len(keys) - 1) / len(keys)
