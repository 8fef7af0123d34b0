"""Recurrent layers forked at the trie's branch points: LFM2's gated short convolutions and
the Mamba-2 mixers (Mamba-2, Bamba, Granite 4.0 hybrid, Nemotron-H, Falcon-H1). Each token
convolves its own path's predecessors and each segment's scan starts from its parent's final
state, so the packed forward equals forwarding each sample alone, in log-probs and gradients,
with activation checkpointing too. Controls: the convolution along the row (what
transformers computes on a packed row) and, for Mamba-2, every segment's scan from a zero
state, each move log-probs by more than 1e-2.

Float64 weights and activations, with SDPA as the reference (eager attention takes its
softmax in float32) and experts through transformers' eager loop (grouped_mm has no float64).
LFM2 is then exact to the last bits; transformers' Mamba-2 scan (``mamba2_chunk_scan``)
computes in float32 whatever its inputs, on both sides, so Mamba-2's bounds are float32's."""

import copy
import functools
import sys

import pytest
import torch
from families import MAMBA2, SHORT_CONVOLUTIONS
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
from asyncgrpo.core.packing.recurrent_tree import recurrent_layout
from asyncgrpo.core.packing.tree import pack_row

FAMILIES = {**SHORT_CONVOLUTIONS, **MAMBA2}
# (log-prob, per-parameter gradient relative to its norm). LFM2: the forwards agree to the
# last bits (measured: 0.0); some gradients differ by ~1e-7 of themselves even where no
# recurrent layer is involved (Llama's embedding gradient, measured 2026-12-07). Mamba-2:
# float32's, as the model table's.
TOLERANCES = {
    **dict.fromkeys(SHORT_CONVOLUTIONS, (1e-12, 1e-6)),
    **dict.fromkeys(MAMBA2, (1e-5, 5e-5)),
}


@functools.cache
def models(family, checkpointing=False):
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(
        FAMILIES[family](),
        attn_implementation="eager" if family == "mamba2" else "sdpa",  # Mamba-2: none
        experts_implementation="eager",
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


def within(family, dlogp, dgrad) -> bool:
    logp_tolerance, gradient_tolerance = TOLERANCES[family]
    return dlogp <= logp_tolerance and dgrad <= gradient_tolerance


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_family_takes_the_tree(family) -> None:
    assert training_path(models(family)[0]) == TrainingPath("tree")


@pytest.mark.parametrize("family", sorted(FAMILIES))
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
    assert within(family, dlogp, dgrad), (dlogp, dgrad)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_activation_checkpointing_recomputes_along_the_paths(family) -> None:
    dlogp, dgrad = largest_differences(family, ROW, checkpointing=True)
    assert within(family, dlogp, dgrad), (dlogp, dgrad)


def _along_the_row(row, conv_kernel):
    """The control's tables: each token's window is the K - 1 row positions before it."""
    layout = recurrent_layout(row, conv_kernel)
    t = layout.num_tokens
    window = torch.arange(t)[:, None] + torch.arange(-conv_kernel + 1, 1)[None]
    return type(layout)(
        num_tokens=t,
        conv_window=torch.where(window < 0, t, window).numpy(),
        levels=layout.levels,
        output_order=layout.output_order,
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_convolving_along_the_row_breaks_the_match(family, monkeypatch) -> None:
    monkeypatch.setattr(gated_delta_net, "recurrent_layout", _along_the_row)
    dlogp, _ = largest_differences(family, ROW)
    assert dlogp > 1e-2


@pytest.mark.parametrize("family", sorted(MAMBA2))
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
