"""What the policy losses take in, and the checks that refuse bad input.

:class:`LossConfig` holds the loss's hyperparameters and :class:`SamplerTopK` the sampler's
top-K log-probs at each trained position; both check themselves when built. The tensor checks
(:func:`check_kind`, :func:`check_tensor`, :func:`check_logits`) are the ones every entry point
of :mod:`asyncgrpo.core.loss.losses` runs on its arguments: a wrong dtype or shape raises with the
field's name and the fix, before any maths.
"""

from __future__ import annotations

import math

import attrs
import torch
from torch import Tensor


@attrs.frozen
class LossConfig:
    """The loss's hyperparameters, under the config's names.

    Attributes:
        temperature: sampling temperature (> 0); the policy is ``log_softmax(logits / T)``.
        epsilon: lower trust-region width; ``r < 1 - epsilon`` is clipped (surrogate mode) and
            counted in ``clip_ratio/low_*``.
        epsilon_high: upper width; ``None`` means ``epsilon``.
        vllm_importance_sampling_clip_min: tokens with ``r`` below this are dropped.
        vllm_importance_sampling_clip_max: tokens with ``r`` above this are dropped.
        score_centering: score-centered estimator (True) or clipped surrogate (False).
    """

    temperature: float = 1.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    vllm_importance_sampling_clip_min: float = 0.5
    vllm_importance_sampling_clip_max: float = 5.0
    score_centering: bool = True

    def __attrs_post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature > 0.0):
            raise ValueError(
                f"temperature must be finite and > 0, got {self.temperature}; pass the "
                "sampling temperature the rollouts were generated with"
            )
        if not 0.0 <= self.epsilon <= 1.0:
            raise ValueError(f"epsilon must lie in [0, 1], got {self.epsilon}; 0.2 is usual")
        if self.epsilon_high is not None and not self.epsilon_high >= 0.0:
            raise ValueError(
                f"epsilon_high must be >= 0, got {self.epsilon_high}; or None to use epsilon"
            )
        low = self.vllm_importance_sampling_clip_min
        high = self.vllm_importance_sampling_clip_max
        if not 0.0 <= low <= 1.0 <= high:
            raise ValueError(
                "need 0 <= vllm_importance_sampling_clip_min <= 1 <= "
                f"vllm_importance_sampling_clip_max, got {low} and {high}; a range without 1 "
                "drops every on-policy token"
            )

    @property
    def trust_region(self) -> tuple[float, float]:
        """``(1 - epsilon, 1 + epsilon_high)``, with ``epsilon_high`` defaulting to epsilon."""
        high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        return 1.0 - self.epsilon, 1.0 + high

    @property
    def keep_range(self) -> tuple[float, float]:
        """The importance-sampling keep range ``(clip_min, clip_max)``."""
        return self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max


@attrs.frozen(eq=False)
class SamplerTopK:
    """The sampler's top-K log-probs at each trained position, for score centering.

    Attributes:
        ids: long [N, K] token ids; any value (even out of range) where ``valid`` is False.
        logp: float [N, K] the sampler's processed log-probs of ``ids`` (nats, <= 0, -inf for
            probability 0); any value where ``valid`` is False.
        valid: bool [N, K], False for padding where a position has fewer than K entries.
    """

    ids: Tensor
    logp: Tensor
    valid: Tensor

    def __attrs_post_init__(self) -> None:
        check_kind("topk.ids", self.ids, "long")
        if self.ids.dim() != 2:
            raise ValueError(f"topk.ids has shape {tuple(self.ids.shape)}; it must be [N, K]")
        shape = tuple(self.ids.shape)
        check_tensor("topk.logp", self.logp, shape, "float", "match topk.ids")
        check_tensor("topk.valid", self.valid, shape, "bool", "match topk.ids")


_KIND_FIX = {
    "float": ("a floating-point tensor", "convert it with .float()"),
    "long": ("a torch.long tensor", "convert it with .long()"),
    "bool": ("a bool tensor", "convert it with .bool()"),
}


def check_kind(name: str, tensor: Tensor, kind: str) -> None:
    """Raise ``TypeError`` unless ``tensor`` is a tensor of ``kind`` ("float", "long" or
    "bool"); the message names ``name`` and the conversion that fixes it.

    Example:
        >>> check_kind("completion_ids", torch.tensor([3, 5]), "long")
        >>> check_kind("completion_ids", torch.tensor([3.0, 5.0]), "long")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        TypeError: completion_ids has dtype torch.float32; ... convert it with .long()
    """
    if not isinstance(tensor, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    ok = {
        "float": tensor.is_floating_point(),
        "long": tensor.dtype == torch.long,
        "bool": tensor.dtype == torch.bool,
    }[kind]
    if not ok:
        wanted, fix = _KIND_FIX[kind]
        raise TypeError(f"{name} has dtype {tensor.dtype}; it must be {wanted}: {fix}")


def check_tensor(name: str, tensor: Tensor, shape: tuple[int, ...], kind: str, why: str) -> None:
    """:func:`check_kind`, then ``ValueError`` unless ``tensor`` has exactly ``shape``; ``why``
    ends the message ("it must be <shape> to <why>")."""
    check_kind(name, tensor, kind)
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}; it must be {shape} to {why}")


def check_logits(logits: Tensor) -> tuple[int, int]:
    """``(N, V)`` of float [N, V] logits with V >= 1; raises naming ``logits`` otherwise."""
    check_kind("logits", logits, "float")
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(
            f"logits has shape {tuple(logits.shape)}; it must be [N, V] with V >= 1: flatten "
            "the trained positions of the micro-batch into N rows"
        )
    return logits.shape[0], logits.shape[1]
