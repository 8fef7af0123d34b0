"""Foreign-weights detection: properties over dtypes and sequences of staleness-0 gaps."""

import math

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.weight_parity import (
    PARITY_LIMITS,
    ParityWatch,
    Verdict,
    check_parity,
    dtype_name,
    parity_limit,
    staleness0_gap,
)

dtypes = st.sampled_from(["float32", "torch.float32", "fp32", "bfloat16", "bf16", "float16",
                          "torch.float16", "auto", None, "int8"])  # fmt: skip
gaps = st.one_of(st.none(), st.just(math.nan), st.floats(0, 10))


@given(dtypes, dtypes)
def test_the_limit_is_symmetric_and_the_less_precise_side_sets_it(a, b) -> None:
    assert parity_limit(a, b) == parity_limit(b, a)
    assert parity_limit(a, b) == max(parity_limit(a, a), parity_limit(b, b))
    if dtype_name(a) == dtype_name(b) == "float32":
        assert parity_limit(a, b) == PARITY_LIMITS["float32"] < 1e-2


@given(st.lists(gaps, max_size=50), st.floats(1e-6, 1), st.integers(0, 6))
def test_the_run_fails_at_patience_bad_steps_in_a_row_and_only_then(seq, limit, patience) -> None:
    watch, in_a_row = ParityWatch(), 0
    for gap in seq:
        watch, verdict = check_parity(watch, gap, limit, patience)
        if gap is None or math.isnan(gap):
            assert verdict is Verdict.OK
            continue
        in_a_row = in_a_row + 1 if gap > limit else 0
        assert watch.bad_in_a_row == in_a_row
        if in_a_row == 0:
            assert verdict is Verdict.OK
        elif patience and in_a_row >= patience:
            assert verdict is Verdict.FAIL
            return
        else:
            assert verdict is Verdict.WARN


@given(st.lists(st.floats(0, 1e-4), max_size=40), st.integers(0, 5))
def test_fp32_arithmetic_noise_never_warns(seq, patience) -> None:
    watch = ParityWatch()
    for gap in seq:
        watch, verdict = check_parity(watch, gap, parity_limit("float32", "float32"), patience)
        assert verdict is Verdict.OK


@given(
    st.lists(st.tuples(st.floats(0, 10), st.integers(0, 4)), max_size=40),
    st.lists(st.integers(0, 3), min_size=5, max_size=5),
    st.integers(0, 3),
)
def test_the_staleness0_gap_is_the_mean_over_fresh_tokens_only(tokens, versions, current) -> None:
    difference = np.array([d for d, _ in tokens], dtype=np.float64)
    sample_index = np.array([i for _, i in tokens], dtype=np.int64)
    gap, count = staleness0_gap(difference, sample_index, versions, current)
    fresh = [d for d, i in tokens if versions[i] == current]
    assert count == len(fresh)
    if fresh:
        assert math.isclose(gap, sum(fresh) / len(fresh), rel_tol=1e-9, abs_tol=1e-12)
    else:
        assert math.isnan(gap)
