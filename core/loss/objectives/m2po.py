"""M2PO: second-moment trust region, masking the tokens with the largest squared log-ratio.

With ``r_t = pi(o_t) / mu(o_t)`` (current policy over the sampler, the behaviour policy) and
``m_t = (log r_t)^2``, M2PO's mask (Algorithm 1 of the paper) starts from the tokens PPO could
clip, the trust-region tokens ``T = {t : A_t > 0 and r_t > 1, or A_t < 0 and r_t < 1}``, and
removes the token of ``T`` with the largest ``m_t`` while ``mean_{t in T} m_t > tau``
(``tau = m2po_threshold``). Tokens outside ``T`` are never masked. The loss is unclipped:

    ``loss_t = -M_t r_t A_t``,  gradient ``-M_t r_t A_t grad log pi``,

averaged over all trained tokens, masked ones included (the paper's footnote 2, and the global
token mean of ``normalize_loss``). Removing the largest values first is the same as keeping the
smallest ``k`` values of ``T`` for the largest ``k`` whose mean is at most ``tau`` (ties are
removed in token order). ``M_t`` is detached.

Sources: Zheng, Zhao and Chen 2025, "Prosperity before Collapse: How Far Can Off-Policy RL Reach
with Stale Data on LLMs?" (arXiv 2510.01161; ``tau = 0.04`` in every experiment, reported
insensitive). Shipped by the authors' verl fork (Infini-AI-Lab/M2PO), AReaL (``m2_threshold``)
and Trinity-RFT. The ratio is to the behaviour policy, so ``proximal_logp`` is not used.

**The batch.** The paper computes the mask over the optimizer batch. Here it is computed over the
tokens of one call (``needs.batch_coupled``): per packed row. If every row's kept trust-region
tokens have mean ``m`` at most ``tau``, so does their union (a weighted mean of the rows' means),
so the paper's constraint holds for the whole batch; per-row masking can only mask more tokens
than the global algorithm would. The shell gets the paper's exact mask only by computing the
cut-off over all rows and processes first.

Metrics: ``objective/masked_fraction`` (tokens masked), ``objective/second_moment``
(``mean_t m_t`` over the call's tokens, before masking), ``objective/trust_region_fraction``,
``objective/is_weight_mean`` and ``objective/is_weight_max`` (of ``M_t r_t``).

Example:
    >>> from asyncgrpo.core.loss.objectives import TokenInputs
    >>> inputs = TokenInputs(logp=torch.log(torch.tensor([0.9, 0.5, 0.5])),
    ...     sampler_logp=torch.log(torch.tensor([0.3, 0.45, 0.5])),
    ...     advantages=torch.tensor([1.0, 1.0, 1.0]), sample_index=torch.tensor([0, 0, 1]),
    ...     entropy=torch.zeros(3))
    >>> m2po_keep(inputs, M2POSettings()).tolist()  # (log 3)^2 = 1.2 is masked
    [False, True, True]
    >>> [round(x, 4) for x in M2PO_OBJECTIVE.per_token_loss(inputs, M2POSettings()).tolist()]
    [0.0, -1.1111, -1.0]
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

from asyncgrpo.core.loss.objectives.base import (
    Needs,
    ObjectiveSettings,
    TokenInputs,
    empty_loss,
    finite,
    metric_values,
    setting,
)
from asyncgrpo.core.loss.objectives.weights import (
    IS_WEIGHT_MAX,
    IS_WEIGHT_MEAN,
    MASKED_FRACTION,
    SECOND_MOMENT,
    TRUST_REGION_FRACTION,
    fraction,
    masked_weight,
)


@attrs.frozen(kw_only=True)
class M2POSettings(ObjectiveSettings):
    """M2PO's bound on the second moment."""

    m2po_threshold: float = setting(
        0.04,
        "Not in TRL. m2po: bound on the kept tokens' mean squared log-ratio.",
        "M2PO paper, section 5.2 (AReaL m2_threshold)",
        finite,
    )


def trust_region_tokens(log_ratio: Tensor, advantages: Tensor) -> Tensor:
    """bool [N]: the tokens PPO could clip, ``A > 0`` and ``r > 1`` or ``A < 0`` and ``r < 1``.

    Example:
        >>> trust_region_tokens(torch.tensor([0.1, 0.1, -0.1, 0.0]),
        ...                     torch.tensor([1.0, -1.0, -1.0, 1.0])).tolist()
        [True, False, True, False]
    """
    return ((advantages > 0) & (log_ratio > 0)) | ((advantages < 0) & (log_ratio < 0))


def m2po_keep(inputs: TokenInputs, settings: M2POSettings) -> Tensor:
    """bool [N]: M2PO's mask ``M`` over the call's tokens (see the module docstring)."""
    log_ratio = (inputs.logp.detach() - inputs.sampler_logp).detach()
    candidates = trust_region_tokens(log_ratio, inputs.advantages)
    index = torch.nonzero(candidates).squeeze(-1)
    values = log_ratio[index].square()
    order = torch.sort(values, descending=True, stable=True).indices
    ordered = values[order]
    # mean of what is left after removing the k largest, for k = 0 .. len - 1
    remaining_sum = ordered.flip(0).cumsum(0).flip(0)
    remaining_count = torch.arange(ordered.shape[0], 0, -1, device=ordered.device)
    satisfied = remaining_sum / remaining_count <= settings.m2po_threshold
    removed = int(torch.nonzero(satisfied)[0]) if bool(satisfied.any()) else ordered.shape[0]
    keep = torch.ones_like(candidates)
    keep[index[order[:removed]]] = False
    return keep


@attrs.frozen
class M2PO:
    """M2PO (see the module docstring)."""

    name: str
    needs: Needs
    settings_type: type[M2POSettings] = M2POSettings

    def per_token_loss(self, inputs: TokenInputs, settings: M2POSettings) -> Tensor:
        """float [N]: ``-M r A``, gradient through ``r``."""
        if inputs.n == 0:
            return empty_loss(inputs)
        keep = m2po_keep(inputs, settings)
        ratio = torch.where(keep, inputs.logp - inputs.sampler_logp, 0.0).exp()
        return torch.where(keep, -ratio * inputs.advantages, 0.0)

    @torch.no_grad()
    def metrics(self, inputs: TokenInputs, settings: M2POSettings) -> dict[str, Tensor]:
        """``masked_fraction``, ``second_moment``, ``trust_region_fraction``, ``is_weight_*``."""
        if inputs.n == 0:
            return {}
        keep = m2po_keep(inputs, settings)
        log_ratio = inputs.logp.detach() - inputs.sampler_logp
        weight = masked_weight(log_ratio, keep)
        return metric_values(
            (MASKED_FRACTION, SECOND_MOMENT, TRUST_REGION_FRACTION, IS_WEIGHT_MEAN, IS_WEIGHT_MAX),
            [
                fraction(~keep),
                log_ratio.square().mean(),
                fraction(trust_region_tokens(log_ratio, inputs.advantages)),
                weight.mean(),
                weight.max(),
            ],
        )


M2PO_OBJECTIVE = M2PO(
    name="m2po",
    needs=Needs(sampler_topk=False, proximal_logp=False, whole_samples=False, batch_coupled=True),
)
OBJECTIVES = (M2PO_OBJECTIVE,)
