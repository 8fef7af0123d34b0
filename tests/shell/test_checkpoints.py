"""Atomic checkpoints: written beside their final name and renamed when complete, a failed
write names a full disk, resume takes the newest complete one, pruning keeps the newest.
Damaged files, file by file: ``test_checkpoint_damage.py``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import attrs
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from asyncgrpo.core.rollout.cursor import PromptCursor
from asyncgrpo.shell.run import checkpoints
from asyncgrpo.shell.run.checkpoints import ROLLOUT_STATE, CheckpointError
from asyncgrpo.shell.run.metrics_log import drop_rows_after


def write_complete(path: Path) -> None:
    """The files a checkpoint holds, with the learner's layout (a sharded ``dcp/`` written by
    torch's distributed checkpoint, ``learner_state.pt``, an RNG state) and a rollout state."""
    path.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": {"w": torch.ones(64)}}, checkpoint_id=str(path / "dcp"))
    torch.save({"step": 1, "scheduler": {}}, path / "learner_state.pt")
    torch.save({"cpu": torch.get_rng_state()}, path / "rng_state_0.pth")
    checkpoints.write_rollout_state(path, PromptCursor(3), version=1, step=1)


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
    assert final == tmp_path / "checkpoint-3" and (final / ROLLOUT_STATE).is_file()
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
    assert "rollout_state.json: missing (written last" in found.reasons[1]
    assert checkpoints.find_for_resume(tmp_path) == tmp_path / "checkpoint-2"
    assert checkpoints.latest(tmp_path) == tmp_path / "checkpoint-2"


def test_surveying_a_directory_not_named_as_a_checkpoint_names_the_pattern(tmp_path) -> None:
    (tmp_path / "checkpoint-2").mkdir()
    assert checkpoints.survey(tmp_path / "checkpoint-2").step == 2
    with pytest.raises(ValueError, match=r"not a checkpoint directory.*checkpoint-<step>"):
        checkpoints.survey(tmp_path / "final-model")


def test_resume_without_a_complete_checkpoint_says_so(tmp_path) -> None:
    (tmp_path / "checkpoint-5").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no complete checkpoint that loads.*checkpoint-5"):
        checkpoints.find_for_resume(tmp_path)


def test_a_distributed_checkpoint_exception_becomes_a_checkpoint_error(tmp_path) -> None:
    """torch's distributed checkpoint raises ``CheckpointException``, a ``BaseException``:
    it is converted like any failure, naming each rank's cause; an interrupt passes through."""

    def write(path: Path) -> None:
        path.mkdir()
        inner = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704")
        raise CheckpointException("CheckpointException", {0: (inner, None)})

    with pytest.raises(
        CheckpointError,
        match=r"could not be written to .*Cause: "
        r"CheckpointException \(rank 0: RuntimeError: .*unexpected pos 704\)",
    ):
        checkpoints.save(tmp_path, 1, write, free_bytes=lambda _: 10 * 1024**3)
    with pytest.raises(CheckpointError, match="is full"):  # whatever torch says: free space
        checkpoints.save(tmp_path, 1, write, free_bytes=lambda _: 4096)

    def interrupted(path: Path) -> None:
        path.mkdir()
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        checkpoints.save(tmp_path, 2, interrupted)
    assert list(tmp_path.iterdir()) == []


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


def in_private_mount_namespace() -> list[str]:
    """A command prefix that runs a program in a mount namespace of its own (as root inside a
    user namespace when not root), so the tmpfs it mounts is gone when it exits."""
    prefix = ["unshare", "--mount"]
    if os.geteuid() != 0:
        prefix += ["--user", "--map-root-user"]
    probe = subprocess.run([*prefix, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a private mount namespace here: {probe.stderr.strip()}")
    return prefix


@pytest.mark.slow  # a real save onto a full filesystem: about 9 s
def test_a_full_disk_is_named_through_the_real_save_path(tiny_qwen3, tmp_path) -> None:
    """A real learner's checkpoint (torch's distributed checkpoint, ~6.9 MB for the tiny
    Qwen3) saved twice onto a 10 MiB tmpfs: the first fits, the second fills the disk. torch
    raises ``CheckpointException`` (a ``BaseException``) whose inner error reads ``unexpected
    pos ...``; the run's save path names the full disk, removes the partial checkpoint and
    leaves the first one loadable."""
    script = Path(__file__).parents[1] / "support" / "full_disk_save.py"
    command = [
        *in_private_mount_namespace(),
        sys.executable,
        str(script),
        str(tiny_qwen3),
        str(tmp_path / "small-disk"),
        str(10 * 1024**2),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["first"].endswith("checkpoint-1")
    assert re.search(
        r"checkpoint 2 could not be written: the disk holding .* is full", result["error"]
    ), result
    assert "CheckpointException (rank 0: " in result["error"], result["error"]
    assert result["cause"] == "CheckpointException"
    assert result["left"] == ["checkpoint-1"] and result["first_loads"]


def test_the_queued_samples_come_back_with_their_positions_pending(tmp_path) -> None:
    """A checkpoint keeps the samples generated and not trained yet: a resume reads them back
    with the cursor that has them queued (a split group keeps what it had taken, nothing is
    dropped), and a samples file that does not match the cursor is named as damaged."""
    from packing_strategies import make_sample

    from asyncgrpo.core.rollout.cursor import group_outcome, samples_consumed

    # make_sample's group is the prompt position too
    queued = [make_sample([1, 2, 3 + i], [0, 1, 1], group=p) for i, p in enumerate([5, 5, 7])]
    cursor = group_outcome(group_outcome(PromptCursor(5), 5, 3), 7, 1)
    cursor = samples_consumed(cursor, [5])  # position 5: one of its 3 samples trained
    write_complete(tmp_path)
    checkpoints.write_queued_samples(tmp_path, queued)
    checkpoints.write_rollout_state(tmp_path, cursor, version=2, step=2)
    checkpoints.check_loads(tmp_path)
    state = checkpoints.read_rollout_state(tmp_path)
    assert state.cursor == cursor and state.split_groups == {}
    assert state.queued is not None
    assert [attrs.evolve(s, queued_at=0.0) for s in state.queued] == queued
    checkpoints.write_queued_samples(tmp_path, queued[:2])  # position 7's sample lost
    checkpoints.write_rollout_state(tmp_path, cursor, version=2, step=2)
    with pytest.raises(CheckpointError, match="queued_samples.safetensors holds samples of"):
        checkpoints.check_loads(tmp_path)
