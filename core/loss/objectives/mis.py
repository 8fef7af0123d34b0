"""Masked importance sampling (MIS) at token, sequence and geometric-mean level.

As TIS (:mod:`asyncgrpo.core.loss.objectives.tis`) but a ratio outside a keep range drops the token
(or the whole sample) instead of being truncated: the detached behaviour weight is

    ``w = rho`` if ``clip_min <= rho <= clip_max``, else 0,

with ``rho`` the token ratio ``pi_prox / mu`` (``mis_token``), the sample's product of ratios
(``mis_sequence``) or their geometric mean (``mis_geometric``), and the keep range
``mis_<level>_clip_min``, ``mis_<level>_clip_max``. Per token ``loss_t = w_t * ppo_t`` with PPO's
term against the proximal policy (:func:`~asyncgrpo.core.loss.objectives.weights.decoupled_loss`);
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
(:mod:`asyncgrpo.core.loss.objectives.icepop`) in this trainer; the two differ only in their
settings.

Metrics: ``objective/is_weight_mean``, ``objective/is_weight_max`` (of ``w``),
``objective/masked_fraction`` (tokens dropped), ``objective/clipped_fraction``,
``objective/proximal_gap``.

Example:
    >>> import torch
    >>> from asyncgrpo.core.loss.objectives import TokenInputs
    >>> inputs = TokenInputs(logp=torch.log(torch.tensor([0.6, 0.9])),
    ...     sampler_logp=torch.log(torch.tensor([0.2, 0.9])), advantages=torch.tensor([1.0, 1.0]),
    ...     sample_index=torch.tensor([0, 0]), entropy=torch.zeros(2))
    >>> [round(x, 4) for x in MIS_TOKEN.per_token_loss(inputs, MISSettings()).tolist()]
    [0.0, -1.0]
    >>> MIS_SEQUENCE.per_token_loss(inputs, MISSettings()).tolist()  # product 3 > 2
    [0.0, 0.0]
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
class MISSettings(TrustRegionSettings):
    """MIS's keep range at each level, with the trust region of the PPO term."""

    mis_token_clip_min: float = setting(
        0.5,
        "Not in TRL. mis_token: tokens with a ratio below are masked.",
        "slime mis_lower_bound; verl token RS (lower = 1 / upper)",
        RangeContainingOne("mis_token_clip_min", "mis_token_clip_max"),
    )
    mis_token_clip_max: float = setting(
        2.0,
        "Not in TRL. mis_token: tokens with a ratio above are masked.",
        "slime mis_upper_bound; verl token RS",
        RangeContainingOne("mis_token_clip_min", "mis_token_clip_max"),
    )
    mis_sequence_clip_min: float = setting(
        0.5,
        "Not in TRL. mis_sequence: samples whose product of ratios is below are masked.",
        "SkyRL product_mask_low",
        RangeContainingOne("mis_sequence_clip_min", "mis_sequence_clip_max"),
    )
    mis_sequence_clip_max: float = setting(
        2.0,
        "Not in TRL. mis_sequence: the keep range's upper end.",
        "SkyRL product_mask_high",
        RangeContainingOne("mis_sequence_clip_min", "mis_sequence_clip_max"),
    )
    mis_geometric_clip_min: float = setting(
        0.99,
        "Not in TRL. mis_geometric: samples whose geometric-mean ratio is below are masked.",
        "SkyRL geo_mask_low",
        RangeContainingOne("mis_geometric_clip_min", "mis_geometric_clip_max"),
    )
    mis_geometric_clip_max: float = setting(
        1.01,
        "Not in TRL. mis_geometric: the keep range's upper end.",
        "SkyRL geo_mask_high (verl: typical 1.0002-1.001)",
        RangeContainingOne("mis_geometric_clip_min", "mis_geometric_clip_max"),
    )


def token_range(settings: MISSettings) -> tuple[float, float]:
    return settings.mis_token_clip_min, settings.mis_token_clip_max


def sequence_range(settings: MISSettings) -> tuple[float, float]:
    return settings.mis_sequence_clip_min, settings.mis_sequence_clip_max


def geometric_range(settings: MISSettings) -> tuple[float, float]:
    return settings.mis_geometric_clip_min, settings.mis_geometric_clip_max


MIS_TOKEN = MaskedWeightObjective(
    "mis_token", "token", plain_needs(False), token_range, MISSettings
)
MIS_SEQUENCE = MaskedWeightObjective(
    "mis_sequence", "sequence", plain_needs(True), sequence_range, MISSettings
)
MIS_GEOMETRIC = MaskedWeightObjective(
    "mis_geometric", "geometric", plain_needs(True), geometric_range, MISSettings
)
OBJECTIVES = (MIS_TOKEN, MIS_SEQUENCE, MIS_GEOMETRIC)
