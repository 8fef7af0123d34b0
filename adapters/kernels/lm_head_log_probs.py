"""The LM head and the log-softmax of one chunk of trained positions, with the gradient written
out instead of traced.

Autograd through ``log_softmax(hidden @ W.T / T).gather(...)`` spends most of its backward
outside the two matrix products: each ``gather`` backward zero-fills a ``[c, V]`` tensor and
scatters into it, then the log-softmax backward reads the ``[c, V]`` log-probs again. The
gradient of a log-prob with respect to its logits is known in closed form, so
:class:`LMHeadLogProbs` computes it in one pass over the softmax::

    d logp_i / d logits_ij        = (1[j = target_i] - p_ij) / T
    d topk_logp_ik / d logits_ij  = (1[j = id_ik]    - p_ij) / T      (valid entries only)

The forward values are :func:`asyncgrpo.core.loss.losses.token_log_probs` itself, so they do not
change. ``keep_logits`` chooses between keeping the chunk's ``[c, V]`` logits for the backward
and recomputing them there (one more ``[c, H] x [H, V]`` product): the caller keeps them only
for the last chunk of a row, whose backward runs first, so memory still holds one chunk's
logits at most. On the real demo's rows (one chunk) this spares the recomputation too; the
measurements are in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from asyncgrpo.core.loss.inputs import SamplerTopK
from asyncgrpo.core.loss.losses import TokenLogProbs, token_log_probs


def lm_head_log_probs(
    lm_head: nn.Linear,
    hidden: Tensor,
    target_ids: Tensor,
    temperature: float,
    candidate_mask: Tensor | None,
    topk: SamplerTopK | None,
    *,
    keep_logits: bool,
) -> TokenLogProbs:
    """:func:`~asyncgrpo.core.loss.losses.token_log_probs` of ``lm_head(hidden)``, whose
    backward is :class:`LMHeadLogProbs`'s.

    Args:
        lm_head: the model's output projection, a plain ``nn.Linear`` (weight [V, H]).
        hidden: float [c, H] final hidden states at the chunk's trained positions.
        target_ids: long [c] the trained tokens.
        temperature: the sampling temperature, > 0.
        candidate_mask: bool [c, V] the sampler's candidate sets, or None.
        topk: the sampler's top-K at the chunk's positions, or None.
        keep_logits: keep the ``[c, V]`` logits for the backward instead of recomputing them.

    Returns:
        ``logp`` [c] and ``topk_logp`` [c, K] (or None) with gradients to ``hidden`` and the
        head's parameters; ``entropy`` [c] detached.
    """
    ids, sampler_logp, valid = (
        (None, None, None) if topk is None else (topk.ids, topk.logp, topk.valid)
    )
    logp, entropy, topk_logp = LMHeadLogProbs.apply(
        hidden,
        lm_head.weight,
        lm_head.bias,
        target_ids,
        temperature,
        candidate_mask,
        sampler_logp,
        ids,
        valid,
        keep_logits,
    )
    return TokenLogProbs(logp=logp, entropy=entropy, topk_logp=None if topk is None else topk_logp)


class LMHeadLogProbs(torch.autograd.Function):
    """``(logp [c], entropy [c], topk_logp [c, K] or [c, 0])`` of ``F.linear(hidden, weight,
    bias)``; see the module docstring for the backward."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        target_ids: Tensor,
        temperature: float,
        candidate_mask: Tensor | None,
        topk_logp: Tensor | None,
        topk_ids: Tensor | None,
        topk_valid: Tensor | None,
        keep_logits: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:
        logits = F.linear(hidden, weight, bias)
        topk = None if topk_ids is None else SamplerTopK(topk_ids, topk_logp, topk_valid)
        out = token_log_probs(logits, target_ids, temperature, candidate_mask, topk)
        ctx.temperature = temperature
        ctx.save_for_backward(
            hidden,
            weight,
            bias,
            target_ids,
            candidate_mask,
            topk_ids,
            topk_valid,
            logits if keep_logits else None,
        )
        ctx.mark_non_differentiable(out.entropy)
        chosen = out.topk_logp if out.topk_logp is not None else out.logp.new_empty(len(logits), 0)
        return out.logp, out.entropy, chosen

    @staticmethod
    def backward(
        ctx: Any, grad_logp: Tensor, _grad_entropy: Tensor, grad_topk: Tensor
    ) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, target_ids, candidate_mask, topk_ids, topk_valid, logits = (
            ctx.saved_tensors
        )
        if logits is None:
            logits = F.linear(hidden, weight, bias)
        grad_logits = _grad_of_logits(
            logits,
            ctx.temperature,
            candidate_mask,
            target_ids,
            grad_logp,
            topk_ids,
            topk_valid,
            grad_topk,
        )
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        return (
            grad_logits @ weight if need_hidden else None,
            grad_logits.t() @ hidden if need_weight else None,
            grad_logits.sum(0) if need_bias and bias is not None else None,
            *([None] * 7),
        )


def _grad_of_logits(
    logits: Tensor,
    temperature: float,
    candidate_mask: Tensor | None,
    target_ids: Tensor,
    grad_logp: Tensor,
    topk_ids: Tensor | None,
    topk_valid: Tensor | None,
    grad_topk: Tensor,
) -> Tensor:
    """d loss / d logits [c, V] in the logits' dtype: ``(scatter(g) - p * sum(g)) / T``, with
    ``g`` the gradients of the target's and the valid top-K entries' log-probs and ``p`` the
    (candidate-masked) softmax, computed as :func:`token_log_probs` computes it."""
    scaled = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        scaled = scaled / temperature
    if candidate_mask is not None:
        scaled = scaled.masked_fill(~candidate_mask, -math.inf)
    grad_logp = grad_logp.to(scaled.dtype)
    total = grad_logp
    if topk_ids is not None:
        grad_topk = grad_topk.to(scaled.dtype).masked_fill(~topk_valid, 0.0)
        total = total + grad_topk.sum(-1)
    grad = torch.softmax(scaled, dim=-1).mul_(-total.unsqueeze(-1))
    grad.scatter_add_(-1, target_ids.unsqueeze(-1), grad_logp.unsqueeze(-1))
    if topk_ids is not None:
        grad.scatter_add_(-1, topk_ids.masked_fill(~topk_valid, 0), grad_topk)
    if temperature != 1.0:
        grad.div_(temperature)
    return grad.to(logits.dtype)
