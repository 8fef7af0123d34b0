"""``asyncgrpo compare RUN_OR_SWEEP...``: settings side by side, with intervals, and claims that
hold, fail or stay undecided.

Each argument is a sweep directory (``asyncgrpo sweep``: its finished runs, grouped by their
settings) or a run directory (one ``metrics.jsonl``; grouped under its directory's name). Out:

* ``comparison.png``: reward against step and against training time, one line per setting (the
  median over seeds) with a band from the lowest to the highest seed;
* ``comparison.md`` (also printed): per setting, the final reward, time and steps to the
  threshold, the area under the reward curve, collapsed runs and the ``perf/*`` breakdown, each
  a median over seeds with its bootstrap interval (:mod:`asyncgrpo.core.experiments.table`),
  the time to the threshold as a ratio to a baseline setting with its interval, and each
  claim's verdict (:mod:`asyncgrpo.core.experiments.verdicts`).

The exit status is 1 when a claim fails, so a claim can guard a result in CI or a benchmark.
Training time is the runs' summed ``perf/step_s`` (start-up left out, alike for every run).
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from asyncgrpo.core.experiments.claims import ClaimSyntaxError, parse_claim
from asyncgrpo.core.experiments.curves import Run, curve_from_rows
from asyncgrpo.core.experiments.statistic import Statistic
from asyncgrpo.core.experiments.table import comparison_table, group_runs, markdown, verdict_table
from asyncgrpo.core.experiments.verdicts import Verdict, evaluate_claims, exit_status
from asyncgrpo.shell.experiments.sweep import SWEEP_COPY, SweepError, read_index
from asyncgrpo.shell.run import read_metrics

PERF_PARTS = (
    "perf/step_s",
    "perf/rollout_wait_s",
    "perf/fwd_bwd_s",
    "perf/weight_sync_s",
    "perf/weight_push_s",
)
DEFAULT_THRESHOLD = 0.9


@attrs.frozen
class Comparison:
    """What ``compare`` found: the table, the verdicts, and where it wrote them."""

    table: str
    verdicts: tuple[Verdict, ...]
    markdown_path: Path
    plot_path: Path | None

    @property
    def exit_status(self) -> int:
        return exit_status(self.verdicts)


def load_runs(paths: Sequence[str | Path]) -> tuple[list[Run], list[str], dict[str, Any]]:
    """The runs under ``paths``, the claims their sweep files state, and the sweeps'
    ``[compare]`` settings (threshold, baseline)."""
    runs: list[Run] = []
    claims: list[str] = []
    settings: dict[str, Any] = {}
    for path in map(Path, paths):
        if (path / "index.json").exists():
            sweep = (
                json.loads((path / SWEEP_COPY).read_text()) if (path / SWEEP_COPY).exists() else {}
            )
            claims += [c for c in sweep.get("claims", []) if c not in claims]
            settings = {**sweep.get("compare", {}), **settings}
            threshold = (sweep.get("stop") or {}).get("reward_threshold")
            if threshold is not None:
                settings.setdefault("threshold", threshold)
            for entry in read_index(path):
                if entry["status"] != "finished":
                    continue
                rows = read_metrics(path / entry["name"])
                runs.append(Run(entry["settings"], entry["seed"], curve_from_rows(rows)))
        elif (path / "metrics.jsonl").exists():
            runs.append(Run({"run": path.name}, 0, curve_from_rows(read_metrics(path))))
        else:
            raise SweepError(
                f"{path}: neither a sweep directory (index.json) nor a run "
                "directory (metrics.jsonl)"
            )
    return runs, claims, settings


def compare(
    paths: Sequence[str | Path],
    output_dir: str | Path | None = None,
    threshold: float | None = None,
    baseline: str | None = None,
    claims: Sequence[str] = (),
    confidence: float = 0.9,
) -> Comparison:
    """Compare the runs under ``paths`` (see the module docstring); writes ``comparison.md`` and
    ``comparison.png`` into ``output_dir`` (default: the first path)."""
    runs, stated, settings = load_runs(paths)
    if not runs:
        raise SweepError(f"no finished run under {', '.join(map(str, paths))}")
    threshold = threshold if threshold is not None else settings.get("threshold", DEFAULT_THRESHOLD)
    groups = group_runs(runs)
    labels = [label for label, _ in groups]
    baseline = baseline if baseline is not None else settings.get("baseline")
    if baseline is not None:  # "a=1,b=2" names the setting labelled "a=1, b=2"
        baseline = next(
            (label for label in labels if label.replace(" ", "") == baseline.replace(" ", "")),
            baseline,
        )
    elif len(groups) > 1:
        baseline = labels[0]
    statistics = [
        Statistic("final_reward"),
        Statistic("time_to", threshold),
        Statistic("steps_to", threshold),
        Statistic("auc"),
        Statistic("collapsed"),
        *(Statistic(name) for name in PERF_PARTS if all(_logs(r, name) for r in runs)),
    ]
    ratio = Statistic("time_to", threshold) if baseline is not None else None
    table = comparison_table(
        groups, statistics, baseline=baseline, ratio_of=ratio, confidence=confidence
    )
    try:
        parsed = [parse_claim(text) for text in [*stated, *claims]]
    except ClaimSyntaxError as error:
        raise SweepError(str(error)) from error
    verdicts = evaluate_claims(parsed, runs, confidence=confidence)
    text = _report(table, verdicts, threshold, len(runs))
    out = Path(output_dir) if output_dir is not None else Path(paths[0])
    out.mkdir(parents=True, exist_ok=True)
    (out / "comparison.md").write_text(text)
    plot = plot_comparison(groups, threshold, out / "comparison.png")
    return Comparison(text, tuple(verdicts), out / "comparison.md", plot)


def _logs(run: Run, name: str) -> bool:
    """Whether the run logged a finite ``name`` (a metric only some settings log, such as
    ``perf/weight_push_s``, is left out of the table)."""
    return any(math.isfinite(p.metrics.get(name, math.nan)) for p in run.curve.points)


def _report(table: Any, verdicts: Sequence[Verdict], threshold: float, runs: int) -> str:
    lines = [
        f"{runs} runs; time is training time (summed perf/step_s); threshold {threshold:g}; "
        "medians over seeds with bootstrap 90% intervals",
        "",
        markdown(table),
    ]
    if verdicts:
        lines += ["", markdown(verdict_table(verdicts))]
    return "\n".join(lines) + "\n"


def plot_comparison(
    groups: Sequence[tuple[str, Sequence[Run]]], threshold: float, path: Path
) -> Path | None:
    """Reward against step and against training time, a line (median over seeds) and a band
    (lowest to highest seed) per setting; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    figure, (by_step, by_time) = plt.subplots(1, 2, figsize=(12, 4.5))
    for index, (label, runs) in enumerate(groups):
        color = f"C{index % 10}"
        steps = sorted({p.step for r in runs for p in r.curve.points})
        by_step_values = np.array([[_at_step(r, s) for s in steps] for r in runs])
        _band(by_step, np.array(steps, dtype=float), by_step_values, color, label)
        end = max(r.curve.last_wall_s for r in runs if r.curve.points)
        grid = np.linspace(0.0, end, 200)
        by_time_values = np.array([[_at_time(r, t) for t in grid] for r in runs])
        _band(by_time, grid, by_time_values, color, label)
    for axis, xlabel in ((by_step, "step"), (by_time, "training time (s)")):
        axis.axhline(threshold, color="grey", linestyle=":", linewidth=1)
        axis.set_xlabel(xlabel)
        axis.set_ylabel("reward")
        axis.grid(alpha=0.3)
    by_step.legend(fontsize=8)
    by_step.set_title("reward by step (median over seeds, band: min-max)")
    by_time.set_title("reward by training time")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _band(axis: Any, x: np.ndarray, values: np.ndarray, color: str, label: str) -> None:
    with warnings.catch_warnings():  # before a run's first point a column is all NaN
        warnings.simplefilter("ignore", RuntimeWarning)
        middle = np.nanmedian(values, axis=0)
        low, high = np.nanmin(values, axis=0), np.nanmax(values, axis=0)
    axis.plot(x, middle, color=color, label=label)
    axis.fill_between(x, low, high, color=color, alpha=0.2, linewidth=0)


def _at_step(run: Run, step: int) -> float:
    """The run's reward at ``step``; after its last point, its last reward (a run that
    stopped at the threshold stays there); NaN before its first."""
    value = math.nan
    for point in run.curve.points:
        if point.step > step:
            break
        value = point.reward
    return value


def _at_time(run: Run, seconds: float) -> float:
    value = math.nan
    for point in run.curve.points:
        if point.wall_s > seconds:
            break
        value = point.reward
    return value
