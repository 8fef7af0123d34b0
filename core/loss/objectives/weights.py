"""Pieces the objectives share: per-sample aggregation of log-ratios, keep ranges in log space,
the PPO term against an anchor policy, and the objective metrics' names.

Shapes: N trained tokens; ``sample_index`` long [N] says which sample each token belongs to (ids
are any longs, a sample's tokens need not be contiguous). Every function here is pure tensor
maths and keeps the device and dtype it is given.

The objective metrics (each a 0-d tensor over one call's tokens, left on the device; how each
aggregates over a window, a mean weighted by the call's N tokens or the extreme, is declared in
:data:`OBJECTIVE_METRICS`):

* ``objective/is_weight_mean``: mean of the detached importance weight each token's own term is
  multiplied by (0 for a dropped token); PPO clipping is not part of the weight.
* ``objective/is_weight_max``: its largest value (kept as the extreme over a window).
* ``objective/truncated_fraction``: fraction of tokens whose weight was cut to a bound instead of
  being the raw ratio (TIS above its cap; CISPO outside its clip range).
* ``objective/masked_fraction``: fraction of tokens dropped from the loss (weight 0): ratio
  outside a keep range, or masked by M2PO.
* ``objective/clipped_fraction``: fraction of tokens whose gradient the PPO clip removes
  (``A > 0`` and ``rho > 1 + epsilon_high``, or ``A < 0`` and ``rho < 1 - epsilon``), among
  those not dropped; ``rho`` is the ratio to the anchor policy (the sampler for the clipped
  surrogate, the proximal policy for the decoupled objectives, where it is 0 while the
  proximal policy is the current one).
* ``objective/proximal_gap``: mean ``|logp - proximal_logp|`` (nats); 0 while the proximal
  policy is the current one.
* ``objective/second_moment``: M2PO's ``mean((log r)^2)`` over the call's tokens, before masking.
* ``objective/trust_region_fraction``: fraction of tokens M2PO may mask (those PPO could clip).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Generic, Literal, TypeVar

import attrs
import torch
from torch import Tensor

from asyncgrpo.core.frozen import FrozenMap
from asyncgrpo.core.loss.inputs import LossConfig
from asyncgrpo.core.loss.objectives.base import (
    Needs,
    ObjectiveSettings,
    RangeContainingOne,
    TokenInputs,
    finite,
    metric_values,
    setting,
    unit_interval,
)
from asyncgrpo.core.metrics import Aggregation

Level = Literal["token", "sequence", "geometric"]
"""How token log-ratios become a weight: per token, summed over the sample (the product of its
ratios) or averaged over the sample (the geometric mean of its ratios)."""

IS_WEIGHT_MEAN = "objective/is_weight_mean"
IS_WEIGHT_MAX = "objective/is_weight_max"
TRUNCATED_FRACTION = "objective/truncated_fraction"
MASKED_FRACTION = "objective/masked_fraction"
CLIPPED_FRACTION = "objective/clipped_fraction"
PROXIMAL_GAP = "objective/proximal_gap"
SECOND_MOMENT = "objective/second_moment"
TRUST_REGION_FRACTION = "objective/trust_region_fraction"
OBJECTIVE_METRICS: Mapping[str, Aggregation] = FrozenMap(
    {
        **dict.fromkeys(
            (
                IS_WEIGHT_MEAN,
                TRUNCATED_FRACTION,
                MASKED_FRACTION,
                CLIPPED_FRACTION,
                PROXIMAL_GAP,
                SECOND_MOMENT,
                TRUST_REGION_FRACTION,
            ),
            Aggregation.MEAN,
        ),
        IS_WEIGHT_MAX: Aggregation.MAX,
    }
)
"""How each objective metric aggregates over a window's calls; an objective's ``metrics`` may
return only names declared here (a new one is declared here beside its name)."""


@attrs.frozen(kw_only=True)
class TrustRegionSettings(ObjectiveSettings):
    """PPO's trust region, shared by the objectives with a PPO term (TRL's names).

    Example:
        >>> TrustRegionSettings().trust_region
        (0.8, 1.2)
        >>> TrustRegionSettings(epsilon=0.2, epsilon_high=0.28).trust_region
        (0.8, 1.28)
    """

    epsilon: float = setting(
        0.2, "Lower clipping epsilon.", "TRL (GRPOConfig, AsyncGRPOConfig)", unit_interval
    )
    epsilon_high: float | None = setting(
        None,
        "Upper clipping epsilon; None: epsilon.",
        "TRL; DAPO recommends 0.28",
        finite,
        optional=True,
    )

    @property
    def trust_region(self) -> tuple[float, float]:
        """``(1 - epsilon, 1 + epsilon_high)``, with ``epsilon_high`` defaulting to epsilon."""
        high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        return 1.0 - self.epsilon, 1.0 + high


@attrs.frozen(kw_only=True)
class TRLSettings(TrustRegionSettings):
    """The settings of TRL's two objectives (score centering, clipped surrogate): the trust
    region and the keep range of masked importance sampling."""

    vllm_importance_sampling_clip_min: float = setting(
        0.5,
        "Tokens with a sampler ratio below this are masked.",
        "TRL's AsyncGRPOTrainer documentation",
        RangeContainingOne(
            "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max"
        ),
    )
    vllm_importance_sampling_clip_max: float = setting(
        5.0,
        "Tokens with a sampler ratio above this are masked.",
        "TRL's AsyncGRPOTrainer documentation",
        RangeContainingOne(
            "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max"
        ),
    )


def per_sample_sum(values: Tensor, sample_index: Tensor) -> Tensor:
    """float [N]: at each token, the sum of ``values`` over the tokens of its sample.

    Example:
        >>> per_sample_sum(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([9, 3, 9])).tolist()
        [5.0, 2.0, 5.0]
    """
    _, inverse, counts = torch.unique(sample_index, return_inverse=True, return_counts=True)
    totals = values.new_zeros(counts.shape[0]).index_add(0, inverse, values)
    return totals[inverse]


def per_sample_mean(values: Tensor, sample_index: Tensor) -> Tensor:
    """float [N]: at each token, the mean of ``values`` over the tokens of its sample.

    Example:
        >>> per_sample_mean(torch.tensor([1.0, 2.0, 4.0]), torch.tensor([9, 3, 9])).tolist()
        [2.5, 2.0, 2.5]
    """
    ones = torch.ones_like(values)
    return per_sample_sum(values, sample_index) / per_sample_sum(ones, sample_index)


def level_log_ratio(log_ratio: Tensor, sample_index: Tensor, level: Level) -> Tensor:
    """float [N]: the log of each token's weight ratio at ``level``.

    ``token``: ``log_ratio`` itself; ``sequence``: its sum over the sample (log of the product of
    the sample's ratios); ``geometric``: its mean over the sample (log of their geometric mean).
    The sample's tokens must all be in ``log_ratio``.

    Example:
        >>> lr, idx = torch.tensor([0.2, 0.4, -0.1]), torch.tensor([0, 0, 1])
        >>> [round(x, 6) for x in level_log_ratio(lr, idx, "sequence").tolist()]
        [0.6, 0.6, -0.1]
        >>> [round(x, 6) for x in level_log_ratio(lr, idx, "geometric").tolist()]
        [0.3, 0.3, -0.1]
    """
    if level == "token":
        return log_ratio
    if level == "sequence":
        return per_sample_sum(log_ratio, sample_index)
    if level == "geometric":
        return per_sample_mean(log_ratio, sample_index)
    raise ValueError(f"level must be 'token', 'sequence' or 'geometric', got {level!r}")


def log_bound(bound: float) -> float:
    """``log(bound)``, with ``log(0) = -inf`` and ``log(inf) = inf``, to compare ratios in log
    space (no overflow for a sample's product of ratios).

    Example:
        >>> log_bound(0.0), log_bound(math.inf), round(log_bound(math.e), 6)
        (-inf, inf, 1.0)
    """
    return -math.inf if bound == 0.0 else math.log(bound)


def keep_in_range(log_ratio: Tensor, low: float, high: float) -> Tensor:
    """bool [N]: True where ``low <= exp(log_ratio) <= high``.

    Example:
        >>> keep_in_range(torch.log(torch.tensor([0.4, 1.0, 2.0, 3.0])), 0.5, 2.0).tolist()
        [False, True, True, False]
    """
    return (log_ratio >= log_bound(low)) & (log_ratio <= log_bound(high))


def masked_weight(log_ratio: Tensor, keep: Tensor) -> Tensor:
    """float [N]: ``exp(log_ratio)`` where ``keep``, exactly 0 elsewhere (never inf or NaN, even
    when a dropped ratio would overflow). Detached.

    Example:
        >>> masked_weight(torch.tensor([0.0, 1000.0]), torch.tensor([True, False])).tolist()
        [1.0, 0.0]
    """
    log_ratio = log_ratio.detach()
    return torch.where(keep, torch.where(keep, log_ratio, 0.0).exp(), 0.0)


def truncated_weight(log_ratio: Tensor, cap: float) -> Tensor:
    """float [N]: ``min(exp(log_ratio), cap)``, computed as ``exp(min(log_ratio, log cap))`` so a
    huge ratio never overflows. Detached.

    Example:
        >>> truncated_weight(torch.log(torch.tensor([0.5, 3.0])), 2.0).tolist()
        [0.5, 2.0]
    """
    return log_ratio.detach().clamp(max=log_bound(cap)).exp()


def ppo_term(
    logp: Tensor, anchor_logp: Tensor, advantages: Tensor, settings: TrustRegionSettings
) -> Tensor:
    """float [N]: PPO's per-token loss ``-min(rho A, clip(rho, 1 - eps, 1 + eps_high) A)`` with
    ``rho = exp(logp - anchor_logp)``, gradient through ``logp``.

    With the anchor the current policy itself (``anchor_logp = logp.detach()``), ``rho`` is 1,
    the clip never binds, the value is ``-A`` and the gradient is REINFORCE's ``-A grad logp``.

    Example:
        >>> logp = torch.tensor([-1.0, -1.0], requires_grad=True)
        >>> ppo_term(logp, logp.detach(), torch.tensor([2.0, -1.0]),
        ...          TrustRegionSettings()).tolist()
        [-2.0, 1.0]
    """
    ratio = (logp - anchor_logp).exp()
    low, high = settings.trust_region
    return -torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)


def ppo_clipped(ratio: Tensor, advantages: Tensor, settings: TrustRegionSettings) -> Tensor:
    """bool [N]: True where PPO's clip removes the token's gradient: ``A > 0`` and
    ``rho > 1 + epsilon_high``, or ``A < 0`` and ``rho < 1 - epsilon``.

    Example:
        >>> ppo_clipped(torch.tensor([1.5, 1.5, 0.5]), torch.tensor([1.0, -1.0, -1.0]),
        ...             TrustRegionSettings()).tolist()
        [True, False, True]
    """
    low, high = settings.trust_region
    return ((advantages > 0) & (ratio > high)) | ((advantages < 0) & (ratio < low))


def fraction(flags: Tensor) -> Tensor:
    """0-d: the fraction of True in ``flags`` (in the default float dtype).

    Example:
        >>> fraction(torch.tensor([True, False, False, False])).item()
        0.25
    """
    return flags.float().mean()


def trl_loss_config(settings: TRLSettings) -> LossConfig:
    """The :class:`~asyncgrpo.core.loss.inputs.LossConfig` that TRL's two objectives in
    :mod:`asyncgrpo.core.loss.losses` take (its temperature and ``score_centering`` are not used by
    them).

    Example:
        >>> trl_loss_config(TRLSettings()).keep_range
        (0.5, 5.0)
    """
    return LossConfig(
        epsilon=settings.epsilon,
        epsilon_high=settings.epsilon_high,
        vllm_importance_sampling_clip_min=settings.vllm_importance_sampling_clip_min,
        vllm_importance_sampling_clip_max=settings.vllm_importance_sampling_clip_max,
    )


def decoupled_loss(inputs: TokenInputs, settings: TrustRegionSettings, weight: Tensor) -> Tensor:
    """float [N]: ``weight * ppo_term(logp, proximal, A)``, exactly 0 with zero gradient (never
    NaN, even for a log-prob of -inf) where ``weight`` is 0. ``weight`` is a detached behaviour
    weight computed from ``pi_prox / mu``.

    This is the decoupled objective of AReaL (and verl's "decoupled" rollout correction): the
    behaviour weight corrects from the sampler to the proximal policy, the PPO term trusts the
    update relative to the proximal policy. With the proximal policy the current one the PPO
    term is ``-A`` with REINFORCE's gradient, so the gradient is ``-weight A grad logp``.

    Example:
        >>> inputs = TokenInputs(logp=torch.tensor([-1.0, -1.0], requires_grad=True),
        ...     sampler_logp=torch.tensor([-1.0, -1.0]), advantages=torch.tensor([2.0, 2.0]),
        ...     sample_index=torch.tensor([0, 1]), entropy=torch.zeros(2))
        >>> decoupled_loss(inputs, TrustRegionSettings(), torch.tensor([0.5, 0.0])).tolist()
        [-1.0, 0.0]
    """
    kept = weight > 0
    # zero the log-probs of dropped tokens first: a -inf log-prob there must not leak a NaN
    # into the gradient through the unselected branch
    logp = torch.where(kept, inputs.logp, 0.0)
    anchor = torch.where(kept, inputs.proximal(), 0.0)
    term = ppo_term(logp, anchor, inputs.advantages, settings)
    return torch.where(kept, weight * term, 0.0)


def decoupled_metrics(
    inputs: TokenInputs,
    settings: TrustRegionSettings,
    weight: Tensor,
    extra: dict[str, Tensor],
) -> dict[str, Tensor]:
    """The decoupled objectives' metrics: ``is_weight_mean``, ``is_weight_max``,
    ``clipped_fraction`` (against the proximal policy, among tokens with weight > 0),
    ``proximal_gap``, then ``extra`` (name to 0-d tensor). Empty when N = 0.

    Example:
        >>> inputs = TokenInputs(logp=torch.tensor([-1.0, -1.0]),
        ...     sampler_logp=torch.tensor([-1.0, -1.0]), advantages=torch.tensor([2.0, 2.0]),
        ...     sample_index=torch.tensor([0, 1]), entropy=torch.zeros(2))
        >>> metrics = decoupled_metrics(inputs, TrustRegionSettings(), torch.tensor([0.5, 0.0]), {})
        >>> {name: float(value) for name, value in metrics.items()}
        {'objective/is_weight_mean': 0.25, 'objective/is_weight_max': 0.5, \
'objective/clipped_fraction': 0.0, 'objective/proximal_gap': 0.0}
    """
    if inputs.n == 0:
        return {}
    logp = inputs.logp.detach()
    proximal = inputs.proximal()
    clipped = (weight > 0) & ppo_clipped((logp - proximal).exp(), inputs.advantages, settings)
    names = (IS_WEIGHT_MEAN, IS_WEIGHT_MAX, CLIPPED_FRACTION, PROXIMAL_GAP, *extra)
    gap = torch.where(logp == proximal, 0.0, (logp - proximal).abs())  # -inf == -inf: no gap
    values = [weight.mean(), weight.max(), fraction(clipped), gap.mean()]
    return metric_values(names, values + list(extra.values()))


def behaviour_log_ratio(inputs: TokenInputs) -> Tensor:
    """float [N], detached: ``log(pi_prox / mu)``, the proximal policy over the sampler (the
    current policy over the sampler while no proximal policy is given).

    Example:
        >>> inputs = TokenInputs(logp=torch.tensor([-1.0]), sampler_logp=torch.tensor([-1.5]),
        ...     advantages=torch.ones(1), sample_index=torch.zeros(1).long(),
        ...     entropy=torch.zeros(1))
        >>> behaviour_log_ratio(inputs).tolist()
        [0.5]
    """
    return (inputs.proximal() - inputs.sampler_logp).detach()


def plain_needs(whole_samples: bool) -> Needs:
    """What an objective over the sampled tokens' log-probs needs: no top-K, no proximal
    forward, no statistic over the call; ``whole_samples`` for sequence-level weights."""
    return Needs(
        sampler_topk=False, proximal_logp=False, whole_samples=whole_samples, batch_coupled=False
    )


TrustRegionT = TypeVar("TrustRegionT", bound=TrustRegionSettings)


@attrs.frozen
class MaskedWeightObjective(Generic[TrustRegionT]):
    """A decoupled loss whose detached weight is the behaviour ratio at ``level`` where it lies
    in ``bounds(settings)`` and 0 elsewhere: ``loss_t = w_t * ppo_t``. MIS
    (:mod:`~asyncgrpo.core.loss.objectives.mis`), IcePop and decoupled PPO are instances; their
    modules hold the formulas, the sources and the settings record.

    Attributes:
        name: registry key.
        level: how token ratios combine into the weight.
        needs: what the shell provides.
        bounds: the keep range ``(low, high)`` of the ratio, from the settings.
        settings_type: the objective's settings record (with the trust region).
    """

    name: str
    level: Level
    needs: Needs
    bounds: Callable[[TrustRegionT], tuple[float, float]]
    settings_type: type[TrustRegionT]

    def weight(self, inputs: TokenInputs, settings: TrustRegionT) -> tuple[Tensor, Tensor]:
        """``(w, keep)``: float [N] detached ratio inside the keep range (0 outside) and bool
        [N] whether the token is kept."""
        log_ratio = level_log_ratio(behaviour_log_ratio(inputs), inputs.sample_index, self.level)
        keep = keep_in_range(log_ratio, *self.bounds(settings))
        return masked_weight(log_ratio, keep), keep

    def per_token_loss(self, inputs: TokenInputs, settings: TrustRegionT) -> Tensor:
        """float [N]: ``w * ppo_t``."""
        return decoupled_loss(inputs, settings, self.weight(inputs, settings)[0])

    @torch.no_grad()
    def metrics(self, inputs: TokenInputs, settings: TrustRegionT) -> dict[str, Tensor]:
        """``is_weight_*``, ``clipped_fraction``, ``proximal_gap``, ``masked_fraction``."""
        weight, keep = self.weight(inputs, settings)
        return decoupled_metrics(inputs, settings, weight, {MASKED_FRACTION: fraction(~keep)})
