"""What a harness rollout gives training (core/rollout/harness.py): its turn budget, each turn's
training mask, the reward ``verify()`` forwards, and the metrics of how it ended."""

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.metrics import Aggregation
from asyncgrpo.core.records import TurnRecord
from asyncgrpo.core.rollout import harness


@given(st.none() | st.integers(0, 1000))
def test_a_rollout_may_take_one_turn_per_tool_round_and_one_to_answer(iterations) -> None:
    turns = harness.harness_max_turns(iterations)
    expected = harness.DEFAULT_MAX_TURNS if iterations is None else iterations + 1
    assert turns == expected and turns >= 1


def test_a_negative_tool_round_count_is_refused() -> None:
    with pytest.raises(ValueError, match="max_tool_calling_iterations must be >= 0, got -1"):
        harness.harness_max_turns(-1)


turns = st.builds(
    lambda prompt, mask: TurnRecord(prompt, [5] * len(mask), [-0.5] * len(mask), output_mask=mask),
    st.lists(st.integers(0, 100), min_size=1, max_size=20),
    st.lists(st.integers(0, 1), min_size=0, max_size=20),
)


@given(turns)
def test_the_loss_mask_keeps_the_prompt_as_context_and_trains_what_the_turn_trains(turn) -> None:
    mask = harness.loss_mask(turn)
    assert len(mask) == len(turn.prompt_ids) + len(turn.output_ids)
    assert not any(mask[: len(turn.prompt_ids)])
    assert mask[len(turn.prompt_ids) :] == tuple(turn.trained_mask())


@given(st.text(min_size=1, max_size=12), st.integers(0, 50), st.integers(0, 50))
def test_turn_identities_differ_between_turns(rollout, first, second) -> None:
    same = harness.node_id(rollout, first) == harness.node_id(rollout, second)
    assert same == (first == second)


@given(st.integers(-(10**6), 10**6) | st.floats(allow_nan=True, allow_infinity=True))
def test_a_forwarded_number_is_the_reward_unless_it_is_not_finite(value) -> None:
    reward, nonfinite = harness.verified_reward(value, "S.verify")
    assert nonfinite == (not math.isfinite(value))
    assert reward == (None if nonfinite else float(value))


def test_none_is_unscored_and_anything_else_is_refused_naming_the_source() -> None:
    assert harness.verified_reward(None, "S.verify") == (None, False)
    for bad in ("1.0", True, [1.0]):
        with pytest.raises(TypeError, match=r"S\.verify returned env_reward="):
            harness.verified_reward(bad, "S.verify")


@given(
    st.sampled_from(harness.ENDINGS),
    st.floats(0, 1e4),
    st.none() | st.floats(-10, 10),
    st.booleans(),
)
def test_each_fault_is_counted_once_and_every_rollout_once_in_the_fractions(
    ending, seconds, reward, nonfinite
) -> None:
    outcome = harness.HarnessOutcome(ending, seconds, reward, nonfinite)
    found = {o.name: o for o in harness.outcome_observations(outcome)}
    counts = {n for n in found if n.endswith("_count") and n != "harness/nonfinite_reward_count"}
    assert counts == ({f"harness/{ending}_count"} if ending != harness.FINISHED else set())
    assert all(found[n].aggregation is Aggregation.SUM and found[n].amount == 1 for n in counts)
    assert found["harness/unscored_frac"].amount == float(reward is None)
    assert found["harness/duration_s"].amount == seconds
    assert ("harness/nonfinite_reward_count" in found) == nonfinite
    if reward is None:
        assert "harness/reward_mean" not in found
    else:
        assert found["harness/reward_mean"].amount == reward


def test_an_unknown_ending_is_refused() -> None:
    with pytest.raises(ValueError):
        harness.HarnessOutcome("exploded")
