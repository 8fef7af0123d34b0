"""The loss metrics of TRL's AsyncGRPOTrainer over one micro-batch's trained tokens.

:func:`loss_metrics` turns the policy's and the sampler's log-probs at the N trained tokens into
the ``sampling/*``, ``entropy`` and ``clip_ratio/*`` metrics, without grad, in one
device-to-host copy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor

from asyncgrpo.core.frozen import FrozenMap
from asyncgrpo.core.loss.importance_sampling import importance_keep, importance_ratio, sampler_mass
from asyncgrpo.core.loss.inputs import LossConfig, SamplerTopK
from asyncgrpo.core.metrics import LENGTH_QUARTERS, Aggregation

_MEAN, _MIN, _MAX = Aggregation.MEAN, Aggregation.MIN, Aggregation.MAX
_SAMPLER_MASS = "sampling/sampler_mass"
_BY_LENGTH = tuple(
    f"sampling/length_q{q}/{part}"
    for q in range(1, LENGTH_QUARTERS + 1)
    for part in ("masked_token_count", "token_count")
)
LOSS_METRICS: Mapping[str, Aggregation] = FrozenMap(
    {
        "sampling/importance_sampling_ratio/min": _MIN,
        "sampling/importance_sampling_ratio/mean": _MEAN,
        "sampling/importance_sampling_ratio/max": _MAX,
        "sampling/sampling_logp_difference/mean": _MEAN,
        "sampling/sampling_logp_difference/max": _MAX,
        "sampling/masked_mean": _MEAN,
        "entropy": _MEAN,
        "clip_ratio/region_mean": _MEAN,
        "clip_ratio/low_mean": _MEAN,
        "clip_ratio/low_min": _MIN,
        "clip_ratio/high_mean": _MEAN,
        "clip_ratio/high_max": _MAX,
        _SAMPLER_MASS: _MEAN,
        **dict.fromkeys(_BY_LENGTH, Aggregation.SUM),
    }
)
"""How each metric of :func:`loss_metrics` aggregates over a window's micro-batches (a mean
weighted by the micro-batch's trained tokens, or the extreme)."""
_BASE_METRICS = tuple(
    name for name in LOSS_METRICS if name != _SAMPLER_MASS and name not in _BY_LENGTH
)


@torch.no_grad()
def loss_metrics(
    logp: Tensor,
    sampler_logp: Tensor,
    entropy: Tensor,
    sample_index: Tensor,
    config: LossConfig,
    topk: SamplerTopK | None = None,
    length_quarter: Tensor | None = None,
) -> dict[str, Tensor]:
    """The loss metrics of TRL's AsyncGRPOTrainer over the N trained tokens, computed without grad.

    * ``sampling/importance_sampling_ratio/{min,mean,max}``: of ``r`` before masking;
    * ``sampling/sampling_logp_difference/{mean,max}``: of ``|logp - sampler_logp|`` (nats);
    * ``sampling/masked_mean``: fraction of tokens dropped by the keep range;
    * ``entropy``: mean entropy (nats);
    * ``clip_ratio/region_mean``: fraction with ``r`` outside ``[1 - eps, 1 + eps_high]``
      whatever the advantage's sign (in score-centering mode nothing is clipped; these only
      count tokens outside the trust region); ``clip_ratio/low_mean`` (``r < 1 - eps``) and
      ``clip_ratio/high_mean`` (``r > 1 + eps_high``);
    * ``clip_ratio/low_min``, ``clip_ratio/high_max``: min (max) over completions of each
      completion's fraction of its tokens in this micro-batch below (above) the trust region;
    * ``sampling/sampler_mass`` (only with ``topk``): mean of :func:`sampler_mass`;
    * ``sampling/length_q{1-4}/masked_token_count`` and ``.../token_count`` (only with
      ``length_quarter``): per quarter of ``max_completion_length`` the sample's length falls
      in, the tokens dropped by the keep range and all its trained tokens, summed over a
      window (their ratio is ``sampling/masked_mean`` of that quarter).

    With N = 0 every metric is NaN (a metric window ignores it). Each is a 0-d float64 tensor
    left where the tokens are: the learner takes a step's metrics to the host at once.

    Args:
        logp: float [N] policy log-probs of the targets (nats).
        sampler_logp: float [N] the sampler's log-probs of the targets (nats).
        entropy: float [N] per-position entropy (nats).
        sample_index: long [N] the completion each token belongs to.
        config: trust region and keep range.
        topk: the sampler's top-K, in score-centering mode.
        length_quarter: int [N] the length quarter (1-4) of each token's completion
            (:func:`asyncgrpo.core.rollout.metrics.token_length_quarters`).

    Example:
        >>> m = loss_metrics(torch.log(torch.tensor([0.5, 0.5])),
        ...                  torch.log(torch.tensor([0.25, 0.5])), torch.zeros(2),
        ...                  torch.tensor([7, 9]), LossConfig())
        >>> float(m["sampling/importance_sampling_ratio/max"]), float(m["clip_ratio/high_max"])
        (2.0, 1.0)
    """
    names = _BASE_METRICS + ((_SAMPLER_MASS,) if topk is not None else ())
    if logp.shape[0] == 0:
        nan = torch.tensor(math.nan, dtype=torch.float64, device=logp.device)
        zero = torch.zeros((), dtype=torch.float64, device=logp.device)
        counts = dict.fromkeys(_BY_LENGTH, zero) if length_quarter is not None else {}
        return {**dict.fromkeys(names, nan), **counts}
    logp = logp.detach()
    dtype = logp.dtype
    ratio = importance_ratio(logp, sampler_logp.to(dtype))
    difference = (logp - sampler_logp.to(dtype)).abs()
    low, high = config.trust_region
    below, above = ratio < low, ratio > high
    masked = ~importance_keep(ratio, config)
    values = [
        ratio.min(),
        ratio.mean(),
        ratio.max(),
        difference.mean(),
        difference.max(),
        masked.to(dtype).mean(),
        entropy.to(dtype).mean(),
        (below | above).to(dtype).mean(),
        below.to(dtype).mean(),
        _fraction_per_sample(below, sample_index, dtype).min(),
        above.to(dtype).mean(),
        _fraction_per_sample(above, sample_index, dtype).max(),
    ]
    if topk is not None:
        values.append(sampler_mass(topk).to(dtype).mean())
    if length_quarter is not None:
        names += _BY_LENGTH
        for quarter in range(1, LENGTH_QUARTERS + 1):
            inside = length_quarter == quarter
            values += [(masked & inside).sum(), inside.sum()]
    return {name: v.to(torch.float64) for name, v in zip(names, values, strict=True)}


def _fraction_per_sample(flags: Tensor, sample_index: Tensor, dtype: torch.dtype) -> Tensor:
    order = torch.argsort(sample_index, stable=True)
    _, counts = torch.unique_consecutive(sample_index[order], return_counts=True)
    totals = flags[order].long().cumsum(0)[counts.cumsum(0) - 1]
    hits = torch.diff(totals, prepend=totals.new_zeros(1))
    return hits.to(dtype) / counts.to(dtype)
