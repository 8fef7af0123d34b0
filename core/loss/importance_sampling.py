"""Masked importance sampling, shared by the policy losses and their metrics.

The importance ratio ``r = pi / mu`` of each trained token (policy over sampler probability),
which tokens the keep range ``[vllm_importance_sampling_clip_min,
vllm_importance_sampling_clip_max]`` keeps, the masked weight ``f(r)`` (``r`` inside the range,
0 outside), and the sampler's probabilities on its top-K. Shapes: N trained tokens, K top-K
entries per position.
"""

from __future__ import annotations

import torch
from torch import Tensor

from asyncgrpo.core.loss.inputs import LossConfig, SamplerTopK


def importance_ratio(logp: Tensor, sampler_logp: Tensor) -> Tensor:
    """``r = exp(logp - sampler_logp)``, policy over sampler probability; float [N].

    Example:
        >>> importance_ratio(torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25])))
        tensor([2.])
    """
    return torch.exp(logp - sampler_logp)


def importance_keep(ratio: Tensor, config: LossConfig) -> Tensor:
    """bool [N]: True where ``clip_min <= r <= clip_max``; the other tokens leave the loss.

    Example:
        >>> importance_keep(torch.tensor([0.4, 1.0, 5.0, 6.0]), LossConfig()).tolist()
        [False, True, True, False]
    """
    low, high = config.keep_range
    return (ratio >= low) & (ratio <= high)


def masked_importance_weight(log_ratio: Tensor, config: LossConfig) -> Tensor:
    """``f(r)``: ``r = exp(log_ratio)`` inside the keep range, 0 outside; detached, any shape.

    Example:
        >>> masked_importance_weight(torch.log(torch.tensor([0.25, 2.0, 8.0])), LossConfig())
        tensor([0., 2., 0.])
    """
    ratio = log_ratio.detach().exp()
    return torch.where(importance_keep(ratio, config), ratio, 0.0)


def sampler_mass(topk: SamplerTopK) -> Tensor:
    """float [N]: the sampler's probability mass on its valid top-K tokens at each position.

    Example:
        >>> topk = SamplerTopK(torch.tensor([[3, 1]]), torch.log(torch.tensor([[0.5, 0.3]])),
        ...                    torch.tensor([[True, True]]))
        >>> round(sampler_mass(topk).item(), 4)
        0.8
    """
    return sampler_probs(topk).sum(-1)


def sampler_probs(topk: SamplerTopK) -> Tensor:
    """float [N, K]: the sampler's probability of each top-K entry, 0 where ``topk.valid`` is
    False."""
    return torch.where(topk.valid, topk.logp.exp(), 0.0)
