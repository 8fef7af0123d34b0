"""Decoupled PPO (AReaL): PPO against a proximal policy, times a capped behaviour weight.

Three policies: the behaviour policy ``mu`` (the sampler, possibly several versions old), a
proximal policy ``pi_prox`` and the current policy ``pi``. Per token

    ``loss_t = 1[w_t <= cap] w_t * -min(q_t A_t, clip(q_t, 1 - eps, 1 + eps_high) A_t)``,

``w_t = pi_prox(o_t) / mu(o_t)`` detached, ``q_t = pi(o_t) / pi_prox(o_t)``,
``cap = behav_imp_weight_cap``. The trust region is centred on the proximal policy, not on the
stale sampler, so staleness does not shrink the step; the behaviour weight corrects the
sampling. Tokens whose weight exceeds the cap are dropped (not truncated), as in AReaL.

Sources: Fu et al. 2025, "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for
Language Reasoning" (decoupled PPO objective; its ablation at staleness 4: 42.2 on AIME24 against
23.3 for plain PPO); Hilton et al. 2022, "Batch size-invariance for policy optimization"
(decoupled PPO). Shipped by AReaL (``use_decoupled_loss``, ``behav_imp_weight_cap``) and verl
(rollout correction in decoupled mode).

**The proximal policy in this trainer.** AReaL's proximal policy is the one at the start of the
optimizer step, recomputed with a no-grad forward, which differs from the current policy only
when one batch takes several optimizer steps. This trainer takes one optimizer step per batch,
so at gradient time the proximal policy equals the current one: ``proximal_logp`` None means
``logp.detach()`` and costs no forward (the case "skipped when the proximal and current policies
coincide"). Then ``q = 1``, the clip never binds, and the gradient is
``-1[pi / mu <= cap] (pi / mu) A grad log pi``. ``needs.proximal_logp`` is therefore False; a
``proximal_logp`` that is given (several optimizer steps per batch, or AReaL's log-linear
approximation between versions) is used as written.

Metrics: ``objective/is_weight_mean``, ``objective/is_weight_max`` (of the kept ``w``),
``objective/masked_fraction`` (``w > cap``), ``objective/clipped_fraction`` (against the proximal
policy), ``objective/proximal_gap`` (mean ``|log pi - log pi_prox|``).

Example:
    >>> import torch
    >>> from asyncgrpo.core.loss.objectives import TokenInputs
    >>> inputs = TokenInputs(logp=torch.log(torch.tensor([0.6, 0.9])),
    ...     sampler_logp=torch.log(torch.tensor([0.1, 0.9])), advantages=torch.tensor([1.0, 1.0]),
    ...     sample_index=torch.tensor([0, 0]), entropy=torch.zeros(2))
    >>> [round(x, 4) for x in DECOUPLED_PPO.per_token_loss(inputs, DecoupledPPOSettings()).tolist()]
    [0.0, -1.0]
"""

from __future__ import annotations

import attrs

from asyncgrpo.core.loss.objectives.base import cap, setting
from asyncgrpo.core.loss.objectives.weights import (
    MaskedWeightObjective,
    TrustRegionSettings,
    plain_needs,
)


@attrs.frozen(kw_only=True)
class DecoupledPPOSettings(TrustRegionSettings):
    """Decoupled PPO's cap of the behaviour weight, with the trust region of the PPO term."""

    behav_imp_weight_cap: float = setting(
        5.0,
        "Not in TRL. decoupled_ppo: tokens whose behaviour weight (proximal over sampler) "
        "exceeds this are dropped (AReaL's name).",
        "AReaL's name; its example configs use 5.0",
        cap,
    )


def keep_range(settings: DecoupledPPOSettings) -> tuple[float, float]:
    """``[0, behav_imp_weight_cap]``: a weight over the cap drops the token."""
    return 0.0, settings.behav_imp_weight_cap


DECOUPLED_PPO = MaskedWeightObjective(
    "decoupled_ppo", "token", plain_needs(False), keep_range, DecoupledPPOSettings
)
OBJECTIVES = (DECOUPLED_PPO,)
