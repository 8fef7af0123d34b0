"""What the rollout side is doing: the calls in flight, longest first, in one line.

A reward function, tool or environment method that never returns does not stop the rollout
process's heartbeat (it runs in a worker thread), so the trainer would wait forever. The rollout
loop records each call it makes as an :class:`Activity`; the trainer shows
:func:`describe_activities` when it has waited too long for samples.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs


@attrs.frozen
class Activity:
    """One call in flight.

    Attributes:
        what: e.g. ``"reward function 'my_reward'"``, ``"tool 'search'"``, ``"generation"``.
        group_id: the group it works for (-1: none).
        row_index: the dataset row of that group (-1: none).
        started_s: when it started, in the loop's monotonic seconds.
    """

    what: str
    group_id: int = -1
    row_index: int = -1
    started_s: float = 0.0


def describe_activities(activities: Iterable[Activity], now_s: float, limit: int = 5) -> str:
    """The ``limit`` longest-running calls at ``now_s``, longest first, and how many more.

    Example:
        >>> calls = [Activity("generation", 4, 3, 95.0),
        ...          Activity("reward function 'slow'", 2, 7, 40.0)]
        >>> describe_activities(calls, now_s=100.0)
        "reward function 'slow' for 60 s on group 2 (row 7); generation for 5 s on group 4 (row 3)"
        >>> describe_activities([], now_s=1.0)
        'no call in flight'
    """
    ordered = sorted(activities, key=lambda a: a.started_s)
    if not ordered:
        return "no call in flight"
    parts = []
    for activity in ordered[:limit]:
        where = "" if activity.group_id < 0 else f" on group {activity.group_id}"
        row = "" if activity.row_index < 0 else f" (row {activity.row_index})"
        parts.append(f"{activity.what} for {now_s - activity.started_s:.0f} s{where}{row}")
    more = f"; and {len(ordered) - limit} more" if len(ordered) > limit else ""
    return "; ".join(parts) + more
