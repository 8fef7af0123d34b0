"""The loss and metrics of one micro-batch from its logits, as the learner computes them (its
packed forward gives the log-probs; here :func:`~asyncgrpo.core.loss.losses.token_log_probs` does),
through the objective TRL's ``score_centering`` names (:mod:`asyncgrpo.core.loss.objectives`)."""

from __future__ import annotations

import attrs
from torch import Tensor

from asyncgrpo.core.loss.inputs import LossConfig, SamplerTopK, check_logits, check_tensor
from asyncgrpo.core.loss.losses import normalize_loss, token_log_probs
from asyncgrpo.core.loss.metrics import loss_metrics
from asyncgrpo.core.loss.objectives import TokenInputs, loss_type_from, objective_for
from asyncgrpo.core.loss.objectives.weights import TRLSettings


@attrs.frozen(eq=False)
class LossOutput:
    """One micro-batch's loss (normalised by :func:`normalize_loss`, with grad), its metrics
    and its trained tokens N (the weight of each metric)."""

    loss: Tensor
    metrics: dict[str, float]
    num_tokens: int


def policy_loss(
    logits: Tensor,
    target_ids: Tensor,
    sampler_logp: Tensor,
    advantages: Tensor,
    sample_index: Tensor,
    *,
    config: LossConfig,
    num_trained_tokens_global: int,
    gradient_accumulation_steps: int,
    candidate_mask: Tensor | None = None,
    topk: SamplerTopK | None = None,
) -> LossOutput:
    """Score centering (``config.score_centering``, needs ``topk``) or the clipped surrogate of
    N trained tokens, with the keep range and trust region of ``config``."""
    n, _ = check_logits(logits)
    for name, tensor in (("sampler_logp", sampler_logp), ("advantages", advantages)):
        check_tensor(name, tensor, (n,), "float", "match logits' N trained tokens")
    check_tensor("sample_index", sample_index, (n,), "long", "match logits' N trained tokens")
    objective = objective_for(loss_type_from(None, config.score_centering))
    if objective.needs.sampler_topk and topk is None:
        raise ValueError(
            "score centering needs topk (the sampler's top-K log-probs); pass topk or set "
            "score_centering=False"
        )
    centering_topk = topk if objective.needs.sampler_topk else None
    tokens = token_log_probs(logits, target_ids, config.temperature, candidate_mask, centering_topk)
    settings = TRLSettings(
        epsilon=config.epsilon,
        epsilon_high=config.epsilon_high,
        vllm_importance_sampling_clip_min=config.vllm_importance_sampling_clip_min,
        vllm_importance_sampling_clip_max=config.vllm_importance_sampling_clip_max,
    )
    inputs = TokenInputs(
        logp=tokens.logp,
        sampler_logp=sampler_logp.to(tokens.logp.dtype),
        advantages=advantages.to(tokens.logp.dtype),
        sample_index=sample_index,
        entropy=tokens.entropy,
        topk_logp=tokens.topk_logp,
        topk=centering_topk,
    )
    per_token = objective.per_token_loss(inputs, settings)
    return LossOutput(
        loss=normalize_loss(per_token, num_trained_tokens_global, gradient_accumulation_steps),
        metrics=loss_metrics(
            tokens.logp, inputs.sampler_logp, tokens.entropy, sample_index, config, centering_topk
        ),
        num_tokens=n,
    )
