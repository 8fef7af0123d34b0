"""LFM2's gated short convolutions on tree-packed rows: each token convolves its own path's
predecessors, so the packed forward equals forwarding each sample alone (float64, so that any
difference is the tree's and not rounding; float32 in the model table), with activation
checkpointing too; the convolution along the row instead, what transformers computes on a
packed row, does not.

Float64 with SDPA as the reference (eager attention takes its softmax in float32) and the
experts through transformers' eager loop (grouped_mm has no float64)."""

import copy
import functools

import pytest
import torch
from families import SHORT_CONVOLUTIONS
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from model_table import ROW, differences
from packing_strategies import sample_sets
from transformers import AutoModelForCausalLM

from asyncgrpo.adapters.kernels import gated_delta_net
from asyncgrpo.adapters.kernels.attention import enable_tree_attention
from asyncgrpo.adapters.kernels.packed_forward import packed_log_probs
from asyncgrpo.core.packing.tree import pack_row

LOGP_TOLERANCE = 1e-12  # float64: the forwards agree to the last bits (measured: 0.0)
# Per parameter, relative to its gradient's norm: some gradients differ by ~1e-7 of themselves
# even where no recurrent layer is involved (Llama's embedding gradient, measured 2026-12-07),
# so this bounds the tree's error, far below a window misplaced (control: 1e-2)
GRADIENT_TOLERANCE = 1e-6


@functools.cache
def models(family, checkpointing=False):
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(
        SHORT_CONVOLUTIONS[family](),
        attn_implementation="sdpa",  # eager attention takes its softmax in float32
        experts_implementation="eager",  # grouped_mm has no float64
        dtype=torch.float64,
    )
    tree = enable_tree_attention(copy.deepcopy(stock))
    if checkpointing:
        tree.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return stock.train(), tree.train()


def largest_differences(family, row, backend, checkpointing=False, seed=0):
    stock, tree = models(family, checkpointing)

    def forward(model, row):
        return packed_log_probs(model, row, 1.0, backend=backend)

    return differences(tree, stock, forward, row, seed)


@pytest.mark.parametrize("family", sorted(SHORT_CONVOLUTIONS))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    samples=sample_sets(max_groups=2, max_per_group=3, vocab=12, max_len=8),
    backend=st.sampled_from(["dense", "segments"]),
    seed=st.integers(0, 2**16),
)
def test_packed_equals_each_sample_alone(family, samples, backend, seed) -> None:
    row = pack_row(samples)
    assume(len(row.target_ids) > 0)
    dlogp, dgrad = largest_differences(family, row, backend, seed=seed)
    assert dlogp <= LOGP_TOLERANCE
    assert dgrad <= GRADIENT_TOLERANCE


@pytest.mark.parametrize("family", sorted(SHORT_CONVOLUTIONS))
def test_activation_checkpointing_recomputes_along_the_paths(family) -> None:
    dlogp, dgrad = largest_differences(family, ROW, "segments", checkpointing=True)
    assert dlogp <= LOGP_TOLERANCE
    assert dgrad <= GRADIENT_TOLERANCE


def _along_the_row(row, conv_kernel):
    """The control's tables: each token's window is the K - 1 row positions before it."""
    layout = real_layout(row, conv_kernel)
    t = layout.num_tokens
    window = torch.arange(t)[:, None] + torch.arange(-conv_kernel + 1, 1)[None]
    window = torch.where(window < 0, t, window).numpy()
    window.setflags(write=False)
    return type(layout)(
        num_tokens=t,
        conv_window=window,
        levels=layout.levels,
        output_order=layout.output_order,
    )


real_layout = gated_delta_net.recurrent_layout


@pytest.mark.parametrize("family", sorted(SHORT_CONVOLUTIONS))
def test_convolving_along_the_row_breaks_the_match(family, monkeypatch) -> None:
    monkeypatch.setattr(gated_delta_net, "recurrent_layout", _along_the_row)
    dlogp, _ = largest_differences(family, ROW, "segments")
    assert dlogp > 1e-2
