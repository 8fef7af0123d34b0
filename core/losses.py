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

Tensors stay on the device they arrive on. Floating inputs are computed in the logits' dtype,
promoted to at least float32. Nothing here reduces across processes: see :func:`normalize_loss`.

Example:
    >>> logits = torch.zeros(2, 4, requires_grad=True)
    >>> out = policy_loss(
    ...     logits,
    ...     target_ids=torch.tensor([0, 1]),
    ...     sampler_logp=torch.log(torch.tensor([0.25, 0.25])),
    ...     advantages=torch.tensor([1.0, -1.0]),
    ...     sample_index=torch.tensor([0, 1]),
    ...     config=LossConfig(score_centering=False),
    ...     num_trained_tokens_global=2,
    ...     gradient_accumulation_steps=1,
    ... )
    >>> round(out.loss.item(), 6), out.num_tokens, out.metrics["sampling/masked_mean"]
    (0.0, 2, 0.0)
"""

from __future__ import annotations

import math

import attrs
import torch
from torch import Tensor

_BASE_METRICS = (
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/masked_mean",
    "entropy",
    "clip_ratio/region_mean",
    "clip_ratio/low_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_mean",
    "clip_ratio/high_max",
)
_SAMPLER_MASS = "sampling/sampler_mass"


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
        _check_kind("topk.ids", self.ids, "long")
        if self.ids.dim() != 2:
            raise ValueError(f"topk.ids has shape {tuple(self.ids.shape)}; it must be [N, K]")
        shape = tuple(self.ids.shape)
        _check_tensor("topk.logp", self.logp, shape, "float", "match topk.ids")
        _check_tensor("topk.valid", self.valid, shape, "bool", "match topk.ids")


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


@attrs.frozen(eq=False)
class LossOutput:
    """One micro-batch's loss and metrics.

    Attributes:
        loss: scalar tensor with grad, normalised as :func:`normalize_loss` describes.
        metrics: the metric names of TRL's AsyncGRPOTrainer to values (see :func:`loss_metrics`).
        num_tokens: N, this micro-batch's trained tokens on this process. Record each metric
            with this weight (``metrics.value(name, amount, weight=num_tokens)``) so a window's
            means are over trained tokens; ``_min``/``_max`` metrics ignore the weight.
    """

    loss: Tensor
    metrics: dict[str, float]
    num_tokens: int


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
    n, v = _check_logits(logits)
    _check_tensor("target_ids", target_ids, (n,), "long", "match logits' N trained tokens")
    if not (math.isfinite(temperature) and temperature > 0.0):
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")
    if candidate_mask is not None:
        _check_tensor("candidate_mask", candidate_mask, (n, v), "bool", "match logits")
    if topk is not None and topk.ids.shape[0] != n:
        raise ValueError(
            f"topk has {topk.ids.shape[0]} rows but logits has {n} trained tokens; gather the "
            "sampler's top-K at the same trained positions"
        )
    scaled = logits.to(_compute_dtype(logits)) / temperature
    if candidate_mask is not None:
        scaled = scaled.masked_fill(~candidate_mask, -math.inf)
    logp_all = torch.log_softmax(scaled, dim=-1)
    logp = logp_all.gather(-1, target_ids.unsqueeze(-1)).squeeze(-1)
    topk_logp = None
    if topk is not None:
        gathered = logp_all.gather(-1, topk.ids.masked_fill(~topk.valid, 0))
        topk_logp = gathered.masked_fill(~topk.valid, -math.inf)
    return TokenLogProbs(logp=logp, entropy=_entropy(logp_all.detach()), topk_logp=topk_logp)


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
    mu = _sampler_probs(topk).to(topk_logp.dtype)
    log_ratio = torch.where(mu > 0, topk_logp.detach() - topk.logp.to(topk_logp.dtype), -math.inf)
    weight = masked_importance_weight(log_ratio, config)
    centering = (mu * weight * torch.where(weight > 0, topk_logp, 0.0)).sum(-1)
    return -advantages * (own - centering)


def sampler_mass(topk: SamplerTopK) -> Tensor:
    """float [N]: the sampler's probability mass on its valid top-K tokens at each position.

    Example:
        >>> topk = SamplerTopK(torch.tensor([[3, 1]]), torch.log(torch.tensor([[0.5, 0.3]])),
        ...                    torch.tensor([[True, True]]))
        >>> round(sampler_mass(topk).item(), 4)
        0.8
    """
    return _sampler_probs(topk).sum(-1)


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


@torch.no_grad()
def loss_metrics(
    logp: Tensor,
    sampler_logp: Tensor,
    entropy: Tensor,
    sample_index: Tensor,
    config: LossConfig,
    topk: SamplerTopK | None = None,
) -> dict[str, float]:
    """The loss metrics of TRL's AsyncGRPOTrainer over the N trained tokens, computed without grad.

    * ``sampling/importance_sampling_ratio/{min,mean,max}``: of ``r`` before masking;
    * ``sampling/sampling_logp_difference/{mean,max}``: of ``|logp - sampler_logp|`` (nats);
    * ``sampling/masked_mean``: fraction of tokens dropped by the keep range;
    * ``entropy``: mean entropy (nats);
    * ``clip_ratio/region_mean``: fraction with ``r`` outside ``[1 - eps, 1 + eps_high]``
      whatever the advantage's sign (in score-centering mode nothing is clipped; these only
      count tokens outside the trust region); ``clip_ratio/low_mean`` (``r < 1 - eps``) and
      ``clip_ratio/high_mean`` (``r > 1 + eps_high``);
    * ``clip_ratio/low_min``, ``clip_ratio/high_max``: min (max) over completions of each
      completion's fraction of its tokens in this micro-batch below (above) the trust region;
    * ``sampling/sampler_mass`` (only with ``topk``): mean of :func:`sampler_mass`.

    With N = 0 every metric is NaN (a metric window ignores it). All values come back in one
    device-to-host copy.

    Args:
        logp: float [N] policy log-probs of the targets (nats).
        sampler_logp: float [N] the sampler's log-probs of the targets (nats).
        entropy: float [N] per-position entropy (nats).
        sample_index: long [N] the completion each token belongs to.
        config: trust region and keep range.
        topk: the sampler's top-K, in score-centering mode.

    Example:
        >>> m = loss_metrics(torch.log(torch.tensor([0.5, 0.5])),
        ...                  torch.log(torch.tensor([0.25, 0.5])), torch.zeros(2),
        ...                  torch.tensor([7, 9]), LossConfig())
        >>> m["sampling/importance_sampling_ratio/max"], m["clip_ratio/high_max"]
        (2.0, 1.0)
    """
    names = _BASE_METRICS + ((_SAMPLER_MASS,) if topk is not None else ())
    if logp.shape[0] == 0:
        return dict.fromkeys(names, math.nan)
    logp = logp.detach()
    dtype = logp.dtype
    ratio = importance_ratio(logp, sampler_logp.to(dtype))
    difference = (logp - sampler_logp.to(dtype)).abs()
    low, high = config.trust_region
    below, above = ratio < low, ratio > high
    values = [
        ratio.min(),
        ratio.mean(),
        ratio.max(),
        difference.mean(),
        difference.max(),
        (~importance_keep(ratio, config)).to(dtype).mean(),
        entropy.to(dtype).mean(),
        (below | above).to(dtype).mean(),
        below.to(dtype).mean(),
        _fraction_per_sample(below, sample_index, dtype).min(),
        above.to(dtype).mean(),
        _fraction_per_sample(above, sample_index, dtype).max(),
    ]
    if topk is not None:
        values.append(sampler_mass(topk).to(dtype).mean())
    return dict(zip(names, torch.stack([v.to(dtype) for v in values]).tolist(), strict=True))


def policy_loss(
    logits: Tensor,
    target_ids: Tensor,
    sampler_logp: Tensor,
    advantages: Tensor,
    sample_index: Tensor,
    *,
    config: LossConfig,
    num_trained_tokens_global: int,
    gradient_accumulation_steps: int,
    candidate_mask: Tensor | None = None,
    topk: SamplerTopK | None = None,
) -> LossOutput:
    """The loss and metrics of one micro-batch (or one chunk of it) of N trained tokens.

    Score centering (``config.score_centering``, needs ``topk``) or the clipped surrogate,
    normalised by :func:`normalize_loss`; metrics from :func:`loss_metrics`. ``topk`` is
    ignored by the clipped surrogate. A target outside its candidate set (the records reject
    one upstream) has log-prob -inf, ratio 0, and is dropped without NaN.

    Args:
        logits: float [N, V] raw logits predicting each trained token.
        target_ids: long [N] sampled tokens.
        sampler_logp: float [N] the sampler's processed log-probs of the targets (nats).
        advantages: float [N] each token's rollout advantage.
        sample_index: long [N] the completion each token belongs to.
        config: the hyperparameters.
        num_trained_tokens_global: this micro-batch's trained tokens summed over processes.
        gradient_accumulation_steps: micro-batches per optimizer step.
        candidate_mask: bool [N, V] the sampler's candidate sets, or None for the full vocab.
        topk: the sampler's top-K log-probs at each position.
    """
    n, _ = _check_logits(logits)
    for name, tensor in (("sampler_logp", sampler_logp), ("advantages", advantages)):
        _check_tensor(name, tensor, (n,), "float", "match logits' N trained tokens")
    _check_tensor("sample_index", sample_index, (n,), "long", "match logits' N trained tokens")
    if config.score_centering and topk is None:
        raise ValueError(
            "score centering needs topk (the sampler's top-K log-probs); pass topk or set "
            "score_centering=False"
        )
    centering_topk = topk if config.score_centering else None
    tokens = token_log_probs(logits, target_ids, config.temperature, candidate_mask, centering_topk)
    sampler_logp = sampler_logp.to(tokens.logp.dtype)
    advantages = advantages.to(tokens.logp.dtype)
    if centering_topk is not None and tokens.topk_logp is not None:
        per_token = score_centered_surrogate(
            tokens.logp, sampler_logp, advantages, tokens.topk_logp, centering_topk, config
        )
    else:
        per_token = clipped_surrogate(tokens.logp, sampler_logp, advantages, config)
    return LossOutput(
        loss=normalize_loss(per_token, num_trained_tokens_global, gradient_accumulation_steps),
        metrics=loss_metrics(
            tokens.logp, sampler_logp, tokens.entropy, sample_index, config, centering_topk
        ),
        num_tokens=n,
    )


def _compute_dtype(logits: Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


def _entropy(logp_all: Tensor) -> Tensor:
    return -(logp_all.exp() * logp_all.nan_to_num(neginf=0.0)).sum(-1)


def _sampler_probs(topk: SamplerTopK) -> Tensor:
    return torch.where(topk.valid, topk.logp.exp(), 0.0)


def _fraction_per_sample(flags: Tensor, sample_index: Tensor, dtype: torch.dtype) -> Tensor:
    order = torch.argsort(sample_index, stable=True)
    _, counts = torch.unique_consecutive(sample_index[order], return_counts=True)
    totals = flags[order].long().cumsum(0)[counts.cumsum(0) - 1]
    hits = torch.diff(totals, prepend=totals.new_zeros(1))
    return hits.to(dtype) / counts.to(dtype)


_KIND_FIX = {
    "float": ("a floating-point tensor", "convert it with .float()"),
    "long": ("a torch.long tensor", "convert it with .long()"),
    "bool": ("a bool tensor", "convert it with .bool()"),
}


def _check_kind(name: str, tensor: Tensor, kind: str) -> None:
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


def _check_tensor(name: str, tensor: Tensor, shape: tuple[int, ...], kind: str, why: str) -> None:
    _check_kind(name, tensor, kind)
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}; it must be {shape} to {why}")


def _check_logits(logits: Tensor) -> tuple[int, int]:
    _check_kind("logits", logits, "float")
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(
            f"logits has shape {tuple(logits.shape)}; it must be [N, V] with V >= 1: flatten "
            "the trained positions of the micro-batch into N rows"
        )
    return logits.shape[0], logits.shape[1]
