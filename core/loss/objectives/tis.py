"""Truncated importance sampling (TIS) at token, sequence and geometric-mean level.

The sampler ``mu`` generated the tokens; the behaviour weight ``w = min(rho, C)`` corrects the
policy-gradient term from ``mu`` to the proximal policy and is detached:

* ``tis_token``: ``rho_t = pi_prox(o_t) / mu(o_t)``, ``C = tis_token_cap``;
* ``tis_sequence``: ``rho = prod_t rho_t`` over the sample's trained tokens (unbiased, high
  variance), ``C = tis_sequence_cap``, one weight for every token of the sample;
* ``tis_geometric``: ``rho = exp(mean_t log rho_t)`` over the sample (biased, low variance),
  ``C = tis_geometric_cap``.

Per token, ``loss_t = w_t * ppo_t`` with PPO's term against the proximal policy,
``ppo_t = -min(q_t A_t, clip(q_t, 1 - eps, 1 + eps_high) A_t)``, ``q_t = pi(o_t) / pi_prox(o_t)``
(:func:`~asyncgrpo.core.loss.objectives.weights.decoupled_loss`). This trainer takes one optimizer
step per batch, so the proximal policy is the current one (``proximal_logp`` None): ``q = 1``,
``rho = pi / mu``, and the gradient is truncated-IS REINFORCE, ``-min(rho, C) A grad log pi``.

Sources: Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training" (token TIS, C = 2); sequence and geometric levels as in Liu, Li et al. 2025, "When
Speed Kills Stability". Shipped by verl (``rollout_correction.rollout_is`` token/sequence with
``rollout_is_threshold``), slime (``mis_mode: truncate``, ``mis_level`` token/sequence/geometric),
SkyRL (``off_policy_correction.tis_ratio_type`` with ``token_tis_ratio_clip_high`` /
``sequence_tis_ratio_clip_high``). TRL's GRPOConfig has ``vllm_importance_sampling_mode`` =
``token_truncate`` / ``sequence_truncate``, which also clips from below when a ``clip_min`` is
set; TIS here is one-sided, as in the sources above. Names: ``tis_<level>``, the literature's
acronym and slime's level names.

Sequence-level weights need every trained token of each sample in one call
(``needs.whole_samples``): one packed row per call gives that. Weights are computed in log space,
so a long sample's product of ratios never overflows.

Metrics: ``objective/is_weight_mean``, ``objective/is_weight_max`` (of ``w``),
``objective/truncated_fraction`` (tokens whose ``rho`` exceeded the cap),
``objective/clipped_fraction`` and ``objective/proximal_gap`` (both 0 while the proximal policy is
the current one).

Example:
    >>> from asyncgrpo.core.loss.objectives import TokenInputs
    >>> inputs = TokenInputs(logp=torch.log(torch.tensor([0.6, 0.9])),
    ...     sampler_logp=torch.log(torch.tensor([0.2, 0.9])), advantages=torch.tensor([1.0, 1.0]),
    ...     sample_index=torch.tensor([0, 0]), entropy=torch.zeros(2))
    >>> [round(x, 4) for x in TIS_TOKEN.per_token_loss(inputs, TISSettings()).tolist()]
    [-2.0, -1.0]
    >>> [round(x, 4) for x in TIS_GEOMETRIC.per_token_loss(inputs, TISSettings()).tolist()]
    [-1.7321, -1.7321]
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

from asyncgrpo.core.loss.objectives.base import Needs, TokenInputs, cap, setting
from asyncgrpo.core.loss.objectives.weights import (
    TRUNCATED_FRACTION,
    Level,
    TrustRegionSettings,
    behaviour_log_ratio,
    decoupled_loss,
    decoupled_metrics,
    fraction,
    level_log_ratio,
    log_bound,
    plain_needs,
    truncated_weight,
)


@attrs.frozen(kw_only=True)
class TISSettings(TrustRegionSettings):
    """TIS's cap at each level, with the trust region of the PPO term."""

    tis_token_cap: float = setting(
        2.0,
        "Not in TRL. tis_token: cap C of the token ratio (>= 1).",
        "Yao et al. 2025 (TIS blog, C = 2); verl rollout_is_threshold; SkyRL "
        "token_tis_ratio_clip_high",
        cap,
    )
    tis_sequence_cap: float = setting(
        5.0,
        "Not in TRL. tis_sequence: cap of a sample's product of ratios (>= 1).",
        "SkyRL sequence_tis_ratio_clip_high (verl: typical 2-10)",
        cap,
    )
    tis_geometric_cap: float = setting(
        2.0,
        "Not in TRL. tis_geometric: cap of a sample's geometric-mean ratio.",
        "slime mis_upper_bound (slime applies one bound at every level)",
        cap,
    )


@attrs.frozen
class TruncatedIS:
    """TIS at one level (see the module docstring).

    Attributes:
        name: registry key.
        level: how token ratios combine into the weight.
        needs: what the shell provides.
        settings_type: its settings record.
    """

    name: str
    level: Level
    needs: Needs
    settings_type: type[TISSettings] = TISSettings

    def cap(self, settings: TISSettings) -> float:
        """The cap C of this level."""
        return {
            "token": settings.tis_token_cap,
            "sequence": settings.tis_sequence_cap,
            "geometric": settings.tis_geometric_cap,
        }[self.level]

    def log_rho(self, inputs: TokenInputs) -> Tensor:
        """float [N], detached: ``log rho`` of each token's weight at this level."""
        return level_log_ratio(behaviour_log_ratio(inputs), inputs.sample_index, self.level)

    def per_token_loss(self, inputs: TokenInputs, settings: TISSettings) -> Tensor:
        """float [N]: ``min(rho, C) * ppo_t``."""
        weight = truncated_weight(self.log_rho(inputs), self.cap(settings))
        return decoupled_loss(inputs, settings, weight)

    @torch.no_grad()
    def metrics(self, inputs: TokenInputs, settings: TISSettings) -> dict[str, Tensor]:
        """``is_weight_*``, ``clipped_fraction``, ``proximal_gap``, ``truncated_fraction``."""
        log_rho = self.log_rho(inputs)
        weight = truncated_weight(log_rho, self.cap(settings))
        truncated = log_rho > log_bound(self.cap(settings))
        return decoupled_metrics(
            inputs, settings, weight, {TRUNCATED_FRACTION: fraction(truncated)}
        )


TIS_TOKEN = TruncatedIS("tis_token", "token", plain_needs(False))
TIS_SEQUENCE = TruncatedIS("tis_sequence", "sequence", plain_needs(True))
TIS_GEOMETRIC = TruncatedIS("tis_geometric", "geometric", plain_needs(True))
OBJECTIVES = (TIS_TOKEN, TIS_SEQUENCE, TIS_GEOMETRIC)
