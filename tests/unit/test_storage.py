"""Storage: safetensors round trips and clean errors for bad files; the checkpoint directory layout and commit."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors import safe_open

from tenplex_megatron.storage.directory import (
    FORMAT_NAME,
    FORMAT_VERSION,
    commit,
    committed_iterations,
    find_checkpoint,
    find_megatron_checkpoint,
    partial_dirs,
    prepare_partial,
    read_metadata,
)
from tenplex_megatron.storage.safetensors_io import (
    CheckpointFileError,
    SafetensorsReader,
    block_crc32,
    crc32,
    read_header,
    write_safetensors,
)

# ---------------------------------------------------------------------------------------------------------------
# safetensors
# ---------------------------------------------------------------------------------------------------------------


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w.f32": torch.randn(3, 5, generator=g),
        "b.bf16": torch.randn(7, generator=g).to(torch.bfloat16),  # 14 bytes: the next tensor is unaligned
        "e.f32": torch.randn(2, 3, 4, generator=g),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "i64": torch.arange(5, dtype=torch.int64),
        "f16": torch.randn(4, generator=g).to(torch.float16),
        "mask": torch.tensor([True, False, True]),
    }


def test_round_trip_all_dtypes(tmp_path) -> None:
    path = str(tmp_path / "rank_00000.safetensors")
    tensors = _tensors()
    size, sums = write_safetensors(path, tensors)
    assert size == os.path.getsize(path)
    assert set(sums) == set(tensors)
    r = SafetensorsReader(path)
    try:
        assert set(r.entries) == set(tensors)
        for name, t in tensors.items():
            flat = r.flat(name, expect_dtype=str(t.dtype).removeprefix("torch."), expect_numel=t.numel())
            assert flat.dtype == t.dtype and flat.shape == (t.numel(),)
            assert torch.equal(flat, t.reshape(-1)), name
            assert r.entries[name].shape == tuple(t.shape)
            assert sums[name] == block_crc32(t.contiguous())
            if t.numel():  # a tensor smaller than a block: its one block CRC is the whole CRC
                assert sums[name] == (crc32(t.contiguous()),)
    finally:
        r.close()


def test_files_are_readable_by_the_reference_safetensors_reader(tmp_path) -> None:
    path = str(tmp_path / "x.safetensors")
    tensors = _tensors()
    write_safetensors(path, tensors)
    with safe_open(path, framework="pt") as f:
        assert set(f.keys()) == set(tensors)
        for name, t in tensors.items():
            assert torch.equal(f.get_tensor(name), t), name


def test_flat_is_a_zero_copy_view_of_the_mapped_file(tmp_path) -> None:
    path = str(tmp_path / "x.safetensors")
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    b = torch.arange(6, dtype=torch.bfloat16)
    write_safetensors(path, {"w": w, "b": b})
    r = SafetensorsReader(path)
    try:
        for name in ("w", "b"):
            entry = r.entries[name]
            flat = r.flat(name)
            assert flat.data_ptr() == r._buf.data_ptr() + entry.begin  # points into the mapping itself
            assert flat.untyped_storage().data_ptr() == r._buf.untyped_storage().data_ptr()
        v1, v2 = r.flat("w"), r.flat("w")
        v1[0] = 99.0  # the map is private (copy-on-write): the views share it, the file is untouched
        assert v2[0].item() == 99.0
    finally:
        r.close()
    r2 = SafetensorsReader(path)
    assert r2.flat("w")[0].item() == 0.0
    r2.close()


def test_unaligned_tensor_is_read_through_a_copy(tmp_path) -> None:
    path = str(tmp_path / "x.safetensors")
    tensors = {"b": torch.ones(3, dtype=torch.bfloat16), "w": torch.arange(4, dtype=torch.float32)}
    write_safetensors(path, tensors)
    r = SafetensorsReader(path)
    try:
        assert r.entries["w"].begin % 4 != 0
        assert torch.equal(r.flat("w"), tensors["w"])
    finally:
        r.close()


def test_flat_checks_name_dtype_and_numel(tmp_path) -> None:
    path = str(tmp_path / "x.safetensors")
    write_safetensors(path, {"w": torch.zeros(4)})
    r = SafetensorsReader(path)
    try:
        with pytest.raises(CheckpointFileError, match="'nope' is not in the file") as e:
            r.flat("nope")
        assert path in str(e.value)
        with pytest.raises(CheckpointFileError, match="dtype float32, metadata says bfloat16"):
            r.flat("w", expect_dtype="bfloat16")
        with pytest.raises(CheckpointFileError, match="4 elements, metadata says 5"):
            r.flat("w", expect_numel=5)
    finally:
        r.close()


@pytest.mark.parametrize("cut", [1, 8, 47])
def test_truncated_file_names_the_file_and_the_tensor(tmp_path, cut: int) -> None:
    path = str(tmp_path / "rank_00003.safetensors")
    write_safetensors(path, {"first": torch.zeros(2), "layer.weight": torch.ones(12)})
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - cut)
    with pytest.raises(CheckpointFileError) as e:
        SafetensorsReader(path)
    msg = str(e.value)
    assert path in msg and "'layer.weight'" in msg and "truncated" in msg


def test_file_truncated_inside_the_header(tmp_path) -> None:
    path = str(tmp_path / "rank_00000.safetensors")
    write_safetensors(path, {"w": torch.ones(4)})
    for keep in (0, 5, 20):
        with open(path, "r+b") as f:
            f.truncate(keep)
        with pytest.raises(CheckpointFileError) as e:
            SafetensorsReader(path)
        assert path in str(e.value)


def test_missing_file_names_the_file(tmp_path) -> None:
    path = str(tmp_path / "rank_00009.safetensors")
    with pytest.raises(CheckpointFileError) as e:
        SafetensorsReader(path)
    assert path in str(e.value) and "missing" in str(e.value)


def _raw_file(path: str, header: bytes, data: bytes = b"\0" * 64, length: int | None = None) -> None:
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header) if length is None else length) + header + data)


def _hdr(obj) -> bytes:
    return json.dumps(obj).encode()


T = {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 64]}

MALFORMED = {
    "bad json": b"{not json",
    "not utf-8": b"\xff\xfe{}",
    "header length beyond the file": (_hdr({"t": T}), 10_000),
    "header length beyond the limit": (_hdr({"t": T}), 2**64 - 1),
    "list, not dict": _hdr([1, 2]),
    "string, not dict": _hdr("t"),
    "entry not a dict": _hdr({"t": [1, 2]}),
    "entry null": _hdr({"t": None}),
    "unknown dtype": _hdr({"t": {**T, "dtype": "F8"}}),
    "unhashable dtype": _hdr({"t": {**T, "dtype": ["F32"]}}),
    "missing shape": _hdr({"t": {"dtype": "F32", "data_offsets": [0, 64]}}),
    "shape not a list": _hdr({"t": {**T, "shape": 7}}),
    "shape with text": _hdr({"t": {**T, "shape": ["x", 4]}}),
    "negative shape": _hdr({"t": {**T, "shape": [-4, -4]}}),
    "infinite shape": b'{"t": {"dtype": "F32", "shape": [Infinity], "data_offsets": [0, 64]}}',
    "nan shape": b'{"t": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 64]}}',
    "infinite offset": b'{"t": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, Infinity]}}',
    "offsets mismatching shape": _hdr({"t": {**T, "shape": [4, 5]}}),
    "offsets reversed": _hdr({"t": {**T, "data_offsets": [64, 0]}}),
    "negative offset": _hdr({"t": {**T, "data_offsets": [-64, 0]}}),
    "three offsets": _hdr({"t": {**T, "data_offsets": [0, 32, 64]}}),
    "offsets past the end": _hdr({"t": {**T, "shape": [8, 4], "data_offsets": [0, 128]}}),
    "huge claimed tensor": _hdr({"t": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 2**42]}}),
    "deeply nested json": b"[" * 100_000 + b"]" * 100_000,
    "deeply nested entry": b'{"t": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_header_is_a_checkpoint_file_error(tmp_path, case: str) -> None:
    path = str(tmp_path / "bad.safetensors")
    spec = MALFORMED[case]
    header, length = spec if isinstance(spec, tuple) else (spec, None)
    _raw_file(path, header, length=length)
    with pytest.raises(CheckpointFileError) as e:  # and never another exception type
        SafetensorsReader(path)
    assert path in str(e.value)
    with pytest.raises(CheckpointFileError):
        read_header(path)


def test_metadata_entry_is_ignored(tmp_path) -> None:
    path = str(tmp_path / "x.safetensors")
    _raw_file(path, _hdr({"__metadata__": {"format": "pt"}, "t": T}))
    entries, size = read_header(path)
    assert list(entries) == ["t"] and size == os.path.getsize(path)


# ---------------------------------------------------------------------------------------------------------------
# checkpoint directory layout
# ---------------------------------------------------------------------------------------------------------------


def _meta(it: int, **extra) -> dict:
    return {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "iteration": it, **extra}


def _save(save: str, it: int, files: dict[str, bytes] | None = None, **extra) -> str:
    staging = prepare_partial(save, it)
    files = files or {"rank_00000.safetensors": b"x" * 10}
    for name, data in files.items():
        with open(os.path.join(staging, name), "wb") as f:
            f.write(data)
    return commit(save, it, _meta(it, **extra), {n: len(d) for n, d in files.items()})


def _tracker(save: str) -> str:
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        return f.read()


def test_commit_makes_the_iteration_directory_and_tracker(tmp_path) -> None:
    save = str(tmp_path)
    final = _save(save, 42)
    assert final == os.path.join(save, "iter_0000042")
    assert sorted(os.listdir(final)) == ["metadata.json", "rank_00000.safetensors"]
    assert _tracker(save) == "42"
    assert read_metadata(final) == _meta(42)
    assert partial_dirs(save) == []
    assert committed_iterations(save) == [42]
    assert find_checkpoint(save) == final
    assert find_checkpoint(final) == final  # a checkpoint directory itself
    assert find_checkpoint(save, 42) == final
    assert find_checkpoint(save, 7) is None
    assert sorted(os.listdir(save)) == ["iter_0000042", "latest_checkpointed_iteration.txt"]


def test_commit_of_an_existing_iteration_replaces_it(tmp_path) -> None:
    save = str(tmp_path)
    _save(save, 5, {"rank_00000.safetensors": b"a", "rank_00001.safetensors": b"b"}, run=1)
    final = _save(save, 5, {"rank_00002.safetensors": b"c" * 3}, run=2)
    assert sorted(os.listdir(final)) == ["metadata.json", "rank_00002.safetensors"]  # no stale file survives
    assert read_metadata(final)["run"] == 2
    assert sorted(os.listdir(save)) == ["iter_0000005", "latest_checkpointed_iteration.txt"]


def test_commit_checks_every_rank_file(tmp_path) -> None:
    save = str(tmp_path)
    staging = prepare_partial(save, 3)
    with open(os.path.join(staging, "rank_00000.safetensors"), "wb") as f:
        f.write(b"12345")
    with pytest.raises(CheckpointFileError, match="rank_00001.safetensors: a rank's shard file is missing"):
        commit(save, 3, _meta(3), {"rank_00000.safetensors": 5, "rank_00001.safetensors": 5})
    with pytest.raises(CheckpointFileError, match=r"rank_00000.safetensors: size 5 != 6"):
        commit(save, 3, _meta(3), {"rank_00000.safetensors": 6})
    assert find_checkpoint(save) is None
    assert partial_dirs(save) == [staging]


def test_commit_interrupted_before_the_rename_leaves_the_previous_checkpoint(tmp_path) -> None:
    save = str(tmp_path)
    _save(save, 1)
    staging = prepare_partial(save, 2)

    def crash(point: str) -> None:
        if point == "save.commit":
            raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        commit(save, 2, _meta(2), {}, fault=crash)
    # the staging directory has complete metadata, but it never committed
    assert read_metadata(staging)["iteration"] == 2
    assert find_checkpoint(save) == os.path.join(save, "iter_0000001")
    assert _tracker(save) == "1"


def test_find_checkpoint_never_returns_partial_or_metadata_less_dirs(tmp_path) -> None:
    save = str(tmp_path)
    for it in (2, 4):
        _save(save, it)
    newest = os.path.join(save, "iter_0000004")
    # a newer save that never committed, with complete metadata inside
    staging = prepare_partial(save, 6)
    with open(os.path.join(staging, "metadata.json"), "w") as f:
        json.dump(_meta(6), f)
    # a newer directory without metadata (a rank never finished), and one with half-written metadata
    os.makedirs(os.path.join(save, "iter_0000008"))
    os.makedirs(os.path.join(save, "iter_0000009"))
    with open(os.path.join(save, "iter_0000009", "metadata.json"), "w") as f:
        f.write(json.dumps(_meta(9))[:20])
    # another format's checkpoint (megatron-core's torch_dist also writes metadata.json)
    os.makedirs(os.path.join(save, "iter_0000010"))
    with open(os.path.join(save, "iter_0000010", "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist"}, f)
    assert find_checkpoint(save) == newest
    assert committed_iterations(save) == [2, 4]
    for it in (6, 8, 9, 10):
        assert find_checkpoint(save, it) is None
    # the tracker pointing at an incomplete directory (or at nothing, or garbage): the newest complete one
    for text in ("6", "8", "9", "10", "11", "garbage", ""):
        with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(text)
        assert find_checkpoint(save) == newest, text
    # the tracker pointing at an older complete checkpoint is obeyed (megatron's semantics)
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("2\n")
    assert find_checkpoint(save) == os.path.join(save, "iter_0000002")
    # a staging directory given directly is not a checkpoint either
    assert find_checkpoint(staging) is None


def test_find_checkpoint_without_anything(tmp_path) -> None:
    assert find_checkpoint(str(tmp_path)) is None
    assert find_checkpoint(str(tmp_path / "does-not-exist")) is None


@pytest.mark.parametrize(
    "content,needle,found",
    [
        # not ours: never chosen
        ({"format": "something-else", "format_version": 1}, "not a tenplex-megatron metadata file", False),
        ({"format_version": 1}, "not a tenplex-megatron metadata file", False),
        ([1, 2], "not a tenplex-megatron metadata file", False),
        ("{broken", "malformed JSON", False),
        ("[" * 100_000, "malformed JSON", False),  # deeply nested
        ("\udcff", "malformed JSON", False),
        (None, "missing", False),
        # ours, but a version this build cannot read: chosen, so that loading fails loudly instead of
        # silently starting from scratch
        ({"format": FORMAT_NAME, "format_version": 3}, "format version 3, this build reads 1, 2", True),
        ({"format": FORMAT_NAME, "format_version": True}, "format version True", True),
        ({"format": FORMAT_NAME}, "format version None", True),
        ({"format": FORMAT_NAME, "format_version": "1"}, "format version '1'", True),
    ],
)
def test_read_metadata_rejects_bad_files_naming_them(tmp_path, content, needle: str, found: bool) -> None:
    d = tmp_path / "iter_0000001"
    d.mkdir()
    path = str(d / "metadata.json")
    if content is not None:
        with open(path, "w", errors="surrogateescape") as f:
            f.write(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(CheckpointFileError) as e:
        read_metadata(str(d))
    assert path in str(e.value) and needle in str(e.value)
    assert find_checkpoint(str(tmp_path)) == (str(d) if found else None)
    assert find_megatron_checkpoint(str(tmp_path)) is None


def test_a_save_that_never_committed_is_listed_as_partial_beside_committed_ones(tmp_path) -> None:
    """(from the former test_layout_and_storage.py) a staging directory without metadata, next to real checkpoints."""
    save = str(tmp_path)
    for it in (2, 4):
        prepare_partial(save, it)
        commit(save, it, _meta(it), {})  # a commit with no rank files (metadata only)
    staging = prepare_partial(save, 6)  # never committed, nothing written into it
    assert partial_dirs(save) == [staging] == [os.path.join(save, "iter_0000006.tenplex-partial")]
    assert committed_iterations(save) == [2, 4]
    assert find_checkpoint(save) == os.path.join(save, "iter_0000004")
