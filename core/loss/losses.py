"""Policy-gradient losses for one micro-batch of trained tokens.

Every tensor is per trained token, flattened over the micro-batch: N trained tokens, a
vocabulary of V, and the sampler's top-K log-probs at each position. The learner runs the model
and gathers the logits that predict each trained token; this module turns them into a scalar loss
and a dict of metrics. Two estimators share masked importance sampling, which drops every token
whose ratio ``r = pi / mu`` (policy over sampler) lies outside
``[vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max]``:

* **score centering** (the default): a surrogate whose gradient is
  ``-A (f(r_t) grad log pi(o_t) - sum_{v in top-K} mu(v) f(r_v) grad log pi(v))``, with
  ``f(r) = r`` inside the range and 0 outside (:func:`score_centered_surrogate`);
* **clipped surrogate**: PPO's ``-min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)``
  (:func:`clipped_surrogate`).

The policy ``pi`` is ``log_softmax(logits / temperature)``, renormalised over the sampler's
candidate set when one is given, so it matches the sampler's processed log-probs.

The inputs and their checks live in :mod:`asyncgrpo.core.loss.inputs`, the importance ratio and
keep range in :mod:`asyncgrpo.core.loss.importance_sampling`, the metrics in
:mod:`asyncgrpo.core.loss.metrics`; the objectives that choose between these and others are in
:mod:`asyncgrpo.core.loss.objectives`.

Tensors stay on the device they arrive on. Floating inputs are computed in the logits' dtype,
promoted to at least float32. Nothing here reduces across processes: see :func:`normalize_loss`.

Example:
    >>> logits = torch.zeros(2, 4, requires_grad=True)
    >>> tokens = token_log_probs(logits, torch.tensor([0, 1]), temperature=1.0)
    >>> per_token = clipped_surrogate(tokens.logp, torch.log(torch.tensor([0.25, 0.25])),
    ...                               torch.tensor([1.0, -1.0]), LossConfig())
    >>> round(normalize_loss(per_token, 2, 1).item(), 6)
    0.0
"""

from __future__ import annotations

import math

import attrs
import torch
from torch import Tensor

from asyncgrpo.core.loss.importance_sampling import (
    importance_keep,
    masked_importance_weight,
    sampler_probs,
)
from asyncgrpo.core.loss.inputs import LossConfig, SamplerTopK, check_logits, check_tensor


@attrs.frozen(eq=False)
class TokenLogProbs:
    """Policy log-probs (nats) at the trained tokens.

    Attributes:
        logp: float [N] log-prob of each target token, with grad.
        entropy: float [N] entropy of each position's distribution (nats), detached.
        topk_logp: float [N, K] log-probs of the sampler's top-K ids, with grad, -inf where
            ``topk.valid`` is False; ``None`` without ``topk``.
    """

    logp: Tensor
    entropy: Tensor
    topk_logp: Tensor | None


def token_log_probs(
    logits: Tensor,
    target_ids: Tensor,
    temperature: float,
    candidate_mask: Tensor | None = None,
    topk: SamplerTopK | None = None,
) -> TokenLogProbs:
    """Log-probs of the target tokens (and of ``topk.ids``) under ``log_softmax(logits / T)``.

    With ``candidate_mask``, logits outside the candidate set are set to -inf first, so the
    distribution (and the entropy) is renormalised over the set the sampler could pick from.
    Every position must have at least one candidate.

    Args:
        logits: float [N, V] raw logits at the positions predicting each trained token.
        target_ids: long [N] sampled token ids, in ``[0, V)``.
        temperature: the sampling temperature, > 0.
        candidate_mask: bool [N, V], True where the sampler could pick the token.
        topk: the sampler's top-K ids at each position.

    Example:
        >>> out = token_log_probs(torch.zeros(1, 4), torch.tensor([1]), 1.0,
        ...                       candidate_mask=torch.tensor([[True, True, False, False]]))
        >>> round(out.logp.item(), 4), round(out.entropy.item(), 4)
        (-0.6931, 0.6931)
    """
    n, v = check_logits(logits)
    check_tensor("target_ids", target_ids, (n,), "long", "match logits' N trained tokens")
    if not (math.isfinite(temperature) and temperature > 0.0):
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    if candidate_mask is not None:
        check_tensor("candidate_mask", candidate_mask, (n, v), "bool", "match logits")
    if topk is not None and topk.ids.shape[0] != n:
        raise ValueError(
            f"topk has {topk.ids.shape[0]} rows but logits has {n} trained tokens; gather the "
            "sampler's top-K at the same trained positions"
        )
    scaled = logits.to(_compute_dtype(logits))
    if temperature != 1.0:  # x / 1 is x exactly: spare a pass over the vocabulary
        scaled = scaled / temperature
    if candidate_mask is not None:
        scaled = scaled.masked_fill(~candidate_mask, -math.inf)
    logp_all = torch.log_softmax(scaled, dim=-1)
    logp = logp_all.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
    topk_logp = None
    if topk is not None:
        gathered = logp_all.gather(-1, topk.ids.masked_fill(~topk.valid, 0))
        topk_logp = gathered.masked_fill(~topk.valid, -math.inf)
    entropy = _entropy(logp_all.detach(), masked=candidate_mask is not None)
    return TokenLogProbs(logp=logp, entropy=entropy, topk_logp=topk_logp)


def clipped_surrogate(
    logp: Tensor, sampler_logp: Tensor, advantages: Tensor, config: LossConfig
) -> Tensor:
    """Per-token clipped-surrogate loss, float [N] with grad through ``logp``.

    ``-1[C_min <= r <= C_max] * min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)``. A dropped
    token contributes exactly 0 and no gradient, even when its ratio overflows.

    Args:
        logp: float [N] policy log-probs of the targets (nats), with grad.
        sampler_logp: float [N] the sampler's log-probs of the targets (nats).
        advantages: float [N] each token's rollout advantage.
        config: epsilon, epsilon_high and the keep range.

    Example:
        >>> half, quarter = math.log(0.5), math.log(0.25)
        >>> loss = clipped_surrogate(torch.tensor([half, half]), torch.tensor([quarter, quarter]),
        ...                          torch.tensor([1.0, -1.0]), LossConfig())
        >>> [round(x, 4) for x in loss.tolist()]  # r = 2: clipped to 1.2 for A > 0 only
        [-1.2, 2.0]
    """
    log_ratio = logp - sampler_logp
    keep = importance_keep(log_ratio.detach().exp(), config)
    ratio = torch.where(keep, log_ratio, 0.0).exp()
    low, high = config.trust_region
    objective = torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
    return -torch.where(keep, objective, 0.0)


def score_centered_surrogate(
    logp: Tensor,
    sampler_logp: Tensor,
    advantages: Tensor,
    topk_logp: Tensor,
    topk: SamplerTopK,
    config: LossConfig,
) -> Tensor:
    """Per-token score-centered loss, float [N], whose gradient is the score-centered estimator.

    Per token ``-A (w_t logp_t - sum_{valid v} mu(v) w_v logpi(v))`` with detached weights
    ``w = f(r)`` (:func:`masked_importance_weight`), ``mu(v) = exp(topk.logp)``, not
    renormalised. ``f`` applies per token: a dropped target loses its own term, but its
    position's centering term stays, which keeps the expectation zero for a constant advantage.
    When sampler and policy agree and the top-K covers the vocabulary, the centering term's
    gradient is ``sum_v grad pi(v) = 0`` and the loss's gradient is REINFORCE's.

    Args:
        logp: float [N] policy log-probs of the targets (nats), with grad.
        sampler_logp: float [N] the sampler's log-probs of the targets (nats).
        advantages: float [N] each token's rollout advantage.
        topk_logp: float [N, K] policy log-probs of ``topk.ids`` (-inf where invalid), with grad.
        topk: the sampler's top-K ids and log-probs.
        config: the keep range.

    Example:
        >>> quarter = math.log(0.25)
        >>> topk = SamplerTopK(torch.tensor([[0, 1]]), torch.tensor([[quarter, quarter]]),
        ...                    torch.tensor([[True, False]]))
        >>> loss = score_centered_surrogate(torch.tensor([quarter]), torch.tensor([quarter]),
        ...     torch.tensor([2.0]), torch.tensor([[quarter, -math.inf]]), topk, LossConfig())
        >>> round(loss.item(), 4)  # -2 * (1 * log 0.25 - 0.25 * 1 * log 0.25)
        2.0794
    """
    own_weight = masked_importance_weight(logp - sampler_logp, config)
    own = own_weight * torch.where(own_weight > 0, logp, 0.0)
    mu = sampler_probs(topk).to(topk_logp.dtype)
    log_ratio = torch.where(mu > 0, topk_logp.detach() - topk.logp.to(topk_logp.dtype), -math.inf)
    weight = masked_importance_weight(log_ratio, config)
    centering = (mu * weight * torch.where(weight > 0, topk_logp, 0.0)).sum(-1)
    return -advantages * (own - centering)


def normalize_loss(
    per_token_loss: Tensor, num_trained_tokens_global: int, gradient_accumulation_steps: int
) -> Tensor:
    """Sum per-token losses and divide by the global token count and the accumulation steps.

    ``loss = sum(per_token_loss) / (num_trained_tokens_global * gradient_accumulation_steps)``.
    With ``num_trained_tokens_global`` the trained tokens of this micro-batch summed over all
    processes, summing the returned losses over processes gives the micro-batch's mean over its
    trained tokens, and summing those over the GA micro-batches gives the mean of the
    micro-batch means (the mean over all trained tokens of the step when micro-batches hold
    equal global counts; pass the step's total with ``gradient_accumulation_steps=1`` for the
    exact token mean). So the shell must SUM gradients across processes, or multiply the loss by
    the world size if its all-reduce averages. Splitting a micro-batch into pieces that share
    ``num_trained_tokens_global`` and summing their losses gives the loss of the whole, so the
    loss does not depend on packing or chunking.

    Args:
        per_token_loss: float [N].
        num_trained_tokens_global: >= N; 0 only with N = 0 (the loss is then 0).
        gradient_accumulation_steps: >= 1.

    Example:
        >>> normalize_loss(torch.tensor([1.0, 2.0, 3.0]), 6, 2)
        tensor(0.5000)
    """
    if gradient_accumulation_steps < 1:
        raise ValueError(
            f"gradient_accumulation_steps must be >= 1, got {gradient_accumulation_steps}"
        )
    n = per_token_loss.shape[0]
    if num_trained_tokens_global < n:
        raise ValueError(
            f"num_trained_tokens_global is {num_trained_tokens_global} but this process alone "
            f"trains {n} tokens; pass the micro-batch's trained tokens summed over processes"
        )
    return per_token_loss.sum() / (max(num_trained_tokens_global, 1) * gradient_accumulation_steps)


def _compute_dtype(logits: Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


def _entropy(logp_all: Tensor, masked: bool) -> Tensor:
    """Entropy of each row of log-probs [N, V]; ``masked``: some are -inf (0 * -inf counts 0)."""
    logp = logp_all.nan_to_num(neginf=0.0) if masked else logp_all
    return -(logp_all.exp() * logp).sum(-1)
