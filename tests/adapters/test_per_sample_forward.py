"""Decoders the tree cannot compute (Mamba, Jamba, Zamba2, a logit scaling after the head)
train on the per-sample forward: its log-probs and gradients equal each sample forwarded alone
(fp32, CPU), on random tries, for them and for the Mamba-2 hybrids the tree also computes; the
stock forward of the packed row, what the tree would compute with these layers, does not."""

import copy
import functools

import attrs
import numpy as np
import pytest
import torch
from families import PER_SAMPLE, RECURRENT
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from model_table import ROW, differences, reference_log_probs
from packing_strategies import sample_sets
from transformers import AutoModelForCausalLM

from asyncgrpo.adapters.kernels import per_sample_forward
from asyncgrpo.adapters.kernels.architecture_support import training_path
from asyncgrpo.adapters.kernels.per_sample_forward import per_sample_log_probs
from asyncgrpo.core.packing.sample_batch import PAD_ID, sample_batch
from asyncgrpo.core.packing.tree import pack_row

LOGP_TOLERANCE = 1e-5
GRADIENT_TOLERANCE = 5e-5  # per parameter, relative to its norm (floored as below)
GRADIENT_NORM_FLOOR = 1e-2
CONTROL_DIFFERENCE = 1e-2


@functools.cache
def models(family):
    """``family``'s random weights twice: one for the reference, one for the forward tested."""
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(RECURRENT[family](), attn_implementation="eager")
    return stock, copy.deepcopy(stock)


def largest_differences(family, row, seed=0):
    stock, tested = models(family)
    forward = functools.partial(per_sample_log_probs, temperature=1.0)
    return differences(tested, stock, forward, row, seed)


@pytest.mark.parametrize("family", sorted(PER_SAMPLE))
def test_the_family_takes_the_per_sample_path(family) -> None:
    path = training_path(models(family)[0])
    assert path.kind == "per_sample"
    assert path.reasons


@pytest.mark.parametrize("family", sorted(RECURRENT))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    samples=sample_sets(max_groups=2, max_per_group=3, vocab=12, max_len=8),
    seed=st.integers(0, 2**16),
)
def test_per_sample_equals_each_sample_alone(family, samples, seed) -> None:
    row = pack_row(samples)
    assume(len(row.target_ids) > 0)
    dlogp, relative = largest_differences(family, row, seed)
    assert dlogp <= LOGP_TOLERANCE
    assert relative <= GRADIENT_TOLERANCE


@pytest.mark.parametrize("family", sorted(RECURRENT))
def test_the_long_row_is_exact_and_the_packed_rows_stock_forward_is_not(family) -> None:
    dlogp, relative = largest_differences(family, ROW)
    assert dlogp <= LOGP_TOLERANCE
    assert relative <= GRADIENT_TOLERANCE
    stock, _ = models(family)
    with torch.no_grad():  # the control: the row's tokens as one sequence, states run on
        logits = stock(input_ids=torch.tensor(ROW.input_ids)[None]).logits[0]
        packed = torch.log_softmax(logits[ROW.predict_index], -1)
        packed = packed.gather(-1, torch.tensor(ROW.target_ids)[:, None])[:, 0]
        want = reference_log_probs(stock, ROW.samples, torch.tensor(ROW.target_ids))
    assert (packed - want).abs().max().item() > CONTROL_DIFFERENCE


def left_padded(row):
    """The control's batch: each sample after its padding instead of before it."""
    batch = sample_batch(row)
    shift = batch.input_ids.shape[1] - batch.lengths
    ids = np.full_like(batch.input_ids, PAD_ID)
    for b, n in enumerate(batch.lengths):
        ids[b, shift[b] :] = batch.input_ids[b, :n]
    positions = batch.predict_positions + shift[batch.predict_rows]
    return attrs.evolve(batch, input_ids=ids, predict_positions=positions)


@pytest.mark.parametrize("family", sorted(RECURRENT))
def test_padding_before_the_samples_breaks_the_match(family, monkeypatch) -> None:
    monkeypatch.setattr(per_sample_forward, "sample_batch", left_padded)
    dlogp, _ = largest_differences(family, ROW)
    assert dlogp > CONTROL_DIFFERENCE
