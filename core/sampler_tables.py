"""The sampler's per-token tables as dense arrays: its top log-probs and its candidate sets.

At each of ``T`` token positions the sampler may report a small table: its most probable
tokens with their log-probs (``num_sampler_logprobs``, for score centering) and the ids it
could pick under top-k / top-p truncation (the candidate set). Both travel from the client's
parser to the learner as padded ``[T, K]`` arrays with a count per position, never as one
Python dict per token:

    position t      row t of ids          counts[t]
    table {5: -0.1, 7: -2.0}     [5, 7, 0, 0]          2      (K = 4: two padding entries)
    no table                     [0, 0, 0, 0]         -1      (untrained, or not requested)

The first ``counts[t]`` entries of row ``t`` are valid; padding holds id 0 (and log-prob 0.0),
so the arrays can be turned into tensors and gathered as they are. ``counts[t] == -1`` means
the position has no table: for top log-probs, the sampler reported none; for candidate sets,
the full vocabulary. Top log-probs are sorted once, where they are built: most probable first,
ties by ascending id. The arrays are read-only; a record is checked when built.

The dict form (``list[dict[int, float]]``, ``list[list[int]]``) remains only at the edge where
users build a :class:`~asyncgrpo.core.records.TurnRecord` themselves (TRL's AsyncGRPOTrainer
documentation's field types): :meth:`TopLogprobs.from_tables` and
:meth:`CandidateSets.from_sets` read it, indexing a record gives it back.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import attrs
import numpy as np

from asyncgrpo.core.frozen import ARRAY_EQ, read_only


def _ids(values: np.ndarray) -> np.ndarray:
    return read_only(np.asarray(values, dtype=np.int64))


def _logprobs(values: np.ndarray) -> np.ndarray:
    return read_only(np.asarray(values, dtype=np.float32))


def _check_layout(record: str, ids: np.ndarray, counts: np.ndarray) -> None:
    if ids.ndim != 2:
        raise ValueError(f"{record}.ids: has shape {ids.shape}; it must be [T, K]")
    if counts.shape != (len(ids),):
        raise ValueError(
            f"{record}.counts: has shape {counts.shape}; it must be [T] = ({len(ids)},)"
        )
    if len(counts) and (counts.min() < -1 or counts.max() > ids.shape[1]):
        raise ValueError(
            f"{record}.counts: must lie in [-1, K = {ids.shape[1]}], found "
            f"{int(counts.min())}..{int(counts.max())}"
        )


def _valid(ids: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """bool [T, K]: the valid entries (the first ``counts[t]`` of each row)."""
    return np.arange(ids.shape[1]) < counts[:, None]


def _padded(arrays: Sequence[np.ndarray], width: int, dtype: type) -> np.ndarray:
    out: np.ndarray = np.zeros((sum(len(a) for a in arrays), width), dtype)
    start = 0
    for array in arrays:
        out[start : start + len(array), : array.shape[1]] = array
        start += len(array)
    return out


@attrs.frozen
class TopLogprobs:
    """The sampler's most probable tokens at ``T`` positions, most probable first.

    Attributes:
        ids: int64 [T, K], token ids; 0 in padding.
        logprobs: float32 [T, K], the sampler's processed log-probs of ``ids`` (nats, <= 0,
            -inf for probability zero), descending in each row, ties by ascending id; 0.0 in
            padding.
        counts: int64 [T], valid entries of each row; -1 where the position has no table.

    Example:
        >>> top = TopLogprobs.from_tables([{7: -2.0, 5: -0.5}, None])
        >>> top.ids.tolist(), top.counts.tolist(), top[0], top[1]
        ([[5, 7], [0, 0]], [2, -1], {5: -0.5, 7: -2.0}, None)
    """

    ids: np.ndarray = attrs.field(converter=_ids, eq=ARRAY_EQ)
    logprobs: np.ndarray = attrs.field(converter=_logprobs, eq=ARRAY_EQ)
    counts: np.ndarray = attrs.field(converter=_ids, eq=ARRAY_EQ)

    def __attrs_post_init__(self) -> None:
        _check_layout("TopLogprobs", self.ids, self.counts)
        if self.logprobs.shape != self.ids.shape:
            raise ValueError(
                f"TopLogprobs.logprobs: has shape {self.logprobs.shape}, ids has {self.ids.shape}"
            )

    @classmethod
    def from_entries(
        cls, entries: Sequence[Sequence[tuple[int, float]] | None], k: int | None = None
    ) -> TopLogprobs:
        """Sort each position's ``(id, log-prob)`` entries (most probable first, ties by
        ascending id) and keep the first ``k`` (all when None); ``None`` is a missing table.
        An id given twice at a position counts once, with its last log-prob. The one sort top
        log-probs get on their way to the learner."""
        entries = [None if e is None else list(dict(e).items()) for e in entries]
        counts = np.array([-1 if e is None else len(e) for e in entries], np.int64)
        width = int(counts.max(initial=0))
        ids = np.zeros((len(entries), width), np.int64)
        logprobs = np.zeros((len(entries), width), np.float64)
        for t, table in enumerate(entries):
            if table:
                ids[t, : len(table)], logprobs[t, : len(table)] = zip(*table, strict=True)
        padding = ~_valid(ids, counts)
        order = np.lexsort((ids, -logprobs, padding), axis=1)
        kept = width if k is None else min(k, width)
        order = order[:, :kept]
        ids = np.take_along_axis(ids, order, axis=1)
        logprobs = np.take_along_axis(logprobs, order, axis=1)
        counts = np.minimum(counts, kept)
        padding = ~_valid(ids, counts)
        ids[padding], logprobs[padding] = 0, 0.0
        return cls(ids, logprobs, counts)

    @classmethod
    def from_tables(
        cls, tables: Sequence[Mapping[int, float] | None], k: int | None = None
    ) -> TopLogprobs:
        """The dense form of per-position dicts ``{token id: log-prob}`` (``None``: no table)."""
        return cls.from_entries(
            [None if t is None else [(int(i), float(v)) for i, v in t.items()] for t in tables], k
        )

    @classmethod
    def missing(cls, n: int) -> TopLogprobs:
        """``n`` positions without a table."""
        return cls(np.zeros((n, 0)), np.zeros((n, 0)), np.full(n, -1))

    @classmethod
    def concatenate(cls, parts: Sequence[TopLogprobs]) -> TopLogprobs:
        """The positions of ``parts`` in order, padded to the widest ``K``."""
        width = max((p.ids.shape[1] for p in parts), default=0)
        return cls(
            _padded([p.ids for p in parts], width, np.int64),
            _padded([p.logprobs for p in parts], width, np.float32),
            np.concatenate([p.counts for p in parts] or [np.zeros(0, np.int64)]),
        )

    def take(self, positions: np.ndarray) -> TopLogprobs:
        """The rows at ``positions`` (int [M])."""
        return TopLogprobs(self.ids[positions], self.logprobs[positions], self.counts[positions])

    def drop(self, keep: np.ndarray) -> TopLogprobs:
        """The same positions, without a table where ``keep`` (0/1 [T]) is 0."""
        return TopLogprobs(self.ids, self.logprobs, np.where(keep != 0, self.counts, -1))

    def valid(self) -> np.ndarray:
        """bool [T, K]: the entries that hold a token (not padding)."""
        return _valid(self.ids, self.counts)

    def __len__(self) -> int:
        return len(self.counts)

    def __getitem__(self, position: int) -> dict[int, float] | None:
        count = int(self.counts[position])
        if count < 0:
            return None
        ids, logprobs = self.ids[position, :count].tolist(), self.logprobs[position, :count]
        return dict(zip(ids, logprobs.astype(np.float64).tolist(), strict=True))

    def __iter__(self) -> Iterator[dict[int, float] | None]:
        return (self[t] for t in range(len(self)))


@attrs.frozen
class CandidateSets:
    """The ids the sampler could pick at ``T`` positions under top-k / top-p truncation.

    Attributes:
        ids: int64 [T, K], the candidate ids of each position, in the order given; 0 in
            padding.
        counts: int64 [T], candidates of each position; -1 where the position has no set
            (the full vocabulary).

    Example:
        >>> sets = CandidateSets.from_sets([[2, 7], None, [3]])
        >>> sets.ids.tolist(), sets.counts.tolist(), sets.to_sets()
        ([[2, 7], [0, 0], [3, 0]], [2, -1, 1], ((2, 7), None, (3,)))
    """

    ids: np.ndarray = attrs.field(converter=_ids, eq=ARRAY_EQ)
    counts: np.ndarray = attrs.field(converter=_ids, eq=ARRAY_EQ)

    def __attrs_post_init__(self) -> None:
        _check_layout("CandidateSets", self.ids, self.counts)

    @classmethod
    def from_sets(cls, sets: Sequence[Sequence[int] | None]) -> CandidateSets:
        """The dense form of per-position id lists (``None``: the full vocabulary)."""
        counts = np.array([-1 if s is None else len(s) for s in sets], np.int64)
        ids = np.zeros((len(sets), int(counts.max(initial=0))), np.int64)
        for t, candidates in enumerate(sets):
            if candidates:
                ids[t, : len(candidates)] = candidates
        return cls(ids, counts)

    @classmethod
    def missing(cls, n: int) -> CandidateSets:
        """``n`` positions without a set (the full vocabulary)."""
        return cls(np.zeros((n, 0)), np.full(n, -1))

    @classmethod
    def concatenate(cls, parts: Sequence[CandidateSets]) -> CandidateSets:
        """The positions of ``parts`` in order, padded to the widest ``K``."""
        width = max((p.ids.shape[1] for p in parts), default=0)
        return cls(
            _padded([p.ids for p in parts], width, np.int64),
            np.concatenate([p.counts for p in parts] or [np.zeros(0, np.int64)]),
        )

    def take(self, positions: np.ndarray) -> CandidateSets:
        """The rows at ``positions`` (int [M])."""
        return CandidateSets(self.ids[positions], self.counts[positions])

    def drop(self, keep: np.ndarray) -> CandidateSets:
        """The same positions, without a set where ``keep`` (0/1 [T]) is 0."""
        return CandidateSets(self.ids, np.where(keep != 0, self.counts, -1))

    def valid(self) -> np.ndarray:
        """bool [T, K]: the entries that hold a candidate (not padding)."""
        return _valid(self.ids, self.counts)

    def contains(self, tokens: np.ndarray) -> np.ndarray:
        """bool [T]: whether ``tokens[t]`` (int [T]) is a candidate at ``t`` (True where a
        position has no set: the full vocabulary)."""
        hit = ((self.ids == np.asarray(tokens)[:, None]) & self.valid()).any(axis=1)
        return hit | (self.counts < 0)

    def to_sets(self) -> tuple[tuple[int, ...] | None, ...]:
        """The tuple form, one tuple of ids (or None) per position."""
        return tuple(self[t] for t in range(len(self)))

    def __len__(self) -> int:
        return len(self.counts)

    def __getitem__(self, position: int) -> tuple[int, ...] | None:
        count = int(self.counts[position])
        return None if count < 0 else tuple(self.ids[position, :count].tolist())

    def __iter__(self) -> Iterator[tuple[int, ...] | None]:
        return (self[t] for t in range(len(self)))
