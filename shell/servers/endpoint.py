"""How the run reaches its vLLM server: :class:`ServerSettings`, built once from the config, is
the one place that makes clients of the server (the trainer's, the weight sync's, the rollout
process's)."""

from __future__ import annotations

from typing import Any

import attrs

from asyncgrpo.adapters.vllm_auth import bearer
from asyncgrpo.adapters.vllm_client import VLLMClient
from asyncgrpo.shell.config import AsyncGRPOConfig


@attrs.frozen
class ServerSettings:
    """The server's address and how long the run waits for it.

    Attributes:
        base_url: ``vllm_server_base_url``.
        timeout_s: ``vllm_server_timeout``: a call's tries together, the longest silence, and
            how long a server that went away may take to come back.
        stall_s: ``vllm_server_stall_timeout``: an unanswered call probes the server after this.
        api_key: ``vllm_server_api_key``, else ``VLLM_API_KEY``: every request carries it
            (docs/security.md).
    """

    base_url: str
    timeout_s: float
    stall_s: float
    api_key: str | None = attrs.field(default=None, repr=False)

    @classmethod
    def of(cls, config: AsyncGRPOConfig) -> ServerSettings:
        return cls(config.vllm_server_base_url, config.vllm_server_timeout,
                   config.vllm_server_stall_timeout, config.server_api_key)  # fmt: skip

    def client(self, model: str, **options: Any) -> VLLMClient:
        """A new client of the server for ``model`` (``options``: the client's, e.g. a gate or
        the connection pool's size), sending the API key when there is one."""
        return VLLMClient(self.base_url, model, timeout_s=self.timeout_s, stall_s=self.stall_s,
                          headers=bearer(self.api_key), **options)  # fmt: skip
