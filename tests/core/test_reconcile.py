from collections import Counter

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.records import TurnRecord
from asyncgrpo.core.rollout.reconcile import common_prefix_length, reconcile_turns

tokens = st.lists(st.integers(0, 5), max_size=6)


@st.composite
def rollouts(draw):
    """Turns that append to the held tokens or re-render (drift) them, with random masks.

    Every output token gets a globally unique id (>= 1000) so it can be traced.
    """
    turns = []
    held: list[int] = []
    next_id = 1000
    for index in range(draw(st.integers(1, 5))):
        if index == 0 or draw(st.booleans()):
            prompt = held + draw(tokens)
        else:
            keep = draw(st.integers(0, len(held)))
            prompt = held[:keep] + draw(tokens)
        prompt = prompt or [draw(st.integers(0, 5))]
        n_out = draw(st.integers(0, 4))
        outputs = list(range(next_id, next_id + n_out))
        next_id += n_out
        mask = draw(st.lists(st.integers(0, 1), min_size=n_out, max_size=n_out))
        logprobs = [-0.01 * (tok - 999) for tok in outputs]
        top = [{tok: lp} for tok, lp in zip(outputs, logprobs, strict=True)]
        turns.append(
            TurnRecord(prompt, outputs, logprobs, output_mask=mask, output_sampler_logprobs=top)
        )
        held = prompt + outputs
    return turns


@given(rollouts())
def test_every_generated_token_is_trained_exactly_once_per_its_mask(turns) -> None:
    result = reconcile_turns(turns)
    trained = Counter()
    for seq in result.sequences:
        for tok, keep in zip(seq.input_ids.tolist(), seq.trained_mask.tolist(), strict=True):
            if keep:
                trained[tok] += 1
    expected = Counter(
        tok
        for turn in turns
        for tok, keep in zip(turn.output_ids, turn.trained_mask(), strict=True)
        if keep
    )
    assert trained == expected
    assert all(count == 1 for count in trained.values())


@given(rollouts())
def test_trained_tokens_carry_their_own_sampler_data(turns) -> None:
    for seq in reconcile_turns(turns).sequences:
        assert seq.num_trained > 0
        for pos in np.flatnonzero(seq.trained_mask):
            tok = int(seq.input_ids[pos])
            assert seq.sampler_logprobs[pos] == -0.01 * (tok - 999)
            top = {tok: float(np.float32(seq.sampler_logprobs[pos]))}  # kept as float32
            assert seq.sampler_top_logprobs[pos] == top
        untrained = seq.trained_mask == 0
        assert np.all(seq.sampler_logprobs[untrained] == 0.0)


@given(rollouts())
def test_each_sequence_is_the_full_conversation_of_its_last_turn(turns) -> None:
    full = [list(t.prompt_ids) + list(t.output_ids) for t in turns]
    for seq in reconcile_turns(turns).sequences:
        assert seq.input_ids.tolist() in full


@given(rollouts())
def test_fork_statistics(turns) -> None:
    result = reconcile_turns(turns)
    assert result.transitions == len(turns) - 1
    assert len(result.drift_tokens) == result.transitions
    held = list(turns[0].prompt_ids) + list(turns[0].output_ids)
    forks = 0
    for turn, drift in zip(turns[1:], result.drift_tokens, strict=True):
        prompt = list(turn.prompt_ids)
        if prompt[: len(held)] == held:
            assert drift == 0
            held = prompt + list(turn.output_ids)
        else:
            forks += 1
            assert drift == len(held) - common_prefix_length(held, prompt) > 0
            held = prompt + list(turn.output_ids)
    assert result.forks == forks


def test_appending_turns_make_one_sequence_with_context_untrained() -> None:
    turns = [
        TurnRecord([1, 2], [3, 4], [-0.1, -0.2]),
        TurnRecord([1, 2, 3, 4, 9, 9], [5], [-0.3]),
    ]
    (seq,) = reconcile_turns(turns).sequences
    assert seq.input_ids.tolist() == [1, 2, 3, 4, 9, 9, 5]
    assert seq.trained_mask.tolist() == [0, 0, 1, 1, 0, 0, 1]
    assert seq.sampler_top_logprobs is None and seq.sampling_masks is None


def test_untrained_rollout_yields_no_sequence() -> None:
    turns = [TurnRecord([1], [2, 3], output_mask=[0, 0])]
    result = reconcile_turns(turns)
    assert result.sequences == () and result.transitions == 0
    assert reconcile_turns([]).sequences == ()


def test_sampling_masks_are_carried_at_trained_positions() -> None:
    turns = [
        TurnRecord(
            [1], [2, 3], [-0.1, -0.2], output_mask=[1, 0], output_sampling_mask=[[2, 7], [3]]
        )
    ]
    (seq,) = reconcile_turns(turns).sequences
    assert seq.sampling_masks.to_sets() == (None, (2, 7), None)
