import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from packing_strategies import attended, make_sample, sample_sets

from asyncgrpo.core.packing.recurrent_tree import recurrent_layout, segment_depths
from asyncgrpo.core.packing.tree import pack_row


def path_of(row, token: int) -> list[int]:
    """The token's path from the root, itself last (its attention keys)."""
    return attended(row, token).tolist()


@given(sample_sets(), st.integers(1, 6))
def test_conv_window_is_the_tail_of_each_tokens_own_path(samples, kernel) -> None:
    row = pack_row(samples)
    layout = recurrent_layout(row, kernel)
    t = row.num_tokens
    assert layout.conv_window.shape == (t, kernel)
    for token in range(t):
        tail = path_of(row, token)[-kernel:]
        expected = [t] * (kernel - len(tail)) + tail
        assert layout.conv_window[token].tolist() == expected


@given(sample_sets(), st.integers(1, 6))
def test_conv_window_sees_the_same_tokens_as_the_sample_alone(samples, kernel) -> None:
    row = pack_row(samples)
    layout = recurrent_layout(row, kernel)
    padded = np.append(row.input_ids, -1)
    for index, sample in enumerate(samples):
        single = pack_row([sample])
        alone = recurrent_layout(single, kernel)
        padded_alone = np.append(single.input_ids, -1)
        mine = row.predict_index[row.sample_index == index]
        for packed_at, alone_at in zip(mine, single.predict_index, strict=True):
            assert (
                padded[layout.conv_window[packed_at]].tolist()
                == padded_alone[alone.conv_window[alone_at]].tolist()
            )


@given(sample_sets())
def test_levels_cover_every_segment_once_after_its_parent(samples) -> None:
    row = pack_row(samples)
    layout = recurrent_layout(row, 4)
    depths = segment_depths(row.segment_parents)
    slots = np.concatenate([level.segments for level in layout.levels])
    assert sorted(slots.tolist()) == list(range(row.num_segments))
    for depth, level in enumerate(layout.levels):
        assert np.all(depths[level.segments] == depth)
        for segment, rows, parent_slot in zip(
            level.segments, level.rows, level.parent_slots, strict=True
        ):
            start, length = row.segment_starts[segment], row.segment_lengths[segment]
            assert rows[:length].tolist() == list(range(start, start + length))
            assert np.all(rows[length:] == row.num_tokens)
            parent = row.segment_parents[segment]
            if depth == 0:
                assert parent == -1 and parent_slot == -1
            else:
                # the parent's slot lies in an earlier level and names the parent
                assert 0 <= parent_slot < sum(len(lv.segments) for lv in layout.levels[:depth])
                assert slots[parent_slot] == parent


@given(sample_sets())
def test_output_order_puts_each_rows_output_back_in_place(samples) -> None:
    row = pack_row(samples)
    layout = recurrent_layout(row, 4)
    flat = np.concatenate([lv.rows.reshape(-1)[lv.valid_flat] for lv in layout.levels])
    assert flat[layout.output_order].tolist() == list(range(row.num_tokens))


def test_a_segment_shorter_than_the_window_reaches_its_grandparent() -> None:
    prompt = [1, 2, 3, 4, 5]
    # forks after 5 and after 6: the middle segment [6] is shorter than K - 1 = 3
    samples = [
        make_sample([*prompt, 6, 7, 8], [0] * 5 + [1] * 3),
        make_sample([*prompt, 6, 7, 9], [0] * 5 + [1] * 3),
        make_sample([*prompt, 6, 9], [0] * 5 + [1] * 2),
    ]
    row = pack_row(samples)
    layout = recurrent_layout(row, 4)
    depths = segment_depths(row.segment_parents)
    assert depths.max() == 2
    deepest = int(np.flatnonzero(depths == 2)[0])
    first = int(row.segment_starts[deepest])
    parent = row.segment_parents[deepest]
    grandparent = row.segment_parents[parent]
    window_segments = row.segment_ids[layout.conv_window[first]]
    assert row.segment_lengths[parent] < 3
    assert grandparent in window_segments.tolist()
