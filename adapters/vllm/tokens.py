"""vLLM's token-in/token-out endpoint, the only one that returns the sampler's candidate sets.

``POST /inference/v1/generate`` (served with ``--enable-scale-out``) takes a
``GenerateRequest`` (``token_ids``, ``sampling_params``, ``output_mode="tokens"``) and answers a
``GenerateTokensResponse`` whose choice carries ``token_ids``, ``logprobs.content`` (per token:
the sampled token's id and log-prob, then ``top_logprobs`` as a list in the engine's order, the
sampled token first) and ``sampling_mask`` (per token, the ids that survived top-k / top-p /
min-p, when the server records them with ``--return-sampling-mask``). Replies are read with
vLLM's own pydantic classes from ``vllm.entrypoints.scale_out.token_in_token_out.protocol``,
imported when first needed (importing vLLM takes seconds).

A server started without ``--enable-scale-out`` answers 403 on that route; a vLLM without it
answers 404. :func:`candidate_set_support` reads both facts the rollout worker needs at start.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from asyncgrpo.adapters.vllm.replies import Generation, VLLMError
from asyncgrpo.core.rollout.candidate_sets import CandidateSetSupport
from asyncgrpo.core.sampler_tables import CandidateSets, TopLogprobs

if TYPE_CHECKING:
    from asyncgrpo.adapters.vllm.sampling_params import SamplingParams

TOKEN_ENDPOINT = "/inference/v1/generate"
# vLLM's placeholder for a sampled token that has no entry in the engine's log-prob map.
_MISSING_LOGPROB = -9999.0


def candidate_set_support(
    vllm_config: Mapping[str, Any] | None, probe_status: int
) -> CandidateSetSupport:
    """Read :class:`CandidateSetSupport` from ``/server_info``'s ``vllm_config`` (``None`` when
    the server has no ``/server_info``) and the status of an empty ``POST`` to the token
    endpoint (403: ``--enable-scale-out`` is off; 404: this vLLM has no such endpoint; a
    validation error: served).

    Example:
        >>> candidate_set_support({"model_config": {"return_sampling_mask": True,
        ...                                         "max_logprobs": 20}}, 422)
        CandidateSetSupport(records_sampling_masks=True, serves_token_endpoint=True, \
max_logprobs=20)
        >>> candidate_set_support(None, 403)
        CandidateSetSupport(records_sampling_masks=None, serves_token_endpoint=False, \
max_logprobs=None)
    """
    model = (vllm_config or {}).get("model_config") or {}
    records = None if vllm_config is None else bool(model.get("return_sampling_mask", False))
    limit = model.get("max_logprobs")
    return CandidateSetSupport(
        records_sampling_masks=records,
        serves_token_endpoint=probe_status in (200, 400, 422),
        max_logprobs=int(limit) if limit is not None else None,
    )


def token_request(
    prompt_ids: list[int], params: SamplingParams, seed: int, model: str, logprobs: int
) -> dict[str, Any]:
    """The JSON body of one ``GenerateRequest``; ``logprobs`` counts the sampled token."""
    return {
        "model": model,
        "token_ids": list(prompt_ids),
        "output_mode": "tokens",
        "stream": False,
        "sampling_params": {**params.request_fields(seed), "logprobs": logprobs},
    }


def parse_token_reply(payload: Any, num_sampler_logprobs: int) -> Generation:
    """Read one ``GenerateTokensResponse`` into a :class:`Generation` with its candidate sets.

    Raises:
        VLLMError: the reply is not a valid ``GenerateTokensResponse``, has not one choice, or
            lacks token ids, log-probs or sampling masks for every token.
    """
    import pydantic
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateTokensResponse

    try:
        reply = GenerateTokensResponse.model_validate(payload)
    except pydantic.ValidationError as error:
        raise VLLMError(f"{TOKEN_ENDPOINT}: not a GenerateTokensResponse: {error}") from error
    if len(reply.choices) != 1:
        raise VLLMError(f"{TOKEN_ENDPOINT}: expected 1 choice, got {len(reply.choices)}")
    choice = reply.choices[0]
    ids = choice.token_ids
    if ids is None:
        raise VLLMError(f"{TOKEN_ENDPOINT}: the reply has no token_ids")
    content = choice.logprobs.content if choice.logprobs is not None else None
    if content is None or len(content) != len(ids):
        raise VLLMError(
            f"{TOKEN_ENDPOINT}: {0 if content is None else len(content)} log-probs for "
            f"{len(ids)} tokens; the request must set sampling_params.logprobs"
        )
    masks = choice.sampling_mask
    if masks is None or len(masks) != len(ids):
        raise VLLMError(
            f"{TOKEN_ENDPOINT}: {0 if masks is None else len(masks)} sampling masks for "
            f"{len(ids)} tokens; the server must run with --return-sampling-mask (vLLM >= 0.28, "
            "V2 model runner)"
        )
    for position, (token, entry) in enumerate(zip(ids, content, strict=True)):
        if entry.token_id != token or entry.logprob == _MISSING_LOGPROB:
            raise VLLMError(
                f"{TOKEN_ENDPOINT}: position {position}: no log-prob for sampled token {token}"
            )
        if not math.isfinite(entry.logprob):
            raise VLLMError(f"{TOKEN_ENDPOINT}: non-finite log-prob at position {position}")
    top = None
    if num_sampler_logprobs > 0:
        top = TopLogprobs.from_entries(
            [[(e.token_id, e.logprob) for e in entry.top_logprobs] for entry in content],
            num_sampler_logprobs,
        )
    return Generation(
        output_ids=tuple(ids),
        output_log_probs=tuple(float(e.logprob) for e in content),
        top_logprobs=top,
        finish_reason=choice.finish_reason,
        sampling_masks=CandidateSets.from_sets(masks),
    )
