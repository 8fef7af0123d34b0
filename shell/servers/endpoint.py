"""How the run reaches its vLLM servers: :class:`ServerSettings`, built once from the config, is
the one place that makes clients of them (the trainer's, the weight sync's, the rollout
process's)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from asyncgrpo.adapters.vllm.auth import bearer
from asyncgrpo.adapters.vllm.client import VLLMClient
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.servers.bridge import run_async


def _strings(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(values)


@attrs.frozen
class ServerSettings:
    """The servers' addresses and how long the run waits for them.

    Attributes:
        urls: the servers ``vllm_server_base_url`` names, in order (one for most runs).
        timeout_s: ``vllm_server_timeout``: a call's tries together, the longest silence, and
            how long a server that went away may take to come back (with several servers: how
            long the run goes on with none).
        stall_s: ``vllm_server_stall_timeout``: an unanswered call probes the server after this.
        api_key: ``vllm_server_api_key``, else ``VLLM_API_KEY``: every request carries it
            (docs/security.md).
    """

    urls: tuple[str, ...] = attrs.field(converter=_strings)
    timeout_s: float
    stall_s: float
    api_key: str | None = attrs.field(default=None, repr=False)

    @classmethod
    def of(cls, config: AsyncGRPOConfig) -> ServerSettings:
        return cls(
            config.server_urls,
            config.vllm_server_timeout,
            config.vllm_server_stall_timeout,
            config.server_api_key,
        )

    @property
    def base_url(self) -> str:
        """The first server's URL (the only one of a run with one server)."""
        return self.urls[0]

    @property
    def count(self) -> int:
        return len(self.urls)

    def client(self, model: str, server: int = 0, **options: Any) -> VLLMClient:
        """A new client of server ``server`` for ``model`` (``options``: the client's, e.g. a
        gate or the connection pool's size), sending the API key when there is one."""
        return VLLMClient(
            self.urls[server],
            model,
            timeout_s=self.timeout_s,
            stall_s=self.stall_s,
            headers=bearer(self.api_key),
            **options,
        )

    def max_model_len(self, model: str) -> int:
        """The first server's ``max_model_len`` for ``model`` (every server of a run matches
        it: :func:`~asyncgrpo.shell.servers.check_servers_match`)."""

        async def ask() -> int:
            async with self.client(model) as client:
                return await client.max_model_len()

        return run_async(ask)
