"""The parts of a training step's wall time, as the trainer logs them (``perf/*``, seconds).

A step runs from the end of the previous step's weight sync to the end of its own; its parts,
in order: waiting for samples, planning, packing, sending rows to the processes, forward,
backward, optimizer, weight sync, pushing the weights again after the server went away (and
the wait that ended in it), and the previous step's logging and checkpoint. They add up
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
    "perf/resync_s",
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


def window_rates(summary: Mapping[str, float]) -> dict[str, float]:
    """What the trainer derives from a logging window's means: the wall-clock token rates
    (``perf/wall_clock_{trained,forwarded}_tokens_per_s``), ``perf/unaccounted_s`` and the
    forward+backward rate (``perf/fwd_bwd_forwarded_tokens_per_s``), tokens per second; each
    only when the window holds what it is computed from.

    Example:
        >>> rates = window_rates({"perf/step_s": 2.0, "perf/fwd_s": 0.5, "perf/fwd_bwd_s": 1.5,
        ...                       "batch/trained_tokens_per_step": 100.0,
        ...                       "batch/forwarded_tokens_per_step": 300.0})
        >>> rates  # doctest: +NORMALIZE_WHITESPACE
        {'perf/wall_clock_trained_tokens_per_s': 50.0,
         'perf/wall_clock_forwarded_tokens_per_s': 150.0, 'perf/unaccounted_s': 1.5,
         'perf/fwd_bwd_forwarded_tokens_per_s': 200.0}
    """
    rates: dict[str, float] = {}
    step_s = summary.get("perf/step_s")
    trained = summary.get("batch/trained_tokens_per_step")
    forwarded = summary.get("batch/forwarded_tokens_per_step")
    if step_s and trained is not None and forwarded is not None:
        rates["perf/wall_clock_trained_tokens_per_s"] = trained / step_s
        rates["perf/wall_clock_forwarded_tokens_per_s"] = forwarded / step_s
    unaccounted = unaccounted_s(summary)
    if unaccounted is not None:
        rates["perf/unaccounted_s"] = unaccounted
    fwd_bwd = summary.get("perf/fwd_bwd_s")
    if fwd_bwd and forwarded is not None:
        rates["perf/fwd_bwd_forwarded_tokens_per_s"] = forwarded / fwd_bwd
    return rates
