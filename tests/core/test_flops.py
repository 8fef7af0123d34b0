"""Model FLOP counting and the step-time parts: properties."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from packing_strategies import sample_sets

from asyncgrpo.core.packing.flops import (
    ModelShape,
    forward_flops,
    gpu_peak_flops,
    query_key_pairs,
    train_flops,
)
from asyncgrpo.core.packing.tree import pack_row
from asyncgrpo.core.run.step_time import STEP_PARTS, unaccounted_s, window_rates

shapes = st.builds(
    ModelShape,
    st.integers(1, 10**9),
    st.integers(1, 64),
    st.integers(1, 64),
    st.integers(1, 256),
    st.integers(1, 8192),
    st.integers(1, 200_000),
)


@given(sample_sets())
def test_query_key_pairs_count_the_dense_tree_mask(samples) -> None:
    row = pack_row(samples)
    assert query_key_pairs(row.cu_seqlens_q, row.cu_seqlens_k) == int(row.dense_mask().sum())


@given(shapes, st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**9))
def test_flops_grow_with_every_count_and_backward_is_twice_forward(
    shape, tokens, trained, pairs
) -> None:
    base = forward_flops(shape, tokens, trained, pairs)
    assert base >= 0
    assert forward_flops(shape, tokens + 1, trained, pairs) > base
    assert forward_flops(shape, tokens, trained + 1, pairs) > base
    assert forward_flops(shape, tokens, trained, pairs + 1) > base
    assert train_flops(shape, tokens, trained, pairs) == 3 * base


def test_a_causal_sequence_has_n_n_plus_1_over_2_pairs() -> None:
    assert query_key_pairs([0, 7], [0, 7]) == 28


def test_listed_gpus_have_a_peak_per_dtype() -> None:
    assert gpu_peak_flops("NVIDIA H100 PCIe", True) == 756e12
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", True) == 989e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", False) == 19.5e12
    assert gpu_peak_flops("cpu", True) is None


@given(
    st.lists(st.floats(0, 10), min_size=len(STEP_PARTS), max_size=len(STEP_PARTS)), st.floats(0, 10)
)
def test_unaccounted_is_the_step_minus_its_parts(parts, extra) -> None:
    summary = dict(zip(STEP_PARTS, parts, strict=True))
    summary["perf/step_s"] = sum(parts) + extra
    assert np.isclose(unaccounted_s(summary), extra, atol=1e-9)
    assert unaccounted_s({"perf/fwd_s": 1.0}) is None


optional_seconds = st.one_of(st.none(), st.floats(0.01, 100))
optional_tokens = st.one_of(st.none(), st.floats(0, 1e6))


@given(optional_seconds, optional_seconds, optional_tokens, optional_tokens)
def test_window_rates_are_tokens_over_seconds_present_only_with_their_inputs(
    step_s, fwd_bwd_s, trained, forwarded
) -> None:
    given_values = {
        "perf/step_s": step_s,
        "perf/fwd_bwd_s": fwd_bwd_s,
        "batch/trained_tokens_per_step": trained,
        "batch/forwarded_tokens_per_step": forwarded,
    }
    summary = {k: v for k, v in given_values.items() if v is not None}
    rates = window_rates(summary)
    if step_s is not None and trained is not None and forwarded is not None:
        assert rates["perf/wall_clock_trained_tokens_per_s"] == trained / step_s
        assert rates["perf/wall_clock_forwarded_tokens_per_s"] == forwarded / step_s
    else:
        assert "perf/wall_clock_trained_tokens_per_s" not in rates
    assert ("perf/unaccounted_s" in rates) == (step_s is not None)
    if fwd_bwd_s is not None and forwarded is not None:
        assert rates["perf/fwd_bwd_forwarded_tokens_per_s"] == forwarded / fwd_bwd_s
    else:
        assert "perf/fwd_bwd_forwarded_tokens_per_s" not in rates
