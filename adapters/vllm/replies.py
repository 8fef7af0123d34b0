"""Reading a vLLM server's replies: a ``/v1/completions`` choice, the Prometheus text of
``/metrics`` and the weight-transfer part of ``/server_info``.

Each parser checks what it reads and raises :class:`VLLMError` naming what is missing or
malformed (a reply without token ids means the server cannot return them; a log-prob key not
of the form ``token_id:N`` means the request did not ask for ids), so a bad reply fails where
it enters instead of training on wrong numbers.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import attrs
from prometheus_client.parser import text_string_to_metric_families

from asyncgrpo.core.rollout.pacing import ServerLoad
from asyncgrpo.core.sampler_tables import CandidateSets, TopLogprobs
from asyncgrpo.core.servers.match import ServerFlags


class VLLMError(RuntimeError):
    """The server answered with an error, or could not be reached after retries."""


@attrs.frozen
class Generation:
    """One sampled completion.

    Attributes:
        output_ids: the sampled token ids.
        output_log_probs: the sampler's log-prob (processed: after temperature, top-k/top-p)
            of each sampled token.
        top_logprobs: per token, the sampler's top ``num_sampler_logprobs`` log-probs as dense
            arrays (ids int64 [T, K], log-probs float32 [T, K], most probable first; see
            :mod:`asyncgrpo.core.sampler_tables`); ``None`` when none were requested.
        finish_reason: ``"stop"`` (EOS or a stop token) or ``"length"``; an ``"abort"``ed
            (partial) completion is retried by the client, never returned.
        sampling_masks: per token, the candidate ids the sampler drew from under top-k /
            top-p (:mod:`~asyncgrpo.adapters.vllm.tokens`), as dense arrays (ids int64 [T, K],
            counts int64 [T]); ``None`` when not requested.
    """

    output_ids: tuple[int, ...]
    output_log_probs: tuple[float, ...]
    top_logprobs: TopLogprobs | None
    finish_reason: str | None
    sampling_masks: CandidateSets | None = None


@attrs.frozen
class ServerMetrics:
    """One /metrics scrape, summed over engines (KV usage: max over engines).

    ``identity``: the API server process's start time (``process_start_time_seconds``,
    seconds since the epoch), a value that changes when the server restarts; ``None`` when
    the server does not export it (several API server processes share one Prometheus
    multiprocess registry, which leaves out the ``process_*`` metrics).
    """

    load: ServerLoad
    preemptions: int
    kv_cache_tokens: int | None
    identity: float | None = None


_TOKEN_ID = re.compile(r"^token_id:(-?\d+)$")


def _token_id(key: str) -> int:
    match = _TOKEN_ID.match(key)
    if match is None:
        raise VLLMError(
            f"server returned log-prob key {key!r}, expected 'token_id:N'; the request must "
            "set return_tokens_as_token_ids"
        )
    return int(match.group(1))


def _entries(table: Mapping[str, float]) -> list[tuple[int, float]]:
    """One position's ``(token id, log-prob)`` entries (vLLM adds the sampled token when it is
    not among the most probable)."""
    return [(_token_id(key), float(v)) for key, v in table.items()]


def parse_generation(choice: Mapping[str, Any], num_sampler_logprobs: int) -> Generation:
    """Read one ``/v1/completions`` choice; a malformed reply raises naming what is missing."""
    token_ids = choice.get("token_ids")
    if token_ids is None:
        raise VLLMError("server reply has no token_ids; the server must support return_token_ids")
    logprobs = choice.get("logprobs") or {}
    sampled = logprobs.get("token_logprobs")
    if sampled is None or len(sampled) != len(token_ids):
        raise VLLMError(
            f"server reply has {0 if sampled is None else len(sampled)} log-probs for "
            f"{len(token_ids)} tokens"
        )
    values = tuple(float(v) for v in sampled)
    if any(not math.isfinite(v) for v in values):
        raise VLLMError("server returned a non-finite log-prob for a sampled token")
    top = None
    if num_sampler_logprobs > 0:
        tables = logprobs.get("top_logprobs") or []
        if len(tables) != len(token_ids):
            raise VLLMError(
                f"server reply has {len(tables)} top log-prob tables for {len(token_ids)} tokens"
            )
        top = TopLogprobs.from_entries([_entries(t or {}) for t in tables], num_sampler_logprobs)
    return Generation(
        output_ids=tuple(int(t) for t in token_ids),
        output_log_probs=values,
        top_logprobs=top,
        finish_reason=choice.get("finish_reason"),
    )


def parse_metrics(text: str) -> ServerMetrics:
    """Parse vLLM's Prometheus text (``prometheus_client``'s parser): KV usage (max over
    engines), running / waiting requests and preemptions (summed over engines), the KV-cache
    size in tokens, and the API server's start time (its identity).

    Raises:
        VLLMError: the text is not Prometheus exposition format.

    Example:
        >>> m = parse_metrics('vllm:num_requests_running{engine="0"} 3\\n'
        ...                   'vllm:num_requests_running{engine="1"} 2\\n'
        ...                   'process_start_time_seconds 1700000000.5\\n')
        >>> m.load.running, m.identity
        (5, 1700000000.5)
    """
    identity: float | None = None
    usage: list[float] = []
    running = waiting = preemptions = 0.0
    kv_tokens: list[int] = []
    try:
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    except ValueError as error:
        raise VLLMError(f"/metrics: not Prometheus text: {error}") from error
    for sample in samples:
        name, value = sample.name, float(sample.value)
        if name == "vllm:kv_cache_usage_perc":
            usage.append(value)
        elif name == "vllm:num_requests_running":
            running += value
        elif name == "vllm:num_requests_waiting":
            waiting += value
        elif name == "vllm:num_preemptions_total":
            preemptions += value
        elif name == "process_start_time_seconds":
            identity = value
        elif name == "vllm:cache_config_info":
            size = _kv_cache_tokens(sample.labels)
            if size is not None:
                kv_tokens.append(size)
    return ServerMetrics(
        load=ServerLoad(max(usage, default=0.0), int(running), int(waiting)),
        preemptions=int(preemptions),
        kv_cache_tokens=sum(kv_tokens) if kv_tokens else None,
        identity=identity,
    )


def _kv_cache_tokens(labels: Mapping[str, str]) -> int | None:
    """The KV cache's size in tokens from ``vllm:cache_config_info``'s labels: the size itself
    where vLLM gives it, else blocks x block size."""
    size = labels.get("kv_cache_size_tokens")
    if size is not None and size.isdigit():
        return int(size)
    blocks, block_size = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
    if blocks.isdigit() and block_size.isdigit():
        return int(blocks) * int(block_size)
    return None


@attrs.frozen
class ServerTransfer:
    """What a server offers for weight transfer, from its ``/server_info``.

    Attributes:
        backend: the ``--weight-transfer-config`` backend, ``None`` when it has none.
        workers: its model workers, the ranks that join the trainer's group: every parallel
            dimension vLLM multiplies into its world size (:data:`WORKER_DIMENSIONS`).
    """

    backend: str | None
    workers: int


WORKER_DIMENSIONS = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "prefill_context_parallel_size",
    "data_parallel_size",
)
"""The ``parallel_config`` sizes whose product is the server's worker count. vLLM 0.32
(``vllm/config/parallel.py``) makes its ``world_size`` pipeline x tensor x prefill-context
parallel, and its weight-transfer group spans ``world_size_across_dp`` (that times data
parallel); ``decode_context_parallel_size`` reuses the tensor (or prefill-context) ranks and
adds none."""


def server_transfer(vllm_config: Mapping[str, Any]) -> ServerTransfer:
    """Read :class:`ServerTransfer` from ``/server_info?config_format=json``'s ``vllm_config``.

    Example:
        >>> server_transfer({"weight_transfer_config": {"backend": "nccl"},
        ...                  "parallel_config": {"tensor_parallel_size": 2,
        ...                                      "pipeline_parallel_size": 1,
        ...                                      "prefill_context_parallel_size": 2,
        ...                                      "decode_context_parallel_size": 2,
        ...                                      "data_parallel_size": 2}})
        ServerTransfer(backend='nccl', workers=8)
    """
    config = vllm_config.get("weight_transfer_config") or {}
    parallel = vllm_config.get("parallel_config") or {}
    try:
        workers = 1
        for size in WORKER_DIMENSIONS:
            workers *= int(parallel.get(size, 1))
    except (TypeError, ValueError) as error:
        raise VLLMError(f"/server_info: unreadable parallel_config {parallel!r}") from error
    backend = config.get("backend") if isinstance(config, Mapping) else None
    return ServerTransfer(backend=backend, workers=workers)


def server_flags(
    models_reply: Mapping[str, Any],
    vllm_config: Mapping[str, Any] | None,
    model: str,
    token_endpoint: bool | None = None,
) -> ServerFlags:
    """Read :class:`~asyncgrpo.core.servers.match.ServerFlags` from ``/v1/models``'s reply and
    ``/server_info?config_format=json``'s ``vllm_config`` (``None``: the server has no
    ``/server_info``).

    Example:
        >>> flags = server_flags({"data": [{"id": "m", "max_model_len": 1024}]},
        ...                      {"model_config": {"dtype": "torch.float32"},
        ...                       "lora_config": {"max_loras": 4, "max_lora_rank": 8}}, "m")
        >>> flags.models, flags.max_model_len, flags.dtype, flags.lora, flags.max_loras
        (('m',), 1024, 'torch.float32', True, 4)
    """
    entries = [e for e in models_reply.get("data", []) if isinstance(e, Mapping)]
    lengths = [e.get("max_model_len") for e in entries if e.get("id") == model]
    config = vllm_config or {}
    model_config = config.get("model_config") or {}
    lora = config.get("lora_config") or None
    transfer = config.get("weight_transfer_config") or {}

    def text(value: Any) -> str | None:
        return None if value is None else str(value)

    return ServerFlags(
        models=tuple(str(e.get("id")) for e in entries),
        max_model_len=int(lengths[0]) if lengths and lengths[0] is not None else None,
        described=vllm_config is not None,
        dtype=text(model_config.get("dtype")),
        logprobs_mode=text(model_config.get("logprobs_mode")),
        max_logprobs=model_config.get("max_logprobs"),
        generation_config=text(model_config.get("generation_config")),
        sampling_mask=model_config.get("return_sampling_mask"),
        token_endpoint=token_endpoint,
        weight_transfer=text(transfer.get("backend")) if isinstance(transfer, Mapping) else None,
        lora=lora is not None,
        max_loras=lora.get("max_loras") if lora else None,
        max_lora_rank=lora.get("max_lora_rank") if lora else None,
    )
