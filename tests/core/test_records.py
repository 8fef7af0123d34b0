import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.records import (
    Rollout,
    RolloutGroup,
    TrainingSample,
    TrainingSequence,
    TurnRecord,
)


def test_turn_record_converts_lists_to_tuples_and_defaults_to_all_trained() -> None:
    turn = TurnRecord(prompt_ids=[1, 2], output_ids=[3, 4], output_log_probs=[-0.1, -0.2])
    assert turn.prompt_ids == (1, 2)
    assert turn.trained_mask() == (1, 1)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"output_log_probs": [-0.1]}, "output_log_probs"),
        ({"output_log_probs": [-0.1, float("nan")]}, "output_log_probs"),
        ({"output_log_probs": [-0.1, float("-inf")]}, "output_log_probs"),
        ({"output_log_probs": [-0.1, 0.5]}, "output_log_probs"),
        ({"output_log_probs": []}, "output_log_probs"),
        ({"output_log_probs": [-0.1, -0.1], "output_mask": [1]}, "output_mask"),
        ({"output_log_probs": [-0.1, -0.1], "output_mask": [1, 2]}, "output_mask"),
        (
            {"output_log_probs": [-0.1, -0.1], "output_sampling_mask": [[3], [5]]},
            "output_sampling_mask",
        ),
        (
            {"output_log_probs": [-0.1, -0.1], "output_sampler_logprobs": [{3: -0.1}]},
            "output_sampler_logprobs",
        ),
        (
            {
                "output_log_probs": [-0.1, -0.1],
                "output_sampler_logprobs": [{3: -0.1}, {4: float("nan")}],
            },
            "output_sampler_logprobs",
        ),
    ],
)
def test_turn_record_rejects_bad_fields_by_name(kwargs, field) -> None:
    with pytest.raises(ValueError, match=f"TurnRecord.{field}"):
        TurnRecord(prompt_ids=[1], output_ids=[3, 4], **kwargs)


def test_turn_record_needs_a_prompt() -> None:
    with pytest.raises(ValueError, match="TurnRecord.prompt_ids"):
        TurnRecord(prompt_ids=[], output_ids=[3], output_log_probs=[-0.1])


def test_untrained_turn_needs_no_log_probs() -> None:
    turn = TurnRecord(prompt_ids=[1], output_ids=[3, 4], output_mask=[0, 0])
    assert turn.output_log_probs == ()


def test_sampler_top_logprobs_may_hold_minus_infinity() -> None:
    turn = TurnRecord([1], [3], [-0.1], output_sampler_logprobs=[{3: -0.1, 9: -math.inf}])
    assert turn.output_sampler_logprobs[0][9] == -math.inf


def test_rollout_validates_turns_counts_and_reward() -> None:
    turn = TurnRecord([1], [2], [-0.3])
    rollout = Rollout(
        completion=[{"role": "assistant", "content": "x"}], completion_ids=[2], turns=[turn]
    )
    assert len(rollout.rollout_id) == 32
    assert Rollout([], [], []).rollout_id != Rollout([], [], []).rollout_id
    with pytest.raises(ValueError, match="Rollout.turns"):
        Rollout(completion=[], completion_ids=[], turns=[{"prompt_ids": [1]}])
    with pytest.raises(ValueError, match="Rollout.tool_failure_count"):
        Rollout(completion=[], completion_ids=[], turns=[], tool_call_count=1, tool_failure_count=2)
    with pytest.raises(ValueError, match="Rollout.reward"):
        Rollout(completion=[], completion_ids=[], turns=[], reward=float("nan"))


def sequence(n_context: int = 2, n_out: int = 3) -> TrainingSequence:
    n = n_context + n_out
    return TrainingSequence(
        input_ids=np.arange(n),
        trained_mask=[0] * n_context + [1] * n_out,
        sampler_logprobs=[0.0] * n_context + [-0.5] * n_out,
    )


def test_training_sequence_arrays_are_read_only() -> None:
    seq = sequence()
    with pytest.raises(ValueError):
        seq.input_ids[0] = 7
    assert seq.num_trained == 3
    assert seq == sequence()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"trained_mask": [0, 1]}, "trained_mask"),
        ({"trained_mask": [0, 1, 2]}, "trained_mask"),
        ({"sampler_logprobs": [0.0, np.nan, -1.0]}, "sampler_logprobs"),
        ({"sampler_logprobs": [0.0, 0.3, -1.0]}, "sampler_logprobs"),
        ({"sampling_masks": [None]}, "sampling_masks"),
        ({"trained_mask": [1, 1, 1], "sampler_logprobs": [-0.1] * 3}, "trained_mask"),
        ({"input_ids": [], "trained_mask": [], "sampler_logprobs": []}, "input_ids"),
    ],
)
def test_training_sequence_rejects_bad_fields_by_name(kwargs, field) -> None:
    base = {
        "input_ids": [1, 2, 3],
        "trained_mask": [0, 1, 1],
        "sampler_logprobs": [0.0, -0.1, -1.0],
    }
    with pytest.raises(ValueError, match=f"TrainingSequence.{field}"):
        TrainingSequence(**{**base, **kwargs})


def test_training_sample_staleness_and_validation() -> None:
    sample = TrainingSample(
        sequence(),
        advantage=1.0,
        model_version=3,
        group_id=0,
        row_index=5,
        prompt_position=5,
        rollout_id="r",
    )
    assert sample.staleness(current_version=7) == 4
    with pytest.raises(ValueError, match="TrainingSample.advantage"):
        TrainingSample(
            sequence(),
            advantage=math.inf,
            model_version=0,
            group_id=0,
            row_index=0,
            prompt_position=0,
            rollout_id="r",
        )


def group(n: int = 2, **overrides) -> RolloutGroup:
    fields = dict(
        prompts=[[{"role": "user", "content": "q"}]] * n,
        reward_kwargs={"answer": ["4"] * n},
        completions=[[{"role": "assistant", "content": "4"}]] * n,
        completions_ids=[[1, 2]] * n,
        completions_sequences=[[sequence()]] * n,
        tool_call_counts=[0] * n,
        tool_failure_counts=[0] * n,
        model_version=0,
        group_id=0,
        row_index=0,
        env_rewards=[None] * n,
        rollout_rewards=[None] * n,
    )
    fields.update(overrides)
    return RolloutGroup(**fields)


def test_rollout_group_checks_every_column_length() -> None:
    assert len(group()) == 2
    with pytest.raises(ValueError, match="RolloutGroup.tool_call_counts"):
        group(tool_call_counts=[0])
    with pytest.raises(ValueError, match=r"RolloutGroup.reward_kwargs\['answer'\]"):
        group(reward_kwargs={"answer": ["4"]})
    with pytest.raises(ValueError, match="RolloutGroup.rewards"):
        group(rewards=[1.0])


@given(
    st.lists(st.integers(0, 50_000), min_size=1, max_size=20),
    st.lists(st.floats(-30.0, 0.0), min_size=1, max_size=20),
)
def test_turn_record_accepts_any_valid_turn(prompt, logprobs) -> None:
    outputs = list(range(len(logprobs)))
    turn = TurnRecord(prompt, outputs, logprobs)
    assert turn.output_log_probs == tuple(logprobs)
    assert len(turn.trained_mask()) == len(outputs)


def test_records_survive_the_process_boundary() -> None:
    import pickle

    turn = TurnRecord([1], [2, 3], [-0.1, -0.2], output_sampler_logprobs=[{2: -0.1}, {3: -0.2}])
    assert pickle.loads(pickle.dumps(turn)) == turn
    seq = TrainingSequence([1, 2], [0, 1], [0.0, -0.1], sampler_top_logprobs=[None, {2: -0.1}])
    sample = TrainingSample(seq, 0.5, 1, 2, 3, 4, "r")
    back = pickle.loads(pickle.dumps(sample))
    assert back == sample and back.sequence.sampler_top_logprobs[1] == {2: np.float32(-0.1)}
