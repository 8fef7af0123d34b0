"""A packed row's samples as a right-padded batch: every sample whole in its own row, padding
after it, and each trained token predicted at its own sample's position, in the row's order."""

import attrs
import numpy as np
import pytest
from hypothesis import given
from packing_strategies import make_sample, sample_sets

from asyncgrpo.core.packing.sample_batch import PAD_ID, sample_batch
from asyncgrpo.core.packing.tree import pack_row


@given(sample_sets())
def test_each_sample_is_whole_in_its_own_row_with_padding_after_it(samples) -> None:
    row = pack_row(samples)
    batch = sample_batch(row)
    assert batch.input_ids.shape == (len(samples), max(len(s.sequence) for s in samples))
    for b, sample in enumerate(row.samples):
        ids = np.asarray(sample.sequence.input_ids)
        assert np.array_equal(batch.input_ids[b, : len(ids)], ids)
        assert (batch.input_ids[b, len(ids) :] == PAD_ID).all()
    flat = batch.input_ids.reshape(-1)[batch.real_flat]
    assert np.array_equal(flat, np.concatenate([s.sequence.input_ids for s in row.samples]))
    assert batch.lengths.sum() == sum(len(s.sequence) for s in samples) <= batch.input_ids.size


@given(sample_sets())
def test_each_trained_token_is_predicted_by_its_own_samples_previous_position(samples) -> None:
    row = pack_row(samples)
    batch = sample_batch(row)
    assert np.array_equal(batch.predict_rows, row.sample_index)
    nexts = batch.input_ids[batch.predict_rows, batch.predict_positions + 1]
    assert np.array_equal(nexts, row.target_ids)
    for n, (b, p) in enumerate(zip(batch.predict_rows, batch.predict_positions, strict=True)):
        assert row.samples[b].sequence.trained_mask[p + 1]
        assert row.input_ids[row.predict_index[n]] == row.samples[b].sequence.input_ids[p]


def test_a_row_whose_samples_are_not_its_tokens_is_refused() -> None:
    row = pack_row([make_sample([1, 2, 3, 4], [0, 0, 1, 1])])
    other = attrs.evolve(row, target_ids=row.target_ids + 1)
    with pytest.raises(ValueError, match="build rows with pack_row"):
        sample_batch(other)
