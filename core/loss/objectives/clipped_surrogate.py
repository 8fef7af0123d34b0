"""TRL's clipped surrogate with masked importance sampling (``score_centering=False`` in TRL's
AsyncGRPOTrainer documentation).

Per token, with ``r = pi / mu`` (policy over sampler):

    ``loss_t = -1[C_min <= r_t <= C_max] min(r_t A_t, clip(r_t, 1 - eps, 1 + eps_high) A_t)``,

``C_min, C_max = vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max``. The
sampler's log-probs stand in for the old policy, so one ratio covers both staleness and the
train/infer mismatch. Source: TRL's AsyncGRPOTrainer documentation (GRPO's clipped surrogate,
Shao et al. 2024, with masked IS); the per-token loss is exactly
:func:`asyncgrpo.core.loss.losses.clipped_surrogate`.

Name: ``clipped_surrogate``, the documentation's own words. (TRL's GRPOTrainer calls the same
PPO surrogate normalised by the global token count ``loss_type="dapo"``; there the name picks
the normalisation, which here is always the global token mean.)

Metrics: ``objective/is_weight_mean``, ``objective/is_weight_max`` (``r`` of kept tokens, 0 for
dropped ones), ``objective/masked_fraction`` (ratio outside the keep range) and
``objective/clipped_fraction`` (kept tokens whose gradient the PPO clip removes).

Example:
    >>> import math
    >>> from asyncgrpo.core.loss.objectives import TokenInputs
    >>> half, quarter = math.log(0.5), math.log(0.25)
    >>> inputs = TokenInputs(
    ...     logp=torch.tensor([half, half]), sampler_logp=torch.tensor([quarter, quarter]),
    ...     advantages=torch.tensor([1.0, -1.0]), sample_index=torch.tensor([0, 1]),
    ...     entropy=torch.zeros(2))
    >>> [round(x, 4) for x in CLIPPED_SURROGATE.per_token_loss(inputs, TRLSettings()).tolist()]
    [-1.2, 2.0]
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

from asyncgrpo.core.loss.importance_sampling import importance_keep, importance_ratio
from asyncgrpo.core.loss.losses import clipped_surrogate
from asyncgrpo.core.loss.objectives.base import (
    Needs,
    TokenInputs,
    empty_loss,
    metric_values,
)
from asyncgrpo.core.loss.objectives.weights import (
    CLIPPED_FRACTION,
    IS_WEIGHT_MAX,
    IS_WEIGHT_MEAN,
    MASKED_FRACTION,
    TRLSettings,
    fraction,
    ppo_clipped,
    trl_loss_config,
)


@attrs.frozen
class ClippedSurrogate:
    """TRL's clipped surrogate with masked importance sampling (see the module docstring)."""

    name: str
    needs: Needs
    settings_type: type[TRLSettings] = TRLSettings

    def per_token_loss(self, inputs: TokenInputs, settings: TRLSettings) -> Tensor:
        """float [N]: :func:`~asyncgrpo.core.loss.losses.clipped_surrogate` of the inputs."""
        if inputs.n == 0:
            return empty_loss(inputs)
        return clipped_surrogate(
            inputs.logp, inputs.sampler_logp, inputs.advantages, trl_loss_config(settings)
        )

    @torch.no_grad()
    def metrics(self, inputs: TokenInputs, settings: TRLSettings) -> dict[str, Tensor]:
        """``is_weight_*``, ``masked_fraction`` and ``clipped_fraction``."""
        if inputs.n == 0:
            return {}
        ratio = importance_ratio(inputs.logp.detach(), inputs.sampler_logp)
        kept = importance_keep(ratio, trl_loss_config(settings))
        weight = torch.where(kept, ratio, 0.0)
        clipped = kept & ppo_clipped(ratio, inputs.advantages, settings)
        return metric_values(
            (IS_WEIGHT_MEAN, IS_WEIGHT_MAX, MASKED_FRACTION, CLIPPED_FRACTION),
            [weight.mean(), weight.max(), fraction(~kept), fraction(clipped)],
        )


CLIPPED_SURROGATE = ClippedSurrogate(
    name="clipped_surrogate",
    needs=Needs(sampler_topk=False, proximal_logp=False, whole_samples=False, batch_coupled=False),
)
OBJECTIVES = (CLIPPED_SURROGATE,)
