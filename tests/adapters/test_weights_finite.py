"""The divergence check's verdict (``weights_finite``) equals ``isfinite`` over every trainable
weight, whatever non-finite value sits wherever, an empty weight included."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from asyncgrpo.adapters.models.fsdp import weights_finite


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=4),
    planted=st.lists(
        st.tuples(
            st.integers(0, 3),
            st.integers(0, 299),
            st.sampled_from([math.nan, math.inf, -math.inf, 3e38]),
        ),
        max_size=2,
    ),
    frozen=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_the_verdict_is_isfinite_over_the_trainable_weights(sizes, planted, frozen, dtype) -> None:
    model = nn.Module()
    model.weights = nn.ParameterList(nn.Parameter(torch.randn(n).to(dtype)) for n in sizes)
    for which, index, value in planted:
        if which < len(sizes) and index < sizes[which]:
            with torch.no_grad():
                model.weights[which][index] = value
    if frozen:  # a frozen weight is not checked (a LoRA run's base model)
        model.weights[0].requires_grad_(False)
    trained = [p for p in model.parameters() if p.requires_grad]
    assert weights_finite(model) == all(bool(torch.isfinite(p).all()) for p in trained)
