"""Files and directories replaced whole: the old content or the new one, never part of one."""

from __future__ import annotations

import os

import pytest

from asyncgrpo.adapters.atomic_files import partial_path, replaced_whole, write_text_whole


def test_a_file_is_replaced_and_no_partial_file_stays(tmp_path) -> None:
    file = tmp_path / "index.json"
    write_text_whole(file, "old")
    write_text_whole(file, "new")
    assert file.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["index.json"]


def test_a_failed_write_leaves_the_old_file_and_no_partial_file(tmp_path) -> None:
    file = tmp_path / "index.json"
    write_text_whole(file, "old")
    with pytest.raises(RuntimeError, match="disk full"), replaced_whole(file) as partial:
        partial.write_text("half of the ne")
        raise RuntimeError("disk full")
    assert file.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["index.json"]


def test_what_a_killed_writer_left_is_removed_first(tmp_path) -> None:
    file = tmp_path / "model.safetensors"
    partial_path(file).mkdir()  # a killed export left a directory of that name
    (partial_path(file) / "shard").write_text("stale")
    with replaced_whole(file) as partial:
        assert not partial.exists()
        partial.write_text("weights")
    assert file.read_text() == "weights"


def test_a_directory_is_published_unless_another_writer_finished_first(tmp_path) -> None:
    target = tmp_path / "model"
    with replaced_whole(target, unique=True) as partial:
        assert partial.name == f".model.partial-{os.getpid()}"
        partial.mkdir()
        (partial / "config.json").write_text("{}")
    assert (target / "config.json").read_text() == "{}"
    with pytest.raises(OSError), replaced_whole(target, unique=True) as partial:
        partial.mkdir()
        (partial / "config.json").write_text('{"second": true}')
    assert (target / "config.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
