"""The samples a checkpoint keeps come back as they were saved: tokens, masks, log-probs,
candidate sets, top log-probs and every scalar; a missing or mismatched array is named."""

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.records import TrainingSample, TrainingSequence
from asyncgrpo.core.run.saved_samples import samples_from_arrays, samples_to_arrays


@st.composite
def samples(draw) -> TrainingSample:
    length = draw(st.integers(2, 12))
    ids = draw(st.lists(st.integers(0, 50), min_size=length, max_size=length))
    mask = [0, *draw(st.lists(st.integers(0, 1), min_size=length - 1, max_size=length - 1))]
    logprobs = [-draw(st.floats(0.0, 5.0)) if m else 0.0 for m in mask]
    sets = tables = None
    if draw(st.booleans()):  # top-k / top-p: candidate sets at trained positions
        sets = [
            sorted(set(draw(st.lists(st.integers(0, 50), min_size=1, max_size=4)))) if m else None
            for m in mask
        ]
    if draw(st.booleans()):  # num_sampler_logprobs: the sampler's top log-probs
        tables = [
            {
                t: -draw(st.floats(0.0, 9.0))
                for t in draw(st.sets(st.integers(0, 50), min_size=1, max_size=3))
            }
            if m
            else None
            for m in mask
        ]
    sequence = TrainingSequence(
        ids, mask, logprobs, sampling_masks=sets, sampler_top_logprobs=tables
    )
    return TrainingSample(
        sequence,
        draw(st.floats(-3.0, 3.0)),
        draw(st.integers(0, 40)),
        draw(st.integers(0, 100)),
        draw(st.integers(0, 100)),
        draw(st.integers(0, 1000)),
        draw(st.text(min_size=1, max_size=8)),
        queued_at=draw(st.floats(0.0, 1e6)),
    )


def same(a: TrainingSample, b: TrainingSample) -> bool:
    """Equal records, the top log-probs too (left out of TrainingSequence's equality)."""
    tops = a.sequence.sampler_top_logprobs, b.sequence.sampler_top_logprobs
    if (tops[0] is None) != (tops[1] is None):
        return False
    if tops[0] is not None and tops[1] is not None:
        if not (
            np.array_equal(tops[0].ids, tops[1].ids)
            and np.array_equal(tops[0].counts, tops[1].counts)
        ):
            return False
        if not np.array_equal(tops[0].logprobs, tops[1].logprobs):
            return False
    return a == b


@given(st.lists(samples(), max_size=6), st.floats(0.0, 1e6))
def test_saved_samples_come_back_as_they_were_queued_on_the_resumed_runs_clock(saved, now) -> None:
    arrays, records = samples_to_arrays(saved)
    back = samples_from_arrays(arrays, records, queued_at=now)
    assert len(back) == len(saved)
    for restored, original in zip(back, saved, strict=True):
        assert restored.queued_at == now
        assert same(restored, attrs.evolve(original, queued_at=now))


def test_a_sample_whose_arrays_are_missing_or_do_not_fit_is_named() -> None:
    sequence = TrainingSequence([1, 2, 3], [0, 1, 1], [0.0, -0.5, -1.0])
    arrays, records = samples_to_arrays([TrainingSample(sequence, 1.0, 0, 0, 0, 4, "r")] * 2)
    del arrays["1.trained_mask"]
    with pytest.raises(ValueError, match=r"saved sample 1: missing \['trained_mask'\]"):
        samples_from_arrays(arrays, records, queued_at=0.0)
    arrays, _ = samples_to_arrays([TrainingSample(sequence, 1.0, 0, 0, 0, 4, "r")])
    arrays["0.sampler_logprobs"] = np.zeros(2)
    with pytest.raises(ValueError, match="saved sample 0 does not load: .*sampler_logprobs"):
        samples_from_arrays(arrays, records[:1], queued_at=0.0)
