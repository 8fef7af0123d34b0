import attrs
import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from packing_strategies import as_dicts, attended, make_sample, sample_sets

from asyncgrpo.core.packing.tree import pack_row, shared_positions

P1, P2, P3, A1, A2, B1, B2 = 11, 12, 13, 21, 22, 31, 32


def test_the_seeds_worked_example_verbatim() -> None:
    r0 = make_sample([P1, P2, P3, A1, A2], [0, 0, 0, 1, 1], rollout="r0")
    r1 = make_sample([P1, P2, P3, B1, B2], [0, 0, 0, 1, 1], rollout="r1")
    row = pack_row([r0, r1])
    assert row.input_ids.tolist() == [P1, P2, P3, A1, A2, P3, B1, B2]
    assert row.position_ids.tolist() == [0, 1, 2, 3, 4, 2, 3, 4]
    assert row.segment_ids.tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert row.segment_parents.tolist() == [-1, 0, 0]
    assert row.segment_keys(0).tolist() == [0, 1]
    assert row.segment_keys(1).tolist() == [0, 1, 2, 3, 4]
    assert row.segment_keys(2).tolist() == [0, 1, 5, 6, 7]
    assert row.predict_index.tolist() == [2, 3, 5, 6]
    assert row.target_ids.tolist() == [A1, A2, B1, B2]
    assert row.cu_seqlens_q.tolist() == [0, 2, 5, 8]
    assert row.cu_seqlens_k.tolist() == [0, 2, 7, 12]
    assert row.unpacked_tokens == 10 and row.num_tokens == 8


def alone(sample):
    return pack_row([sample])


@given(sample_sets())
def test_each_trained_token_sees_exactly_what_it_sees_alone(samples) -> None:
    row = pack_row(samples)
    for index, sample in enumerate(samples):
        single = alone(sample)
        mine = row.sample_index == index
        assert row.target_ids[mine].tolist() == single.target_ids.tolist()
        np.testing.assert_array_equal(row.sampler_logprobs[mine], single.sampler_logprobs)
        assert np.all(row.advantages[mine] == sample.advantage)
        for packed_at, alone_at in zip(row.predict_index[mine], single.predict_index, strict=True):
            seen = attended(row, int(packed_at))
            seen_alone = attended(single, int(alone_at))
            # Same tokens at the same positions, in order: the same attention inputs.
            assert row.input_ids[seen].tolist() == single.input_ids[seen_alone].tolist()
            assert row.position_ids[seen].tolist() == single.position_ids[seen_alone].tolist()
            assert row.position_ids[packed_at] == single.position_ids[alone_at]


@given(sample_sets())
def test_layout_is_a_valid_tree(samples) -> None:
    row = pack_row(samples)
    total = int(row.segment_lengths.sum())
    assert total == row.num_tokens == row.cu_seqlens_q[-1]
    assert np.all(np.diff(row.segment_starts) > 0)
    for segment in range(row.num_segments):
        parent = row.segment_parents[segment]
        keys = row.segment_keys(segment)
        start, length = row.segment_starts[segment], row.segment_lengths[segment]
        assert keys[-length:].tolist() == list(range(start, start + length))
        if parent >= 0:
            assert parent < segment
            assert keys[:-length].tolist() == row.segment_keys(parent).tolist()
        # positions count up along the path from 0
        assert row.position_ids[keys].tolist() == list(range(len(keys)))
    mask = row.dense_mask()
    for q in range(row.num_tokens):
        assert np.flatnonzero(mask[q]).tolist() == sorted(attended(row, q).tolist())


@given(sample_sets())
def test_packing_ratio_at_least_one_and_tokens_counted_once(samples) -> None:
    row = pack_row(samples)
    assert row.num_tokens <= row.unpacked_tokens
    trained = sum(s.sequence.num_trained for s in samples)
    assert len(row.target_ids) == trained
    assert set(row.trained_rows.tolist()) <= set(range(row.num_tokens))


def test_nothing_shared_is_plain_padding_free_packing() -> None:
    a = make_sample([1, 2, 3], [0, 1, 1])
    b = make_sample([4, 5], [0, 1])
    row = pack_row([b, a])
    assert row.num_tokens == row.unpacked_tokens == 5
    assert row.num_segments == 2 and row.segment_parents.tolist() == [-1, -1]


def test_identical_samples_share_every_row() -> None:
    a = make_sample([1, 2, 3], [0, 1, 1], rollout="a")
    b = make_sample([1, 2, 3], [0, 1, 1], rollout="b")
    row = pack_row([a, b])
    assert row.num_tokens == 3
    assert row.predict_index.tolist() == [0, 1, 0, 1]


def test_shared_positions_rule() -> None:
    assert shared_positions(np.array([1, 2, 3]), np.array([1, 2])) == 1
    assert shared_positions(np.array([5]), np.array([6])) == 0


tokens = st.lists(st.integers(0, 2), max_size=1500)


@given(tokens, tokens, st.integers(0, 1500))
def test_shared_positions_is_the_common_prefix_less_the_diverging_one(a, b, copied) -> None:
    """Against the rule read off token by token, on sequences long enough to span the windows
    it compares in (``b`` often starts with ``copied`` tokens of ``a``)."""
    b = a[:copied] + b
    pairs = enumerate(zip(a, b, strict=False))
    common = next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))
    expected = common if common == len(a) == len(b) else max(0, common - 1)
    assert shared_positions(np.array(a, dtype=np.int64), np.array(b, dtype=np.int64)) == expected


@given(sample_sets(), st.data())
def test_each_trained_token_carries_its_samples_tables_also_when_sent(samples, data) -> None:
    """Some samples carry top log-probs and candidate sets (one table per position, ids drawn
    from the position), others none; the row holds each trained token's own, in sample order,
    and still does once the samples' own copies are left out for sending."""
    with_tables = []
    for sample in samples:
        if data.draw(st.booleans()):
            tables = [{int(t): -0.5 * p} for p, t in enumerate(sample.sequence.input_ids)]
            sets = [[int(t), 99] for t in sample.sequence.input_ids]
            sequence = attrs.evolve(
                sample.sequence, sampler_top_logprobs=tables, sampling_masks=sets
            )
            sample = attrs.evolve(sample, sequence=sequence)
        with_tables.append(sample)
    samples = with_tables
    row = pack_row(samples)
    want_top, want_sets = [], []
    for sample in samples:
        top, sets = sample.sequence.sampler_top_logprobs, sample.sequence.sampling_masks
        for position in np.flatnonzero(sample.sequence.trained_mask):
            want_top.append(None if top is None else top[position])
            want_sets.append(None if sets is None else sets[position])
    if all(s.sequence.sampler_top_logprobs is None for s in samples):
        assert row.sampler_top_logprobs is None and row.candidate_sets is None
    else:
        assert as_dicts(row.sampler_top_logprobs) == tuple(want_top)
        assert row.candidate_sets.to_sets() == tuple(want_sets)
    sent = row.without_sample_tables()
    assert all(s.sequence.sampler_top_logprobs is None for s in sent.samples)
    assert all(s.sequence.sampling_masks is None for s in sent.samples)
    assert sent == row and sent.sampler_top_logprobs == row.sampler_top_logprobs
    assert [s.rollout_id for s in sent.samples] == [s.rollout_id for s in samples]
