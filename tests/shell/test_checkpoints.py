"""Atomic checkpoints: written beside their final name and renamed when complete, a failed
write names a full disk, resume takes the newest complete one, pruning keeps the newest."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from asyncgrpo.shell.run import checkpoints
from asyncgrpo.shell.run.checkpoints import CheckpointError
from asyncgrpo.shell.run.metrics_log import drop_rows_after


def write_complete(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    torch.save({"w": torch.ones(4)}, path / "learner_state.pt")
    (path / checkpoints.ROLLOUT_STATE).write_text("{}")


def write_to_full_device(path: Path) -> None:
    """A file of the checkpoint lands on ``/dev/full``: the kernel answers ENOSPC, as on a
    full disk, and torch's writer reports it its own way (``unexpected pos ...``)."""
    path.mkdir(parents=True)
    os.symlink("/dev/full", path / "learner_state.pt")
    torch.save({"w": torch.ones(10_000)}, path / "learner_state.pt")


def test_a_checkpoint_appears_only_when_complete(tmp_path) -> None:
    seen = []

    def write(path: Path) -> None:
        seen.append((path.name, (tmp_path / "checkpoint-3").exists()))
        write_complete(path)

    final = checkpoints.save(tmp_path, 3, write)
    assert seen == [("checkpoint-3.partial", False)]
    assert final == tmp_path / "checkpoint-3" and checkpoints.is_complete(final)
    assert not (tmp_path / "checkpoint-3.partial").exists()
    checkpoints.save(tmp_path, 3, write_complete)  # saving a step again replaces it
    assert checkpoints.checkpoints(tmp_path) == [final]


def test_a_full_disk_is_named_and_leaves_no_checkpoint(tmp_path) -> None:
    checkpoints.save(tmp_path, 1, write_complete)
    # torch's error carries no errno; the free space tells. A filesystem that has filled up
    # cannot be made here without root, so this reports the free space a full one would
    # (a fake, named as such).
    with pytest.raises(CheckpointError, match=r"disk holding .* is full \(no space left"):
        checkpoints.save(tmp_path, 2, write_to_full_device, free_bytes=lambda _: 4096)
    assert checkpoints.checkpoints(tmp_path) == [tmp_path / "checkpoint-1"]
    assert not (tmp_path / "checkpoint-2.partial").exists()


def test_enospc_is_named_whatever_the_free_space(tmp_path) -> None:
    def write(path: Path) -> None:
        path.mkdir()
        with open("/dev/full", "wb") as device:
            device.write(b"x" * 1024)

    with pytest.raises(CheckpointError, match="is full") as raised:
        checkpoints.save(tmp_path, 1, write)
    assert isinstance(raised.value.__cause__, OSError)


def test_other_failures_do_not_blame_the_disk(tmp_path) -> None:
    def write(path: Path) -> None:
        path.mkdir()
        raise ValueError("a tensor went missing")

    with pytest.raises(CheckpointError, match="could not be written to") as raised:
        checkpoints.save(tmp_path, 1, write, free_bytes=lambda _: 10 * 1024**3)
    assert "full" not in str(raised.value) and "a tensor went missing" in str(raised.value)
    assert list(tmp_path.iterdir()) == []


def test_resume_takes_the_newest_complete_checkpoint_and_names_the_skipped(tmp_path) -> None:
    write_complete(tmp_path / "checkpoint-1")
    write_complete(tmp_path / "checkpoint-2")
    (tmp_path / "checkpoint-3").mkdir()  # written in place by an older version, then killed
    (tmp_path / "checkpoint-4.partial").mkdir()  # a save that did not finish
    found = checkpoints.resumable(tmp_path)
    assert found.checkpoint == tmp_path / "checkpoint-2"
    assert [p.name for p in found.skipped] == ["checkpoint-4.partial", "checkpoint-3"]
    assert checkpoints.find_for_resume(tmp_path) == tmp_path / "checkpoint-2"
    assert checkpoints.latest(tmp_path) == tmp_path / "checkpoint-2"


def test_resume_without_a_complete_checkpoint_says_so(tmp_path) -> None:
    (tmp_path / "checkpoint-5").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no complete checkpoint.*checkpoint-5"):
        checkpoints.find_for_resume(tmp_path)


def test_pruning_keeps_the_newest_complete_checkpoints(tmp_path) -> None:
    for step in (1, 2, 3, 4):
        write_complete(tmp_path / f"checkpoint-{step}")
    (tmp_path / "checkpoint-10").mkdir()  # incomplete and newer: not pruned, not counted
    deleted = checkpoints.prune(tmp_path, keep=2)
    assert sorted(p.name for p in deleted) == ["checkpoint-1", "checkpoint-2"]
    names = [p.name for p in checkpoints.checkpoints(tmp_path)]
    assert names == ["checkpoint-3", "checkpoint-4", "checkpoint-10"]
    assert checkpoints.prune(tmp_path, keep=None) == []


def test_rows_after_the_resumed_step_are_dropped(tmp_path) -> None:
    rows = "".join(json.dumps({"step": s, "reward": 0.5}) + "\n" for s in (1, 2, 3, 4))
    (tmp_path / "metrics.jsonl").write_text(rows + '{"step": 5, "rew')  # cut short by a kill
    (tmp_path / "completions.jsonl").write_text(rows)
    drop_rows_after(tmp_path, 2)
    for name in ("metrics.jsonl", "completions.jsonl"):
        lines = (tmp_path / name).read_text().splitlines()
        assert [json.loads(line)["step"] for line in lines] == [1, 2]
