"""Which CPU cores the vLLM server and the trainer's processes get when they share a machine.

A vLLM CPU worker keeps its cores busy while it generates; a learner whose torch runs one
intra-op thread per core beside it waits on descheduled threads at every small op (measured on
2 cores: the demo's step took 2x longer). So when the server runs on the trainer's host, the
cores are split on purpose: the server's worker binds its OpenMP threads to the first cores
(vLLM's ``VLLM_CPU_OMP_THREADS_BIND``), each local trainer rank is pinned to its own slice of
the rest and runs one torch thread per core of its slice. The rollout process (mostly waiting
on HTTP) is left free to run on any core.

The decision is :func:`plan_cpus`, a pure function of the visible cores, the number of local
trainer ranks and the settings; the server side (``asyncgrpo demo``/``train`` starting the
server) and the trainer side compute it from the same inputs, so they agree without talking.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

AUTO = "auto"
OFF = "off"
CPU_SHARING_MODES = (AUTO, OFF)
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0", "[::1]"})


@attrs.frozen
class CpuPlan:
    """Who runs where.

    Attributes:
        server_cpus: cores of the vLLM server (its worker's OpenMP threads and its processes);
            empty when no server shares this machine or nothing is decided for it.
        rank_cpus: per local trainer rank, the cores it is pinned to; empty when the trainer's
            affinity is left alone.
        rank_threads: per local trainer rank, torch intra-op threads (0: leave torch's default).
        disjoint: whether no two of the server and the ranks share a core.
        reason: one sentence for the run's log.
    """

    server_cpus: tuple[int, ...]
    rank_cpus: tuple[tuple[int, ...], ...]
    rank_threads: tuple[int, ...]
    disjoint: bool
    reason: str

    def vllm_bind(self) -> str | None:
        """``VLLM_CPU_OMP_THREADS_BIND`` for the server's single worker (``"0"``, ``"0-3"``),
        or None to leave vLLM's own binding."""
        return format_cpu_list(self.server_cpus) if self.server_cpus else None


def check_cpu_sharing(mode: str, server_cpus: int | None) -> None:
    """Raise a ``ValueError`` naming the config field when a setting is out of range."""
    if mode not in CPU_SHARING_MODES:
        raise ValueError(
            f"AsyncGRPOConfig.cpu_sharing must be one of {', '.join(CPU_SHARING_MODES)}; "
            f"got {mode!r}"
        )
    if server_cpus is not None and server_cpus < 1:
        raise ValueError(
            f"AsyncGRPOConfig.server_cpus must be >= 1 or None (half the cores), got {server_cpus}"
        )


def plan_cpus(
    available: Sequence[int],
    local_ranks: int,
    server_on_host: bool,
    mode: str = AUTO,
    server_cpus: int | None = None,
) -> CpuPlan:
    """Split ``available`` cores between a server on this host and the local trainer ranks.

    Args:
        available: the cores this process may run on (``os.sched_getaffinity(0)``).
        local_ranks: trainer processes on this machine (torchrun's ``LOCAL_WORLD_SIZE``).
        server_on_host: whether the vLLM server runs on this machine.
        mode: ``"auto"`` splits the cores; ``"off"`` leaves threads and affinity alone.
        server_cpus: cores for the server; None gives it half (rounded down, at least one).
            The trainer ranks always keep at least one core each.

    Returns:
        A plan in which, whenever a split is possible (``len(available) > local_ranks`` with a
        server, always without one), the server and every rank have disjoint non-empty core
        sets covering ``available``, and each rank runs as many torch threads as it has cores.

    Example:
        >>> plan = plan_cpus([0, 1], local_ranks=1, server_on_host=True)
        >>> plan.server_cpus, plan.rank_cpus, plan.rank_threads
        ((0,), ((1,),), (1,))
        >>> plan.vllm_bind()
        '0'
    """
    check_cpu_sharing(mode, server_cpus)
    if local_ranks < 1:
        raise ValueError(f"local_ranks must be >= 1, got {local_ranks}")
    cores = tuple(sorted(set(available)))
    if not cores:
        raise ValueError("no available CPU cores")
    if mode == OFF:
        return CpuPlan((), (), (0,) * local_ranks, False, "cpu_sharing='off': torch defaults")
    if not server_on_host:
        return CpuPlan(
            (),
            _slices(cores, local_ranks),
            _threads(cores, local_ranks),
            len(cores) >= local_ranks,
            f"no server on this host: {len(cores)} cores for {local_ranks} rank(s)",
        )
    if len(cores) <= local_ranks:
        return CpuPlan(
            (),
            (),
            (1,) * local_ranks,
            False,
            f"{len(cores)} core(s) cannot give the server and {local_ranks} rank(s) "
            "a core each: one torch thread per rank, affinity left alone",
        )
    wanted = server_cpus if server_cpus is not None else max(1, len(cores) // 2)
    count = min(wanted, len(cores) - local_ranks)
    server, rest = cores[:count], cores[count:]
    return CpuPlan(
        server,
        _slices(rest, local_ranks),
        _threads(rest, local_ranks),
        True,
        f"server on {format_cpu_list(server)}, trainer ranks on "
        f"{format_cpu_list(rest)} ({len(cores)} cores)",
    )


def _slices(cores: tuple[int, ...], ranks: int) -> tuple[tuple[int, ...], ...]:
    """Contiguous, near-equal slices, one per rank; ranks beyond the cores share round-robin."""
    if len(cores) < ranks:
        return tuple((cores[r % len(cores)],) for r in range(ranks))
    bounds = [round(r * len(cores) / ranks) for r in range(ranks + 1)]
    return tuple(cores[bounds[r] : bounds[r + 1]] for r in range(ranks))


def _threads(cores: tuple[int, ...], ranks: int) -> tuple[int, ...]:
    return tuple(len(s) for s in _slices(cores, ranks)) if len(cores) >= ranks else (1,) * ranks


def format_cpu_list(cpus: Sequence[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"`` (the form vLLM and taskset read).

    Example:
        >>> format_cpu_list([5, 0, 1, 2])
        '0-2,5'
    """
    ordered = sorted(set(cpus))
    parts: list[str] = []
    start = prev = None
    for cpu in [*ordered, None]:
        if cpu is not None and prev is not None and cpu == prev + 1:
            prev = cpu
            continue
        if start is not None:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = cpu
    return ",".join(parts)


def is_local_host(host: str, own_names: Sequence[str] = ()) -> bool:
    """Whether a server URL's host is this machine (loopback or one of ``own_names``).

    Example:
        >>> is_local_host("127.0.0.1"), is_local_host("gpu-node-3", ["trainer-1"])
        (True, False)
    """
    return host.lower() in LOOPBACK_HOSTS or host in own_names


def split_server_cpus(server_cpus: Sequence[int], servers: int) -> tuple[tuple[int, ...], ...]:
    """The plan's server cores shared by ``servers`` local servers: contiguous, near-equal
    slices, one per server; with fewer cores than servers, servers share cores round-robin
    (they then compete for them: no more throughput than one server). No cores (nothing
    decided for the server) leaves every server vLLM's own binding.

    Example:
        >>> split_server_cpus((0, 1, 2, 3), 2)
        ((0, 1), (2, 3))
        >>> split_server_cpus((0,), 2)
        ((0,), (0,))
    """
    if servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers}")
    cores = tuple(sorted(set(server_cpus)))
    if not cores:
        return ((),) * servers
    return _slices(cores, servers)
