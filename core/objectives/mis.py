"""Masked importance sampling (MIS) at token, sequence and geometric-mean level.

As TIS (:mod:`asyncgrpo.core.objectives.tis`) but a ratio outside a keep range drops the token
(or the whole sample) instead of being truncated: the detached behaviour weight is

    ``w = rho`` if ``clip_min <= rho <= clip_max``, else 0,

with ``rho`` the token ratio ``pi_prox / mu`` (``mis_token``), the sample's product of ratios
(``mis_sequence``) or their geometric mean (``mis_geometric``), and the keep range
``mis_<level>_clip_min``, ``mis_<level>_clip_max``. Per token ``loss_t = w_t * ppo_t`` with PPO's
term against the proximal policy (:func:`~asyncgrpo.core.objectives.weights.decoupled_loss`);
while the proximal policy is the current one (one optimizer step per batch) the gradient is
``-w A grad log pi`` with ``rho = pi / mu``. A dropped token contributes exactly 0 and no
gradient, and still counts in the token mean's denominator.

Sources: Liu, Li et al. 2025, "When Speed Kills Stability: Demystifying RL Collapse from the
Training-Inference Mismatch" (masking over truncation; sequence and geometric rejection).
Shipped by verl (``rollout_correction.rollout_rs`` token/sequence/geometric), slime
(``mis_mode: mask``, which keeps the ratio as the weight of kept tokens, as here), SkyRL
(``sequence_mask_metric`` product/geometric, ``token_mask_is_threshold_*``; SkyRL's masks keep
weight 1), TRL's GRPOConfig (``vllm_importance_sampling_mode`` = ``token_mask`` /
``sequence_mask``). Names: ``mis_<level>``.

``mis_token`` with the keep range ``[alpha, beta]`` is IcePop
(:mod:`asyncgrpo.core.objectives.icepop`) in this trainer; the two differ only in their settings.

Metrics: ``objective/is_weight_mean``, ``objective/is_weight_max`` (of ``w``),
``objective/masked_fraction`` (tokens dropped), ``objective/clipped_fraction``,
``objective/proximal_gap``.

Example:
    >>> from asyncgrpo.core.objectives.base import TokenInputs, example_settings
    >>> inputs = TokenInputs(logp=torch.log(torch.tensor([0.6, 0.9])),
    ...     sampler_logp=torch.log(torch.tensor([0.2, 0.9])), advantages=torch.tensor([1.0, 1.0]),
    ...     sample_index=torch.tensor([0, 0]), entropy=torch.zeros(2))
    >>> [round(x, 4) for x in MIS_TOKEN.per_token_loss(inputs, example_settings()).tolist()]
    [0.0, -1.0]
    >>> MIS_SEQUENCE.per_token_loss(inputs, example_settings()).tolist()  # product 3 > 2
    [0.0, 0.0]
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

from asyncgrpo.core.objectives.base import Needs, ObjectiveSettings, TokenInputs
from asyncgrpo.core.objectives.weights import (
    MASKED_FRACTION,
    Level,
    behaviour_log_ratio,
    decoupled_loss,
    decoupled_metrics,
    fraction,
    keep_in_range,
    level_log_ratio,
    masked_weight,
)


@attrs.frozen
class MaskedIS:
    """MIS at one level (see the module docstring).

    Attributes:
        name: registry key.
        level: how token ratios combine into the weight.
        needs: what the shell provides.
    """

    name: str
    level: Level
    needs: Needs

    def keep_range(self, settings: ObjectiveSettings) -> tuple[float, float]:
        """``(clip_min, clip_max)`` of this level."""
        return (
            getattr(settings, f"mis_{self.level}_clip_min"),
            getattr(settings, f"mis_{self.level}_clip_max"),
        )

    def weight(self, inputs: TokenInputs, settings: ObjectiveSettings) -> tuple[Tensor, Tensor]:
        """``(w, keep)``: float [N] detached ``rho`` inside the keep range (0 outside) and bool
        [N] whether the token is kept."""
        log_rho = level_log_ratio(behaviour_log_ratio(inputs), inputs.sample_index, self.level)
        keep = keep_in_range(log_rho, *self.keep_range(settings))
        return masked_weight(log_rho, keep), keep

    def per_token_loss(self, inputs: TokenInputs, settings: ObjectiveSettings) -> Tensor:
        """float [N]: ``w * ppo_t``."""
        return decoupled_loss(inputs, settings, self.weight(inputs, settings)[0])

    @torch.no_grad()
    def metrics(self, inputs: TokenInputs, settings: ObjectiveSettings) -> dict[str, float]:
        """``is_weight_*``, ``clipped_fraction``, ``proximal_gap``, ``masked_fraction``."""
        weight, keep = self.weight(inputs, settings)
        return decoupled_metrics(inputs, settings, weight, {MASKED_FRACTION: fraction(~keep)})


def _needs(whole_samples: bool) -> Needs:
    return Needs(
        sampler_topk=False, proximal_logp=False, whole_samples=whole_samples, batch_coupled=False
    )


MIS_TOKEN = MaskedIS("mis_token", "token", _needs(whole_samples=False))
MIS_SEQUENCE = MaskedIS("mis_sequence", "sequence", _needs(whole_samples=True))
MIS_GEOMETRIC = MaskedIS("mis_geometric", "geometric", _needs(whole_samples=True))
OBJECTIVES = (MIS_TOKEN, MIS_SEQUENCE, MIS_GEOMETRIC)
