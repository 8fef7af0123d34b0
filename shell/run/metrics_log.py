"""Console logs (structlog) and the metrics files of a run: ``metrics.jsonl`` (a row per logged
window and per evaluation, in step order, :class:`WindowLog`) and ``evaluations.jsonl`` (a row
per evaluation, keyed by its weight version)."""

from __future__ import annotations

import json
import logging
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import structlog
from tqdm import tqdm

from asyncgrpo.core import metrics as windows
from asyncgrpo.core.run import step_time

log = structlog.get_logger("asyncgrpo.trainer")


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time (test runners swap it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(json_logs: bool = False) -> None:
    """Send structlog lines at info level and above to stderr: key=value for people, or JSON
    for machines."""
    renderer = (
        structlog.processors.JSONRenderer()
        if json_logs
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),
        cache_logger_on_first_use=False,
    )


def _json_number(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


METRICS_FILE = "metrics.jsonl"
EVALUATIONS_FILE = "evaluations.jsonl"
POSITIONS_FILE = "positions.jsonl"
TRAINED = "trained"


class MetricsFile:
    """Appends one JSON object per row to ``<output_dir>/<name>``: a logging window to
    ``metrics.jsonl``, an evaluation to ``evaluations.jsonl``.

    Non-finite numbers are written as ``null`` (JSON has no NaN), so every line parses with
    any JSON reader.
    """

    def __init__(self, output_dir: str | Path, name: str = METRICS_FILE) -> None:
        self.path = Path(output_dir) / name
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = self.path.open("a", encoding="utf-8")

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._file.write(_row(step, metrics))
        self._file.flush()

    def place(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Put ``metrics`` in the row of ``step``: joined to that row where the file has one,
        else a row of its own after the last row of an earlier step (rows stay in step order).
        The file is rewritten beside itself and renamed into place."""
        self._file.close()
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        steps = [_row_step(line) for line in lines]
        if step in steps:
            at = steps.index(step)
            lines[at] = _row(step, {**json.loads(lines[at]), **metrics, "step": step})
        else:
            at = sum(1 for s in steps if s < step)
            lines.insert(at, _row(step, metrics))
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text("".join(lines), encoding="utf-8")
        partial.replace(self.path)
        self._file = self.path.open("a", encoding="utf-8")

    def replace_last(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Write ``metrics`` in place of the last row, which must be ``step``'s (a step's
        window completed after it was logged: each step keeps one row). The file is rewritten
        beside itself and renamed into place."""
        self._file.close()
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        if not lines or _row_step(lines[-1]) != step:
            raise ValueError(f"{self.path}: the last row is not step {step}'s")
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text("".join([*lines[:-1], _row(step, metrics)]), encoding="utf-8")
        partial.replace(self.path)
        self._file = self.path.open("a", encoding="utf-8")

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> MetricsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class WindowLog:
    """The run's logged windows: each a row of ``metrics.jsonl`` for its step, a console line,
    the progress bar's reward and the window's completions (rank 0 writes them; every rank gets
    the summary). What arrives after a step's row was written (at the end: a push that
    landed, the groups of a step that never came) joins that row, which is written again: each
    step keeps one row.

    An evaluation of weight version ``v`` goes in the row of step ``v`` (:meth:`evaluation`),
    whenever its result arrives: joined to that row if it was written, else held until that
    row is written; a step that logs no window gets a row of its own for it, in step order.
    Evaluations never enter a window, so no window mixes two of them.

    Attributes:
        file: ``metrics.jsonl``; None until the run opens it, and on the other ranks.
        bar: the progress bar (a step each); None likewise.
    """

    def __init__(self, output_dir: Path, num_completions_to_print: int | None) -> None:
        self.output_dir = output_dir
        self.num_completions_to_print = num_completions_to_print
        self.file: MetricsFile | None = None
        self.bar: tqdm | None = None
        # the last row written: its step, window and the evaluation figures joined to it
        self._logged: tuple[int, windows.MetricWindow, dict[str, float]] | None = None
        self._held: dict[int, dict[str, float]] = {}  # evaluations of steps not written yet

    def open_bar(self, step: int, max_steps: int, disable: bool) -> None:
        """The progress bar, a tick per step from ``step`` (to ``max_steps`` when > 0)."""
        total = max_steps if max_steps > 0 else None
        self.bar = tqdm(total=total, initial=step, desc="train", unit="step", disable=disable)

    def write(
        self,
        step: int,
        window: windows.MetricWindow,
        extra: Mapping[str, float],
        completions: Sequence[tuple[str, str, float]],
    ) -> dict[str, float]:
        """Log ``step``'s window with ``extra`` figures (``epoch``, ``num_tokens``) and the
        rates they give; return its summary."""
        evaluated = self._held.pop(step, {})
        again = self._logged is not None and self._logged[0] == step
        if again:
            assert self._logged is not None
            window = windows.merge(self._logged[1], window)
            evaluated = {**self._logged[2], **evaluated}
        self._logged = (step, window, evaluated)
        summary = windows.summarize(window)
        summary.update(extra)
        summary.update(step_time.window_rates(summary))
        if self.file is None:
            return summary
        if again:
            self.file.replace_last(step, {**summary, **evaluated})
        else:
            self._place_held(before=step)
            self.file.write(step, {**summary, **evaluated})
        log.info(
            "step",
            step=step,
            reward=_rounded(summary.get("reward")),
            loss=_rounded(summary.get("loss")),
            staleness_max=summary.get("sample/staleness_max"),
            logp_diff_max=_rounded(summary.get("sampling/sampling_logp_difference/max"), 6),
        )
        if self.bar is not None:
            self.bar.set_postfix(reward=_rounded(summary.get("reward")))
        if completions:
            write_completions(self.output_dir, step, completions, self.num_completions_to_print)
        return summary

    def evaluation(self, version: int, figures: Mapping[str, float]) -> None:
        """An evaluation of weight version ``version`` arrived: its figures go in the row of
        step ``version`` (rank 0; see the class)."""
        if self.file is None:
            return
        if self._logged is not None and self._logged[0] == version:
            self._logged[2].update(figures)  # kept when the row is written again
        elif self._logged is None or version > self._logged[0]:
            self._held[version] = {**self._held.get(version, {}), **figures}
            return
        self.file.place(version, figures)

    def _place_held(self, before: float = math.inf) -> None:
        """Write the held evaluations of steps before ``before`` (steps that logged no window
        before it) in the rows of their steps."""
        assert self.file is not None
        for version in sorted(v for v in self._held if v < before):
            self.file.place(version, self._held.pop(version))

    def step_done(self) -> None:
        """A step was trained: the progress bar moves on."""
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self._place_held()
            self.file.close()


def _rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def _row(step: int, metrics: Mapping[str, Any]) -> str:
    return json.dumps({"step": step, **{k: _json_number(v) for k, v in metrics.items()}}) + "\n"


def read_metrics(output_dir: str | Path, name: str = METRICS_FILE) -> list[dict[str, Any]]:
    """All rows of ``<output_dir>/<name>`` (the windows of ``metrics.jsonl``, or the
    evaluations of ``evaluations.jsonl``), in order."""
    path = Path(output_dir) / name
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def drop_rows_after(output_dir: str | Path, step: int) -> None:
    """Remove the rows of ``metrics.jsonl``, ``completions.jsonl``, ``positions.jsonl`` and
    ``evaluations.jsonl`` logged after ``step`` (an evaluation by its version): a run resumed
    from checkpoint ``step`` logs those steps again, and each step is kept once. Each file is
    rewritten beside itself and renamed into place."""
    for name in (METRICS_FILE, "completions.jsonl", POSITIONS_FILE, EVALUATIONS_FILE):
        path = Path(output_dir) / name
        if not path.is_file():
            continue
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [line for line in lines if line.strip() and _row_step(line) <= step]
        if len(kept) == len(lines):
            continue
        partial = path.with_name(f".{name}.partial")
        partial.write_text("".join(kept), encoding="utf-8")
        partial.replace(path)


def _row_step(line: str) -> float:
    try:
        return float(json.loads(line).get("step", math.inf))
    except ValueError:  # a line cut short by a kill: written after the checkpoint
        return math.inf


def write_positions(output_dir: str | Path, step: int, done: Mapping[str, Sequence[int]]) -> None:
    """Append a window's row to ``<output_dir>/positions.jsonl``: the prompt positions the trainer
    was done with since the last row, by outcome.

    ``done`` maps ``"trained"`` to the positions of the samples trained (one entry per sample, so
    a group of 8 shows its position 8 times) and each drop reason of
    :mod:`asyncgrpo.core.rollout.sample_wait` (``stale``, ``oversize`` per sample;
    ``zero_reward_spread``, ``prompt_too_long``, ... per group) to its positions. A position is
    the prompt stream's index (epoch x dataset size + index in that epoch's order, see
    :mod:`asyncgrpo.core.rollout.cursor`). Over a run's rows, resumed runs included, each sample
    of a consumed position appears once: rows after a resumed checkpoint are removed with the
    metrics' (:func:`drop_rows_after`).

    Example:
        >>> import tempfile
        >>> out = tempfile.mkdtemp()
        >>> write_positions(out, 3, {"trained": [4, 4], "stale": [2]})
        >>> (Path(out) / POSITIONS_FILE).read_text()
        '{"step": 3, "trained": [4, 4], "stale": [2]}\\n'
    """
    row = {"step": step, **{outcome: list(positions) for outcome, positions in done.items()}}
    with (Path(output_dir) / POSITIONS_FILE).open("a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def write_completions(
    output_dir: str | Path,
    step: int,
    completions: Sequence[tuple[str, str, float]],
    num_to_print: int | None,
) -> None:
    """Append a window's ``(prompt, completion, reward)`` samples to
    ``<output_dir>/completions.jsonl`` and print ``num_to_print`` of them (all when None) as
    a table."""
    path = Path(output_dir) / "completions.jsonl"
    with path.open("a", encoding="utf-8") as f:
        for prompt, completion, reward in completions:
            row = {
                "step": step,
                "prompt": prompt,
                "completion": completion,
                "reward": _json_number(reward),
            }
            f.write(json.dumps(row) + "\n")
    shown = completions if num_to_print is None else completions[:num_to_print]
    if not shown:
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"completions at step {step}", show_lines=True)
    for column in ("prompt", "completion", "reward"):
        table.add_column(column)
    for prompt, completion, reward in shown:
        table.add_row(prompt, completion, f"{reward:.3f}")
    Console(file=sys.stderr).print(table)
