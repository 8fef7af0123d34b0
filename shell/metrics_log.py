"""Console logs (structlog) and the metrics file (``metrics.jsonl``) of a run."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import structlog


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is at the time (test runners swap it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(json_logs: bool = False) -> None:
    """Send structlog lines to stderr: key=value for people, or JSON for machines."""
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
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),
        cache_logger_on_first_use=False,
    )


def _json_number(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsFile:
    """Appends one JSON object per logging window to ``<output_dir>/metrics.jsonl``.

    Non-finite numbers are written as ``null`` (JSON has no NaN), so every line parses with
    any JSON reader.
    """

    def __init__(self, output_dir: str | Path) -> None:
        self.path = Path(output_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = self.path.open("a", encoding="utf-8")

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        row = {"step": step, **{k: _json_number(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row, sort_keys=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> MetricsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(output_dir: str | Path) -> list[dict[str, Any]]:
    """All windows of ``<output_dir>/metrics.jsonl``, in order."""
    path = Path(output_dir) / "metrics.jsonl"
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
