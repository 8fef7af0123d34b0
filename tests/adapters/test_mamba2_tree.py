"""Mamba-2 mixers on tree-packed rows (Mamba-2, Bamba, Granite 4.0 hybrid, Nemotron-H,
Falcon-H1): each token convolves its own path's predecessors and each segment's scan starts
from its parent's final state, so the packed forward equals forwarding each sample alone, in
log-probs and gradients, with activation checkpointing too. Controls: the convolution along
the row, and the scan of every segment from a zero state, each move log-probs by > 1e-2.

Float64 parameters and activations, but transformers' scan (``mamba2_chunk_scan``) computes
in float32 whatever its inputs, on both sides; the bounds are those of float32."""

import copy
import functools
import sys

import pytest
import torch
from families import RECURRENT
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from model_table import ROW, differences
from packing_strategies import sample_sets
from transformers import AutoModelForCausalLM

from asyncgrpo.adapters.kernels import gated_delta_net
from asyncgrpo.adapters.kernels.architecture_support import TrainingPath, training_path
from asyncgrpo.adapters.kernels.attention import enable_tree_attention
from asyncgrpo.adapters.kernels.mamba2 import is_mamba2
from asyncgrpo.adapters.kernels.packed_forward import packed_log_probs
from asyncgrpo.core.packing.tree import pack_row

FAMILIES = ["bamba", "falcon_h1", "granitemoehybrid", "mamba2", "nemotron_h"]
LOGP_TOLERANCE = 1e-5
GRADIENT_TOLERANCE = 5e-5


@functools.cache
def models(family, checkpointing=False):
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(
        RECURRENT[family](),
        attn_implementation="eager" if family == "mamba2" else "sdpa",  # Mamba-2: none
        experts_implementation="eager",  # grouped_mm has no float64
        dtype=torch.float64,
    )
    tree = enable_tree_attention(copy.deepcopy(stock))
    if checkpointing:
        tree.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return stock.train(), tree.train()


def largest_differences(family, row, backend="segments", checkpointing=False, seed=0):
    stock, tree = models(family, checkpointing)

    def forward(model, row):
        return packed_log_probs(model, row, 1.0, backend=backend)

    return differences(tree, stock, forward, row, seed)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_family_takes_the_tree(family) -> None:
    assert training_path(models(family)[0]) == TrainingPath("tree")


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
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


@pytest.mark.parametrize("family", FAMILIES)
def test_activation_checkpointing_recomputes_along_the_paths(family) -> None:
    dlogp, dgrad = largest_differences(family, ROW, checkpointing=True)
    assert dlogp <= LOGP_TOLERANCE
    assert dgrad <= GRADIENT_TOLERANCE


def _along_the_row(row, conv_kernel):
    layout = real_layout(row, conv_kernel)
    t = layout.num_tokens
    window = torch.arange(t)[:, None] + torch.arange(-conv_kernel + 1, 1)[None]
    return type(layout)(
        num_tokens=t,
        conv_window=torch.where(window < 0, t, window).numpy(),
        levels=layout.levels,
        output_order=layout.output_order,
    )


real_layout = gated_delta_net.recurrent_layout


@pytest.mark.parametrize("family", FAMILIES)
def test_convolving_along_the_row_breaks_the_match(family, monkeypatch) -> None:
    monkeypatch.setattr(gated_delta_net, "recurrent_layout", _along_the_row)
    dlogp, _ = largest_differences(family, ROW)
    assert dlogp > 1e-2


@pytest.mark.parametrize("family", FAMILIES)
def test_scanning_each_segment_from_zero_breaks_the_match(family, monkeypatch) -> None:
    stock, _ = models(family)
    mixer = next(module for module in stock.modules() if is_mamba2(module))
    module = sys.modules[type(mixer).__module__]
    scan = module.mamba2_chunk_scan

    def from_zero(*args, initial_states=None, **kwargs):
        return scan(*args, initial_states=None, **kwargs)

    monkeypatch.setattr(module, "mamba2_chunk_scan", from_zero)
    dlogp, _ = largest_differences(family, ROW)
    assert dlogp > 1e-2
