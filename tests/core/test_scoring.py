import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.records import TrainingSequence
from asyncgrpo.core.rollout.advantages import score_group
from asyncgrpo.core.rollout.scoring import check_reward_values, group_samples

reward_or_none = st.one_of(
    st.none(), st.floats(allow_nan=False, allow_infinity=False), st.integers(-5, 5)
)


@given(st.lists(reward_or_none, max_size=12), st.sampled_from([list, tuple]))
def test_reward_values_of_the_right_length_come_back_as_floats_or_none(values, container):
    checked = check_reward_values("fn", container(values), len(values))
    assert len(checked.values) == len(values) and checked.nonfinite == ()
    for got, given_value in zip(checked.values, values, strict=True):
        if given_value is None:
            assert got is None
        else:
            assert isinstance(got, float) and got == float(given_value)


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False), max_size=8))
def test_numpy_reward_arrays_are_accepted(values):
    checked = check_reward_values("fn", np.asarray(values, dtype=np.float64), len(values))
    assert checked.values == tuple(float(v) for v in values)


@given(st.lists(reward_or_none, max_size=8), st.integers(0, 9))
def test_a_wrong_number_of_rewards_names_the_function_and_both_counts(values, expected):
    if len(values) == expected:
        expected += 1
    with pytest.raises(ValueError, match=rf"'my_fn' returned {len(values)} values for {expected}"):
        check_reward_values("my_fn", values, expected)


nonfinite = st.sampled_from([math.nan, math.inf, -math.inf, np.float32("nan")])


@given(st.lists(st.one_of(reward_or_none, nonfinite), max_size=12), st.sampled_from([list, tuple]))
def test_nan_and_infinite_rewards_count_as_unscored_and_are_listed(values, container):
    """As TRL's AsyncGRPOTrainer (documentation) treats NaN: unscored (None), never an error;
    every other value comes back as it was."""
    checked = check_reward_values("fn", container(values), len(values))
    bad = tuple(i for i, v in enumerate(values) if v is not None and not math.isfinite(v))
    assert checked.nonfinite == bad
    for index, (got, given_value) in enumerate(zip(checked.values, values, strict=True)):
        if index in bad or given_value is None:
            assert got is None
        else:
            assert got == float(given_value)


@given(st.lists(reward_or_none, min_size=1, max_size=8), st.data())
def test_non_numbers_name_the_completion(values, data):
    index = data.draw(st.integers(0, len(values) - 1))
    values[index] = data.draw(st.sampled_from(["good", object()]))
    with pytest.raises(ValueError, match=rf"for completion {index}; return a float or None"):
        check_reward_values("fn", values, len(values))


def test_one_nan_in_ten_leaves_the_other_nine_scored():
    values = [float(i) for i in range(10)]
    values[4] = math.nan
    checked = check_reward_values("fn", values, 10)
    assert checked.nonfinite == (4,) and checked.values[4] is None
    assert sum(v is not None for v in checked.values) == 9


@pytest.mark.parametrize("result", [None, 1.0, {"a": 1.0}])
def test_a_result_that_is_no_list_is_refused(result):
    with pytest.raises(ValueError, match="return a list with one float"):
        check_reward_values("fn", result, 1)


def sequence(length: int) -> TrainingSequence:
    return TrainingSequence(list(range(length)), [0] + [1] * (length - 1), [0.0] * length)


@st.composite
def groups(draw):
    g = draw(st.integers(1, 6))
    rewards = draw(
        st.lists(
            st.one_of(st.just(math.nan), st.sampled_from([0.0, 0.5, 1.0])), min_size=g, max_size=g
        )
    )
    per_rollout = [
        [sequence(draw(st.integers(2, 5))) for _ in range(draw(st.integers(0, 3)))]
        for _ in range(g)
    ]
    return score_group(np.asarray(rewards, dtype=np.float64)), per_rollout


@given(groups(), st.integers(0, 7), st.integers(0, 99), st.floats(0, 1e6))
def test_group_samples_are_every_sequence_with_its_rollouts_advantage(group, version, row, at):
    score, per_rollout = group
    ids = [f"r{i}" for i in range(len(per_rollout))]
    samples = group_samples(
        per_rollout,
        score,
        ids,
        model_version=version,
        group_id=2,
        row_index=row,
        prompt_position=row + 100,
        queued_at=at,
    )
    if not score.kept:
        assert samples == ()
        return
    expected = [(ids[i], s) for i, seqs in enumerate(per_rollout) for s in seqs]
    assert [(s.rollout_id, s.sequence) for s in samples] == expected
    for sample in samples:
        rollout = ids.index(sample.rollout_id)
        assert sample.advantage == score.advantages[rollout]
        assert (sample.model_version, sample.group_id, sample.row_index) == (version, 2, row)
        assert (sample.prompt_position, sample.queued_at) == (row + 100, at)


@given(groups())
def test_group_samples_refuses_mismatched_rollout_counts(group):
    score, per_rollout = group
    with pytest.raises(ValueError, match="one of each per rollout"):
        group_samples(
            [*per_rollout, []],
            score,
            [str(i) for i in range(len(per_rollout))],
            model_version=0,
            group_id=0,
            row_index=0,
            prompt_position=0,
            queued_at=0.0,
        )
