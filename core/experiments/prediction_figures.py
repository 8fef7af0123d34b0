"""The figures a simulator's prediction is scored on, read from a run's (or a simulation's)
``metrics.jsonl`` windows, and the errors of predicted against measured ones
(:mod:`asyncgrpo.core.experiments.calibration` fits the simulator; this module scores it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from asyncgrpo.core.experiments.curves import evaluation_only
from asyncgrpo.core.experiments.windows import (
    SAMPLES,
    STALE_DROPS,
    STALENESS,
    STEP,
    WAIT,
    metric_number,
)


@attrs.frozen
class PipelineFigures:
    """What a prediction is scored on, over a run's windows (weighted by their steps).

    Attributes:
        step_s: mean ``perf/step_s``.
        staleness: mean ``sample/staleness_mean`` (None if not logged).
        trainer_idle_frac: summed ``perf/rollout_wait_s`` over summed ``perf/step_s``.
        generator_idle_frac: the share of the run the generator ran no request (None when not
            measured: the trainer does not log it; a poller of the server's /metrics or the
            simulator gives it).
        seconds_per_sample: summed ``perf/step_s`` over the samples trained
            (``batch/samples_per_step``): the time to ``N`` samples is ``N`` times it (None
            when no window logs samples).
        stale_drop_frac: the samples dropped as stale (``sample/dropped_stale_count``) over
            those generated, trained or dropped: the generation the pacing wasted (None when
            no window logs samples).
    """

    step_s: float
    staleness: float | None
    trainer_idle_frac: float
    generator_idle_frac: float | None = None
    seconds_per_sample: float | None = None
    stale_drop_frac: float | None = None


def pipeline_figures(
    rows: Sequence[Mapping[str, Any]],
    generator_idle_frac: float | None = None,
    skip_windows: int = 1,
) -> PipelineFigures:
    """The figures of a run's (or a simulation's) windows after the first ``skip_windows``.

    Example:
        >>> rows = [{"step": 2, "perf/step_s": 1.0, "perf/rollout_wait_s": 0.5},
        ...         {"step": 4, "perf/step_s": 2.0, "perf/rollout_wait_s": 0.5,
        ...          "sample/staleness_mean": 1.0}]
        >>> pipeline_figures(rows, skip_windows=0)
        PipelineFigures(step_s=1.5, staleness=1.0, trainer_idle_frac=0.3333333333333333, \
generator_idle_frac=None, seconds_per_sample=None, stale_drop_frac=None)
        >>> rows = [{"step": 2, "perf/step_s": 1.0, "batch/samples_per_step": 8.0,
        ...          "sample/dropped_stale_count": 4.0}]  # 16 trained, 4 dropped
        >>> pipeline_figures(rows, skip_windows=0).stale_drop_frac
        0.2
    """
    step_total = wait_total = steps_total = samples_total = 0.0
    stale_total = stale_steps = dropped_total = 0.0
    previous = 0
    for index, row in enumerate(r for r in rows if not evaluation_only(r)):
        step = int(row["step"])
        steps, previous = step - previous, step
        step_s = metric_number(row, STEP)
        if index < skip_windows or step_s is None or steps < 1:
            continue
        step_total += step_s * steps
        wait_total += (metric_number(row, WAIT) or 0.0) * steps
        samples_total += (metric_number(row, SAMPLES) or 0.0) * steps
        dropped_total += metric_number(row, STALE_DROPS) or 0.0  # a window's total
        steps_total += steps
        staleness = metric_number(row, STALENESS)
        if staleness is not None:
            stale_total += staleness * steps
            stale_steps += steps
    if steps_total == 0:
        raise ValueError(f"no window with {STEP} to score")
    return PipelineFigures(
        step_s=step_total / steps_total,
        staleness=stale_total / stale_steps if stale_steps else None,
        trainer_idle_frac=wait_total / step_total if step_total > 0 else 0.0,
        generator_idle_frac=generator_idle_frac,
        seconds_per_sample=step_total / samples_total if samples_total > 0 else None,
        stale_drop_frac=dropped_total / (samples_total + dropped_total)
        if samples_total > 0
        else None,
    )


def samples_per_s(rows: Sequence[Mapping[str, Any]], skip_windows: int = 1) -> float:
    """Trained samples per second over a run's windows after the first ``skip_windows``: the
    steps' ``batch/samples_per_step`` summed over their ``perf/step_s`` (each window's means
    weighted by the steps it covers).

    Example:
        >>> rows = [{"step": 2, "perf/step_s": 1.0, "batch/samples_per_step": 8.0},
        ...         {"step": 4, "perf/step_s": 2.0, "batch/samples_per_step": 16.0}]
        >>> samples_per_s(rows, skip_windows=0)
        8.0
    """
    samples = seconds = 0.0
    previous = 0
    for index, row in enumerate(r for r in rows if not evaluation_only(r)):
        step = int(row["step"])
        steps, previous = step - previous, step
        step_s = metric_number(row, STEP)
        if index < skip_windows or step_s is None or steps < 1:
            continue
        samples += (metric_number(row, SAMPLES) or 0.0) * steps
        seconds += step_s * steps
    if seconds == 0:
        raise ValueError(f"no window with {STEP} to score")
    return samples / seconds


@attrs.frozen
class FigureError:
    """One figure, predicted against measured.

    Attributes:
        name: ``step_s``, ``staleness``, ``trainer_idle_frac``, ``generator_idle_frac`` or
            ``seconds_per_sample``.
        predicted, measured: the values.
        absolute: ``predicted - measured``.
        relative: ``(predicted - measured) / measured``; None when measured is 0 (a relative
            error of an idle share of 0, or of staleness 0, means nothing: read ``absolute``).
    """

    name: str
    predicted: float
    measured: float
    absolute: float
    relative: float | None


def compare_figures(
    predicted: PipelineFigures, measured: PipelineFigures
) -> tuple[FigureError, ...]:
    """Predicted against measured, for each figure both sides have.

    Example:
        >>> predicted, measured = PipelineFigures(1.1, 0.5, 0.2), PipelineFigures(1.0, 0.0, 0.25)
        >>> errors = compare_figures(predicted, measured)
        >>> [(e.name, round(e.absolute, 3), e.relative and round(e.relative, 3)) for e in errors]
        [('step_s', 0.1, 0.1), ('staleness', 0.5, None), ('trainer_idle_frac', -0.05, -0.2)]
    """
    out = []
    for field in attrs.fields(PipelineFigures):
        p, m = getattr(predicted, field.name), getattr(measured, field.name)
        if p is None or m is None:
            continue
        relative = (p - m) / m if m != 0 else None
        out.append(FigureError(field.name, p, m, p - m, relative))
    return tuple(out)
