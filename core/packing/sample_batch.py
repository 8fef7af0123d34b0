"""A packed row's samples as a batch of separate sequences: the fallback layout for decoders
the tree-packed forward cannot compute exactly.

Each sample becomes one sequence of the batch, right-padded to the longest; nothing is shared,
so a causal model computes every real position exactly as for the sample alone (padding comes
after it and is never seen). The row's trained tokens keep their order: trained token ``n``
is predicted by batch row ``predict_rows[n]`` at position ``predict_positions[n]``.

Example: two samples of 3 and 5 tokens, the last two tokens of each trained:

    >>> from asyncgrpo.core.packing.tree import pack_row
    >>> from asyncgrpo.core.records import TrainingSample, TrainingSequence
    >>> def sample(tokens):
    ...     mask = [0] * (len(tokens) - 2) + [1, 1]
    ...     seq = TrainingSequence(tokens, mask, [0.0] * len(tokens))
    ...     return TrainingSample(seq, 1.0, 0, 0, 0, 0, "r")
    >>> batch = sample_batch(pack_row([sample([5, 6, 7]), sample([5, 6, 8, 9, 4])]))
    >>> batch.input_ids.tolist()
    [[5, 6, 7, 0, 0], [5, 6, 8, 9, 4]]
    >>> batch.predict_rows.tolist(), batch.predict_positions.tolist()
    ([0, 0, 1, 1], [0, 1, 2, 3])
"""

from __future__ import annotations

import attrs
import numpy as np

from asyncgrpo.core.frozen import ARRAY_EQ, read_only
from asyncgrpo.core.packing.tree import PackedRow

PAD_ID = 0
"""The id right padding holds (any id in the vocabulary: no real position sees it)."""


@attrs.frozen
class SampleBatch:
    """A row's samples as one right-padded batch (see the module docstring).

    Attributes:
        input_ids: int64 [B, L], sample ``b`` in row ``b``, padded with :data:`PAD_ID`.
        lengths: int64 [B], each sample's own length.
        predict_rows: int64 [N], the batch row whose output predicts trained token ``n``.
        predict_positions: int64 [N], its position in that row.
        real_flat: int64 [sum of lengths], the flat indices into ``input_ids.reshape(-1)``
            of real (not padding) tokens, row by row.
    """

    input_ids: np.ndarray = attrs.field(eq=ARRAY_EQ)
    lengths: np.ndarray = attrs.field(eq=ARRAY_EQ)
    predict_rows: np.ndarray = attrs.field(eq=ARRAY_EQ)
    predict_positions: np.ndarray = attrs.field(eq=ARRAY_EQ)
    real_flat: np.ndarray = attrs.field(eq=ARRAY_EQ)


def sample_batch(row: PackedRow) -> SampleBatch:
    """``row``'s samples as a :class:`SampleBatch`, its trained tokens in ``predict_index``
    order.

    Raises:
        ValueError: a trained token of the row is not its sample's own next token (the row's
            trie arrays and samples disagree).
    """
    tokens = [np.asarray(s.sequence.input_ids, dtype=np.int64) for s in row.samples]
    lengths = np.array([len(t) for t in tokens], dtype=np.int64)
    input_ids = np.full((len(tokens), int(lengths.max())), PAD_ID, dtype=np.int64)
    for b, ids in enumerate(tokens):
        input_ids[b, : len(ids)] = ids
    predict_rows = np.asarray(row.sample_index, dtype=np.int64)
    predict_positions = np.asarray(row.position_ids[row.predict_index], dtype=np.int64)
    nexts = input_ids[predict_rows, np.minimum(predict_positions + 1, input_ids.shape[1] - 1)]
    if np.any(predict_positions + 1 >= lengths[predict_rows]) or not np.array_equal(
        nexts, row.target_ids
    ):
        raise ValueError(
            "the packed row's trained tokens are not its samples' own next tokens: its trie "
            "arrays and its samples disagree (build rows with pack_row)"
        )
    return SampleBatch(
        input_ids=read_only(input_ids),
        lengths=read_only(lengths),
        predict_rows=read_only(predict_rows),
        predict_positions=read_only(predict_positions),
        real_flat=read_only(real_positions(lengths)),
    )


def real_positions(lengths: np.ndarray) -> np.ndarray:
    """int64 [sum of lengths]: the flat indices of the samples' own tokens in a right-padded
    batch of sequences of ``lengths`` (``B x max(lengths)`` positions), row by row.

    Example:
        >>> real_positions(np.array([3, 5])).tolist()
        [0, 1, 2, 5, 6, 7, 8, 9]
    """
    width = int(lengths.max())
    return np.concatenate([b * width + np.arange(n, dtype=np.int64) for b, n in enumerate(lengths)])
