"""At the start of a run with several servers: can every server stand in for the first?

Each server is asked what it offers (``/v1/models``, ``/server_info``, with top-k/top-p the
token endpoint) and :func:`~asyncgrpo.core.servers.match.check_servers` names the first server
and flag that differ; the run fails there, before any weight is pushed.
"""

from __future__ import annotations

from asyncgrpo.core.servers.match import ServerFlags, check_servers
from asyncgrpo.shell.servers.bridge import each_server_async
from asyncgrpo.shell.servers.endpoint import ServerSettings


def check_servers_match(settings: ServerSettings, model: str, candidate_sets: bool) -> None:
    """Raise :class:`~asyncgrpo.core.servers.match.ServerMismatch` naming the server and the
    flag when a server of the run does not serve ``model`` as the first one does
    (``candidate_sets``: the run samples under top-k/top-p, so the token endpoint counts)."""
    if settings.count < 2:
        return

    async def read(index: int) -> ServerFlags:
        async with settings.client(model, index) as client:
            return await client.server_flags(probe_token_endpoint=candidate_sets)

    flags = each_server_async(range(settings.count), read)
    failed = [error for error in flags.values() if isinstance(error, Exception)]
    if failed:
        raise failed[0]
    check_servers(settings.urls, [f for f in flags.values() if isinstance(f, ServerFlags)], model)
