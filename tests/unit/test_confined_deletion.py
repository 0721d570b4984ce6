"""Deletion is confined: retention, clean-up of partial saves and replacing a checkpoint remove only what this project
made, never follow a symbolic link out, and never delete a directory they do not recognise.

Links (to directories outside, to checkpoints outside) and foreign directories (a megatron-core checkpoint, a
directory without metadata, one named like a staging directory but holding other files) are placed among real
tenplex checkpoints, and every save goes through the real collective ``save_chunks`` (one process).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from tenplex_megatron.engine.chunks import LocalChunk
from tenplex_megatron.engine.save import save_chunks
from tenplex_megatron.execute.collective import RankFailure
from tenplex_megatron.plan.ptc import Chunk, TensorMeta
from tenplex_megatron.storage.directory import (
    apply_retention,
    committed_iterations,
    partial_dirs,
    prepare_partial,
    read_metadata,
    remove_partial,
)
from tenplex_megatron.storage.files import CheckpointFileError

W = torch.arange(12, dtype=torch.float32)


def _save(save: str, it: int, keep: int | None = None):
    chunk = LocalChunk(TensorMeta("w", (12,), "float32"), Chunk("w", (0,), (12,)), W.clone(), True)
    return save_chunks([chunk], save, it, {"tp": 1}, {}, lambda infos: {}, keep=keep)


def _tree(root: str) -> dict[str, bytes]:
    """Every file under ``root`` (links not followed) with its content: what must survive untouched."""
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = fh.read()
    return out


def _write(path: str, data: str = "x") -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(data)


@pytest.fixture
def outside(tmp_path) -> str:
    """A directory outside the save directory, with a file and a valid tenplex checkpoint in it."""
    out = str(tmp_path / "outside")
    _write(os.path.join(out, "precious.txt"), "keep me")
    _save(out, 99)
    return out


def test_retention_deletes_only_real_tenplex_checkpoints_never_links_or_foreign_dirs(tmp_path, outside) -> None:
    save = str(tmp_path / "save")
    before_outside = _tree(outside)
    _save(save, 1)
    _save(save, 2)
    os.symlink(outside, os.path.join(save, "iter_0000001", "link_out"))  # a link inside a checkpoint that goes
    os.symlink(os.path.join(outside, "precious.txt"), os.path.join(save, "iter_0000002", "file_link"))
    # foreign things among the checkpoints, older and newer
    _write(os.path.join(save, "iter_0000000", "metadata.json"), json.dumps({"sharded_backend": "torch_dist"}))
    _write(os.path.join(save, "iter_0000005", "metadata.json"), json.dumps({"sharded_backend": "torch_dist"}))
    _write(os.path.join(save, "iter_0000003", "common.pt"))  # no metadata at all
    os.symlink(os.path.join(outside, "iter_0000099"), os.path.join(save, "iter_0000004"))  # a link to a checkpoint
    os.symlink(outside, os.path.join(save, "iter_0000006"))  # a link to a plain directory
    _write(os.path.join(save, "notes", "iter_0000001"))
    assert committed_iterations(save) == [1, 2]  # links and foreign directories are not counted

    res = _save(save, 7, keep=2)
    assert res.removed == (os.path.join(save, "iter_0000001"),)
    assert committed_iterations(save) == [2, 7]
    assert sorted(os.listdir(save)) == ["iter_0000000", "iter_0000002", "iter_0000003", "iter_0000004",
                                        "iter_0000005", "iter_0000006", "iter_0000007",
                                        "latest_checkpointed_iteration.txt", "notes"]
    assert os.path.islink(os.path.join(save, "iter_0000004")) and os.path.islink(os.path.join(save, "iter_0000006"))
    assert _tree(outside) == before_outside  # nothing behind a link was touched

    assert apply_retention(save, 1) == [os.path.join(save, "iter_0000002")]
    assert _tree(outside) == before_outside and os.path.isfile(os.path.join(outside, "precious.txt"))
    assert sorted(os.listdir(save)) == ["iter_0000000", "iter_0000003", "iter_0000004", "iter_0000005",
                                        "iter_0000006", "iter_0000007", "latest_checkpointed_iteration.txt", "notes"]
    with pytest.raises(ValueError, match="--tenplex-keep must be >= 1"):
        apply_retention(save, 0)


def test_partial_clean_up_removes_only_staging_dirs_this_project_wrote(tmp_path, outside, capsys) -> None:
    save = str(tmp_path / "save")
    _save(save, 1)
    before_outside = _tree(outside)
    ours = prepare_partial(save, 7)  # a crashed save: a shard written, metadata half written
    _write(os.path.join(ours, "rank_00000.safetensors"))
    _write(os.path.join(ours, "metadata.json"), "{")
    prepare_partial(save, 8)  # a crashed save that wrote nothing
    link = os.path.join(save, "iter_0000009.tenplex-partial")
    os.symlink(outside, link)  # named like staging, but a link: unlinked, its target untouched
    foreign = os.path.join(save, "iter_0000010.tenplex-partial")
    _write(os.path.join(foreign, "rank_00000.safetensors"))
    _write(os.path.join(foreign, "my-notes.txt"), "not a tenplex file")
    nested = os.path.join(save, "iter_0000011.tenplex-partial")
    _write(os.path.join(nested, "sub", "rank_00000.safetensors"))  # a subdirectory: not what a save writes
    odd = os.path.join(save, "mine.tenplex-partial")  # not the project's name pattern: not even listed
    _write(os.path.join(odd, "rank_00000.safetensors"))
    assert partial_dirs(save) == [ours, os.path.join(save, "iter_0000008.tenplex-partial"), link, foreign, nested]

    capsys.readouterr()
    res = _save(save, 12)
    warned = [line for line in capsys.readouterr().err.splitlines() if "left in place" in line]  # logged warnings
    assert {line.removeprefix("> tenplex: warning: ").split(":")[0] for line in warned} == {foreign, nested}
    assert res.removed == (ours, os.path.join(save, "iter_0000008.tenplex-partial"), link)
    assert partial_dirs(save) == [foreign, nested]
    assert os.path.isfile(os.path.join(foreign, "my-notes.txt")) and os.path.isdir(os.path.join(nested, "sub"))
    assert os.path.isdir(odd) and _tree(outside) == before_outside
    assert not remove_partial(foreign) and not remove_partial(odd)


def test_a_save_refuses_to_replace_what_it_does_not_recognise_before_writing(tmp_path, outside, capsys) -> None:
    save = str(tmp_path / "save")
    _save(save, 1)
    mcore = os.path.join(save, "iter_0000003")  # another format's checkpoint at the iteration being saved
    _write(os.path.join(mcore, "metadata.json"), json.dumps({"sharded_backend": "torch_dist"}))
    _write(os.path.join(mcore, "__0_0.distcp"), "shards")
    before = _tree(save)
    with pytest.raises(RankFailure) as e:
        _save(save, 3)
    assert isinstance(e.value.__cause__, CheckpointFileError)
    assert f"{mcore}: exists and is not a tenplex checkpoint" in str(e.value) and "preparing the directory" in str(e.value)
    assert _tree(save) == before and partial_dirs(save) == []  # nothing written, nothing removed

    staging = os.path.join(save, "iter_0000004.tenplex-partial")  # a foreign directory named like staging
    _write(os.path.join(staging, "data.bin"))
    with pytest.raises(RankFailure, match="iter_0000004.tenplex-partial: exists and is not a staging directory"):
        _save(save, 4)
    assert "> tenplex: warning: " + staging + ": left in place" in capsys.readouterr().err
    assert os.path.isfile(os.path.join(staging, "data.bin"))


def test_a_link_named_like_the_iteration_is_replaced_without_touching_its_target(tmp_path, outside) -> None:
    save = str(tmp_path / "save")
    os.makedirs(save)
    before_outside = _tree(outside)
    os.symlink(os.path.join(outside, "iter_0000099"), os.path.join(save, "iter_0000005"))
    res = _save(save, 5)
    assert not os.path.islink(res.path) and read_metadata(res.path)["iteration"] == 5
    assert _tree(outside) == before_outside

    # a left-over of an interrupted replace that is not a checkpoint is never deleted
    old = res.path + ".tenplex-old"
    _write(os.path.join(old, "unknown.txt"))
    with pytest.raises(RankFailure, match=r"iter_0000005.tenplex-old: exists and is not a tenplex checkpoint"):
        _save(save, 5)
    assert os.path.isfile(os.path.join(old, "unknown.txt"))
    os.remove(os.path.join(old, "unknown.txt"))
    os.rmdir(old)
    os.symlink(outside, old)  # a link there is unlinked, its target untouched
    res = _save(save, 5)
    assert not os.path.lexists(old) and _tree(outside) == before_outside
    assert sorted(os.listdir(save)) == ["iter_0000005", "latest_checkpointed_iteration.txt"]
