"""Calibrate the pipeline simulator from a real run's metrics, and score its predictions.

The simulator (``asyncgrpo simulate``) models a step as waiting for samples, then training
on the step's forwarded tokens at a fixed throughput, with a generator that produces
completion tokens at a fixed throughput shared by the groups in flight. :func:`calibrate`
fits those throughputs from the windows of a run's ``metrics.jsonl`` (one dict per logged
window, each value the mean over the window's steps, as the trainer logs them; read by
:mod:`asyncgrpo.core.experiments.windows`):

* **training**: a step's training time ``T = perf/step_s - perf/rollout_wait_s -
  perf/weight_sync_s - perf/checkpoint_s`` (everything but waiting, the push and checkpoints:
  planning, packing, forward, backward, optimizer, logging) is fitted as
  ``T = fixed_s + forwarded / tokens_per_s [+ per_sample_s x samples]`` over the windows,
  ``forwarded`` being ``batch/forwarded_tokens_per_step`` and ``samples``
  ``batch/samples_per_step``, by least squares on *relative* residuals (weighted by the steps
  a window covers), since timings vary in proportion to their size and the goal is a
  relative error of step time. A term stays only when the data supports it: its coefficient
  is positive and at least three standard errors (:data:`SUPPORT`); otherwise it is dropped
  (0) and the rest refitted. A run whose steps all forward about the same number of tokens
  cannot tell a fixed cost from a per-token cost, so it gets no fixed cost.
* **weight push**: seconds per sync the server stands still, ``perf/weight_sync_s`` (0 on
  steps without a sync), or ``perf/weight_push_s`` where the push runs beside the step
  (``weight_push_overlap``) and is longer, summed over the steps and divided by the syncs
  (``steps / weight_sync_steps``).
* **generation**: completion tokens per second while the generator is busy. Tokens generated
  per step are ``batch/trained_tokens_per_step / (1 - frac_reward_zero_std)`` (groups without
  reward spread are generated, then dropped) plus the stale drops'
  (``sample/dropped_stale_count x sample/trained_tokens_mean``). The generator's busy time per
  step is, at ``max_staleness`` 0 (no overlap: generation runs only while the trainer waits),
  ``perf/rollout_wait_s`` less the part of a push beside the step that the wait covered (the
  next samples wait for it to land); with overlap it is known only in windows where the
  trainer waited (``rollout_wait_s >= min_wait_frac x step_s``: the generator is the
  bottleneck, so it was busy all the step but the push). A run whose trainer never
  waits, or waits in fewer than half its windows, does not identify the generator's
  throughput (only that it is fast enough): then the fit is None, with the reason.

Each fitted value comes with its relative residual spread (the RMS of the windows' relative
deviations from the fit, weighted by their steps), so a poor fit is visible.

Limits of the model, which the held-out comparison measures rather than assumes: a real
server's throughput grows with the requests in flight (the tiny Qwen3 on 2 cores: about
4,500-5,000 tokens/s at 64-256 concurrent requests), so a throughput fitted at one
concurrency carries to settings that run at about the same concurrency; a push against a
busy server takes longer than against an idle one (2.5x measured), so the push fitted at
``max_staleness`` 0 (idle server during the push) may be short for overlapped settings.
:meth:`Calibration.simulator_settings` gives either the values for the simulator, which models
the fixed and per-sample costs and the push (every ``weight_sync_steps``, beside the step or
waited for), or one throughput that folds them in.

:mod:`asyncgrpo.core.experiments.prediction_figures` scores a prediction: the figures read from a
run's (or a simulation's) windows, predicted against measured.

Example:
    >>> rows = [{"step": s, "perf/step_s": 0.1 + 0.2 + t / 5000 + 0.05,
    ...          "perf/rollout_wait_s": 0.2, "perf/weight_sync_s": 0.05,
    ...          "batch/forwarded_tokens_per_step": t, "batch/trained_tokens_per_step": 400.0,
    ...          "frac_reward_zero_std": 0.2}
    ...         for s, t in enumerate([1000.0, 3000.0, 2000.0, 4000.0, 1500.0], start=1)]
    >>> fit = calibrate(rows, max_staleness=0, skip_windows=0)
    >>> round(fit.training_tokens_per_s), round(fit.training_fixed_s, 3)
    (5000, 0.1)
    >>> round(fit.generation_tokens_per_s), round(fit.weight_sync_s, 3)
    (2500, 0.05)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from asyncgrpo.core.experiments.windows import (
    FORWARDED,
    SAMPLES,
    STEP,
    SYNC,
    TRAINED,
    WAIT,
    Window,
    windows_from_rows,
)

SUPPORT = 3.0
"""A fixed or per-sample training cost is kept when it is at least this many standard errors
above 0 (at 2 a term that is truly 0 survives about one fit in twenty)."""


@attrs.frozen
class TrainingFit:
    """``train_s = fixed_s + forwarded / tokens_per_s + per_sample_s x samples``.

    Attributes:
        tokens_per_s: forwarded tokens per second (the per-token cost's inverse).
        fixed_s: seconds per step whatever its size (0 when the data did not support one).
        per_sample_s: seconds per sample (0 when the data did not support one).
        effective_tokens_per_s: total forwarded tokens over total seconds of everything but
            the wait (training and the push): the one throughput a simulator whose step is
            ``wait + forwarded / throughput`` needs to reproduce the measured step time.
        residual_frac: RMS of the windows' relative residuals (weighted by their steps).
        standard_errors: of (tokens_per_s's inverse, fixed_s, per_sample_s), NaN if dropped.
        windows: windows fitted.
        dropped: terms the data did not support, with why.
    """

    tokens_per_s: float
    fixed_s: float
    per_sample_s: float
    effective_tokens_per_s: float
    residual_frac: float
    standard_errors: tuple[float, float, float]
    windows: int
    dropped: tuple[str, ...]

    def train_s(self, forwarded_tokens: float, samples: float = 0.0) -> float:
        """Predicted training seconds of a step."""
        return self.fixed_s + forwarded_tokens / self.tokens_per_s + self.per_sample_s * samples


def _weighted_fit(
    columns: dict[str, np.ndarray], y: np.ndarray, w: np.ndarray
) -> tuple[dict[str, float], dict[str, float], np.ndarray]:
    """Weighted least squares of ``y`` on ``columns``; coefficients, standard errors and
    residuals. Columns that are (nearly) proportional to each other cannot be told apart:
    their standard errors are infinite."""
    names = list(columns)
    x = np.column_stack([columns[n] for n in names])
    root = np.sqrt(w)
    coef, *_ = np.linalg.lstsq(x * root[:, None], y * root, rcond=None)
    residuals = y - x @ coef
    dof = len(y) - len(names)
    norms = np.linalg.norm(x, axis=0)
    scaled = x / np.where(norms > 0, norms, 1.0)  # unit columns: the rank sees directions only
    collinear = np.linalg.matrix_rank(scaled, tol=1e-6) < len(names)
    if dof > 0 and not collinear:
        sigma2 = float(np.sum(w * residuals**2) / dof)
        try:
            cov = sigma2 * np.linalg.inv((x * w[:, None]).T @ x)
            se = np.sqrt(np.clip(np.diag(cov), 0.0, None))
        except np.linalg.LinAlgError:
            se = np.full(len(names), math.inf)
    else:
        se = np.full(len(names), math.inf)
    return dict(zip(names, coef, strict=True)), dict(zip(names, se, strict=True)), residuals


def fit_training(windows: Sequence[Window]) -> TrainingFit:
    """Fit training time per step against forwarded tokens (and samples), dropping the fixed
    and per-sample terms the data does not support (see the module's docstring).

    Example:
        >>> ws = [Window(1, 0.05 + t / 2000, 0.0, 0.0, 0.0, t, None, None, 0.0, 0.0)
        ...       for t in (100.0, 400.0, 200.0, 300.0)]
        >>> fit = fit_training(ws)
        >>> round(fit.tokens_per_s), round(fit.fixed_s, 3), fit.dropped
        (2000, 0.05, ('per_sample_s: no batch/samples_per_step',))
    """
    usable = [w for w in windows if w.train_s > 0 and w.forwarded_tokens > 0]
    if len(usable) < 2:
        raise ValueError(
            f"calibration needs at least 2 windows with {STEP} and {FORWARDED}, got "
            f"{len(usable)}; log more steps (or lower skip_windows)"
        )
    y = np.array([w.train_s for w in usable])
    steps = np.array([float(w.steps) for w in usable])
    weight = steps / y**2  # relative least squares: a short step's error counts as much
    columns = {
        "per_token_s": np.array([w.forwarded_tokens for w in usable]),
        "fixed_s": np.ones(len(usable)),
    }
    dropped: list[str] = []
    samples = [w.samples for w in usable if w.samples is not None]
    if len(samples) == len(usable):
        columns["per_sample_s"] = np.array([float(count) for count in samples])
    else:
        dropped.append(f"per_sample_s: no {SAMPLES}")
    while True:
        coef, se, residuals = _weighted_fit(columns, y, weight)
        optional = [name for name in ("per_sample_s", "fixed_s") if name in columns]
        weak = [n for n in optional if not (coef[n] > 0 and coef[n] >= SUPPORT * se[n])]
        if weak:
            name = weak[0]
            dropped.append(
                f"{name}: {coef[name]:.3g} +- {se[name]:.2g} s is not supported by the data"
            )
        elif coef["per_token_s"] <= 0 and optional:
            name = optional[0]
            dropped.append(f"{name}: it left no cost per token")
        else:
            break
        del columns[name]
    if coef["per_token_s"] <= 0:
        raise ValueError(
            "training time does not grow with forwarded tokens in this run "
            f"(slope {coef['per_token_s']:.3g} s per token), so no throughput fits"
        )
    rms = float(np.sqrt(np.average((residuals / y) ** 2, weights=steps)))
    total_tokens = sum(w.forwarded_tokens * w.steps for w in usable)
    total_s = sum((w.train_s + w.sync_s) * w.steps for w in usable)
    return TrainingFit(
        tokens_per_s=float(1.0 / coef["per_token_s"]),
        fixed_s=float(coef.get("fixed_s", 0.0)),
        per_sample_s=float(coef.get("per_sample_s", 0.0)),
        effective_tokens_per_s=total_tokens / total_s,
        residual_frac=rms,
        standard_errors=(
            float(se["per_token_s"]),
            float(se.get("fixed_s", math.nan)),
            float(se.get("per_sample_s", math.nan)),
        ),
        windows=len(usable),
        dropped=tuple(dropped),
    )


@attrs.frozen
class RateFit:
    """A fitted rate or duration with its relative residual spread over windows.

    Attributes:
        value: the fitted value; None when the run does not identify it.
        residual_frac: weighted RMS of the windows' values around ``value``, over ``value``.
        windows: windows used.
        note: how it was fitted, or why it could not be.
    """

    value: float | None
    residual_frac: float
    windows: int
    note: str


def _spread(values: np.ndarray, weights: np.ndarray, center: float) -> float:
    return float(np.sqrt(np.average((values - center) ** 2, weights=weights)) / center)


def fit_weight_sync(windows: Sequence[Window], weight_sync_steps: int = 1) -> RateFit:
    """Seconds per weight push: ``perf/weight_sync_s`` summed over steps, over the number of
    syncs (``steps / weight_sync_steps``).

    Example:
        >>> ws = [Window(2, 1.0, 0.0, s, 0.0, 100.0, None, None, 0.0, 0.0) for s in (0.2, 0.3)]
        >>> fit = fit_weight_sync(ws, weight_sync_steps=2)
        >>> round(fit.value, 3), round(fit.residual_frac, 3)
        (0.5, 0.2)
    """
    if weight_sync_steps < 1:
        raise ValueError(f"weight_sync_steps must be >= 1, got {weight_sync_steps}")
    if not windows:
        return RateFit(None, math.nan, 0, "no windows")
    steps = np.array([float(w.steps) for w in windows])
    per_sync = np.array([w.server_paused_s(weight_sync_steps) * weight_sync_steps for w in windows])
    value = float(np.average(per_sync, weights=steps))
    if value <= 0:
        return RateFit(None, math.nan, len(windows), f"no {SYNC} in this run")
    note = f"mean {SYNC} x weight_sync_steps ({weight_sync_steps})"
    return RateFit(value, _spread(per_sync, steps, value), len(windows), note)


def fit_generation(
    windows: Sequence[Window],
    max_staleness: int,
    min_wait_frac: float = 0.05,
    min_bound_share: float = 0.5,
    weight_sync_steps: int = 1,
) -> RateFit:
    """Completion tokens per second while the generator is busy (see the module's docstring
    for which windows identify it and how). With overlap, at least ``min_bound_share`` of the
    windows must have the trainer waiting: a mostly trainer-bound run waits only now and then
    (a group finishing late, the start), and those few waits say little about the generator.

    Example:
        >>> waited = Window(1, 1.0, 0.6, 0.1, 0.0, 900.0, None, 600.0, 0.0, 0.0)
        >>> trained = Window(1, 1.0, 0.0, 0.1, 0.0, 900.0, None, 600.0, 0.0, 0.0)
        >>> fit_generation([waited, trained], max_staleness=2).value  # 600 tokens in 0.9 s
        666.6666666666666
        >>> fit_generation([waited, trained, trained], max_staleness=2).note[:37]
        'the trainer waited in only 1 of 3 win'
        >>> fit_generation([waited], max_staleness=0).value  # no overlap: 600 tokens in 0.6 s
        1000.0
    """
    rows, counted = [], 0
    for w in windows:
        tokens = w.generated_tokens
        if tokens is None:
            continue
        counted += 1
        if max_staleness == 0:  # a push beside the step lands while the trainer waits
            busy = w.wait_s - max(0.0, w.push_s - w.sync_s)
        elif w.wait_s >= min_wait_frac * w.step_s:
            busy = w.step_s - w.server_paused_s(weight_sync_steps)
        else:
            continue
        if busy > 0:
            rows.append((tokens, busy, float(w.steps)))
    if not rows:
        why = (
            f"no window with {TRAINED} and a wait"
            if max_staleness == 0
            else f"the trainer never waited (>= {min_wait_frac:.0%} of a step) for samples, "
            "so the generator was never the bottleneck: its throughput is only known to be "
            "high enough; calibrate from a run at max_staleness 0"
        )
        return RateFit(None, math.nan, 0, why)
    if max_staleness > 0 and len(rows) < min_bound_share * counted:
        why = (
            f"the trainer waited in only {len(rows)} of {counted} windows: the run is mostly "
            "trainer-bound, so the generator's throughput is only known to be high enough; "
            "calibrate from a run at max_staleness 0"
        )
        return RateFit(None, math.nan, len(rows), why)
    token_counts, busy_s, steps = (np.array(column) for column in zip(*rows, strict=True))
    value = float(np.sum(token_counts * steps) / np.sum(busy_s * steps))
    how = f"{WAIT}" if max_staleness == 0 else f"{STEP} - {SYNC} in windows the trainer waited"
    note = f"generated tokens per step over {how}"
    return RateFit(value, _spread(token_counts / busy_s, steps, value), len(rows), note)


PAUSE_PARTS = ("perf/weight_sync_pause_s", "perf/weight_sync_transfer_s")
"""The parts of a push that hold the server still: asking it to pause, then the reload or
transfer and the resume (docs/metrics.md); the disk path's file is written before them."""
WRITE = "perf/weight_sync_write_s"


def _mean_of_sums(
    rows: Sequence[Mapping[str, Any]], keys: Sequence[str], skip_windows: int
) -> RateFit:
    """The mean of ``keys`` summed, over the rows after the first ``skip_windows`` that log
    every one of them."""
    sums = [
        sum(row[k] for k in keys)
        for row in rows[skip_windows:]
        if all(row.get(k) is not None for k in keys)
    ]
    if not sums:
        return RateFit(None, math.nan, 0, f"no window logs {' and '.join(keys)}")
    values = np.array(sums)
    value = float(values.mean())
    return RateFit(
        value, _spread(values, np.ones_like(values), value), len(sums), f"mean {' + '.join(keys)}"
    )


def fit_server_pause(rows: Sequence[Mapping[str, Any]], skip_windows: int = 1) -> RateFit:
    """Seconds per push the server stands still: the mean of :data:`PAUSE_PARTS` summed, over
    the windows that log both (after the first ``skip_windows``).

    Example:
        >>> rows = [{"perf/weight_sync_pause_s": 0.02, "perf/weight_sync_transfer_s": t}
        ...         for t in (0.1, 0.03, 0.05)]
        >>> round(fit_server_pause(rows).value, 3)
        0.06
        >>> fit_server_pause([{"perf/step_s": 1.0}] * 3).value is None
        True
    """
    return _mean_of_sums(rows, PAUSE_PARTS, skip_windows)


def fit_push_write(rows: Sequence[Mapping[str, Any]], skip_windows: int = 1) -> RateFit:
    """Seconds per push spent writing its file on the trainer's cores (the disk path's
    :data:`WRITE`), the mean over the windows after the first ``skip_windows`` that log it.

    Example:
        >>> fit_push_write([{"perf/weight_sync_write_s": w} for w in (9.0, 0.4, 0.5)]).value
        0.45
    """
    return _mean_of_sums(rows, (WRITE,), skip_windows)


@attrs.frozen
class Calibration:
    """The simulator's throughputs fitted from one run.

    Attributes:
        training: per-token, fixed and per-sample training costs.
        weight_sync: seconds per push.
        generation: busy generator throughput, completion tokens per second (value None
            when the run does not identify it).
        windows: windows of the run that were read.
        server_pause: seconds of a push the server stands still (value None: not logged,
            the whole push is taken to stop it).
        push_write: seconds of a push writing its file on the trainer's cores.
    """

    training: TrainingFit
    weight_sync: RateFit
    generation: RateFit
    windows: int
    server_pause: RateFit = RateFit(None, math.nan, 0, "not fitted")
    push_write: RateFit = RateFit(None, math.nan, 0, "not fitted")

    @property
    def training_tokens_per_s(self) -> float:
        return self.training.tokens_per_s

    @property
    def training_fixed_s(self) -> float:
        return self.training.fixed_s

    @property
    def weight_sync_s(self) -> float:
        return self.weight_sync.value or 0.0

    @property
    def generation_tokens_per_s(self) -> float | None:
        return self.generation.value

    def simulator_settings(self, with_fixed_costs: bool = True) -> dict[str, float]:
        """The fitted values under ``SimulationConfig``'s names.

        With ``with_fixed_costs`` the per-token throughput plus ``training_fixed_s``,
        ``training_per_sample_s`` and ``weight_sync_s`` (a simulator that models them);
        without, the one ``training_tokens_per_s`` that folds them in
        (:attr:`TrainingFit.effective_tokens_per_s`). ``generation_tokens_per_s`` is left out
        when the run does not identify it.

        Example:
            >>> fit = TrainingFit(1000.0, 0.1, 0.0, 800.0, 0.02, (0, 0, 0), 5, ())
            >>> c = Calibration(fit, RateFit(0.3, 0.1, 5, ""), RateFit(None, 0, 0, ""), 5)
            >>> c.simulator_settings(with_fixed_costs=False)
            {'training_tokens_per_s': 800.0}
        """
        settings: dict[str, float] = {}
        if self.generation.value is not None:
            settings["generation_tokens_per_s"] = self.generation.value
        if not with_fixed_costs:
            settings["training_tokens_per_s"] = self.training.effective_tokens_per_s
            return settings
        settings |= {
            "training_tokens_per_s": self.training.tokens_per_s,
            "training_fixed_s": self.training.fixed_s,
            "training_per_sample_s": self.training.per_sample_s,
            "weight_sync_s": self.weight_sync_s,
        }
        if self.server_pause.value is not None:
            settings["server_pause_s"] = min(self.server_pause.value, self.weight_sync_s)
        if self.push_write.value is not None:
            settings["push_trainer_s"] = self.push_write.value
        return settings


def calibrate(
    rows: Sequence[Mapping[str, Any]],
    max_staleness: int,
    weight_sync_steps: int = 1,
    skip_windows: int = 1,
    min_wait_frac: float = 0.05,
    min_bound_share: float = 0.5,
) -> Calibration:
    """Fit the simulator's throughputs from one run's ``metrics.jsonl`` rows (see the module's
    docstring). ``max_staleness`` and ``weight_sync_steps`` are the run's settings.

    Example:
        >>> rows = [{"step": s, "perf/step_s": 0.5, "perf/rollout_wait_s": 0.2,
        ...          "batch/forwarded_tokens_per_step": 600.0} for s in (1, 2, 3)]
        >>> fit = calibrate(rows, max_staleness=0, skip_windows=0)
        >>> round(fit.training_tokens_per_s), fit.training.dropped[-1][:8]  # all steps alike
        (2000, 'fixed_s:')
        >>> fit.generation_tokens_per_s is None, fit.generation.note
        (True, 'no window with batch/trained_tokens_per_step and a wait')
    """
    windows = windows_from_rows(rows, skip_windows)
    return Calibration(
        training=fit_training(windows),
        weight_sync=fit_weight_sync(windows, weight_sync_steps),
        generation=fit_generation(
            windows, max_staleness, min_wait_frac, min_bound_share, weight_sync_steps
        ),
        windows=len(windows),
        server_pause=fit_server_pause(rows, skip_windows),
        push_write=fit_push_write(rows, skip_windows),
    )


# ------------------------------------------------------------------ predicted vs measured
