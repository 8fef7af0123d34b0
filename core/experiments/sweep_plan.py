"""A sweep's runs, their order and what to do with each when the sweep starts again: pure
decisions over the sweep file's settings and the runs' recorded status.

A sweep is settings (a grid: every combination of the listed values, or a list of overrides)
times seeds. :func:`plan_runs` names each run by its settings and seed (a directory name), and
orders them so that settings interleave (each seed runs every setting, in an order rotated per
seed): drift of a shared machine spreads over the settings instead of landing on one. A sweep
started again skips finished runs, runs again an interrupted one from its last checkpoint (or
from scratch without one), and leaves a failed one alone unless asked (:func:`next_action`), so
no run is counted twice.

Example:
    >>> runs = plan_runs(grid={"max_staleness": [0, 1]}, overrides=(), seeds=(0, 1))
    >>> [(r.name, r.seed) for r in runs]  # doctest: +NORMALIZE_WHITESPACE
    [('max_staleness=0/seed=0', 0), ('max_staleness=1/seed=0', 0),
     ('max_staleness=1/seed=1', 1), ('max_staleness=0/seed=1', 1)]
"""

from __future__ import annotations

import enum
import itertools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from asyncgrpo.core.frozen import FrozenMap

_UNSAFE = re.compile(r"[^A-Za-z0-9._=+-]")


def setting_text(value: Any) -> str:
    """A setting's value as it appears in names and comparisons (``true``/``false`` for
    booleans, ``repr``-free numbers and strings).

    Example:
        >>> setting_text(True), setting_text(0.01), setting_text("cispo")
        ('true', '0.01', 'cispo')
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def setting_label(settings: Mapping[str, Any]) -> str:
    """``key=value,key=value`` in the settings' order (``base`` for none)."""
    return ",".join(f"{k}={setting_text(v)}" for k, v in settings.items()) or "base"


def _frozen_settings(settings: Mapping[str, Any]) -> FrozenMap[str, Any]:
    return FrozenMap(settings)


@attrs.frozen
class PlannedRun:
    """One run of a sweep.

    Attributes:
        settings: the config fields this run sets beyond the sweep's base (in the sweep file's
            order).
        seed: the run's ``seed``.
        name: its directory under the sweep's, ``<label>/seed=<seed>``, filesystem-safe.
    """

    settings: FrozenMap[str, Any] = attrs.field(converter=_frozen_settings)
    seed: int

    @property
    def label(self) -> str:
        return setting_label(self.settings)

    @property
    def name(self) -> str:
        return f"{_UNSAFE.sub('_', self.label)}/seed={self.seed}"


def expand(
    grid: Mapping[str, Sequence[Any]], overrides: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The settings of a sweep: every combination of ``grid``'s values (keys in order), times
    each of ``overrides`` (a list of setting sets; none means one empty set).

    Raises:
        ValueError: a grid value that is not a non-empty list, or two settings that are equal.

    Example:
        >>> expand({"a": [1, 2]}, [{"b": 0}, {"b": 1}])
        [{'b': 0, 'a': 1}, {'b': 0, 'a': 2}, {'b': 1, 'a': 1}, {'b': 1, 'a': 2}]
    """
    for key, values in grid.items():
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
            raise ValueError(f"grid.{key} must be a non-empty list of values, got {values!r}")
    combos = [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]
    settings = [{**over, **combo} for over in (overrides or [{}]) for combo in combos]
    labels = [setting_label(s) for s in settings]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(f"the sweep lists the same settings twice: {repeated}")
    return settings


def plan_runs(
    grid: Mapping[str, Sequence[Any]],
    overrides: Sequence[Mapping[str, Any]],
    seeds: Sequence[int],
) -> list[PlannedRun]:
    """Every (settings, seed) run, settings interleaved: seed ``i`` runs the settings rotated
    by ``i``, so no setting always runs first or last."""
    if not seeds:
        raise ValueError("a sweep needs at least one seed")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds repeat: {list(seeds)}")
    settings = expand(grid, overrides)
    runs = []
    for index, seed in enumerate(seeds):
        shift = index % len(settings)
        order = settings[shift:] + settings[:shift]
        runs += [PlannedRun(s, seed) for s in order]
    return runs


class Status(enum.Enum):
    """A run's recorded status."""

    PLANNED = "planned"
    RUNNING = "running"  # started; still so when the sweep was killed while it ran
    FINISHED = "finished"
    INTERRUPTED = "interrupted"  # ended by a signal (a kill of the sweep, a timeout)
    FAILED = "failed"  # ended by an error of its own


class Action(enum.Enum):
    """What a sweep that starts again does with a run."""

    SKIP = "skip"
    START = "start"  # from scratch (its directory emptied first)
    RESUME = "resume"  # from its last complete checkpoint


def next_action(status: Status, has_checkpoint: bool, retry_failed: bool) -> Action:
    """Finished runs are skipped; interrupted ones (and runs left ``running`` by a killed
    sweep) resume from their last checkpoint, or start over without one; failed ones start
    over only when ``retry_failed``.

    Example:
        >>> next_action(Status.RUNNING, has_checkpoint=True, retry_failed=False).value
        'resume'
    """
    if status is Status.FINISHED:
        return Action.SKIP
    if status is Status.FAILED and not retry_failed:
        return Action.SKIP
    if status in (Status.RUNNING, Status.INTERRUPTED) and has_checkpoint:
        return Action.RESUME
    return Action.START
