"""The CPU attention backend choice: the cheaper of two monotone cost models."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.packing.attention_choice import (
    DENSE,
    SEGMENTS,
    cheaper_backend,
    dense_cost,
    segments_cost,
)

rows = st.integers(1, 8192).flatmap(
    lambda t: st.tuples(st.just(t), st.integers(1, t), st.integers(t, t * (t + 1) // 2))
)
widths = st.sampled_from([64, 128, 1024, 2048])
layers = st.integers(1, 64)


@given(rows, widths, layers)
def test_the_pick_is_the_cheaper_model(row, width, depth) -> None:
    tokens, segments, pairs = row
    pick = cheaper_backend(tokens, segments, pairs, width, depth)
    dense = dense_cost(tokens, width, depth)
    split = segments_cost(segments, pairs, width, depth)
    assert pick == (DENSE if dense < split else SEGMENTS)


@given(rows, widths, layers, st.integers(1, 100))
def test_more_segments_at_equal_pairs_never_turn_the_pick_to_segments(
    row, width, depth, extra
) -> None:
    tokens, segments, pairs = row
    if cheaper_backend(tokens, segments, pairs, width, depth) == DENSE:
        assert cheaper_backend(tokens, segments + extra, pairs, width, depth) == DENSE


def test_bad_counts_are_refused() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        cheaper_backend(0, 1, 1, 64)
