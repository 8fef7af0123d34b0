"""Whether rollouts ask the server for the sampler's candidate sets: a pure decision.

Top-k and top-p renormalise the sampling distribution over a truncated candidate set, and the
server's processed log-probs follow it, so the trainer must renormalise over the same set or
every importance ratio is biased (TRL's AsyncGRPOTrainer documentation, "Top-k and top-p
sampling"). vLLM records each sampled token's candidate set when started with
``--return-sampling-mask`` (V2 model runner) and returns it only through the token-in/token-out
endpoint ``/inference/v1/generate``, which ``--enable-scale-out`` serves. The rollout worker
reads both from the server at start (:class:`CandidateSetSupport`) and
:func:`plan_candidate_sets` decides.
"""

from __future__ import annotations

import attrs

SAMPLING_MASK_FLAG = "--return-sampling-mask"
SCALE_OUT_FLAG = "--enable-scale-out"


@attrs.frozen
class CandidateSetSupport:
    """What the server offers, read at start.

    Attributes:
        records_sampling_masks: the server's ``model_config.return_sampling_mask``; ``None`` when
            it does not say (no ``/server_info``: started without ``VLLM_SERVER_DEV_MODE=1``).
        serves_token_endpoint: whether ``/inference/v1/generate`` is served.
        max_logprobs: the server's ``--max-logprobs`` (-1: no cap); ``None`` when unknown.
    """

    records_sampling_masks: bool | None
    serves_token_endpoint: bool
    max_logprobs: int | None = None


@attrs.frozen
class CandidateSetPlan:
    """The decision.

    Attributes:
        request_sets: generate through the token endpoint and keep each token's candidate set.
        logprobs_to_request: the ``logprobs`` of each token-endpoint request: one more than
            ``num_sampler_logprobs``, since that endpoint counts the sampled token among them
            (0 when no top log-probs are wanted).
        warning: the one warning to give (candidate sets needed but not available), or ``None``.
    """

    request_sets: bool
    logprobs_to_request: int = 0
    warning: str | None = None


def _flag_state(on: bool | None) -> str:
    return "unknown (no /server_info)" if on is None else ("on" if on else "off")


def plan_candidate_sets(
    support: CandidateSetSupport, top_k: int, top_p: float, num_sampler_logprobs: int
) -> CandidateSetPlan:
    """Decide from the server's support and the config's ``top_k`` / ``top_p``.

    Raises:
        ValueError: the server records sampling masks but ``top_k`` is 0 (vLLM rejects every
            such request), or ``--max-logprobs`` is too small for the token endpoint.

    Example:
        >>> plan_candidate_sets(CandidateSetSupport(True, True, 20), 50, 1.0, 8)
        CandidateSetPlan(request_sets=True, logprobs_to_request=9, warning=None)
        >>> plan_candidate_sets(CandidateSetSupport(False, True, 20), 0, 1.0, 8)
        CandidateSetPlan(request_sets=False, logprobs_to_request=0, warning=None)
    """
    if support.records_sampling_masks and top_k == 0:
        raise ValueError(
            f"the vLLM server was started with {SAMPLING_MASK_FLAG}, which rejects every "
            "request with top_k=0; set AsyncGRPOConfig.top_k (e.g. 512) or restart the server "
            f"without {SAMPLING_MASK_FLAG}"
        )
    truncated = top_k > 0 or top_p < 1.0
    if not truncated:
        return CandidateSetPlan(request_sets=False)
    if not (support.records_sampling_masks and support.serves_token_endpoint):
        return CandidateSetPlan(
            request_sets=False,
            warning=(
                f"top_k={top_k}/top_p={top_p} truncate the sampler's distribution, but this "
                "server does not return the candidate sets it sampled from: it needs "
                f"{SAMPLING_MASK_FLAG} (now {_flag_state(support.records_sampling_masks)}; "
                f"vLLM >= 0.28, V2 model runner) and {SCALE_OUT_FLAG} (now "
                f"{_flag_state(support.serves_token_endpoint)}). The trainer normalises over "
                "the full vocabulary instead, so importance ratios are biased"
            ),
        )
    wanted = num_sampler_logprobs + 1 if num_sampler_logprobs > 0 else 0
    limit = support.max_logprobs
    if limit is not None and limit >= 0 and wanted > limit:
        raise ValueError(
            f"num_sampler_logprobs={num_sampler_logprobs} needs {wanted} log-probs per token "
            "from the token endpoint (it counts the sampled token among them), but the server "
            f"allows {limit}; restart it with --max-logprobs {wanted} or lower "
            "AsyncGRPOConfig.num_sampler_logprobs"
        )
    return CandidateSetPlan(request_sets=True, logprobs_to_request=wanted)
