"""The vLLM server's control endpoints, which only a weight update (and an evaluation of a
LoRA checkpoint) calls: pause and resume the scheduler, drop the prefix cache, call a method on
every worker, load and unload LoRA adapters. They need the server started with
``VLLM_SERVER_DEV_MODE=1`` (and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` for adapters).

:class:`ServerAdmin` is reached as :attr:`VLLMClient.admin
<asyncgrpo.adapters.vllm.client.VLLMClient>` and sends through the client's
:class:`~asyncgrpo.adapters.vllm.transport.ServerTransport` (its retries and silence watch).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx

from asyncgrpo.adapters.vllm.replies import VLLMError
from asyncgrpo.adapters.vllm.transport import ServerTransport


class ServerAdmin:
    """The control endpoints of one server.

    Args:
        transport: the client's transport.
        check: raises for an HTTP error reply, naming the endpoint (the client's check).
    """

    def __init__(
        self, transport: ServerTransport, check: Callable[[httpx.Response, str], None]
    ) -> None:
        self.transport = transport
        self._check = check

    async def post(self, path: str, **kwargs: Any) -> Any:
        """POST to ``path``; the reply's JSON, its text, or None when empty."""
        response = await self.transport.request("POST", path, **kwargs)
        self._check(response, path)
        if not response.content:
            return None
        if "json" in response.headers.get("content-type", ""):
            return response.json()
        return response.text

    async def pause(self, keep_kv_cache: bool = False) -> None:
        """Pause the scheduler for a weight update.

        In-flight requests are frozen (``mode=keep``), not aborted: they continue after
        :meth:`resume`, and each token's sampler log-prob is that of the policy that sampled it.
        vLLM drops the KV cache as it pauses, preempting the running requests, unless
        ``keep_kv_cache`` (``clear_cache=false``; its API documents the flag as ignored under
        ``mode=keep``, but the engine applies it).
        """
        params: dict[str, str] = {"mode": "keep"}
        if keep_kv_cache:
            params["clear_cache"] = "false"
        await self.post("/pause", params=params)

    async def resume(self) -> None:
        await self.post("/resume")

    async def reset_prefix_cache(self) -> None:
        """Drop all cached KV, preempting running requests so that their KV is recomputed
        under the current weights when they continue; raises if the server could not."""
        reply = await self.post("/reset_prefix_cache", params={"reset_running_requests": True})
        if isinstance(reply, dict) and reply.get("success") is False:
            raise VLLMError(
                "/reset_prefix_cache: the server kept its prefix cache (blocks still held); "
                "KV computed by the old weights would be reused"
            )

    async def collective_rpc(
        self, method: str, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
    ) -> list[Any]:
        """Call ``method`` on every worker; returns each worker's result."""
        payload = {"method": method, "args": list(args), "kwargs": dict(kwargs or {})}
        result = await self.post("/collective_rpc", json=payload)
        return list((result or {}).get("results", []))

    async def load_lora_adapter(self, name: str, path: str, in_place: bool = False) -> None:
        """Register a LoRA adapter; ``in_place`` replaces one loaded under ``name`` (else the
        server refuses the name)."""
        body = {"lora_name": name, "lora_path": path, "load_inplace": in_place}
        await self.post("/v1/load_lora_adapter", json=body)

    async def unload_lora_adapter(self, name: str) -> None:
        await self.post("/v1/unload_lora_adapter", json={"lora_name": name})
