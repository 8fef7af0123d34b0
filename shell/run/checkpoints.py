"""The checkpoints of a run directory: ``<output_dir>/checkpoint-<step>/``, written atomically.

A checkpoint is written into ``checkpoint-<step>.partial/`` and renamed to
``checkpoint-<step>/`` only once every file is in place, so a run killed while saving, or a disk
that fills up, never leaves a checkpoint that looks complete. ``rollout_state.json`` is written
last: the prompt cursor, policy version and step of the rollout side, and the size of every other
file the checkpoint holds (``files``), beside what the learner writes
(:mod:`asyncgrpo.shell.learner.checkpoint`), ``model_source.json`` and
``queued_samples.safetensors``: the samples generated and queued, not trained yet, which a
resumed run puts back on its queue (:mod:`asyncgrpo.core.run.saved_samples`) instead of
generating them again.

A checkpoint is *complete* when its save finished and every file checks (:func:`check_loads`,
without loading the tensors): ``rollout_state.json`` parses and holds its keys, every file it
lists is there with the size it was written with, ``model_source.json`` names a model, and the
learner's files load (:func:`~asyncgrpo.shell.learner.check_learner_files`). Which checkpoint a
resume takes and which ones ``save_total_limit`` deletes is the core's decision over these
findings (:mod:`asyncgrpo.core.run.checkpoint_choice`): a resume takes the newest complete
checkpoint and names the newer ones it skipped, with the file and what is wrong; rotation counts
only complete checkpoints, after the new one is renamed into place and checked. A checkpoint
named explicitly that is not complete fails naming the file.

A failed write, whatever raised it (torch's distributed checkpoint raises
``CheckpointException``, a ``BaseException``), becomes a :class:`CheckpointError` naming the
cause; a full disk is recognised by the free space left after the failure (torch reports it as
``unexpected pos ...``, without an errno).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import structlog
from torch.distributed.checkpoint.api import CheckpointException

from asyncgrpo.adapters.checkpoint_files import (
    DamagedFile,
    check_file_sizes,
    file_sizes,
    read_arrays,
    read_json_object,
    write_arrays,
)
from asyncgrpo.core.records import TrainingSample
from asyncgrpo.core.rollout.cursor import PromptCursor, split_by_checkpoint
from asyncgrpo.core.run.checkpoint_choice import SavedCheckpoint, choose_resume, to_rotate
from asyncgrpo.core.run.saved_samples import (
    check_queued,
    samples_from_arrays,
    samples_to_arrays,
)
from asyncgrpo.shell.learner import Learner, check_learner_files
from asyncgrpo.shell.run.interrupts import interrupts_deferred

log = structlog.get_logger("asyncgrpo.checkpoints")

CHECKPOINT_PREFIX = "checkpoint-"
MODEL_SOURCE = "model_source.json"  # the model a checkpoint's weights belong to
PARTIAL_SUFFIX = ".partial"
ROLLOUT_STATE = "rollout_state.json"
ROLLOUT_STATE_KEYS = ("cursor", "version", "step")
QUEUED_SAMPLES = "queued_samples.safetensors"  # samples queued, not trained, at the save
SAMPLE_RECORDS = "samples"  # the metadata key of QUEUED_SAMPLES: one JSON record per sample
FILES_KEY = "files"  # in rollout_state.json: every other file's size in bytes, by relative path
FULL_DISK_BYTES = 16 * 1024**2  # less free space than this after a failed write: a full disk
FULL_DISK_FRACTION = 0.05  # ... or than this fraction of a smaller filesystem


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (the message says whether the disk is full)."""


def _parse(path: Path) -> tuple[int, bool] | None:
    """``checkpoint-12`` -> ``(12, False)``, ``checkpoint-12.partial`` -> ``(12, True)``."""
    name = path.name
    if not name.startswith(CHECKPOINT_PREFIX):
        return None
    number = name.removeprefix(CHECKPOINT_PREFIX).removesuffix(PARTIAL_SUFFIX)
    return (int(number), name.endswith(PARTIAL_SUFFIX)) if number.isdigit() else None


def _parsed(path: Path) -> tuple[int, bool]:
    """:func:`_parse` of a checkpoint directory's path.

    Raises:
        ValueError: ``path`` is not named as a checkpoint directory.
    """
    parsed = _parse(path)
    if parsed is None:
        raise ValueError(
            f"{path} is not a checkpoint directory: its name must be "
            f"{CHECKPOINT_PREFIX}<step> or {CHECKPOINT_PREFIX}<step>{PARTIAL_SUFFIX}"
        )
    return parsed


def _saves(output_dir: str | Path) -> list[Path]:
    """Every checkpoint directory, ``.partial`` ones included, oldest first."""
    found = [p for p in Path(output_dir).glob(f"{CHECKPOINT_PREFIX}*") if _parse(p)]
    return sorted(found, key=_parsed)


def checkpoints(output_dir: str | Path) -> list[Path]:
    """The run's checkpoint directories (complete or not, no ``.partial``), oldest first."""
    return [p for p in _saves(output_dir) if not _parsed(p)[1]]


def check_loads(path: Path) -> None:
    """Check that checkpoint ``path`` is complete, without loading the tensors:
    ``rollout_state.json`` parses into a prompt cursor and a step, every file it lists is there
    with the size it was written with (checkpoints written before the sizes were recorded skip
    this), ``model_source.json`` (where there is one) names a model, and the learner's files
    load (:func:`~asyncgrpo.shell.learner.check_learner_files`).

    Raises:
        CheckpointError: naming the file that is missing, empty, cut short or does not load,
            and what is wrong.
    """
    state = path / ROLLOUT_STATE
    if not state.is_file():
        raise CheckpointError(
            f"checkpoint {path} is incomplete: {state}: missing (written last; the save did "
            "not finish)"
        )
    try:
        saved = read_json_object(state, ROLLOUT_STATE_KEYS)
        _parse_rollout_state(saved, state, _queued_samples(path))
        if FILES_KEY in saved:
            check_file_sizes(path, _listed_sizes(saved[FILES_KEY], state), ROLLOUT_STATE)
        if (path / MODEL_SOURCE).exists():
            read_json_object(path / MODEL_SOURCE, ("model",))
        check_learner_files(path)
    except DamagedFile as error:
        raise CheckpointError(f"checkpoint {path} does not load: {error}") from error


def _listed_sizes(listed: Any, state: Path) -> dict[str, int]:
    """The ``files`` of a rollout state: relative paths to sizes in bytes."""
    if not isinstance(listed, dict) or not all(
        isinstance(k, str) and isinstance(v, int) for k, v in listed.items()
    ):
        raise DamagedFile(state, f"its {FILES_KEY!r} is not an object of file sizes")
    return listed


def survey(path: Path) -> SavedCheckpoint:
    """What the core needs to know of checkpoint directory ``path``: its step, whether its
    save finished and, when it did, what is wrong with its files (:func:`check_loads`)."""
    step, unfinished = _parsed(path)
    if unfinished:
        return SavedCheckpoint(step, finished=False)
    try:
        check_loads(path)
    except CheckpointError as error:
        return SavedCheckpoint(step, problem=str(error))
    return SavedCheckpoint(step)


def latest(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint, or ``None`` when the run saved none."""
    return resumable(output_dir).checkpoint


@attrs.frozen
class Resumable:
    """The checkpoint to resume from, and the newer ones skipped (with why, in ``reasons``)
    because they are incomplete or do not load."""

    checkpoint: Path | None
    skipped: tuple[Path, ...]
    reasons: tuple[str, ...] = ()


def resumable(output_dir: str | Path) -> Resumable:
    """The newest complete checkpoint of ``output_dir`` and the newer ones that are not (a
    ``.partial`` directory of a killed save, a checkpoint missing its rollout state, a file
    missing, empty, cut short or that does not load): checked newest first, down to the first
    complete one (:func:`~asyncgrpo.core.run.checkpoint_choice.choose_resume`)."""
    paths: dict[SavedCheckpoint, Path] = {}
    for path in reversed(_saves(output_dir)):
        record = survey(path)
        paths[record] = path
        if record.complete:
            break
    choice = choose_resume(list(paths))
    return Resumable(
        None if choice.checkpoint is None else paths[choice.checkpoint],
        tuple(paths[s] for s in choice.skipped),
        tuple(s.why_not_complete or "" for s in choice.skipped),
    )


def find_for_resume(output_dir: str | Path) -> Path:
    """The checkpoint ``resume_from_checkpoint=True`` resumes from; skipped ones are logged
    with the file and what is wrong.

    Raises:
        FileNotFoundError: no checkpoint in ``output_dir`` is complete.
    """
    found = resumable(output_dir)
    if found.skipped:
        log.warning(
            "skipped checkpoints that are incomplete or do not load",
            skipped=[
                f"{p.name}: {why}" for p, why in zip(found.skipped, found.reasons, strict=True)
            ],
            resuming_from=str(found.checkpoint),
        )
    if found.checkpoint is None:
        incomplete = f" (skipped: {list(found.reasons)})" if found.skipped else ""
        raise FileNotFoundError(
            f"resume_from_checkpoint=True but {output_dir} holds no complete checkpoint that "
            f"loads{incomplete}; put a complete one back, or train from the start without "
            "resume_from_checkpoint (asyncgrpo train without --resume)"
        )
    return found.checkpoint


def write_queued_samples(path: Path, samples: Sequence[TrainingSample]) -> None:
    """Write the samples queued and not trained yet into checkpoint directory ``path`` (rank 0,
    before :func:`write_rollout_state`, which lists its size)."""
    arrays, records = samples_to_arrays(samples)
    write_arrays(path / QUEUED_SAMPLES, arrays, {SAMPLE_RECORDS: json.dumps(records)})


def _queued_samples(path: Path) -> tuple[TrainingSample, ...] | None:
    """The samples checkpoint ``path`` kept queued; None for a checkpoint written before they
    were kept (its split groups' samples left are dropped on resume).

    Raises:
        DamagedFile: the file is damaged or its samples do not load.
    """
    file = path / QUEUED_SAMPLES
    if not file.exists():
        return None
    arrays, metadata = read_arrays(file)
    try:
        records = json.loads(metadata[SAMPLE_RECORDS])
        return samples_from_arrays(arrays, records, queued_at=time.monotonic())
    except (KeyError, ValueError, TypeError) as error:
        raise DamagedFile(file, f"does not hold queued samples: {error}") from error


def write_rollout_state(
    path: Path, cursor: PromptCursor, version: int, step: int, last_evaluated: int | None = None
) -> None:
    """Write ``rollout_state.json`` into checkpoint directory ``path`` (rank 0, last, once
    every process wrote its files); with the version evaluated last (None: none), which a
    resumed run does not evaluate again, and the size of every other file under ``path``
    (``files``), which :func:`check_loads` compares with the files found."""
    state = {
        "cursor": cursor.to_json(),
        "version": version,
        "step": step,
        "last_evaluated": last_evaluated,
        FILES_KEY: file_sizes(path, leave_out=(ROLLOUT_STATE,)),
    }
    (path / ROLLOUT_STATE).write_text(json.dumps(state, indent=2))


@attrs.frozen
class RolloutState:
    """What a checkpoint saved of the rollout side (:func:`write_rollout_state`).

    Attributes:
        cursor: the prompt cursor (the first untrained position and those done after it).
        step: the optimizer step the checkpoint was written after.
        last_evaluated: the version the run evaluated last; None for none, and for checkpoints
            written before evaluations were recorded (a resumed run does not evaluate it again).
        split_groups: the samples left of each group the checkpoint split (some of its samples
            trained before it, the rest queued), by prompt position, where the resumed run
            drops them (:func:`asyncgrpo.core.rollout.cursor.split_by_checkpoint`): a
            checkpoint written before the queued samples were kept; else empty.
        queued: the samples queued and not trained at the save, which the resumed run puts
            back on its queue; None for a checkpoint written before they were kept.
    """

    cursor: PromptCursor
    step: int
    last_evaluated: int | None
    split_groups: dict[int, int]
    queued: tuple[TrainingSample, ...] | None = None


def read_rollout_state(path: Path) -> RolloutState:
    """The rollout state checkpoint ``path`` saved, from one read of ``rollout_state.json``.

    Raises:
        DamagedFile: the file is missing, empty, does not parse or lacks a key (names it).
    """
    file = path / ROLLOUT_STATE
    state = read_json_object(file, ROLLOUT_STATE_KEYS)
    return _parse_rollout_state(state, file, _queued_samples(path))


def _parse_rollout_state(
    state: dict[str, Any], file: Path, queued: tuple[TrainingSample, ...] | None
) -> RolloutState:
    """The rollout state of ``state`` (``rollout_state.json``, read from ``file``) and the
    samples the checkpoint kept queued (None: it kept none, it predates them).

    Raises:
        DamagedFile: the state does not parse, or the samples are not those its cursor has
            queued (by prompt position).
    """
    try:
        last_evaluated = state.get("last_evaluated")
        saved_cursor = state["cursor"]
        if queued is None:
            cursor, split = PromptCursor.from_json(saved_cursor), split_by_checkpoint(saved_cursor)
        else:
            cursor, split = PromptCursor.with_queue_restored(saved_cursor), {}
            check_queued(queued, cursor.pending, QUEUED_SAMPLES)
        return RolloutState(
            cursor=cursor,
            step=int(state["step"]),
            last_evaluated=None if last_evaluated is None else int(last_evaluated),
            split_groups=split,
            queued=queued,
        )
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise DamagedFile(
            file, f"does not hold a rollout state ({type(error).__name__}: {error})"
        ) from error


def load_rollout_state(path: Path) -> RolloutState:
    """:func:`read_rollout_state` for a resume.

    Raises:
        CheckpointError: the rollout state does not load (names the file).
    """
    try:
        return read_rollout_state(path)
    except DamagedFile as error:
        raise CheckpointError(f"checkpoint {path} does not load: {error}") from error


def write_model_source(path: Path, model: str, peft_config: dict[str, Any] | None) -> None:
    """Write what a checkpoint's weights need to become a model again (``asyncgrpo eval`` of a
    checkpoint): the base model's name or path and the LoRA config, if any (rank 0)."""
    source = {"model": model, "peft_config": peft_config}
    (path / MODEL_SOURCE).write_text(json.dumps(source, indent=2, default=_jsonable))


def read_model_source(path: Path) -> tuple[str, dict[str, Any] | None]:
    """``(model, peft_config)`` of a checkpoint (:func:`write_model_source`).

    Raises:
        CheckpointError: the checkpoint has no model record (names the file and the fix).
    """
    file = path / MODEL_SOURCE
    try:
        source = json.loads(file.read_text())
        return str(source["model"]), source.get("peft_config")
    except (OSError, ValueError, KeyError) as error:
        raise CheckpointError(
            f"{file} does not load ({type(error).__name__}: {error}); checkpoints written "
            "before asyncgrpo recorded their model have none: evaluate the run's saved model "
            "(its output_dir) instead"
        ) from error


def _jsonable(value: Any) -> Any:
    """A value of a PEFT config as JSON: sets become sorted lists, enums their values."""
    if isinstance(value, set | frozenset):
        return sorted(value)
    return getattr(value, "value", str(value))


def _free_bytes(path: Path) -> int:
    return shutil.disk_usage(path).free


def _total_bytes(path: Path) -> int:
    return shutil.disk_usage(path).total


def _causes(error: BaseException) -> list[BaseException]:
    """``error``, its chain, and the per-rank failures a ``CheckpointException`` wraps."""
    found: list[BaseException] = []
    pending = [error]
    while pending:
        seen: BaseException | None = pending.pop()
        while seen is not None and seen not in found:
            found.append(seen)
            if isinstance(seen, CheckpointException):
                pending += [failure[0] for failure in seen.failures.values()]
            seen = seen.__cause__ or seen.__context__
    return found


def _disk_full(error: BaseException, free_bytes: int, total_bytes: int | None = None) -> bool:
    """ENOSPC anywhere in ``error``'s causes, or almost no free space left: less than
    ``FULL_DISK_BYTES``, or on a filesystem smaller than 20 times that, less than
    ``FULL_DISK_FRACTION`` of it (torch's writer reports a full disk as ``unexpected pos ...``
    without an errno)."""
    for seen in _causes(error):
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(seen):
            return True
    limit = FULL_DISK_BYTES
    if total_bytes is not None:
        limit = min(limit, int(total_bytes * FULL_DISK_FRACTION))
    return free_bytes < limit


def _cause(error: BaseException) -> str:
    """One line per distinct cause: for a ``CheckpointException``, each rank's error (its
    own message is a traceback dump)."""
    if isinstance(error, CheckpointException):
        ranks = [
            f"rank {rank}: {type(failure[0]).__name__}: {failure[0]}"
            for rank, failure in sorted(error.failures.items())
        ]
        return f"{type(error).__name__} ({'; '.join(ranks) or 'no rank named'})"
    return f"{type(error).__name__}: {error}"


def _describe_failure(
    error: BaseException, step: int, partial: Path, free_bytes: int, total_bytes: int | None
) -> str:
    free = f"{free_bytes / 1024**2:.1f} MiB free"
    if _disk_full(error, free_bytes, total_bytes):
        return (
            f"checkpoint {step} could not be written: the disk holding {partial.parent} is full "
            f"(no space left on device, ENOSPC; {free} after the failed write). Free space, "
            "lower save_total_limit, or point output_dir at a larger disk; the partial "
            f"checkpoint was removed and the earlier ones are intact. Cause: {_cause(error)}"
        )
    return (
        f"checkpoint {step} could not be written to {partial} ({free}); the partial checkpoint "
        f"was removed and the earlier ones are intact. Cause: {_cause(error)}"
    )


def _write_failed(error: BaseException) -> bool:
    """Whether ``error`` is a failed write (to turn into a :class:`CheckpointError`), not an
    interrupt or an exit passing through."""
    return isinstance(error, Exception | CheckpointException)


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
        CheckpointError: ``write`` failed (an ``Exception`` or torch's
            ``CheckpointException``); names the cause and says whether the disk is full (on
            rank 0; other ranks re-raise what they got). An interrupt passes through.
    """
    output_dir = Path(output_dir)
    partial = output_dir / f"{CHECKPOINT_PREFIX}{step}{PARTIAL_SUFFIX}"
    final = output_dir / f"{CHECKPOINT_PREFIX}{step}"
    try:
        write(partial)
    except BaseException as error:
        if not rank0:
            raise
        if not _write_failed(error):
            shutil.rmtree(partial, ignore_errors=True)
            raise
        free = free_bytes(output_dir)
        total = _total_bytes(output_dir)
        shutil.rmtree(partial, ignore_errors=True)
        raise CheckpointError(_describe_failure(error, step, partial, free, total)) from error
    if rank0:
        _publish(partial, final)
        written = survey(final)
        if written.problem is not None:
            log.warning(
                "a checkpoint was written but does not check; it does not count toward "
                "save_total_limit and the earlier ones are kept",
                checkpoint=str(final),
                problem=written.problem,
            )
        prune(output_dir, keep, checked={final: written})
    return final


def save_run(
    output_dir: str | Path,
    learner: Learner,
    *,
    rank0: bool,
    keep: int | None,
    model_name: str,
    cursor: PromptCursor,
    version: int,
    last_evaluated: int | None,
    queued: Sequence[TrainingSample],
) -> Path:
    """A run's checkpoint at the learner's step (:func:`save`), written whole or not at all: a
    signal waits until it is (:func:`~asyncgrpo.shell.run.interrupts.interrupts_deferred`).
    Every rank writes the learner's state; rank 0 adds the model's source, the ``queued``
    samples (generated, not trained yet) and the rollout state (the prompt cursor, the policy
    ``version`` the servers hold, the last evaluated version)."""

    def write(path: Path) -> None:
        learner.save_checkpoint(path)
        if rank0:
            write_model_source(path, model_name, learner.lora_config)
            write_queued_samples(path, queued)
            write_rollout_state(path, cursor, version, learner.step, last_evaluated=last_evaluated)

    with interrupts_deferred():
        return save(output_dir, learner.step, write, rank0=rank0, keep=keep)


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


def prune(
    output_dir: str | Path,
    keep: int | None,
    checked: Mapping[Path, SavedCheckpoint] | None = None,
) -> list[Path]:
    """Delete what ``save_total_limit=keep`` says (nothing when ``keep`` is falsy): all but
    the newest ``keep`` complete checkpoints, complete meaning that every file checks
    (:func:`survey`; ``checked`` holds findings already made), so a damaged checkpoint is never
    the one kept (:func:`~asyncgrpo.core.run.checkpoint_choice.to_rotate`). Returns the
    deleted, oldest first."""
    if not keep:
        return []
    known = dict(checked or {})
    paths = {known[p] if p in known else survey(p): p for p in checkpoints(output_dir)}
    doomed = to_rotate(list(paths), keep)
    for record in doomed:
        if record.problem is not None:
            log.warning(
                "deleting a damaged checkpoint older than the newest complete one "
                "(save_total_limit)",
                checkpoint=str(paths[record]),
                problem=record.problem,
            )
        shutil.rmtree(paths[record])
    return [paths[record] for record in doomed]
