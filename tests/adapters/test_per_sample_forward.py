"""Decoders the tree cannot compute (Mamba and Mamba-2 hybrids, a logit
scaling after the head) train on the per-sample forward: its log-probs and gradients equal each
sample forwarded alone (fp32, CPU), on random tries; the stock forward of the packed row, what
the tree would compute with these layers, does not."""

import copy
import functools

import attrs
import numpy as np
import pytest
import torch
from families import RECURRENT
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from packing_strategies import make_sample, sample_sets
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

LONG_ROW = pack_row(
    [
        make_sample(range(1, 12), [0] * 5 + [1] * 6),
        make_sample([*range(1, 7), 17, 18, 19, 20, 21, 22, 23, 24], [0] * 5 + [1] * 9),
        make_sample([*range(1, 7), 17, 18, 30, 31], [0] * 5 + [1] * 5),
        make_sample([3, 4, 5, 6, 7, 8, 9, 10, 11], [0, 0] + [1] * 7),
    ]
)


@functools.cache
def models(family):
    """``family``'s random weights twice: one for the reference, one for the forward tested."""
    torch.manual_seed(0)
    stock = AutoModelForCausalLM.from_config(RECURRENT[family](), attn_implementation="eager")
    return stock, copy.deepcopy(stock)


def reference_log_probs(model, samples, targets):
    logits = [torch.zeros(0, model.config.vocab_size)]
    for sample in samples:
        positions = torch.from_numpy(np.flatnonzero(sample.sequence.trained_mask))
        if len(positions):
            ids = torch.tensor(sample.sequence.input_ids)[None]
            logits.append(model(input_ids=ids, use_cache=False).logits[0, positions - 1])
    return torch.log_softmax(torch.cat(logits), -1).gather(-1, targets[:, None])[:, 0]


def gradients(model):
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return grads


def largest_differences(family, row, seed=0):
    stock, tested = models(family)
    targets = torch.tensor(row.target_ids)
    weights = torch.randn(len(targets), generator=torch.Generator().manual_seed(seed))
    got = per_sample_log_probs(tested, row, 1.0)
    (got.logp * weights).sum().backward()
    want = reference_log_probs(stock, row.samples, targets)
    (want * weights).sum().backward()
    dlogp = (got.logp - want).abs().max().item()
    got_grads, want_grads = gradients(tested), gradients(stock)
    largest = max(max(w.norm() for w in want_grads), torch.finfo(torch.float32).tiny)
    relative = max(
        ((g - w).norm() / max(w.norm(), GRADIENT_NORM_FLOOR * largest)).item()
        for g, w in zip(got_grads, want_grads, strict=True)
    )
    return dlogp, relative


@pytest.mark.parametrize("family", sorted(RECURRENT))
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
    dlogp, relative = largest_differences(family, LONG_ROW)
    assert dlogp <= LOGP_TOLERANCE
    assert relative <= GRADIENT_TOLERANCE
    stock, _ = models(family)
    with torch.no_grad():  # the control: the row's tokens as one sequence, states run on
        logits = stock(input_ids=torch.tensor(LONG_ROW.input_ids)[None]).logits[0]
        packed = torch.log_softmax(logits[LONG_ROW.predict_index], -1)
        packed = packed.gather(-1, torch.tensor(LONG_ROW.target_ids)[:, None])[:, 0]
        want = reference_log_probs(stock, LONG_ROW.samples, torch.tensor(LONG_ROW.target_ids))
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
    dlogp, _ = largest_differences(family, LONG_ROW)
    assert dlogp > CONTROL_DIFFERENCE
