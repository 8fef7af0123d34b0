"""Tree packing: the samples of one row laid out as a prefix trie, depth first, without padding.

Tokens that several samples share are forwarded once, and attention lets each token see
exactly its own history: the keys and values of its segment's path in the trie. A position
predicts one token, so a position is shared only while the *next* token is shared too. The
worked example of TRL's AsyncGRPOTrainer documentation (two rollouts of one prompt):

    rollouts        r0: p1 p2 p3 a1 a2        r1: p1 p2 p3 b1 b2          (10 tokens)
    trie            S0 [p1 p2] ─┬─ S1 [p3 a1 a2]
                                └─ S2 [p3 b1 b2]     p3 predicts a1 or b1: not shared
    packed row      index         0  1 | 2  3  4 | 5  6  7                 (8 tokens)
                    input_ids    p1 p2 | p3 a1 a2 | p3 b1 b2
                    position_ids  0  1 | 2  3  4 | 2  3  4
    attention       S0: keys 0 1    S1: keys 0 1 2 3 4    S2: keys 0 1 5 6 7
    loss            a1 a2 predicted at 2 3;   b1 b2 predicted at 5 6

Construction: the samples are sorted lexicographically, which is the trie's depth-first order;
the shared depth of neighbours gives the trie, and a sample's new nodes take the next row
indices. Two identical samples share every node (their tokens are predicted at the same rows).

Every trained token keeps its own target, advantage and sampler log-prob, and its log-prob
equals that of its sample forwarded alone (``tests/core/test_packing.py`` checks the
prediction indices and attention sets; the learner's tests check the numbers).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import attrs
import numpy as np

from asyncgrpo.core.frozen import ARRAY_EQ, read_only
from asyncgrpo.core.records import TrainingSample
from asyncgrpo.core.sampler_tables import CandidateSets, TopLogprobs

Table = TypeVar("Table", CandidateSets, TopLogprobs)


def shared_positions(a: np.ndarray, b: np.ndarray) -> int:
    """Positions two token sequences can share in a trie: all of them when identical, else
    the common prefix minus one (the last common position predicts different next tokens).

    Example:
        >>> shared_positions(np.array([1, 2, 3, 4]), np.array([1, 2, 3, 9]))
        2
        >>> shared_positions(np.array([1, 2]), np.array([1, 2]))
        2
    """
    if a.size and b.size and a[0] != b[0]:  # different prompts: the usual case, at once
        return 0
    n = min(len(a), len(b))
    # the first difference, in windows growing 4x: samples of one prompt differ after it,
    # so long responses are not compared whole
    common, start, width = n, 0, 256
    while start < n:
        stop = min(n, start + width)
        diff = np.flatnonzero(a[start:stop] != b[start:stop])
        if diff.size:
            common = start + int(diff[0])
            break
        start, width = stop, 4 * width
    if common == len(a) == len(b):
        return common
    return max(0, common - 1)


@attrs.frozen
class PackedRow:
    """One row: the samples of one process for one micro-batch, tree-packed.

    Row arrays (``T`` = forwarded tokens, ``S`` = segments):
        input_ids: int64 [T].
        position_ids: int64 [T], each token's position in its own sample (its trie depth).
        segment_ids: int64 [T], the segment of each token.
        segment_starts, segment_lengths: int64 [S], each segment's contiguous row range.
        segment_parents: int64 [S], the parent segment, -1 for a root.
        kv_indices: int64 [sum of path lengths], for each segment in order, the row indices of
            its keys and values (its path from the root, itself included).
        cu_seqlens_q, cu_seqlens_k: int32 [S + 1], cumulative segment and path lengths: the
            varlen-kernel view (queries of segment ``g`` are rows
            ``cu_seqlens_q[g]:cu_seqlens_q[g+1]``; its keys are
            ``kv_indices[cu_seqlens_k[g]:cu_seqlens_k[g+1]]``, causal, bottom-right aligned).
        trained_rows: int64 [T_trained], row indices holding a trained target of some sample.

    Trained-token arrays (``N`` = trained tokens over all samples, sample by sample):
        predict_index: int64 [N], the row whose output predicts the token.
        target_ids: int64 [N], the token.
        sampler_logprobs: float64 [N], the sampler's log-prob of the token.
        advantages: float64 [N], its sample's advantage.
        sample_index: int64 [N], index of its sample in ``samples``.
        candidate_sets: [N] candidate sets (ids int64 [N, K], counts int64 [N], see
            :mod:`asyncgrpo.core.sampler_tables`), the sampler's candidate ids under
            top-k/top-p at each trained token; ``None`` when no sample carries them (full
            vocabulary).
        sampler_top_logprobs: [N] tables (ids int64 [N, K], log-probs float32 [N, K], counts
            int64 [N]), the sampler's top log-probs at each trained token, most probable
            first; ``None`` when no sample carries them.

    samples: the samples in this row, in the order given.
    """

    input_ids: np.ndarray = attrs.field(eq=ARRAY_EQ)
    position_ids: np.ndarray = attrs.field(eq=ARRAY_EQ)
    segment_ids: np.ndarray = attrs.field(eq=ARRAY_EQ)
    segment_starts: np.ndarray = attrs.field(eq=ARRAY_EQ)
    segment_lengths: np.ndarray = attrs.field(eq=ARRAY_EQ)
    segment_parents: np.ndarray = attrs.field(eq=ARRAY_EQ)
    kv_indices: np.ndarray = attrs.field(eq=ARRAY_EQ)
    cu_seqlens_q: np.ndarray = attrs.field(eq=ARRAY_EQ)
    cu_seqlens_k: np.ndarray = attrs.field(eq=ARRAY_EQ)
    trained_rows: np.ndarray = attrs.field(eq=ARRAY_EQ)
    predict_index: np.ndarray = attrs.field(eq=ARRAY_EQ)
    target_ids: np.ndarray = attrs.field(eq=ARRAY_EQ)
    sampler_logprobs: np.ndarray = attrs.field(eq=ARRAY_EQ)
    advantages: np.ndarray = attrs.field(eq=ARRAY_EQ)
    sample_index: np.ndarray = attrs.field(eq=ARRAY_EQ)
    candidate_sets: CandidateSets | None
    sampler_top_logprobs: TopLogprobs | None = attrs.field(eq=False)
    samples: tuple[TrainingSample, ...] = attrs.field(eq=False)

    def without_sample_tables(self) -> PackedRow:
        """The row with its samples' own per-position sampler tables left out: the trained-token
        arrays already hold what the learner reads, and a row sent to a process carries them
        once (the samples keep their tokens and provenance)."""
        samples = tuple(
            attrs.evolve(
                s, sequence=attrs.evolve(s.sequence, sampling_masks=None, sampler_top_logprobs=None)
            )
            for s in self.samples
        )
        return attrs.evolve(self, samples=samples)

    @property
    def num_tokens(self) -> int:
        """Forwarded tokens ``T``."""
        return len(self.input_ids)

    @property
    def num_segments(self) -> int:
        return len(self.segment_starts)

    @property
    def unpacked_tokens(self) -> int:
        """Tokens the samples would forward one by one."""
        return sum(len(s.sequence) for s in self.samples)

    def segment_keys(self, segment: int) -> np.ndarray:
        """Row indices of the keys and values of ``segment`` (its trie path)."""
        return self.kv_indices[self.cu_seqlens_k[segment] : self.cu_seqlens_k[segment + 1]]

    def dense_mask(self) -> np.ndarray:
        """bool [T, T]: ``mask[q, k]`` is True when query ``q`` attends to key ``k``.

        The reference layout for tests and the CPU attention path; memory grows as T².
        """
        mask = np.zeros((self.num_tokens, self.num_tokens), dtype=bool)
        for segment in range(self.num_segments):
            keys = self.segment_keys(segment)
            start = int(self.segment_starts[segment])
            length = int(self.segment_lengths[segment])
            prefix = len(keys) - length
            for offset in range(length):
                mask[start + offset, keys[: prefix + offset + 1]] = True
        return mask


def _trained_columns(
    samples: Sequence[TrainingSample], paths: Sequence[np.ndarray]
) -> dict[str, np.ndarray]:
    positions = [np.flatnonzero(s.sequence.trained_mask) for s in samples]
    return {
        "predict_index": np.concatenate(
            [path[pos - 1] for path, pos in zip(paths, positions, strict=True)]
            or [np.zeros(0, np.int64)]
        ).astype(np.int64),
        "target_ids": np.concatenate(
            [s.sequence.input_ids[pos] for s, pos in zip(samples, positions, strict=True)]
            or [np.zeros(0, np.int64)]
        ).astype(np.int64),
        "sampler_logprobs": np.concatenate(
            [s.sequence.sampler_logprobs[pos] for s, pos in zip(samples, positions, strict=True)]
            or [np.zeros(0)]
        ).astype(np.float64),
        "advantages": np.concatenate(
            [np.full(len(pos), s.advantage) for s, pos in zip(samples, positions, strict=True)]
            or [np.zeros(0)]
        ),
        "sample_index": np.concatenate(
            [np.full(len(pos), i, np.int64) for i, pos in enumerate(positions)]
            or [np.zeros(0, np.int64)]
        ),
        "trained_rows": np.unique(
            np.concatenate(
                [path[pos] for path, pos in zip(paths, positions, strict=True)]
                or [np.zeros(0, np.int64)]
            )
        ).astype(np.int64),
    }


def _per_token(samples: Sequence[TrainingSample], field: str, kind: type[Table]) -> Table | None:
    """The ``field`` tables of the trained tokens, sample by sample (none where a sample has
    none), or None when no sample has them."""
    if all(getattr(s.sequence, field) is None for s in samples):
        return None
    parts: list[Table] = []
    for sample in samples:
        column = getattr(sample.sequence, field)
        positions = np.flatnonzero(sample.sequence.trained_mask)
        parts.append(kind.missing(len(positions)) if column is None else column.take(positions))
    return kind.concatenate(parts)


def pack_row(samples: Sequence[TrainingSample]) -> PackedRow:
    """Lay out ``samples`` as one tree-packed row (see the module docstring).

    Args:
        samples: the row's samples (a ``TrainingSequence`` always starts with context).

    Returns:
        The :class:`PackedRow`; its trained-token arrays follow ``samples`` order.
    """
    if not samples:
        raise ValueError("pack_row needs at least one sample")
    tokens = [s.sequence.input_ids for s in samples]
    order = sorted(range(len(samples)), key=lambda i: tuple(tokens[i].tolist()))
    paths: list[np.ndarray] = [np.zeros(0, np.int64)] * len(samples)
    boundaries = {0}
    next_row = 0
    previous: int | None = None
    for index in order:
        seq = tokens[index]
        shared = 0 if previous is None else shared_positions(tokens[previous], seq)
        prefix = paths[previous][:shared] if previous is not None else paths[index][:0]
        new = np.arange(next_row, next_row + len(seq) - shared, dtype=np.int64)
        if previous is not None and shared < len(paths[previous]):
            boundaries.add(int(paths[previous][shared]))
        if len(new):
            boundaries.add(int(new[0]))
        next_row += len(new)
        paths[index] = np.concatenate([prefix, new])
        previous = index
    total = next_row
    input_ids = np.zeros(total, np.int64)
    position_ids = np.zeros(total, np.int64)
    parent_row = np.full(total, -1, np.int64)
    for seq, path in zip(tokens, paths, strict=True):
        input_ids[path] = seq
        position_ids[path] = np.arange(len(path))
        parent_row[path[1:]] = path[:-1]
    starts = np.array(sorted(boundaries), np.int64)
    lengths = np.diff(np.append(starts, total)).astype(np.int64)
    segment_ids = (np.searchsorted(starts, np.arange(total), side="right") - 1).astype(np.int64)
    first_parent = parent_row[starts]
    parents = np.where(first_parent >= 0, segment_ids[np.maximum(first_parent, 0)], -1)
    key_paths: list[np.ndarray] = []
    for segment, (start, length, parent) in enumerate(zip(starts, lengths, parents, strict=True)):
        own = np.arange(start, start + length, dtype=np.int64)
        key_paths.append(own if parent < 0 else np.concatenate([key_paths[parent], own]))
        if parent >= segment:
            raise AssertionError("segments must follow their parents in depth-first order")
    kv_lengths = np.array([len(k) for k in key_paths], np.int64)
    return PackedRow(
        input_ids=read_only(input_ids),
        position_ids=read_only(position_ids),
        segment_ids=read_only(segment_ids),
        segment_starts=read_only(starts),
        segment_lengths=read_only(lengths),
        segment_parents=read_only(parents.astype(np.int64)),
        kv_indices=read_only(np.concatenate(key_paths)),
        cu_seqlens_q=read_only(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)),
        cu_seqlens_k=read_only(np.concatenate([[0], np.cumsum(kv_lengths)]).astype(np.int32)),
        **{k: read_only(v) for k, v in _trained_columns(samples, paths).items()},
        candidate_sets=_per_token(samples, "sampling_masks", CandidateSets),
        sampler_top_logprobs=_per_token(samples, "sampler_top_logprobs", TopLogprobs),
        samples=tuple(samples),
    )
