"""IcePop: two-sided masking of the train/infer ratio (Ring-1T's objective for MoE RL).

With ``k_t = pi_prox(o_t) / mu(o_t)`` (trainer over inference engine, both at the sampling
policy's weights in the paper) and ``M(k) = k`` for ``alpha <= k <= beta``, 0 otherwise:

    ``loss_t = M(k_t) * ppo_t``,  ``ppo_t = -min(q_t A_t, clip(q_t, 1 - eps, 1 + eps_high) A_t)``,

``q_t = pi(o_t) / pi_prox(o_t)``, ``M(k)`` detached. The kept tokens' gradient is weighted by
``k`` as the paper's ``M`` says (``grad J = E[M(k) grad log pi A q]``); tokens outside
``[icepop_alpha, icepop_beta]`` get no gradient, where TIS would still scale them. In this trainer
the proximal policy is the current one (one optimizer step per batch), so ``q = 1``,
``k = pi / mu``, and the gradient is ``-M(pi / mu) A grad log pi``, the form INTELLECT-3 writes
(``M(pi_train(theta) / pi_infer(theta_old))``). It then equals ``mis_token`` with the keep range
``[alpha, beta]``; IcePop keeps its own name and bounds because that is how users ask for it.

Sources: the Ling team, "Small Leak Can Sink a Great Ship: Boost RL Training on MoE with IcePop"
(2025) and the Ring-1T report (Ling team, 2025); INTELLECT-3 report (arXiv 2512.16144, eq. 1).
Shipped by prime-rl (``icepop_ratio_low`` / ``icepop_ratio_high``, 0.5 / 5.0), slime and verl
(token-level rejection sampling of the rollout/train ratio), SkyRL (``rollout_is`` loss).

Metrics: ``objective/is_weight_mean``, ``objective/is_weight_max`` (of ``M(k)``),
``objective/masked_fraction`` (tokens outside ``[alpha, beta]``; the blog reports 1-2 per mille
in its runs), ``objective/clipped_fraction``, ``objective/proximal_gap``.

Example:
    >>> import torch
    >>> from asyncgrpo.core.loss.objectives import TokenInputs
    >>> inputs = TokenInputs(logp=torch.log(torch.tensor([0.6, 0.9, 0.01])),
    ...     sampler_logp=torch.log(torch.tensor([0.2, 0.9, 0.5])),
    ...     advantages=torch.tensor([1.0, 1.0, 1.0]), sample_index=torch.tensor([0, 0, 0]),
    ...     entropy=torch.zeros(3))
    >>> [round(x, 4) for x in ICEPOP.per_token_loss(inputs, IcePopSettings()).tolist()]
    [-3.0, -1.0, 0.0]
"""

from __future__ import annotations

import attrs

from asyncgrpo.core.loss.objectives.base import RangeContainingOne, setting
from asyncgrpo.core.loss.objectives.weights import (
    MaskedWeightObjective,
    TrustRegionSettings,
    plain_needs,
)


@attrs.frozen(kw_only=True)
class IcePopSettings(TrustRegionSettings):
    """IcePop's two-sided keep range, with the trust region of the PPO term."""

    icepop_alpha: float = setting(
        0.5,
        "Not in TRL. icepop: tokens with a ratio below are masked.",
        "IcePop as shipped by prime-rl (INTELLECT-3)",
        RangeContainingOne("icepop_alpha", "icepop_beta"),
    )
    icepop_beta: float = setting(
        5.0,
        "Not in TRL. icepop: tokens with a ratio above are masked.",
        "IcePop as shipped by prime-rl (INTELLECT-3)",
        RangeContainingOne("icepop_alpha", "icepop_beta"),
    )


def keep_range(settings: IcePopSettings) -> tuple[float, float]:
    """``[icepop_alpha, icepop_beta]``."""
    return settings.icepop_alpha, settings.icepop_beta


ICEPOP = MaskedWeightObjective("icepop", "token", plain_needs(False), keep_range, IcePopSettings)
OBJECTIVES = (ICEPOP,)
