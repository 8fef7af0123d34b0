import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from packing_strategies import as_dicts

from asyncgrpo.core.sampler_tables import CandidateSets, TopLogprobs

token_ids = st.integers(0, 50)
logprobs32 = st.floats(max_value=0.0, width=32, allow_nan=False).map(lambda v: v + 0.0)
tables = st.lists(st.none() | st.dictionaries(token_ids, logprobs32, max_size=6), max_size=8)
sets = st.lists(st.none() | st.lists(token_ids, max_size=6, unique=True), max_size=8)


def brute_force_top(table: dict[int, float], k: int | None) -> list[tuple[int, float]]:
    """Most probable first, ties by ascending id, the first ``k``."""
    return sorted(table.items(), key=lambda item: (-item[1], item[0]))[:k]


@given(tables)
def test_dict_tables_round_trip_through_the_dense_form(given_tables) -> None:
    top = TopLogprobs.from_tables(given_tables)
    assert as_dicts(top) == tuple(given_tables)
    assert len(top) == len(given_tables) and top.ids.dtype == np.int64
    assert top.logprobs.dtype == np.float32 and not top.ids.flags.writeable


@given(tables, st.none() | st.integers(0, 7))
def test_tables_are_sorted_once_and_cut_to_k(given_tables, k) -> None:
    top = TopLogprobs.from_tables(given_tables, k)
    for t, table in enumerate(given_tables):
        if table is None:
            assert top.counts[t] == -1 and top[t] is None
            continue
        want = brute_force_top(table, k)
        count = int(top.counts[t])
        assert count == len(want)
        assert top.ids[t, :count].tolist() == [token for token, _ in want]
        assert top.logprobs[t, :count].tolist() == [value for _, value in want]
        assert not top.ids[t, count:].any() and not top.logprobs[t, count:].any()


@given(st.lists(st.lists(st.tuples(token_ids, logprobs32), max_size=6), max_size=5))
def test_an_id_given_twice_counts_once_with_its_last_log_prob(entries) -> None:
    top = TopLogprobs.from_entries(entries)
    assert as_dicts(top) == tuple(dict(e) for e in entries)


@given(sets, st.data())
def test_candidate_sets_round_trip_and_membership(given_sets, data) -> None:
    candidates = CandidateSets.from_sets(given_sets)
    assert candidates.to_sets() == tuple(None if s is None else tuple(s) for s in given_sets)
    tokens = data.draw(st.lists(token_ids, min_size=len(given_sets), max_size=len(given_sets)))
    want = [s is None or token in s for s, token in zip(given_sets, tokens, strict=True)]
    assert candidates.contains(np.array(tokens, np.int64)).tolist() == want


@given(st.lists(tables, max_size=4), st.data())
def test_concatenate_take_and_drop_match_the_dict_form(parts, data) -> None:
    whole = TopLogprobs.concatenate([TopLogprobs.from_tables(p) for p in parts])
    flat = [table for part in parts for table in part]
    assert as_dicts(whole) == tuple(flat)
    positions = data.draw(st.lists(st.integers(0, max(len(flat) - 1, 0)), max_size=len(flat)))
    positions = positions if flat else []
    assert as_dicts(whole.take(np.array(positions, np.int64))) == tuple(flat[p] for p in positions)
    keep = np.array(data.draw(st.lists(st.integers(0, 1), min_size=len(flat), max_size=len(flat))))
    dropped = as_dicts(whole.drop(keep.astype(np.int8)))
    assert dropped == tuple(t if k else None for t, k in zip(flat, keep, strict=True))
    sets = CandidateSets.concatenate([CandidateSets.from_sets([[1, 2]]), CandidateSets.missing(2)])
    assert sets.to_sets() == ((1, 2), None, None)


def test_a_bad_layout_names_the_field() -> None:
    with pytest.raises(ValueError, match="TopLogprobs.counts"):
        TopLogprobs(np.zeros((2, 1)), np.zeros((2, 1)), [1, 2])
    with pytest.raises(ValueError, match="TopLogprobs.logprobs"):
        TopLogprobs(np.zeros((2, 1)), np.zeros((2, 2)), [1, 1])
    with pytest.raises(ValueError, match="CandidateSets.ids"):
        CandidateSets(np.zeros(2), [1, 1])
