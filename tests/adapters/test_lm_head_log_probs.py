"""The LM head's log-probs with the gradient written out equal autograd through
``token_log_probs(lm_head(hidden))``: values, and gradients to the hidden states, the weight and
the bias, with temperature, candidate sets, a sampler top-K with invalid entries, kept or
recomputed logits, in fp32 and bf16."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from asyncgrpo.adapters.kernels import lm_head_log_probs as fused
from asyncgrpo.adapters.kernels.lm_head_log_probs import lm_head_log_probs
from asyncgrpo.core.loss.inputs import SamplerTopK
from asyncgrpo.core.loss.losses import token_log_probs

HIDDEN, VOCAB = 12, 40


def inputs(seed: int, n: int, masked: bool, k: int, bias: bool, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(seed)
    head = nn.Linear(HIDDEN, VOCAB, bias=bias).to(dtype)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    hidden = torch.randn(n, HIDDEN, generator=generator).to(dtype)
    targets = torch.randint(0, VOCAB, (n,), generator=generator)
    mask = None
    if masked:
        mask = torch.rand(n, VOCAB, generator=generator) < 0.4
        mask[torch.arange(n), targets] = True
    topk = None
    if k:
        ids = torch.randint(0, VOCAB, (n, k), generator=generator)
        if mask is not None:  # the sampler's top-K lie in its candidate set
            mask[torch.arange(n)[:, None], ids] = True
        valid = torch.rand(n, k, generator=generator) < 0.7
        logp = torch.log_softmax(torch.randn(n, k, generator=generator), -1)
        topk = SamplerTopK(ids.masked_fill(~valid, -1), logp, valid)
    weights = torch.randn(n, generator=generator), torch.randn(n, max(k, 1), generator=generator)
    return head, hidden, targets, mask, topk, weights


def run(compute, head, hidden, targets, temperature, mask, topk, weights):
    """``compute``'s log-probs and the gradients of a weighted sum of them (the top-K's valid
    entries included), to the hidden states and each head parameter."""
    head.zero_grad(set_to_none=True)
    hidden = hidden.detach().requires_grad_()
    out = compute(head, hidden, targets, temperature, mask, topk)
    loss = (out.logp * weights[0]).sum()
    if topk is not None:
        loss = loss + (torch.where(topk.valid, out.topk_logp, 0.0) * weights[1]).sum()
    loss.backward()
    return out, [hidden.grad, *(p.grad for p in head.parameters())]


def traced(head, hidden, targets, temperature, mask, topk):
    return token_log_probs(head(hidden), targets, temperature, mask, topk)


def written_out(keep_logits):
    def compute(head, hidden, targets, temperature, mask, topk):
        return lm_head_log_probs(
            head, hidden, targets, temperature, mask, topk, keep_logits=keep_logits
        )

    return compute


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    n=st.integers(1, 9),
    temperature=st.sampled_from([0.7, 1.0, 1.6]),
    masked=st.booleans(),
    k=st.sampled_from([0, 1, 4]),
    bias=st.booleans(),
    keep_logits=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_written_out_gradient_equals_autograd(
    seed, n, temperature, masked, k, bias, keep_logits, dtype
) -> None:
    case = inputs(seed, n, masked, k, bias, dtype)
    head, hidden, targets, mask, topk, weights = case
    want, want_grads = run(traced, head, hidden, targets, temperature, mask, topk, weights)
    got, got_grads = run(
        written_out(keep_logits), head, hidden, targets, temperature, mask, topk, weights
    )
    # fp32: rounding only; bf16: the gradient is rounded to bf16 once in both, from fp32 sums
    # taken in a different order
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.equal(got.logp, want.logp) and torch.equal(got.entropy, want.entropy)
    assert not got.entropy.requires_grad
    if topk is None:
        assert got.topk_logp is None
    else:
        assert torch.equal(got.topk_logp, want.topk_logp)
    for g, w in zip(got_grads, want_grads, strict=True):
        scale = w.abs().max().float()
        torch.testing.assert_close(g.float(), w.float(), rtol=tolerance, atol=tolerance * scale)


def test_a_wrong_gradient_fails_the_comparison(monkeypatch) -> None:
    """Negative control: the same comparison catches a gradient that forgets the temperature."""
    head, hidden, targets, mask, topk, weights = inputs(3, 6, True, 4, False, torch.float32)
    want_grads = run(traced, head, hidden, targets, 0.7, mask, topk, weights)[1]
    right = fused._grad_of_logits

    def without_temperature(logits, temperature, *rest):
        return right(logits, 1.0, *rest)

    monkeypatch.setattr(fused, "_grad_of_logits", without_temperature)
    got_grads = run(written_out(True), head, hidden, targets, 0.7, mask, topk, weights)[1]
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got_grads[0], want_grads[0], rtol=1e-5, atol=1e-5)
