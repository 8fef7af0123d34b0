"""Index work for recurrent layers (gated DeltaNet) on a tree-packed row.

A gated DeltaNet layer has two token-mixing parts that must follow each token's own path in the
prefix trie of a :class:`~asyncgrpo.core.packing.tree.PackedRow` rather than the row order:

* a short causal convolution of width ``K``: each token reads its ``K - 1`` predecessors along
  its path, which cross into the parent segment (and further up when the parent is shorter);
* the chunked delta rule: a segment's recurrence starts from its parent segment's final state.

This module computes, once per row and for every layer, the row indices both need:

* :attr:`RecurrentLayout.conv_window` [T, K]: per token, the row indices of its ``K - 1`` path
  predecessors (oldest first) and itself, ``T`` (a zero padding row) where the path is shorter;
* :attr:`RecurrentLayout.levels`: the segments grouped by trie depth. Segments of one depth
  are independent given their parents' final states, so each depth runs as one padded batch
  (right padding with ``beta = 0``, ``g = 0`` leaves a state unchanged);
* :attr:`RecurrentLayout.output_order` [T]: where each row's output lies in the concatenation
  of the levels' valid outputs.

Example: the worked example of :mod:`asyncgrpo.core.packing.tree` (``S0 = [0 1]`` the root,
``S1 = [2 3 4]`` and ``S2 = [5 6 7]`` its children), with ``K = 3``:

    >>> from asyncgrpo.core.packing.tree import pack_row
    >>> from asyncgrpo.core.records import TrainingSample, TrainingSequence
    >>> def sample(tokens):
    ...     seq = TrainingSequence(tokens, [0] + [1] * (len(tokens) - 1), [0.0] * len(tokens))
    ...     return TrainingSample(seq, 1.0, 0, 0, 0, 0, "r")
    >>> row = pack_row([sample([11, 12, 13, 21, 22]), sample([11, 12, 13, 31, 32])])
    >>> layout = recurrent_layout(row, conv_kernel=3)
    >>> layout.conv_window[5].tolist()  # token 5 (p3 of S2) reads rows 0 and 1 of the root
    [0, 1, 5]
    >>> layout.conv_window[0].tolist()  # the first token has no predecessors: padding row 8
    [8, 8, 0]
    >>> [level.rows.tolist() for level in layout.levels]
    [[[0, 1]], [[2, 3, 4], [5, 6, 7]]]
    >>> [level.parent_slots.tolist() for level in layout.levels]
    [[-1], [0, 0]]
"""

from __future__ import annotations

import attrs
import numpy as np

from asyncgrpo.core.frozen import ARRAY_EQ, read_only
from asyncgrpo.core.packing.tree import PackedRow


@attrs.frozen
class DepthLevel:
    """The segments at one trie depth, as one right-padded batch.

    Attributes:
        segments: int64 [B], the segment ids, ascending.
        rows: int64 [B, L], each segment's row indices in order, padded with ``T`` (the row
            count, a zero padding row) up to the level's longest segment ``L``.
        parent_slots: int64 [B], the slot of each segment's parent among the final states of
            all earlier levels concatenated in level order (a segment's slot is its level's
            offset plus its index in ``segments``); -1 for roots (depth 0 only).
        valid_flat: int64 [n], the flat indices into ``rows.reshape(-1)`` that hold a real row,
            in order.
    """

    segments: np.ndarray = attrs.field(eq=ARRAY_EQ)
    rows: np.ndarray = attrs.field(eq=ARRAY_EQ)
    parent_slots: np.ndarray = attrs.field(eq=ARRAY_EQ)
    valid_flat: np.ndarray = attrs.field(eq=ARRAY_EQ)


@attrs.frozen
class RecurrentLayout:
    """A row's index tables for recurrent layers (see the module docstring).

    Attributes:
        num_tokens: ``T``, the row's tokens; ``T`` is also the padding row index.
        conv_window: int64 [T, K], per token its ``K - 1`` path predecessors, oldest first,
            then itself; ``T`` where the path has fewer predecessors.
        levels: the depth levels, root depth first.
        output_order: int64 [T], for row ``t`` the index of its output in the concatenation
            over levels of ``outputs.reshape(B * L, ...)[valid_flat]``.
    """

    num_tokens: int
    conv_window: np.ndarray = attrs.field(eq=ARRAY_EQ)
    levels: tuple[DepthLevel, ...]
    output_order: np.ndarray = attrs.field(eq=ARRAY_EQ)


def path_predecessors(row: PackedRow) -> np.ndarray:
    """int64 [T]: each token's predecessor along its trie path (the previous row of its
    segment, or its parent segment's last row for a segment's first token); -1 at a root's
    first token."""
    previous = np.arange(row.num_tokens, dtype=np.int64) - 1
    parents = row.segment_parents
    has_parent = parents >= 0
    parent_last = row.segment_starts[parents] + row.segment_lengths[parents] - 1
    previous[row.segment_starts] = np.where(has_parent, parent_last, -1)
    return previous


def conv_window(row: PackedRow, conv_kernel: int) -> np.ndarray:
    """int64 [T, conv_kernel]: see :attr:`RecurrentLayout.conv_window`."""
    if conv_kernel < 1:
        raise ValueError(f"conv_kernel must be >= 1 taps, got {conv_kernel}")
    t = row.num_tokens
    # predecessor table with the padding row T mapping to itself
    previous = np.append(path_predecessors(row), t)
    previous[previous < 0] = t
    window = np.empty((t, conv_kernel), dtype=np.int64)
    window[:, -1] = np.arange(t)
    for tap in range(conv_kernel - 2, -1, -1):
        window[:, tap] = previous[window[:, tap + 1]]
    return window


def segment_depths(parents: np.ndarray) -> np.ndarray:
    """int64 [S]: each segment's number of ancestors (parents precede children)."""
    depths = np.zeros(len(parents), dtype=np.int64)
    for segment, parent in enumerate(parents):
        if parent >= segment:
            raise ValueError(f"segment {segment} has parent {parent}: parents must come first")
        depths[segment] = 0 if parent < 0 else depths[parent] + 1
    return depths


def recurrent_layout(row: PackedRow, conv_kernel: int) -> RecurrentLayout:
    """The row's :class:`RecurrentLayout` for a convolution of ``conv_kernel`` taps."""
    t = row.num_tokens
    depths = segment_depths(row.segment_parents)
    slot_of = np.full(row.num_segments, -1, dtype=np.int64)
    levels: list[DepthLevel] = []
    ordered_rows: list[np.ndarray] = []
    next_slot = 0
    for depth in range(int(depths.max()) + 1):
        segments = np.flatnonzero(depths == depth).astype(np.int64)
        lengths = row.segment_lengths[segments]
        offsets = np.arange(int(lengths.max()), dtype=np.int64)
        rows = np.where(
            offsets[None, :] < lengths[:, None],
            row.segment_starts[segments][:, None] + offsets[None, :],
            t,
        )
        parents = row.segment_parents[segments]
        parent_slots = np.where(parents >= 0, slot_of[np.maximum(parents, 0)], -1)
        slot_of[segments] = next_slot + np.arange(len(segments))
        next_slot += len(segments)
        valid_flat = np.flatnonzero(rows.reshape(-1) < t).astype(np.int64)
        ordered_rows.append(rows.reshape(-1)[valid_flat])
        levels.append(
            DepthLevel(
                segments=read_only(segments),
                rows=read_only(rows.astype(np.int64)),
                parent_slots=read_only(parent_slots.astype(np.int64)),
                valid_flat=read_only(valid_flat),
            )
        )
    output_order = np.empty(t, dtype=np.int64)
    output_order[np.concatenate(ordered_rows)] = np.arange(t)
    return RecurrentLayout(
        num_tokens=t,
        conv_window=read_only(conv_window(row, conv_kernel)),
        levels=tuple(levels),
        output_order=read_only(output_order),
    )
