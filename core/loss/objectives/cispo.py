"""CISPO (MiniMax-M1): clip the importance-sampling weight, keep every token's gradient.

With ``r_t = pi(o_t) / mu(o_t)`` (current policy over the sampler):

    ``loss_t = -sg(clip(r_t, cispo_clip_min, cispo_clip_max)) A_t log pi(o_t)``,

``sg`` the stop-gradient. PPO's clip zeroes the gradient of a token once its ratio leaves the
trust region; CISPO only bounds the weight, so rare, high-entropy tokens (often the "forks" of a
reasoning chain) keep contributing. The gradient is ``-clip(r) A grad log pi`` on every token.

Sources: MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
Attention" (CISPO; no lower clip in practice); ScaleRL (Khatri et al. 2025, "The Art of Scaling
Reinforcement Learning Compute for LLMs": upper bound 5). Shipped by TRL's GRPOTrainer
(``loss_type="cispo"``, which caps the ratio at ``epsilon_high``, recommended 5.0), SkyRL
(``policy_loss_type="cispo"``, bounds ``[1 - cispo_eps_clip_low, 1 + cispo_eps_clip_high]`` =
``[0, 5]``), AReaL. The name is TRL's ``loss_type`` value. TRL reuses ``epsilon_high`` as the cap;
here CISPO has its own settings, so ``epsilon_high`` keeps one meaning.

**The anchor.** The paper's ratio is to the old policy that generated the samples; in this
trainer that is the sampler, so ``r = pi / mu`` covers staleness and the train/infer mismatch
(SkyRL calls this ``cispo_anchor="rollout"``; anchored on a recomputed old policy, the ratio is 1
at a single gradient step and the clip never bites). ``proximal_logp`` is not used.

The loss's value is ``-w A log pi`` (as in the paper and TRL), not a surrogate near ``-A``.

Metrics: ``objective/is_weight_mean``, ``objective/is_weight_max`` (of the clipped weight) and
``objective/truncated_fraction`` (tokens whose ratio was outside the clip range).

Example:
    >>> from asyncgrpo.core.loss.objectives import TokenInputs
    >>> inputs = TokenInputs(logp=torch.log(torch.tensor([0.6, 0.5])),
    ...     sampler_logp=torch.log(torch.tensor([0.1, 0.5])), advantages=torch.tensor([1.0, 1.0]),
    ...     sample_index=torch.tensor([0, 0]), entropy=torch.zeros(2))
    >>> [round(x, 4) for x in CISPO_OBJECTIVE.per_token_loss(inputs, CISPOSettings()).tolist()]
    [2.5541, 0.6931]
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

from asyncgrpo.core.loss.objectives.base import (
    Needs,
    ObjectiveSettings,
    RangeContainingOne,
    TokenInputs,
    empty_loss,
    metric_values,
    setting,
)
from asyncgrpo.core.loss.objectives.weights import (
    IS_WEIGHT_MAX,
    IS_WEIGHT_MEAN,
    TRUNCATED_FRACTION,
    fraction,
    log_bound,
)


@attrs.frozen(kw_only=True)
class CISPOSettings(ObjectiveSettings):
    """CISPO's clip range of the importance-sampling weight."""

    cispo_clip_min: float = setting(
        0.0,
        "Not in TRL. cispo: lower clip of the IS weight.",
        "MiniMax-M1 (no lower clip); ScaleRL; SkyRL 1 - cispo_eps_clip_low",
        RangeContainingOne("cispo_clip_min", "cispo_clip_max"),
    )
    cispo_clip_max: float = setting(
        5.0,
        "Not in TRL. cispo: upper clip of the IS weight.",
        "ScaleRL via TRL's loss_type='cispo' docs; SkyRL 1 + cispo_eps_clip_high",
        RangeContainingOne("cispo_clip_min", "cispo_clip_max"),
    )


@attrs.frozen
class CISPO:
    """CISPO (see the module docstring)."""

    name: str
    needs: Needs
    settings_type: type[CISPOSettings] = CISPOSettings

    def log_ratio(self, inputs: TokenInputs) -> Tensor:
        """float [N], detached: ``log(pi / mu)``."""
        return (inputs.logp.detach() - inputs.sampler_logp).detach()

    def weight(self, inputs: TokenInputs, settings: CISPOSettings) -> Tensor:
        """float [N], detached: ``clip(r, cispo_clip_min, cispo_clip_max)``, in log space."""
        low, high = log_bound(settings.cispo_clip_min), log_bound(settings.cispo_clip_max)
        return self.log_ratio(inputs).clamp(low, high).exp()

    def per_token_loss(self, inputs: TokenInputs, settings: CISPOSettings) -> Tensor:
        """float [N]: ``-w A log pi``; exactly 0 where ``w`` is 0 (even for a log-prob of -inf)."""
        if inputs.n == 0:
            return empty_loss(inputs)
        weight = self.weight(inputs, settings)
        kept = weight > 0
        return torch.where(
            kept, -weight * inputs.advantages * torch.where(kept, inputs.logp, 0.0), 0.0
        )

    @torch.no_grad()
    def metrics(self, inputs: TokenInputs, settings: CISPOSettings) -> dict[str, Tensor]:
        """``is_weight_mean``, ``is_weight_max``, ``truncated_fraction``."""
        if inputs.n == 0:
            return {}
        weight = self.weight(inputs, settings)
        log_ratio = self.log_ratio(inputs)
        outside = (log_ratio < log_bound(settings.cispo_clip_min)) | (
            log_ratio > log_bound(settings.cispo_clip_max)
        )
        return metric_values(
            (IS_WEIGHT_MEAN, IS_WEIGHT_MAX, TRUNCATED_FRACTION),
            [weight.mean(), weight.max(), fraction(outside)],
        )


CISPO_OBJECTIVE = CISPO(
    name="cispo",
    needs=Needs(sampler_topk=False, proximal_logp=False, whole_samples=False, batch_coupled=False),
)
OBJECTIVES = (CISPO_OBJECTIVE,)
