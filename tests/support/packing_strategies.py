"""Hypothesis strategies shared by the packing and planner tests."""

import numpy as np
from hypothesis import strategies as st

from asyncgrpo.core.packing.tree import PackedRow
from asyncgrpo.core.records import TrainingSample, TrainingSequence
from asyncgrpo.core.sampler_tables import TopLogprobs


def attended(row: PackedRow, row_index: int) -> np.ndarray:
    """Row indices the token at ``row_index`` attends to, in order (itself last): the test's
    reading of the row's segments, against which the attention masks are checked."""
    segment = int(row.segment_ids[row_index])
    keys = row.segment_keys(segment)
    offset = row_index - int(row.segment_starts[segment])
    visible = len(keys) - int(row.segment_lengths[segment]) + offset + 1
    return keys[:visible]


def as_dicts(top: TopLogprobs) -> tuple[dict[int, float] | None, ...]:
    """The dict form of ``top``, one ``{token id: log-prob}`` (or None) per position."""
    return tuple(top[t] for t in range(len(top)))


def make_sample(tokens, trained, group=0, advantage=1.0, rollout="r") -> TrainingSample:
    tokens = list(tokens)
    mask = [0] + [int(t) for t in trained[1 : len(tokens)]]
    mask += [0] * (len(tokens) - len(mask))
    logprobs = [-0.01 * (i + 1) if m else 0.0 for i, m in enumerate(mask)]
    seq = TrainingSequence(input_ids=tokens, trained_mask=mask, sampler_logprobs=logprobs)
    return TrainingSample(seq, advantage, 0, group, group, group, rollout)


@st.composite
def sample_sets(draw, max_groups=4, max_per_group=4, vocab=4, max_len=10):
    """Groups of samples sharing a prompt, with small vocabularies so that completions
    collide and share deeper prefixes; duplicates happen."""
    samples = []
    for group in range(draw(st.integers(1, max_groups))):
        prompt = draw(st.lists(st.integers(0, vocab), min_size=1, max_size=max_len))
        for member in range(draw(st.integers(1, max_per_group))):
            completion = draw(st.lists(st.integers(0, vocab), max_size=max_len))
            tokens = prompt + completion
            trained = [False] * len(prompt) + draw(
                st.lists(st.booleans(), min_size=len(completion), max_size=len(completion))
            )
            advantage = draw(st.floats(-2, 2))
            samples.append(make_sample(tokens, trained, group, advantage, f"{group}-{member}"))
    return draw(st.permutations(samples))


def as_array(sample: TrainingSample) -> np.ndarray:
    return sample.sequence.input_ids
