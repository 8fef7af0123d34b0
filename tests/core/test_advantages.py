import math

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from asyncgrpo.core.rollout.advantages import (
    SPREAD_RTOL,
    duplicate_frac,
    has_signal,
    reward_spread_tolerance,
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


def _assert_spreadless(rewards: np.ndarray) -> None:
    assert not has_signal(rewards)
    assert np.all(standardize_rewards(rewards) == 0.0)
    score = score_group(rewards)
    assert not score.kept and np.all(score.advantages == 0.0)


def test_rounding_noise_is_no_signal() -> None:
    _assert_spreadless(np.array([1.0, 1.0, 1.0, 1.0 + 1e-12]))
    # 0.1 + 0.2 from two reward functions against 0.3 from one: 0.30000000000000004 vs 0.3
    summed = sum_rewards([[0.1, 0.3, 0.3], [0.2, None, None]], 3)
    assert summed[0] != summed[1]
    _assert_spreadless(summed)
    _assert_spreadless(np.array([0.1 + 0.2 - 0.3, 0.0, np.nan]))


@st.composite
def permuted_sums(draw):
    """Rewards of a group, each the float64 sum of the same parts in its own order."""
    parts = draw(st.lists(st.floats(-10, 10), min_size=1, max_size=6))
    g = draw(st.integers(2, 8))
    orders = [draw(st.permutations(parts)) for _ in range(g)]
    nan_at = draw(st.sets(st.integers(0, g - 1), max_size=g - 2))
    return np.array([np.nan if i in nan_at else float(sum(o)) for i, o in enumerate(orders)])


@given(permuted_sums())
def test_sums_of_the_same_parts_in_any_order_have_no_signal(rewards) -> None:
    _assert_spreadless(rewards)


@given(
    st.floats(-1e6, 1e6),
    st.lists(st.integers(-4, 4), min_size=2, max_size=16),
)
def test_a_constant_off_by_a_few_ulp_has_no_signal(reward, ulps) -> None:
    def step(value: float, n: int) -> float:
        for _ in range(abs(n)):
            value = float(np.nextafter(value, np.inf if n > 0 else -np.inf))
        return value

    _assert_spreadless(np.array([step(reward, n) for n in ulps]))


@st.composite
def real_spread(draw):
    """A group whose rewards spread by 1e-6 to 1 of their scale ``max(|base|, 1)``."""
    base = draw(st.floats(-100, 100))
    scale = max(abs(base), 1.0)
    delta = draw(st.floats(1e-6, 1.0)) * scale
    inner = draw(st.lists(st.floats(0.0, 1.0), max_size=10))
    values = [base, base + delta, *(base + f * delta for f in inner)]
    order = draw(st.permutations(range(len(values))))
    return np.array([values[i] for i in order])


@given(real_spread())
def test_a_real_spread_of_one_millionth_has_signal(rewards) -> None:
    assert has_signal(rewards)
    spread = rewards.max() - rewards.min()
    assert spread > 100 * reward_spread_tolerance(rewards)
    adv = standardize_rewards(rewards)
    assert adv.mean() == pytest.approx(0.0, abs=1e-6)
    assert adv.std(ddof=1) == pytest.approx(1.0, rel=1e-6)


@given(real_spread(), st.floats(-1.0, 1.0), st.floats(0.01, 50))
def test_a_real_spread_keeps_its_signal_under_shift_and_scale(rewards, shift, scale) -> None:
    transformed = (rewards + shift * np.abs(rewards).max()) * scale
    assert has_signal(transformed)
    np.testing.assert_allclose(
        standardize_rewards(transformed), standardize_rewards(rewards), atol=1e-6
    )


def test_spread_tolerance_is_relative_to_the_rewards_scale() -> None:
    assert SPREAD_RTOL <= 1e-9
    assert has_signal(np.array([1e6, 1e6 + 1.0]))
    assert not has_signal(np.array([1e6, 1e6 + 1e-4]))
    assert has_signal(np.array([1e-6, 2e-6]))


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
