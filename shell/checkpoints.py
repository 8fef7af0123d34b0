"""The checkpoint layout of a run directory: ``<output_dir>/checkpoint-<step>/``."""

from __future__ import annotations

from pathlib import Path

CHECKPOINT_PREFIX = "checkpoint-"
ROLLOUT_STATE = "rollout_state.json"


def checkpoints(output_dir: str | Path) -> list[Path]:
    """The run's checkpoint directories, oldest step first."""
    found = [p for p in Path(output_dir).glob(f"{CHECKPOINT_PREFIX}*")
             if p.name.removeprefix(CHECKPOINT_PREFIX).isdigit()]  # fmt: skip
    return sorted(found, key=lambda p: int(p.name.removeprefix(CHECKPOINT_PREFIX)))


def latest(output_dir: str | Path) -> Path | None:
    """The newest checkpoint, or ``None`` when the run saved none."""
    found = checkpoints(output_dir)
    return found[-1] if found else None
