"""Everything that knows about the vLLM servers the run uses: their outages and the trust the
trainer and the rollout process share (:mod:`.outages`), the cores they get when they run on
this host (:mod:`.cpu_sharing`), how to reach them (:class:`ServerSettings`, the one maker of
clients), starting them on this host (:mod:`.local`), whether they can stand in for each other
(:mod:`.checks`), which one a group goes to (:mod:`.routing`) and, with several, the watch over
those out of routing (:mod:`.watch`); the version an evaluation pins
(:mod:`.pins`); the one event loop the trainer's calls to them run on (:mod:`.bridge`).
"""

from __future__ import annotations

from asyncgrpo.shell.servers.bridge import (
    each_server_async,
    run_async,
    start_async,
    stop_event_loop,
)
from asyncgrpo.shell.servers.checks import check_servers_match
from asyncgrpo.shell.servers.cpu_sharing import (
    cpus_shared_with_server,
    release_process,
    server_cpus_for,
    server_on_host,
    servers_cpus_for,
)
from asyncgrpo.shell.servers.endpoint import ServerSettings
from asyncgrpo.shell.servers.local import (
    AS_TRAINER,
    dtype_as_trainer,
    local_server_spec,
    local_servers,
    servers_gpus_for,
)
from asyncgrpo.shell.servers.outages import (
    RolloutGate,
    ServerGone,
    ServerOut,
    SharedServers,
    SharedTrust,
    wait_for_server,
    wait_for_servers_out,
)
from asyncgrpo.shell.servers.pins import EvalRequest, VersionPin
from asyncgrpo.shell.servers.routing import PooledServer, ServerPool
from asyncgrpo.shell.servers.watch import ServerWatch

__all__ = [
    "AS_TRAINER",
    "EvalRequest",
    "PooledServer",
    "RolloutGate",
    "ServerGone",
    "ServerOut",
    "ServerPool",
    "ServerSettings",
    "ServerWatch",
    "SharedServers",
    "SharedTrust",
    "VersionPin",
    "check_servers_match",
    "cpus_shared_with_server",
    "dtype_as_trainer",
    "each_server_async",
    "local_server_spec",
    "local_servers",
    "release_process",
    "run_async",
    "server_cpus_for",
    "server_on_host",
    "servers_cpus_for",
    "servers_gpus_for",
    "start_async",
    "stop_event_loop",
    "wait_for_server",
    "wait_for_servers_out",
]
