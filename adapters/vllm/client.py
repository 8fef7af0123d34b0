"""The vLLM HTTP API: generation and what the server reports (metrics, flags, identity); its
control endpoints are :attr:`VLLMClient.admin` (:mod:`asyncgrpo.adapters.vllm.admin`).

Token ids in, token ids and log-probs out, through ``/v1/completions``: the prompt is sent as
token ids, ``return_token_ids`` returns the sampled ids, ``logprobs=K`` the sampled token's
log-prob and the sampler's top ``K`` keyed by id (``return_tokens_as_token_ids``). Every
sampling parameter is sent explicitly, with a seed unique to the request. Every call goes
through the server's :class:`~asyncgrpo.adapters.vllm.transport.ServerTransport` (retries,
dropped connections, the silence watch).

A client given a :class:`ServerGate` (the rollout loop's) survives a server that goes away:
a request that finds the server unreachable
(:func:`~asyncgrpo.core.servers.outage.classify_failure`) is handed to the gate, which waits
until the server is back *and* holds the trainer's weights again, and is then re-issued; a
generation that finished across an outage is re-issued too (``regenerated_count``), since its
tokens may come from a restarted server's checkpoint instead of the trainer's policy. A server
that restarted while no request was in flight fails nothing; the client reads the server's
identity (:meth:`VLLMClient.server_identity`) after every finished generation, before the gate
may trust it, and on every ``/metrics`` scrape, and hands it to the gate
(:func:`~asyncgrpo.core.servers.outage.identity_seen`): a new identity is an outage too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import httpx
import structlog

from asyncgrpo.adapters.vllm import tokens as vllm_tokens
from asyncgrpo.adapters.vllm.admin import ServerAdmin
from asyncgrpo.adapters.vllm.identity import IDENTITY_QUERY, FreshIdentity
from asyncgrpo.adapters.vllm.replies import (
    Generation,
    ServerMetrics,
    ServerTransfer,
    VLLMError,
    parse_generation,
    parse_metrics,
    server_flags,
    server_transfer,
)
from asyncgrpo.adapters.vllm.retries import retrying
from asyncgrpo.adapters.vllm.sampling_params import SamplingParams
from asyncgrpo.adapters.vllm.transport import ServerTransport, ServerUnreachable
from asyncgrpo.core.rollout.candidate_sets import CandidateSetSupport
from asyncgrpo.core.servers.match import ServerFlags


class PromptTooLongError(VLLMError):
    """The server rejected a request as longer than its ``--max-model-len``."""


class ResponsesCut(VLLMError):
    """A generation failed on every try for ``vllm_server_timeout`` seconds although the server
    came back after each failure (it answered ``/health`` and took the trainer's weights): its
    connections are cut by something between the trainer and the server."""


class ServerAuthError(VLLMError):
    """The server refused the request's API key (HTTP 401 or 403): the run's key is missing
    or is not the server's."""


class _Aborted(VLLMError):
    """The server returned an aborted (partial) completion."""


def _is_aborted(error: BaseException) -> bool:
    return isinstance(error, _Aborted)


log = structlog.get_logger("asyncgrpo.vllm_client")
PRIORITY_POLICY = "priority"  # vLLM's --scheduling-policy that orders requests by priority


class ServerGate(Protocol):
    """Whether requests may go to the server now (see :mod:`asyncgrpo.core.servers.outage`)."""

    async def enter(self) -> int:
        """Wait until the server is known to hold the trainer's weights; return the outages
        seen so far (the request's start mark)."""

    async def unreachable(self, error: BaseException) -> None:
        """Record that the server went away; return once it is back and trusted, or raise."""

    def trusted(self, started: int) -> bool:
        """Whether a request started at mark ``started`` and finished now can be used."""

    def identity_seen(self, identity: float | None) -> None:
        """Record the server's identity read now (a new one means it restarted)."""


NONFINITE_REPLY = "Out of range float values are not JSON compliant"
"""What vLLM answers (HTTP 400) when a reply's log-probs are NaN or infinite: the weights it
serves overflow float32 in the forward (diverged weights)."""


REFUSED_KEY_STATUSES = (401, 403)
"""HTTP statuses of a server that refuses the request's ``Authorization`` (its ``--api-key``
or ``VLLM_API_KEY`` check: vLLM's and asyncgrpo's answer 401 ``{"error": "Unauthorized"}``)."""


def error_detail(response: httpx.Response) -> str:
    """The reason an error answer gives, for every shape vLLM answers in: its OpenAI-style
    ``{"error": {"message": ...}}``, the API-key check's ``{"error": "Unauthorized"}``,
    FastAPI's ``{"detail": ...}``, or a body that is not JSON (a proxy's page): then the body
    itself.

    >>> error_detail(httpx.Response(401, json={"error": "Unauthorized"}))
    'Unauthorized'
    >>> error_detail(httpx.Response(400, json={"error": {"message": "too long", "code": 400}}))
    'too long'
    >>> error_detail(httpx.Response(502, text="<html>Bad Gateway</html>"))
    '<html>Bad Gateway</html>'
    """
    try:
        body = response.json()
    except ValueError:
        return response.text
    if not isinstance(body, dict):
        return response.text
    error = body.get("error", body.get("detail"))
    if isinstance(error, dict):
        error = error.get("message")
    return str(error) if error else response.text


def _too_long(detail: str) -> bool:
    return (
        "maximum context length" in detail
        or "max_model_len" in detail
        or ("too long" in detail.lower())
    )


class VLLMClient:
    """An async client for one vLLM server (``httpx`` + ``anyio``).

    Args:
        base_url: e.g. ``http://127.0.0.1:8000``.
        model: the served model name.
        timeout_s: the config's ``vllm_server_timeout``: one call's tries together, and the
            longest the server may stay silent.
        max_retries: retries of a timed-out, dropped or 5xx request before raising.
        backoff_s: first backoff in seconds; doubles per retry, capped at 30 s, each with a
            random jitter of up to half of it (:mod:`asyncgrpo.adapters.vllm.retries`).
        max_connections: connection pool size (about ``max_concurrent_rollouts``).
        gate: hands requests that find the server gone to a :class:`ServerGate` instead of
            retrying them, and re-issues generations that crossed an outage; ``None``: plain
            retries, then the last cause is raised.
        stall_s: the config's ``vllm_server_stall_timeout``: a call unanswered this long probes
            whether the server still answers.
        headers: sent with every request (e.g. ``Authorization`` for a server's API key).
        stall_outage: a call unanswered for ``stall_s`` whose ``/health`` probe is not answered
            either raises :class:`ServerUnreachable` at once (handed to the gate like a refused
            connection) instead of waiting up to ``timeout_s``: for a run with other servers to
            turn to.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        timeout_s: float = 1800.0,
        max_retries: int = 5,
        backoff_s: float = 0.5,
        max_connections: int = 512,
        gate: ServerGate | None = None,
        stall_s: float = 10.0,
        headers: Mapping[str, str] | None = None,
        stall_outage: bool = False,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.max_retries = max_retries
        self.gate = gate
        self.transport = ServerTransport(
            self.base_url,
            timeout_s,
            max_retries=max_retries,
            backoff_s=backoff_s,
            max_connections=max_connections,
            gated=gate is not None,
            stall_s=stall_s,
            headers=headers,
            stall_outage=stall_outage,
        )
        self.admin = ServerAdmin(self.transport, self._raise_for_client_error)
        self.regenerated_count = 0
        self.identity_offered = True  # False once a reading found no identity: stop reading
        self.fresh_identity = FreshIdentity(self.server_identity)

    @property
    def retry_count(self) -> int:
        """Retries so far (of requests and of aborted generations)."""
        return self.transport.retries.count

    @property
    def dropped_connection_count(self) -> int:
        """Requests sent again on a new connection because the server's side dropped theirs
        (a kept-alive connection closed as the request went out, or a reply reset or cut)."""
        return self.transport.dropped_connection_count

    async def aclose(self) -> None:
        await self.transport.aclose()

    async def __aenter__(self) -> VLLMClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @staticmethod
    def _raise_for_client_error(response: httpx.Response, what: str) -> None:
        if response.status_code < 400:
            return
        detail = error_detail(response)
        if response.status_code in REFUSED_KEY_STATUSES:
            raise ServerAuthError(
                f"{what}: the server refused the request's API key (HTTP "
                f"{response.status_code}: {detail[:200]}): the server was started with an API "
                "key (--api-key or VLLM_API_KEY) and the run sent none or another. Give the run "
                "the server's key: set AsyncGRPOConfig's vllm_server_api_key (also a key of an "
                "asyncgrpo train --config file), or VLLM_API_KEY in the trainer's environment"
            )
        if _too_long(detail):
            raise PromptTooLongError(
                f"{what}: the server rejected the request as too long: {detail[:400]} -- raise "
                "the server's --max-model-len (and max_model_len of the run), or lower "
                "max_completion_length / shorten prompts"
            )
        if NONFINITE_REPLY in detail:
            raise VLLMError(
                f"{what}: the server's log-probs are not finite (HTTP {response.status_code}: "
                f"{detail[:200]}): the weights it serves overflow float32, as diverged weights "
                "do. If the trainer pushed them, its learning_rate is too high: lower it (and keep "
                "max_grad_norm clipping on) and start the run again (a resumed checkpoint keeps "
                "the learning rate it was saved with)"
            )
        raise VLLMError(f"{what}: HTTP {response.status_code}: {detail[:1000]}")

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        seed: int,
        model: str | None = None,
        candidate_sets_logprobs: int | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> Generation:
        """Sample one completion of ``prompt_ids`` (from ``model``, e.g. a LoRA adapter's
        name, instead of the client's model when given). A ``priority`` other than 0 (later
        than 0's requests: vLLM schedules lower values first) needs a server started with
        ``--scheduling-policy priority`` (:meth:`scheduling_policy`).

        With ``candidate_sets_logprobs`` (the plan's ``logprobs_to_request``) the request goes
        to the token endpoint and the generation carries each token's candidate set. A
        ``cache_salt`` (vLLM's: at most 128 characters, none of ``@ / \\``) keeps the request
        off every cached block computed under another salt, and its own blocks off theirs."""
        salt = {"cache_salt": cache_salt} if cache_salt is not None else {}
        if candidate_sets_logprobs is not None:
            body = vllm_tokens.token_request(
                list(prompt_ids), params, seed, model or self.model, candidate_sets_logprobs
            )
            body |= salt
            return await self._generate_until_not_aborted(
                vllm_tokens.TOKEN_ENDPOINT,
                body,
                lambda reply: vllm_tokens.parse_token_reply(reply, params.num_sampler_logprobs),
            )
        body = {
            "model": model or self.model,
            "prompt": list(prompt_ids),
            **params.request_fields(seed),
            "logprobs": max(params.num_sampler_logprobs, 0),
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "stream": False,
            **({"priority": priority} if priority else {}),
            **salt,
        }
        return await self._generate_until_not_aborted(
            "/v1/completions", body, lambda reply: self._one_choice(reply, params)
        )

    @staticmethod
    def _one_choice(reply: Any, params: SamplingParams) -> Generation:
        choices = reply.get("choices") or []
        if len(choices) != 1:
            raise VLLMError(f"generation: expected 1 choice, server returned {len(choices)}")
        return parse_generation(choices[0], params.num_sampler_logprobs)

    async def _generate_until_not_aborted(
        self, path: str, body: dict[str, Any], parse: Callable[[Any], Generation]
    ) -> Generation:
        """A whole generation: one the server aborted (a pause with ``mode=abort``) is asked
        again under the retry policy, and a partial completion is never returned."""
        try:
            transport = self.transport
            async for attempt in retrying(transport.policy, _is_aborted, transport.retries):
                with attempt:
                    generation = await self._generate_trusted(path, body, parse)
                    if generation.finish_reason == "abort":
                        raise _Aborted("the server aborted the request")
                    return generation
        except _Aborted as error:
            raise VLLMError(
                f"generation: the server aborted the request {self.max_retries + 1} times "
                "(someone paused it with mode=abort or aborted requests); a partial completion "
                "is never trained"
            ) from error
        raise AssertionError("unreachable: the retry loop returns or raises")

    async def _generate_trusted(
        self, path: str, body: dict[str, Any], parse: Callable[[Any], Generation]
    ) -> Generation:
        """One generation; a gated client sends it again while it crosses an outage (the
        server went away while it ran, or restarted before it could be trusted).

        A request that keeps failing while the server keeps coming back (a link that resets
        or cuts every reply to it, while ``/health`` answers) raises :class:`ResponsesCut`
        at its first failure ``vllm_server_timeout`` seconds or more after its first one,
        instead of going round outages and pushes for ever."""
        failing_since: float | None = None  # the first failure since the last reply
        tries = 0
        while True:
            started = await self.gate.enter() if self.gate is not None else 0
            try:
                tries += 1
                response = await self.transport.request("POST", path, json=body)
            except ServerUnreachable as error:
                assert self.gate is not None  # only a gated client raises it
                now = time.monotonic()
                failing_since = now if failing_since is None else failing_since
                if now - failing_since >= self.transport.timeout_s:
                    raise ResponsesCut(
                        f"generation at {self.base_url}: failed on each of {tries} tries over "
                        f"{now - failing_since:.0f} s (vllm_server_timeout="
                        f"{self.transport.timeout_s:g} s) though the server came back after "
                        f"each (it answers /health and took the trainer's weights); the last: "
                        f"{error}. Something between the trainer and the server (a proxy, a "
                        "load balancer, a flaky link) resets or cuts its replies: fix that path, "
                        "then resume the run (resume_from_checkpoint=True, or asyncgrpo train "
                        "--resume)"
                    ) from error
                await self.gate.unreachable(error)
                self.regenerated_count += 1  # the server went away while it ran: send again
                continue
            failing_since = None
            self._raise_for_client_error(response, "generation")
            generation = parse(response.json())
            if self.gate is not None and not await self._trusted_now(started):
                self.regenerated_count += 1  # sampled across an outage: unknown weights
                continue
            return generation

    async def _trusted_now(self, started: int) -> bool:
        """Gated: whether a generation started at mark ``started`` and finished before this
        call may be used, after a reading of the server's identity begun after it finished."""
        assert self.gate is not None
        if self.identity_offered:
            try:
                identity = await self.fresh_identity.after_now()
            except ServerUnreachable as error:
                await self.gate.unreachable(error)
                return False
            self.gate.identity_seen(identity)
        return self.gate.trusted(started)

    async def server_identity(self) -> float | None:
        """The server's identity (:mod:`~asyncgrpo.adapters.vllm.identity`), which changes
        when it restarts; ``None`` when the server has no ``/metrics`` or does not export it
        (then ``identity_offered`` turns false). Raises :class:`ServerUnreachable` on a gated
        client whose server is gone."""
        response = await self.transport.request("GET", "/metrics", params=IDENTITY_QUERY)
        if response.status_code == 404:
            self.identity_offered = False
            return None
        self._raise_for_client_error(response, "/metrics")
        identity = parse_metrics(response.text).identity
        self.identity_offered = identity is not None
        return identity

    async def served_models(self) -> list[str]:
        """The names the server serves (``/v1/models``; its base model first)."""
        response = await self.transport.request("GET", "/v1/models")
        self._raise_for_client_error(response, "/v1/models")
        return [str(entry.get("id")) for entry in response.json().get("data", [])]

    async def max_model_len(self) -> int:
        """The served model's ``max_model_len`` from ``/v1/models``."""
        response = await self.transport.request("GET", "/v1/models")
        self._raise_for_client_error(response, "/v1/models")
        for entry in response.json().get("data", []):
            if entry.get("id") == self.model:
                return int(entry["max_model_len"])
        names = [e.get("id") for e in response.json().get("data", [])]
        raise VLLMError(f"the server does not serve model {self.model!r}; it serves {names}")

    async def metrics(self) -> ServerMetrics | None:
        """One /metrics scrape, or ``None`` when the server has no /metrics endpoint; a gated
        client waits out an outage (see :class:`ServerGate`) and scrapes again, and hands the
        server's identity to the gate."""
        while True:
            try:
                response = await self.transport.request("GET", "/metrics")
                break
            except ServerUnreachable as error:
                assert self.gate is not None
                await self.gate.unreachable(error)
        if response.status_code == 404:
            return None
        self._raise_for_client_error(response, "/metrics")
        snapshot = parse_metrics(response.text)
        if self.gate is not None:
            self.gate.identity_seen(snapshot.identity)
        return snapshot

    async def healthy(self, timeout_s: float = 5.0) -> bool:
        """Whether the server answers ``/health`` with 200 and serves the client's model now
        (one try each, no retries: a probe while waiting for a restarted server)."""
        try:
            health = await self.transport.http.get("/health", timeout=timeout_s)
            if health.status_code != 200:
                return False
            models = await self.transport.http.get("/v1/models", timeout=timeout_s)
        except (httpx.TimeoutException, httpx.TransportError):
            return False
        if models.status_code != 200:
            return False
        return any(m.get("id") == self.model for m in models.json().get("data", []))

    async def server_config(self) -> dict[str, Any] | None:
        """The server's ``vllm_config`` from ``/server_info`` as JSON, or ``None`` when the
        server does not expose it (started without ``VLLM_SERVER_DEV_MODE=1``)."""
        response = await self.transport.request(
            "GET", "/server_info", params={"config_format": "json"}, timeout=60.0
        )
        if response.status_code == 404:
            return None
        self._raise_for_client_error(response, "/server_info")
        config = response.json().get("vllm_config")
        if not isinstance(config, dict):
            raise VLLMError(f"/server_info: vllm_config is not an object: {str(config)[:200]}")
        return config

    async def scheduling_policy(self) -> str | None:
        """The server's scheduling policy (``"fcfs"`` or :data:`PRIORITY_POLICY`) from
        ``/server_info``; None when it does not say."""
        config = await self.server_config()
        scheduler = (config or {}).get("scheduler_config") or {}
        return scheduler.get("policy") if isinstance(scheduler, dict) else None

    async def candidate_set_support(self) -> CandidateSetSupport:
        """Whether the server records sampling masks (``/server_info``) and serves the token
        endpoint (an empty request to it: 403 when ``--enable-scale-out`` is off)."""
        config = await self.server_config()
        probe = await self.transport.request(
            "POST", vllm_tokens.TOKEN_ENDPOINT, json={}, timeout=60.0
        )
        return vllm_tokens.candidate_set_support(config, probe.status_code)

    async def server_flags(self, probe_token_endpoint: bool = False) -> ServerFlags:
        """What the server offers that a run relies on (``/v1/models`` and ``/server_info``;
        with ``probe_token_endpoint``, whether it serves the token endpoint), to compare the
        servers of a run (:func:`~asyncgrpo.core.servers.match.check_servers`)."""
        response = await self.transport.request("GET", "/v1/models")
        self._raise_for_client_error(response, "/v1/models")
        config = await self.server_config()
        token_endpoint = None
        if probe_token_endpoint:
            probe = await self.transport.request(
                "POST", vllm_tokens.TOKEN_ENDPOINT, json={}, timeout=60.0
            )
            support = vllm_tokens.candidate_set_support(config, probe.status_code)
            token_endpoint = support.serves_token_endpoint
        return server_flags(response.json(), config, self.model, token_endpoint)

    async def weight_transfer(self) -> ServerTransfer | None:
        """The server's weight-transfer engine and workers, or ``None`` when it has no
        ``/server_info`` (started without ``VLLM_SERVER_DEV_MODE=1``)."""
        config = await self.server_config()
        return None if config is None else server_transfer(config)
