"""Everything that knows about the vLLM server the run uses: its outages and the trust the
trainer and the rollout process share (:mod:`.outages`), and the cores it gets when it runs on
this host (:mod:`.cpu_sharing`), and how to reach it (:class:`ServerSettings`, the one maker
of clients).
"""

from __future__ import annotations

from asyncgrpo.shell.servers.cpu_sharing import (
    cpus_shared_with_server,
    release_process,
    server_cpus_for,
)
from asyncgrpo.shell.servers.endpoint import ServerSettings
from asyncgrpo.shell.servers.outages import RolloutGate, ServerGone, SharedTrust, wait_for_server

__all__ = [
    "RolloutGate",
    "ServerGone",
    "ServerSettings",
    "SharedTrust",
    "cpus_shared_with_server",
    "release_process",
    "server_cpus_for",
    "wait_for_server",
]
