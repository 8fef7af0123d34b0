"""The checkpoints of a run directory: ``<output_dir>/checkpoint-<step>/``, written atomically.

A checkpoint is written into ``checkpoint-<step>.partial/`` and renamed to
``checkpoint-<step>/`` only once every file is in place, so a run killed while saving, or a disk
that fills up, never leaves a checkpoint that looks complete. A checkpoint is complete when it
holds ``rollout_state.json`` (written last; checkpoints of older versions were written in place,
so the file is checked, not only the name): the prompt cursor, policy version and step of the
rollout side, beside what the learner writes (:mod:`asyncgrpo.shell.learner.checkpoint`).
Resuming takes the newest complete checkpoint and names the ones it skipped; a failed write
says whether the disk was full.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import attrs
import structlog

from asyncgrpo.core.cursor import PromptCursor

log = structlog.get_logger("asyncgrpo.checkpoints")

CHECKPOINT_PREFIX = "checkpoint-"
PARTIAL_SUFFIX = ".partial"
ROLLOUT_STATE = "rollout_state.json"
FULL_DISK_BYTES = 16 * 1024**2  # less free space than this after a failed write: a full disk


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (the message says whether the disk is full)."""


def _parse(path: Path) -> tuple[int, bool] | None:
    """``checkpoint-12`` -> ``(12, False)``, ``checkpoint-12.partial`` -> ``(12, True)``."""
    name = path.name
    if not name.startswith(CHECKPOINT_PREFIX):
        return None
    number = name.removeprefix(CHECKPOINT_PREFIX).removesuffix(PARTIAL_SUFFIX)
    return (int(number), name.endswith(PARTIAL_SUFFIX)) if number.isdigit() else None


def _saves(output_dir: str | Path) -> list[Path]:
    """Every checkpoint directory, ``.partial`` ones included, oldest first."""
    found = [p for p in Path(output_dir).glob(f"{CHECKPOINT_PREFIX}*") if _parse(p)]
    return sorted(found, key=_parse)


def checkpoints(output_dir: str | Path) -> list[Path]:
    """The run's checkpoint directories (complete or not, no ``.partial``), oldest first."""
    return [p for p in _saves(output_dir) if not _parse(p)[1]]


def is_complete(path: Path) -> bool:
    return (path / ROLLOUT_STATE).is_file()


def latest(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint, or ``None`` when the run saved none."""
    return resumable(output_dir).checkpoint


@attrs.frozen
class Resumable:
    """The checkpoint to resume from, and the newer ones skipped because they are incomplete."""

    checkpoint: Path | None
    skipped: tuple[Path, ...]


def resumable(output_dir: str | Path) -> Resumable:
    """The newest complete checkpoint of ``output_dir`` and the incomplete ones newer than it
    (a ``.partial`` directory of a killed save, a checkpoint missing its rollout state)."""
    skipped: list[Path] = []
    for path in reversed(_saves(output_dir)):
        if not _parse(path)[1] and is_complete(path):
            return Resumable(path, tuple(skipped))
        skipped.append(path)
    return Resumable(None, tuple(skipped))


def find_for_resume(output_dir: str | Path) -> Path:
    """The checkpoint ``resume_from_checkpoint=True`` resumes from; skipped ones are logged.

    Raises:
        FileNotFoundError: no complete checkpoint in ``output_dir``.
    """
    found = resumable(output_dir)
    if found.skipped:
        log.warning("skipped incomplete checkpoints (a save that did not finish)",
                    skipped=[str(p) for p in found.skipped],
                    resuming_from=str(found.checkpoint))  # fmt: skip
    if found.checkpoint is None:
        incomplete = f" (incomplete: {[p.name for p in found.skipped]})" if found.skipped else ""
        raise FileNotFoundError(
            f"resume_from_checkpoint=True but {output_dir} holds no complete checkpoint{incomplete}"
        )
    return found.checkpoint


def write_rollout_state(path: Path, cursor: PromptCursor, version: int, step: int) -> None:
    """Write ``rollout_state.json`` into checkpoint directory ``path`` (rank 0, last)."""
    state = {"cursor": cursor.to_json(), "version": version, "step": step}
    (path / ROLLOUT_STATE).write_text(json.dumps(state, indent=2))


def read_rollout_cursor(path: Path) -> PromptCursor:
    """The prompt cursor a checkpoint saved (:func:`write_rollout_state`)."""
    state = json.loads((path / ROLLOUT_STATE).read_text())
    return PromptCursor.from_json(state["cursor"])


def _free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def _disk_full(error: BaseException, free_bytes: int) -> bool:
    """ENOSPC anywhere in ``error``'s chain, or almost no free space left (torch's writer
    reports a full disk as ``unexpected pos ...`` without an errno)."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return free_bytes < FULL_DISK_BYTES


def _describe_failure(error: Exception, step: int, partial: Path, free_bytes: int) -> str:
    free = f"{free_bytes / 1024**2:.1f} MiB free"
    if _disk_full(error, free_bytes):
        return (
            f"checkpoint {step} could not be written: the disk holding {partial.parent} is full "
            f"(no space left on device, ENOSPC; {free} after the failed write). Free space, "
            "lower save_total_limit, or point output_dir at a larger disk; the partial "
            f"checkpoint was removed and the earlier ones are intact. Cause: "
            f"{type(error).__name__}: {error}"
        )
    return (
        f"checkpoint {step} could not be written to {partial} ({free}); the partial checkpoint "
        f"was removed and the earlier ones are intact. Cause: {type(error).__name__}: {error}"
    )


def save(
    output_dir: str | Path,
    step: int,
    write: Callable[[Path], None],
    *,
    rank0: bool = True,
    keep: int | None = None,
    free_bytes: Callable[[Path], int] = _free_bytes,
) -> Path:
    """Write checkpoint ``step`` with ``write(directory)`` (collective over the ranks: every
    rank writes into the same directory), then rank 0 renames it into place and prunes all but
    the newest ``keep`` complete checkpoints.

    Raises:
        CheckpointError: ``write`` failed; says whether the disk is full (on rank 0; other
            ranks re-raise what they got).
    """
    output_dir = Path(output_dir)
    partial = output_dir / f"{CHECKPOINT_PREFIX}{step}{PARTIAL_SUFFIX}"
    final = output_dir / f"{CHECKPOINT_PREFIX}{step}"
    try:
        write(partial)
    except Exception as error:
        if not rank0:
            raise
        free = free_bytes(output_dir)
        shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(_describe_failure(error, step, partial, free)) from error
    except BaseException:
        if rank0:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    if rank0:
        _publish(partial, final)
        prune(output_dir, keep)
    return final


def _publish(partial: Path, final: Path) -> None:
    """Rename ``partial`` to ``final`` (replacing an older ``final`` of the same step)."""
    if final.exists():
        replaced = final.with_name(final.name + ".replaced")
        shutil.rmtree(replaced, ignore_errors=True)
        final.rename(replaced)
        partial.rename(final)
        shutil.rmtree(replaced)
    else:
        partial.rename(final)
    directory = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def remove_partials(output_dir: str | Path) -> None:
    """Delete ``.partial`` directories left by saves that did not finish (rank 0, at start)."""
    for path in Path(output_dir).glob(f"{CHECKPOINT_PREFIX}*{PARTIAL_SUFFIX}"):
        shutil.rmtree(path, ignore_errors=True)


def prune(output_dir: str | Path, keep: int | None) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints (nothing when ``keep`` is
    falsy); incomplete ones older than the newest complete one go too. Returns the deleted."""
    if not keep:
        return []
    found = checkpoints(output_dir)
    complete = [p for p in found if is_complete(p)]
    if not complete:
        return []
    kept = set(complete[-keep:])
    newest = _parse(complete[-1])[0]
    doomed = [p for p in found if p not in kept and _parse(p)[0] <= newest]
    for path in doomed:
        shutil.rmtree(path)
    return doomed
