"""The metrics files of a run: ``metrics.jsonl`` (rows of logged windows and evaluations, each
carrying its optimizer ``step``, :class:`WindowLog`) and ``evaluations.jsonl`` (a row per
evaluation, keyed by its weight version).

Both files are append-only while a run trains: a row is never rewritten, so ``tail -f`` and log
shippers follow them. What arrives for a step after its row was written (an evaluation that
finished late, the rest of a window) is appended as a row of its own with that ``step``;
:func:`read_metrics` joins the rows of a step into one, in step order. (A run resumed from a
checkpoint is the one exception: :func:`drop_rows_after` removes the rows of the steps it logs
again.)
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import structlog
from tqdm import tqdm

from asyncgrpo.adapters.atomic_files import write_text_whole
from asyncgrpo.core import metrics as windows
from asyncgrpo.core.run import step_time

log = structlog.get_logger("asyncgrpo.trainer")


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
    any JSON reader. The file only grows: a second row of a step joins the first when read
    (:func:`read_metrics`).
    """

    def __init__(self, output_dir: str | Path, name: str = METRICS_FILE) -> None:
        self.path = Path(output_dir) / name
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = self.path.open("a", encoding="utf-8")

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        self._file.write(_row(step, metrics))
        self._file.flush()

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
    landed, the groups of a step that never came) is merged into that step's window, whose
    summary is appended as a second row of the step: read back (:func:`read_metrics`), each
    step has one row, the merged window's.

    An evaluation of weight version ``v`` is a row of step ``v`` (:meth:`evaluation`), appended
    when its result arrives, before or after that step's window row, or for a step that logs
    no window; read back, it is joined to that step's row. Evaluations never enter a window, so
    no window mixes two of them.

    Attributes:
        file: ``metrics.jsonl``; None until the run opens it, and on the other ranks.
        bar: the progress bar (a step each); None likewise.
    """

    def __init__(self, output_dir: Path, num_completions_to_print: int | None) -> None:
        self.output_dir = output_dir
        self.num_completions_to_print = num_completions_to_print
        self.file: MetricsFile | None = None
        self.bar: tqdm | None = None
        self._logged: tuple[int, windows.MetricWindow] | None = None  # the last window row

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
        if self._logged is not None and self._logged[0] == step:
            window = windows.merge(self._logged[1], window)  # its second row supersedes the first
        self._logged = (step, window)
        summary = windows.summarize(window)
        summary.update(extra)
        summary.update(step_time.window_rates(summary))
        if self.file is None:
            return summary
        self.file.write(step, summary)
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
        """An evaluation of weight version ``version`` arrived: its figures are appended as a
        row of step ``version`` (rank 0; see the class)."""
        if self.file is not None:
            self.file.write(version, figures)

    def step_done(self) -> None:
        """A step was trained: the progress bar moves on."""
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()


def _rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def _row(step: int, metrics: Mapping[str, Any]) -> str:
    return json.dumps({"step": step, **{k: _json_number(v) for k, v in metrics.items()}}) + "\n"


def read_metrics(output_dir: str | Path, name: str = METRICS_FILE) -> list[dict[str, Any]]:
    """The rows of ``<output_dir>/<name>`` (the windows and evaluations of ``metrics.jsonl``, or
    the evaluations of ``evaluations.jsonl``), one per ``step``, in step order: the rows a step
    has in the file are joined, a later row's value of a name replacing an earlier one's.

    Example:
        >>> import tempfile
        >>> out = Path(tempfile.mkdtemp())
        >>> _ = (out / METRICS_FILE).write_text(
        ...     '{"step": 2, "reward": 0.5}\\n{"step": 1, "reward": 0.25}\\n'
        ...     '{"step": 2, "eval/reward": 0.75}\\n'
        ... )
        >>> read_metrics(out)
        [{'step': 1, 'reward': 0.25}, {'step': 2, 'reward': 0.5, 'eval/reward': 0.75}]

    Raises:
        ValueError: a row has no ``step`` (every row asyncgrpo writes has one).
    """
    path = Path(output_dir) / name
    rows: dict[Any, dict[str, Any]] = {}
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "step" not in row:
                raise ValueError(
                    f'{path}, line {number}: the row has no "step"; each row of a metrics '
                    "file names the optimizer step it belongs to"
                )
            rows[row["step"]] = {**rows.get(row["step"], {}), **row}
    return sorted(rows.values(), key=lambda row: row["step"])


def drop_rows_after(output_dir: str | Path, step: int) -> None:
    """Remove the rows of ``metrics.jsonl``, ``completions.jsonl``, ``positions.jsonl`` and
    ``evaluations.jsonl`` logged after ``step`` (an evaluation by its version): a run resumed
    from checkpoint ``step`` logs those steps again, and each step is kept once. Each file is
    replaced whole (:func:`~asyncgrpo.adapters.atomic_files.write_text_whole`)."""
    for name in (METRICS_FILE, "completions.jsonl", POSITIONS_FILE, EVALUATIONS_FILE):
        path = Path(output_dir) / name
        if not path.is_file():
            continue
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        kept = [line for line in lines if line.strip() and _row_step(line) <= step]
        if len(kept) == len(lines):
            continue
        write_text_whole(path, "".join(kept))


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
