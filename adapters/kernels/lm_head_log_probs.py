"""The LM head and the log-softmax of one chunk of trained positions, with the gradient written
out instead of traced.

Autograd through ``log_softmax(hidden @ W.T / T).gather(...)`` spends most of its backward
outside the two matrix products: each ``gather`` backward zero-fills a ``[c, V]`` tensor and
scatters into it, then the log-softmax backward reads the ``[c, V]`` log-probs again. The
gradient of a log-prob with respect to its logits is known in closed form, so
:class:`LMHeadLogProbs` computes it in one pass over the softmax::

    d logp_i / d logits_ij        = (1[j = target_i] - p_ij) / T
    d topk_logp_ik / d logits_ij  = (1[j = id_ik]    - p_ij) / T      (valid entries only)

Models that transform the head's output (Gemma 2/3's final-logit soft-cap
``cap * tanh(z / cap)``, Cohere's ``logit_scale``) pass a :class:`LogitTransform`; the
gradient then goes through its derivative, ``d logits / d z = scale * (1 - tanh²)``, in the
same pass. The forward values are :func:`asyncgrpo.core.loss.losses.token_log_probs` itself
(of the transformed logits), so they do not change.

``keep_logits`` chooses between keeping the chunk's ``[c, V]`` logits for the backward and
recomputing them there (one more ``[c, H] x [H, V]`` product): the caller keeps them only
for the last chunk of a row, whose backward runs first, so memory still holds one chunk's
logits at most. On the real demo's rows (one chunk) this spares the recomputation too; the
measurements are in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from asyncgrpo.core.loss.inputs import SamplerTopK
from asyncgrpo.core.loss.losses import TokenLogProbs, token_log_probs


@attrs.frozen
class LogitTransform:
    """What a model does to its LM head's output ``z`` before the softmax:
    ``logits = softcap * tanh(scale * z / softcap)`` (without a soft-cap, ``scale * z``).

    Attributes:
        scale: multiplies the head's output (Cohere's ``logit_scale``); 1.0 for most models.
        softcap: the final-logit cap (Gemma 2/3's ``final_logit_softcapping``), or ``None``.
    """

    scale: float = 1.0
    softcap: float | None = None

    def __attrs_post_init__(self) -> None:
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"final-logit softcap must be > 0 or None, got {self.softcap}")

    @classmethod
    def of(cls, config: Any) -> LogitTransform:
        """The transform of a transformers config (its text config's ``logit_scale`` and
        ``final_logit_softcapping``)."""
        text = config.get_text_config()
        scale = getattr(text, "logit_scale", None)
        return cls(
            scale=1.0 if scale is None else float(scale),
            softcap=getattr(text, "final_logit_softcapping", None),
        )

    @property
    def is_identity(self) -> bool:
        """Leaves the logits as the head computes them."""
        return self.scale == 1.0 and self.softcap is None

    def __call__(self, z: Tensor) -> Tensor:
        """logits [c, V] of the head's output ``z`` [c, V], as the model's forward computes
        them (scale, then ``z / cap``, ``tanh``, ``* cap``)."""
        if self.scale != 1.0:
            z = z * self.scale
        if self.softcap is not None:
            z = torch.tanh(z / self.softcap) * self.softcap
        return z

    def backward(self, z: Tensor, grad_logits: Tensor) -> Tensor:
        """d loss / d z [c, V] from d loss / d logits [c, V], at the head's output ``z``; in
        float32 at least (bf16 logits too), the caller casts back."""
        precision = torch.promote_types(z.dtype, torch.float32)
        grad = grad_logits.to(precision)
        if self.softcap is not None:
            tanh = torch.tanh(z.to(precision) * self.scale / self.softcap)
            grad = grad * (1 - tanh * tanh)
        if self.scale != 1.0:
            grad = grad * self.scale
        return grad


IDENTITY = LogitTransform()


def lm_head_log_probs(
    lm_head: nn.Linear,
    hidden: Tensor,
    target_ids: Tensor,
    temperature: float,
    candidate_mask: Tensor | None,
    topk: SamplerTopK | None,
    *,
    keep_logits: bool,
    transform: LogitTransform = IDENTITY,
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
        transform: what the model does to the head's output before the softmax.

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
        transform,
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
        transform: LogitTransform,
    ) -> tuple[Tensor, Tensor, Tensor]:
        z = F.linear(hidden, weight, bias)
        logits = transform(z)
        topk = _sampler_topk(topk_ids, topk_logp, topk_valid)
        out = token_log_probs(logits, target_ids, temperature, candidate_mask, topk)
        ctx.temperature = temperature
        ctx.transform = transform
        ctx.save_for_backward(
            hidden,
            weight,
            bias,
            target_ids,
            candidate_mask,
            topk_ids,
            topk_valid,
            z if keep_logits else None,
        )
        ctx.mark_non_differentiable(out.entropy)
        chosen = out.topk_logp if out.topk_logp is not None else out.logp.new_empty(len(logits), 0)
        return out.logp, out.entropy, chosen

    @staticmethod
    def backward(
        ctx: Any, grad_logp: Tensor, _grad_entropy: Tensor, grad_topk: Tensor
    ) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, target_ids, candidate_mask, topk_ids, topk_valid, z = (
            ctx.saved_tensors
        )
        if z is None:
            z = F.linear(hidden, weight, bias)
        transform = ctx.transform
        grad_logits = _grad_of_logits(
            transform(z),
            ctx.temperature,
            candidate_mask,
            target_ids,
            grad_logp,
            topk_ids,
            topk_valid,
            grad_topk,
        )
        if not transform.is_identity:
            grad_logits = transform.backward(z, grad_logits).to(z.dtype)
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        return (
            grad_logits @ weight if need_hidden else None,
            grad_logits.t() @ hidden if need_weight else None,
            grad_logits.sum(0) if need_bias and bias is not None else None,
            *([None] * 8),
        )


def _sampler_topk(
    ids: Tensor | None, logp: Tensor | None, valid: Tensor | None
) -> SamplerTopK | None:
    """The sampler's top-K from the function's flat arguments (all three, or none: None)."""
    if ids is None and logp is None and valid is None:
        return None
    if ids is None or logp is None or valid is None:
        raise ValueError("topk_ids, topk_logp and topk_valid go together: give all or none")
    return SamplerTopK(ids, logp, valid)


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
    if (topk_ids is None) != (topk_valid is None):
        raise ValueError("topk_ids and topk_valid go together: give both or neither")
    scaled = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if temperature != 1.0:
        scaled = scaled / temperature
    if candidate_mask is not None:
        scaled = scaled.masked_fill(~candidate_mask, -math.inf)
    grad_logp = grad_logp.to(scaled.dtype)
    total = grad_logp
    if topk_ids is not None and topk_valid is not None:
        grad_topk = grad_topk.to(scaled.dtype).masked_fill(~topk_valid, 0.0)
        total = total + grad_topk.sum(-1)
    grad = torch.softmax(scaled, dim=-1).mul_(-total.unsqueeze(-1))
    grad.scatter_add_(-1, target_ids.unsqueeze(-1), grad_logp.unsqueeze(-1))
    if topk_ids is not None and topk_valid is not None:
        grad.scatter_add_(-1, topk_ids.masked_fill(~topk_valid, 0), grad_topk)
    if temperature != 1.0:
        grad.div_(temperature)
    return grad.to(logits.dtype)
