"""The backend for a model's attention parts: a backend keeps the rows whose parts it has, and
gives the others to one that has every part, saying which part it lacked."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.packing.attention_choice import (
    ATTENTION_PARTS,
    BACKEND_PARTS,
    SINKS,
    SLIDING_WINDOW,
    backend_with_parts,
)

part_sets = st.frozensets(st.sampled_from(ATTENTION_PARTS))


@given(st.sampled_from(sorted(BACKEND_PARTS)), part_sets)
def test_the_row_runs_where_every_part_is_implemented(backend, needed) -> None:
    chosen, reason = backend_with_parts(backend, needed)
    assert needed <= BACKEND_PARTS[chosen]
    if needed <= BACKEND_PARTS[backend]:
        assert (chosen, reason) == (backend, None)
    else:
        lacking = sorted(needed - BACKEND_PARTS[backend])
        assert chosen != backend and all(part in reason for part in lacking)


def test_the_exact_cpu_backends_have_every_part() -> None:
    for backend in ("dense", "segments"):
        assert BACKEND_PARTS[backend] == frozenset(ATTENTION_PARTS)


def test_flex_replaces_the_varlen_kernels_and_segments_replaces_flex_for_sinks() -> None:
    assert backend_with_parts("torch_varlen", frozenset({SLIDING_WINDOW}))[0] == "flex"
    assert backend_with_parts("flash_varlen", frozenset({SINKS}))[0] == "segments"
    assert backend_with_parts("flex", frozenset({SINKS, SLIDING_WINDOW}))[0] == "segments"


def test_an_unknown_part_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown attention parts"):
        backend_with_parts("dense", frozenset({"alibi"}))
