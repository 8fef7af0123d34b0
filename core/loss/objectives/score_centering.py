"""TRL's score centering: the default objective of TRL's AsyncGRPOTrainer documentation.

Per token ``t`` with advantage ``A``, sampler ``mu`` and its top-K ids ``v``, the loss's gradient
is

    ``-A (f(r_t) grad log pi(o_t) - sum_{v in top-K} mu(v) f(r_v) grad log pi(v))``,

``r = pi / mu`` and ``f(r) = r`` inside ``[vllm_importance_sampling_clip_min,
vllm_importance_sampling_clip_max]``, 0 outside (masked importance sampling), ``f`` detached.
The centering term subtracts the sampler's expectation of the weighted score, so a constant
advantage does not pull the policy toward the sampler. Source: TRL's AsyncGRPOTrainer
documentation ("Score Centering", ``score_centering=True``); the per-token loss is exactly
:func:`asyncgrpo.core.loss.losses.score_centered_surrogate`.

Name: ``score_centering``, the config field of TRL's AsyncGRPOConfig that selects it, so
``loss_type="score_centering"`` and ``score_centering=True`` mean the same.

Needs the sampler's top-K log-probs (``num_sampler_logprobs``) and the policy's log-probs of
those ids. Metrics: ``objective/is_weight_mean``, ``objective/is_weight_max`` (``f(r_t)`` of
each token's own term) and ``objective/masked_fraction`` (targets whose own term is dropped;
their centering term stays).

Example:
    >>> import math
    >>> from asyncgrpo.core.loss.inputs import SamplerTopK
    >>> from asyncgrpo.core.loss.objectives import TokenInputs
    >>> quarter = math.log(0.25)
    >>> inputs = TokenInputs(
    ...     logp=torch.tensor([quarter]), sampler_logp=torch.tensor([quarter]),
    ...     advantages=torch.tensor([2.0]), sample_index=torch.tensor([0]),
    ...     entropy=torch.zeros(1), topk_logp=torch.tensor([[quarter, -math.inf]]),
    ...     topk=SamplerTopK(torch.tensor([[0, 1]]), torch.tensor([[quarter, quarter]]),
    ...                      torch.tensor([[True, False]])))
    >>> round(SCORE_CENTERING.per_token_loss(inputs, TRLSettings()).item(), 4)
    2.0794
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

from asyncgrpo.core.loss.importance_sampling import masked_importance_weight
from asyncgrpo.core.loss.losses import score_centered_surrogate
from asyncgrpo.core.loss.objectives.base import (
    Needs,
    TokenInputs,
    empty_loss,
    metric_values,
)
from asyncgrpo.core.loss.objectives.weights import (
    IS_WEIGHT_MAX,
    IS_WEIGHT_MEAN,
    MASKED_FRACTION,
    TRLSettings,
    fraction,
    trl_loss_config,
)


@attrs.frozen
class ScoreCentering:
    """TRL's score centering (see the module docstring)."""

    name: str
    needs: Needs
    settings_type: type[TRLSettings] = TRLSettings

    def per_token_loss(self, inputs: TokenInputs, settings: TRLSettings) -> Tensor:
        """float [N]: :func:`~asyncgrpo.core.loss.losses.score_centered_surrogate` of the inputs."""
        if inputs.topk is None or inputs.topk_logp is None:
            raise ValueError(
                "score centering needs the sampler's top-K log-probs: pass topk and topk_logp "
                "(needs.sampler_topk is True), or choose another loss_type"
            )
        if inputs.n == 0:
            return empty_loss(inputs)
        return score_centered_surrogate(
            inputs.logp,
            inputs.sampler_logp,
            inputs.advantages,
            inputs.topk_logp,
            inputs.topk,
            trl_loss_config(settings),
        )

    @torch.no_grad()
    def metrics(self, inputs: TokenInputs, settings: TRLSettings) -> dict[str, Tensor]:
        """``is_weight_mean``, ``is_weight_max`` and ``masked_fraction`` of the own terms."""
        if inputs.n == 0:
            return {}
        weight = masked_importance_weight(
            inputs.logp - inputs.sampler_logp, trl_loss_config(settings)
        )
        return metric_values(
            (IS_WEIGHT_MEAN, IS_WEIGHT_MAX, MASKED_FRACTION),
            [weight.mean(), weight.max(), fraction(weight == 0)],
        )


SCORE_CENTERING = ScoreCentering(
    name="score_centering",
    needs=Needs(sampler_topk=True, proximal_logp=False, whole_samples=False, batch_coupled=False),
)
OBJECTIVES = (SCORE_CENTERING,)
