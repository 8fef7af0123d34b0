"""plan_candidate_sets: candidate sets are requested exactly when top-k/top-p needs them and
the server can return them; otherwise one warning names both server flags."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncgrpo.core.rollout.candidate_sets import (
    SAMPLING_MASK_FLAG,
    SCALE_OUT_FLAG,
    CandidateSetSupport,
    plan_candidate_sets,
)

supports = st.builds(
    CandidateSetSupport,
    st.sampled_from([True, False, None]),
    st.booleans(),
    st.sampled_from([None, -1, 20]),
)


@given(
    support=supports,
    top_k=st.sampled_from([0, 1, 50]),
    top_p=st.sampled_from([1.0, 0.9]),
    k=st.integers(0, 19),
)
def test_sets_are_requested_iff_needed_and_available_else_one_warning(
    support, top_k, top_p, k
) -> None:
    if support.records_sampling_masks and top_k == 0:
        with pytest.raises(ValueError, match="rejects every request with top_k=0"):
            plan_candidate_sets(support, top_k, top_p, k)
        return
    plan = plan_candidate_sets(support, top_k, top_p, k)
    needed = top_k > 0 or top_p < 1.0
    available = bool(support.records_sampling_masks) and support.serves_token_endpoint
    assert plan.request_sets == (needed and available)
    assert (plan.warning is not None) == (needed and not available)
    if plan.warning is not None:
        assert SAMPLING_MASK_FLAG in plan.warning and SCALE_OUT_FLAG in plan.warning
    if plan.request_sets:
        assert plan.logprobs_to_request == (k + 1 if k else 0)


def test_too_few_server_log_probs_for_the_token_endpoint_names_the_flag() -> None:
    with pytest.raises(ValueError, match="--max-logprobs 9"):
        plan_candidate_sets(CandidateSetSupport(True, True, 8), 50, 1.0, 8)
