"""Damaged checkpoints, as a crashed node, a full disk or an object store that stopped leaves
them: every file a checkpoint holds, cut short, emptied or deleted, is named with what is
wrong; a resume falls back to the newest complete checkpoint and says so; ``save_total_limit``
never keeps a damaged checkpoint in place of the last complete one.

The checkpoint is a real learner's (the tiny Qwen3, no server), saved once per module through
the run's save path and copied for each case."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from asyncgrpo.adapters.checkpoint_files import DamagedFile, check_safetensors
from asyncgrpo.adapters.models.causal_lm import load_causal_lm
from asyncgrpo.core.rollout.cursor import PromptCursor
from asyncgrpo.shell.config import AsyncGRPOConfig
from asyncgrpo.shell.experiments.evaluate import served_model
from asyncgrpo.shell.learner import Learner
from asyncgrpo.shell.run import checkpoints
from asyncgrpo.shell.run.checkpoints import CheckpointError

SHARD = "dcp/__0_0.distcp"
FILES = [
    "rollout_state.json",
    "model_source.json",
    "learner_state.pt",
    "rng_state_0.pth",
    SHARD,
    "dcp/.metadata",
]
"""Every file a one-process checkpoint holds (with N processes: an RNG state and a shard each)."""


@pytest.fixture(scope="module")
def saved(tiny_qwen3, tmp_path_factory) -> Path:
    """A real checkpoint of the tiny Qwen3 after one optimizer step, written as a run writes
    one (:func:`checkpoints.save` around the learner's files, the model record and the rollout
    state)."""
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("saved")
    config = AsyncGRPOConfig(
        output_dir=str(out / "unused"), num_sampler_logprobs=4, seed=0, gradient_checkpointing=False
    )
    with Learner(load_causal_lm(tiny_qwen3), config) as learner:
        learner.optimizer.zero_grad()
        sum(p.sum() for p in learner.model.parameters()).backward()
        learner.optimizer.step()  # an optimizer state to save, as after a real step

        def write(path: Path) -> None:
            learner.save_checkpoint(path)
            checkpoints.write_model_source(path, str(tiny_qwen3), None)
            checkpoints.write_rollout_state(path, PromptCursor(5), version=1, step=1)

        return checkpoints.save(out, 1, write)


def test_the_checkpoint_holds_these_files_and_lists_their_sizes(saved) -> None:
    found = sorted(p.relative_to(saved).as_posix() for p in saved.rglob("*") if p.is_file())
    assert found == sorted(FILES)
    listed = json.loads((saved / "rollout_state.json").read_text())["files"]
    assert listed == {name: (saved / name).stat().st_size for name in sorted(FILES[1:])}
    checkpoints.check_loads(saved)


def damage(file: Path, how: str) -> None:
    if how == "truncate":
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    elif how == "empty":
        file.write_bytes(b"")
    else:
        file.unlink()


# What the check says of each file and damage: with the sizes rollout_state.json lists, and
# for checkpoints written before the sizes were listed, from the files alone (None: a file
# those checkpoints may lack, so its loss cannot be told).
WITH_SIZES = {
    "truncate": r"cut short: \d+ bytes, \d+ when saved \(rollout_state.json\)",
    "empty": r"empty \(0 bytes; \d+ when saved, rollout_state.json\)",
    "delete": r"missing; rollout_state.json lists it \(\d+ bytes\)",
}
STATE = {
    "truncate": r"not valid JSON \(JSONDecodeError",
    "empty": r"empty \(0 bytes\)",
    "delete": r"missing \(written last; the save did not finish\)",
}
WITHOUT_SIZES = {
    "model_source.json": {"truncate": r"not valid JSON", "empty": r"empty \(0 bytes\)"},
    "learner_state.pt": {
        "truncate": r"does not load \(",
        "empty": r"empty \(0 bytes\)",
        "delete": r"missing",
    },
    "rng_state_0.pth": {"truncate": r"does not load \(", "empty": r"empty \(0 bytes\)"},
    SHARD: {
        "truncate": r"cut short: \d+ bytes, .metadata needs \d+",
        "empty": r"cut short: 0 bytes, .metadata needs \d+",
        "delete": r"missing; .*dcp/.metadata refers to it",
    },
    "dcp/.metadata": {
        "truncate": r"does not load \(",
        "empty": r"empty \(0 bytes\)",
        "delete": r"missing",
    },
}


def two_checkpoints(saved: Path, run: Path, listed_sizes: bool) -> tuple[Path, Path]:
    for step in (1, 2):
        shutil.copytree(saved, run / f"checkpoint-{step}")
        if not listed_sizes:  # as written before the sizes were listed
            state = run / f"checkpoint-{step}" / "rollout_state.json"
            state.write_text(
                json.dumps({k: v for k, v in json.loads(state.read_text()).items() if k != "files"})
            )
    return run / "checkpoint-1", run / "checkpoint-2"


def expect_named(run: Path, older: Path, newest: Path, file: Path, problem: str) -> None:
    """Resume takes ``older`` naming ``file`` and ``problem``; named explicitly, ``newest``
    fails with both."""
    with capture_logs() as logs:
        assert checkpoints.find_for_resume(run) == older
    (warning,) = [e for e in logs if e["event"].startswith("skipped checkpoints")]
    assert warning["log_level"] == "warning" and warning["resuming_from"] == str(older)
    (reason,) = warning["skipped"]
    assert reason.startswith("checkpoint-2: ") and re.search(
        f"{re.escape(str(file))}: .*{problem}", reason
    ), reason
    with pytest.raises(CheckpointError, match=f"{re.escape(str(file))}: .*{problem}"):
        checkpoints.check_loads(newest)  # as resume_from_checkpoint=<path> checks it
    checkpoints.check_loads(older)


@pytest.mark.parametrize("how", ["truncate", "empty", "delete"])
@pytest.mark.parametrize("name", FILES)
def test_each_damaged_file_is_named_and_resume_falls_back(saved, tmp_path, name, how) -> None:
    older, newest = two_checkpoints(saved, tmp_path, listed_sizes=True)
    damage(newest / name, how)
    problem = STATE[how] if name == "rollout_state.json" else WITH_SIZES[how]
    expect_named(tmp_path, older, newest, newest / name, problem)


@pytest.mark.parametrize(
    ("name", "how"), [(n, h) for n, kinds in WITHOUT_SIZES.items() for h in kinds]
)
def test_without_listed_sizes_each_file_is_checked_by_what_it_says(
    saved, tmp_path, name, how
) -> None:
    """Checkpoints written before the sizes were listed (and damage that keeps a file's size):
    the sharded checkpoint's metadata gives its data files' sizes, JSON must parse and hold its
    keys, torch files must load."""
    older, newest = two_checkpoints(saved, tmp_path, listed_sizes=False)
    damage(newest / name, how)
    expect_named(tmp_path, older, newest, newest / name, WITHOUT_SIZES[name][how])


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (
            '{"cursor": {"next_untrained": 5, "consumed_after": []}, "version": 1}',
            r"lacks the key\(s\) 'step'",
        ),
        ("[]", "holds a JSON list, not an object"),
        (
            '{"cursor": {"next_untrained": 5}, "version": 1, "step": 1}',
            r"does not hold a rollout state \(ValueError: .*'consumed_after'",
        ),
        (
            '{"cursor": {"next_untrained": 5, "consumed_after": []}, "version": 1, "step": 1, '
            '"files": [1]}',
            "its 'files' is not an object of file sizes",
        ),
    ],
)
def test_a_rollout_state_without_what_a_resume_needs_is_named(
    saved, tmp_path, content, problem
) -> None:
    older, newest = two_checkpoints(saved, tmp_path, listed_sizes=True)
    (newest / "rollout_state.json").write_text(content)
    expect_named(tmp_path, older, newest, newest / "rollout_state.json", problem)


def test_with_no_complete_checkpoint_resume_fails_naming_each(saved, tmp_path) -> None:
    older, newest = two_checkpoints(saved, tmp_path, listed_sizes=True)
    damage(older / "dcp/.metadata", "delete")
    damage(newest / SHARD, "truncate")
    with pytest.raises(
        FileNotFoundError,
        match=r"no complete checkpoint that loads.*"
        r"dcp/__0_0.distcp: cut short.*dcp/.metadata: missing",
    ):
        checkpoints.find_for_resume(tmp_path)


def copy_of(saved: Path, damaged: str | None = None):
    """A checkpoint writer for :func:`checkpoints.save` that copies ``saved``, then damages
    file ``damaged`` (a write that went wrong without raising)."""

    def write(path: Path) -> None:
        shutil.copytree(saved, path)
        if damaged:
            damage(path / damaged, "truncate")

    return write


def test_rotation_does_not_keep_a_damaged_checkpoint_in_place_of_the_complete_one(
    saved, tmp_path
) -> None:
    """save_total_limit=1, a damaged checkpoint-3 left by a crash, and a resumed run saves
    checkpoint-2: the damaged one does not count, checkpoint-2 is kept."""
    shutil.copytree(saved, tmp_path / "checkpoint-1")
    shutil.copytree(saved, tmp_path / "checkpoint-3")
    damage(tmp_path / "checkpoint-3" / SHARD, "truncate")
    checkpoints.save(tmp_path, 2, copy_of(saved), keep=1)
    assert [p.name for p in checkpoints.checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-3"]
    found = checkpoints.resumable(tmp_path)
    assert found.checkpoint == tmp_path / "checkpoint-2"
    assert found.skipped == (tmp_path / "checkpoint-3",)


def test_a_new_checkpoint_that_does_not_check_leaves_the_last_complete_one(saved, tmp_path) -> None:
    """A save that wrote a file short without an error: it is named, and the last complete
    checkpoint stays whatever save_total_limit says."""
    checkpoints.save(tmp_path, 1, copy_of(saved), keep=1)
    with capture_logs() as logs:
        checkpoints.save(tmp_path, 2, copy_of(saved, damaged="learner_state.pt"), keep=1)
    (warning,) = [e for e in logs if e["event"].startswith("a checkpoint was written but")]
    assert warning["checkpoint"] == str(tmp_path / "checkpoint-2")
    assert "checkpoint-2/learner_state.pt: cut short" in warning["problem"]
    assert checkpoints.latest(tmp_path) == tmp_path / "checkpoint-1"
    checkpoints.save(tmp_path, 3, copy_of(saved), keep=1)  # a whole one: the older ones go
    assert [p.name for p in checkpoints.checkpoints(tmp_path)] == ["checkpoint-3"]


def test_the_last_complete_checkpoint_stays_until_the_new_one_is_whole(saved, tmp_path) -> None:
    checkpoints.save(tmp_path, 1, copy_of(saved), keep=1)
    seen = []

    def write(path: Path) -> None:
        seen.append(checkpoints.latest(tmp_path))
        copy_of(saved)(path)
        seen.append(checkpoints.latest(tmp_path))

    checkpoints.save(tmp_path, 2, write, keep=1)
    assert seen == [tmp_path / "checkpoint-1"] * 2
    assert checkpoints.checkpoints(tmp_path) == [tmp_path / "checkpoint-2"]


@pytest.mark.parametrize(
    ("how", "problem"),
    [
        ("truncate", r"cut short: \d+ bytes, its header needs \d+"),
        ("empty", r"empty \(0 bytes\)"),
        ("delete", "missing"),
        ("header", r"cut short: 100 bytes, its header alone needs \d+"),
        ("extra", r"\d+ bytes, 3 more than its header accounts for"),
    ],
)
def test_a_damaged_model_safetensors_is_named(tiny_qwen3, tmp_path, how, problem) -> None:
    """A saved model (``save_model``'s output, an exported checkpoint): loading it names the
    file, where the safetensors library says only "incomplete metadata, file not fully
    covered"."""
    model = tmp_path / "model"
    shutil.copytree(tiny_qwen3, model)
    check_safetensors(model / "model.safetensors")
    file = model / "model.safetensors"
    if how == "header":
        file.write_bytes(file.read_bytes()[:100])
    elif how == "extra":
        file.write_bytes(file.read_bytes() + b"abc")
    else:
        damage(file, how)
    with pytest.raises(DamagedFile, match=f"{re.escape(str(file))}: {problem}"):
        check_safetensors(file)
    if how != "delete":  # without the file, transformers says there are no weights
        with pytest.raises(DamagedFile, match=f"{re.escape(str(file))}: {problem}"):
            load_causal_lm(model)


def test_a_damaged_export_of_a_checkpoint_is_exported_again(saved, tmp_path) -> None:
    """``asyncgrpo eval checkpoint-N`` exports the checkpoint's weights beside it as a model
    (``exported/model.safetensors``); an export cut short is named and written again, and a
    damaged checkpoint is refused naming its file."""
    checkpoint = tmp_path / "checkpoint-1"
    shutil.copytree(saved, checkpoint)
    served = served_model(str(checkpoint))
    weights = Path(served.model) / "model.safetensors"
    check_safetensors(weights)
    damage(weights, "truncate")
    with capture_logs() as logs:
        assert served_model(str(checkpoint)) == served
    (warning,) = [e for e in logs if e["event"].startswith("a damaged export")]
    assert f"{weights}: cut short" in warning["problem"]
    check_safetensors(weights)
    damage(checkpoint / SHARD, "truncate")
    with pytest.raises(CheckpointError, match=f"{re.escape(str(checkpoint / SHARD))}: cut short"):
        served_model(str(checkpoint))
