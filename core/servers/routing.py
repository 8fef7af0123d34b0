"""Which vLLM server a group goes to, when a run has several: a pure policy over what each
server reports.

A group (every turn of every one of its ``num_generations`` rollouts) goes to one server: its
rollouts share the prompt, so the prompt's KV is cached where they all run, and all of the
group's tokens come from the one policy version that had landed on that server. The rollout
loop asks :func:`route_group` when the staleness allowance lets a group start, with a
:class:`ServerView` per server:

1. **Eligible** servers (:func:`eligible`): routable (reachable and known to hold the
   trainer's weights: no outage pending, see :mod:`asyncgrpo.core.servers.outage`), under their
   own load cap (:class:`~asyncgrpo.core.rollout.pacing.LoadCap`, adapted per server from its
   ``/metrics``), and holding a policy at most ``max_staleness`` versions behind the trainer
   (a group sampled by an older one could only be dropped as stale).
2. Among them, the **least loaded** relative to its cap (:func:`load_key`): the load is the
   larger of this run's rollouts routed there and not finished, and the requests the server
   said it runs or queues at its last ``/metrics`` (which counts other clients too, but is a
   few seconds old); divided by the server's cap, so a server with twice the KV cache takes
   twice the groups. Ties go to the server that took fewer of the run's groups so far (equally
   idle servers take turns, also when one group runs at a time), then the lower KV-cache use,
   the newer policy version and the lower index.

This is "least outstanding requests" (verl, PipelineRL, SkyRL's sticky least-loaded) with the
load normalised by each server's capacity, and the version and outage state of this trainer.

Example:
    >>> from asyncgrpo.core.rollout.pacing import ServerLoad
    >>> views = [ServerView(routable=True, version=3, reserved=16, cap=32),
    ...          ServerView(routable=True, version=3, reserved=8, cap=32),
    ...          ServerView(routable=False, version=3, reserved=0, cap=32)]
    >>> route_group(views, steps_taken=3, max_staleness=0)
    1
    >>> route_group(views, steps_taken=4, max_staleness=0) is None   # all one version behind
    True
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from asyncgrpo.core.rollout.pacing import ServerLoad


@attrs.frozen
class ServerView:
    """What the rollout side knows of one server when a group is about to start.

    Attributes:
        routable: reachable and known to hold the trainer's weights (no outage pending).
        version: the trainer's policy version that has landed on it.
        reserved: rollouts of this run's groups routed to it and not finished (a group's
            rollouts count from the moment it is routed, waiting for a slot included).
        cap: its load cap in rollouts (at least 1).
        load: its last ``/metrics`` snapshot; ``None`` when it has none.
        routed: the run's groups routed to it so far.
    """

    routable: bool
    version: int
    reserved: int
    cap: int
    load: ServerLoad | None = None
    routed: int = 0

    def __attrs_post_init__(self) -> None:
        if self.reserved < 0 or self.cap < 1:
            raise ValueError(f"ServerView: need reserved >= 0 and cap >= 1, got {self}")


def eligible(view: ServerView, steps_taken: int, max_staleness: int) -> bool:
    """Whether a group may go to this server now: routable, under its cap, and its policy at
    most ``max_staleness`` versions behind the ``steps_taken`` of the trainer.

    Example:
        >>> eligible(ServerView(True, version=2, reserved=0, cap=4), 3, 1)
        True
        >>> eligible(ServerView(True, version=2, reserved=4, cap=4), 3, 1)  # full
        False
    """
    return (
        view.routable and view.reserved < view.cap and steps_taken - view.version <= max_staleness
    )


def load_of(view: ServerView) -> int:
    """Requests the server is busy with: this run's rollouts routed there, or what its last
    ``/metrics`` counted (running and waiting, other clients included), whichever is more."""
    reported = view.load.running + view.load.waiting if view.load is not None else 0
    return max(view.reserved, reported)


def load_key(view: ServerView, index: int) -> tuple[float, float, float, int, int]:
    """The order :func:`route_group` picks in (smallest first): load over cap, the groups it
    took so far over cap, KV-cache use, the newer version, the lower index.

    Example:
        >>> idle = [ServerView(True, version=1, reserved=0, cap=8, routed=r) for r in (3, 2)]
        >>> route_group(idle, steps_taken=1, max_staleness=0)  # the one that took fewer
        1
    """
    usage = view.load.kv_cache_usage if view.load is not None else 0.0
    return (load_of(view) / view.cap, view.routed / view.cap, usage, -view.version, index)


def route_group(views: Sequence[ServerView], steps_taken: int, max_staleness: int) -> int | None:
    """The index of the server the next group goes to, or ``None`` when no server is eligible
    (the group waits: every server is out, full, or behind).

    Args:
        views: one per server, in the run's order of ``vllm_server_base_url``.
        steps_taken: steps the trainer has taken (the one it trains now included).
        max_staleness: the config's ``max_staleness``.
    """
    candidates = [
        load_key(view, index)
        for index, view in enumerate(views)
        if eligible(view, steps_taken, max_staleness)
    ]
    return min(candidates)[-1] if candidates else None


def server_urls(value: str | Sequence[str]) -> tuple[str, ...]:
    """The servers ``vllm_server_base_url`` names: one URL, a list of URLs, or URLs separated
    by commas (in a string or in the list's entries, as a command-line flag gives them);
    surrounding spaces and a trailing ``/`` are dropped.

    Raises:
        ValueError: no URL, an empty entry, or a server named twice; naming the field.

    Example:
        >>> server_urls("http://a:8000")
        ('http://a:8000',)
        >>> server_urls(["http://a:8000/", "http://b:8000, http://c:8000"])
        ('http://a:8000', 'http://b:8000', 'http://c:8000')
    """
    entries = [value] if isinstance(value, str) else list(value)
    urls = tuple(part.strip().rstrip("/") for entry in entries for part in str(entry).split(","))
    if not urls or any(not url for url in urls):
        raise ValueError(
            f"AsyncGRPOConfig.vllm_server_base_url must name at least one server and no empty "
            f"one, got {value!r}"
        )
    twice = sorted({url for url in urls if urls.count(url) > 1})
    if twice:
        raise ValueError(
            f"AsyncGRPOConfig.vllm_server_base_url names {twice[0]} more than once; each server "
            "once (a server's throughput does not grow by routing to it twice)"
        )
    return urls
