"""The windows of a run's ``metrics.jsonl`` as the simulator's calibration and its scoring
read them: the metric names, a finite number from a row, and one :class:`Window` per logged
window (its means per step: step, wait, push and checkpoint time, forwarded, trained and
generated tokens)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

STEP = "perf/step_s"
WAIT = "perf/rollout_wait_s"
SYNC = "perf/weight_sync_s"
PUSH = "perf/weight_push_s"
CHECKPOINT = "perf/checkpoint_s"
FORWARDED = "batch/forwarded_tokens_per_step"
SAMPLES = "batch/samples_per_step"
TRAINED = "batch/trained_tokens_per_step"
ZERO_STD = "frac_reward_zero_std"
STALE_DROPS = "sample/dropped_stale_count"
SAMPLE_TOKENS = "sample/trained_tokens_mean"
STALENESS = "sample/staleness_mean"

MAX_ZERO_STD = 0.9
"""Windows where more groups than this had no reward spread say too little about how many
tokens were generated (a division by nearly zero) and are left out of the generation fit."""


def metric_number(row: Mapping[str, Any], key: str) -> float | None:
    """``row[key]`` as a finite float; None when missing, a string or not finite."""
    value = row.get(key)
    if value is None or isinstance(value, str):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


@attrs.frozen
class Window:
    """One logged window's means per step, as calibration reads them.

    Attributes:
        steps: optimizer steps the window covers (its weight).
        step_s, wait_s, sync_s, checkpoint_s: ``perf/*`` seconds per step.
        forwarded_tokens, samples, trained_tokens: per step.
        zero_std_frac: groups dropped for no reward spread (0 if not logged).
        stale_tokens: tokens of samples dropped as stale, per step (0 if not logged).
        push_s: ``perf/weight_push_s``: a push beside the step (``weight_push_overlap``), from
            its snapshot to its landing on the server, which stands still meanwhile; a mean
            per push, not per step (0 if not logged: the push is inside ``sync_s``).
    """

    steps: int
    step_s: float
    wait_s: float
    sync_s: float
    checkpoint_s: float
    forwarded_tokens: float
    samples: float | None
    trained_tokens: float | None
    zero_std_frac: float
    stale_tokens: float
    push_s: float = 0.0

    @property
    def train_s(self) -> float:
        """Seconds per step spent neither waiting, pushing weights nor checkpointing."""
        return self.step_s - self.wait_s - self.sync_s - self.checkpoint_s

    def server_paused_s(self, weight_sync_steps: int = 1) -> float:
        """Seconds per step the server stood still for a push: the push inside the step
        (``sync_s``) or beside it (``push_s``, logged per push: one every
        ``weight_sync_steps`` steps), whichever is longer."""
        return max(self.sync_s, self.push_s / weight_sync_steps)

    @property
    def generated_tokens(self) -> float | None:
        """Completion tokens generated per step (trained, dropped for no spread, or stale)."""
        if self.trained_tokens is None or self.zero_std_frac > MAX_ZERO_STD:
            return None
        return self.trained_tokens / (1.0 - self.zero_std_frac) + self.stale_tokens


def windows_from_rows(rows: Sequence[Mapping[str, Any]], skip_windows: int = 1) -> list[Window]:
    """The windows of ``metrics.jsonl`` rows that calibration can use, after the first
    ``skip_windows`` (the first steps carry one-off costs: allocation, first compilation).

    A window needs ``step``, ``perf/step_s`` and ``batch/forwarded_tokens_per_step``; a
    missing wait, push or checkpoint time counts as 0.

    Example:
        >>> w, = windows_from_rows([{"step": 5, "perf/step_s": 1.0, "perf/rollout_wait_s": 0.5,
        ...                          "batch/forwarded_tokens_per_step": 900}], skip_windows=0)
        >>> w.steps, w.train_s, w.generated_tokens
        (5, 0.5, None)
    """
    out, previous = [], 0
    for index, row in enumerate(rows):
        step = int(row["step"])
        steps, previous = step - previous, step
        if index < skip_windows:
            continue
        step_s, forwarded = metric_number(row, STEP), metric_number(row, FORWARDED)
        if step_s is None or forwarded is None or steps < 1:
            continue
        drops, sample_tokens = metric_number(row, STALE_DROPS), metric_number(row, SAMPLE_TOKENS)
        stale = (drops or 0.0) * (sample_tokens or 0.0) / steps
        out.append(
            Window(
                steps=steps,
                step_s=step_s,
                wait_s=metric_number(row, WAIT) or 0.0,
                sync_s=metric_number(row, SYNC) or 0.0,
                checkpoint_s=metric_number(row, CHECKPOINT) or 0.0,
                forwarded_tokens=forwarded,
                samples=metric_number(row, SAMPLES),
                trained_tokens=metric_number(row, TRAINED),
                zero_std_frac=metric_number(row, ZERO_STD) or 0.0,
                stale_tokens=stale,
                push_s=metric_number(row, PUSH) or 0.0,
            )
        )
    return out
