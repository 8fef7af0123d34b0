"""The parts of a training step's wall time, as the trainer logs them (``perf/*``, seconds).

A step runs from the end of the previous step's weight sync to the end of its own; its parts,
in order: waiting for samples, planning, packing, sending rows to the processes, forward,
backward, optimizer, weight sync, and the previous step's logging and checkpoint. They add up
to ``perf/step_s`` but for bookkeeping of a few milliseconds, reported as
``perf/unaccounted_s``.
"""

from __future__ import annotations

from collections.abc import Mapping

STEP_PARTS = (
    "perf/rollout_wait_s",
    "perf/plan_s",
    "perf/pack_s",
    "perf/send_s",
    "perf/fwd_s",
    "perf/bwd_s",
    "perf/optimizer_s",
    "perf/weight_sync_s",
    "perf/logging_s",
    "perf/checkpoint_s",
)


def unaccounted_s(summary: Mapping[str, float]) -> float | None:
    """``perf/step_s`` minus its parts (the means of one logging window), or None without a
    step time.

    Example:
        >>> unaccounted_s({"perf/step_s": 1.0, "perf/fwd_s": 0.25, "perf/bwd_s": 0.5})
        0.25
    """
    step = summary.get("perf/step_s")
    if step is None:
        return None
    return step - sum(summary.get(name) or 0.0 for name in STEP_PARTS)
