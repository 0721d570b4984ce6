"""Transformer Engine's ``_extra_state`` (FP8 scaling state) kept per rank: encoded as raw bytes, given back only at
the saved layout, else left out with one warning naming what re-warms.

TE needs a GPU and does not run here; what tenplex handles is torch's extra-state protocol, which TE implements
(``get_extra_state`` returning a uint8 tensor, or an ``io.BytesIO`` in older TE). The modules below implement it the
same way; megatron-core's ``ShardedObject`` is the one a TE layer's ``sharded_state_dict`` yields. The end-to-end
case (megatron-core's GPTModel under torchrun) is in tests/multiproc/test_crash_safety.py.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from tenplex_megatron.engine.chunks import LocalChunk
from tenplex_megatron.engine.load import load_chunks
from tenplex_megatron.engine.rank_local import PREFIX, entry_sizes, read_file_entry, reader, stored_entries
from tenplex_megatron.engine.save import save_chunks
from tenplex_megatron.integrations.megatron_core import extra_state, sharded
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.ptc import Chunk, TensorMeta
from tenplex_megatron.storage.directory import read_checkpoint_metadata
from tenplex_megatron.storage.files import CheckpointFileError
from tenplex_megatron.storage.verify_ckpt import verify_checkpoint
from tests.logs import logged


@pytest.fixture
def records() -> Iterator[list[logging.LogRecord]]:
    """What the library logs during the test (tests/logs.py)."""
    with logged() as got:
        yield got


def _model_sd() -> dict:
    weight = ShardedTensor.from_rank_offsets("decoder.layers.self_attention.linear_qkv.weight", torch.zeros(4, 4))
    extra = ShardedObject("decoder.layers.self_attention.linear_qkv._extra_state", b"fp8 meta", (2,), (0,))
    return {"decoder.layers.self_attention.linear_qkv.weight": weight,
            "decoder.layers.self_attention.linear_qkv._extra_state": extra,
            "other": ShardedObject("decoder.layers.something_else", b"", (1,), (0,)),
            # megatron-core's own linear layers (SequentialMLP's experts) describe an empty one: nothing to keep
            "local": ShardedObject("decoder.layers.mlp.experts.experts.linear_fc1._extra_state", None, (2,), (0,))}


def test_extra_state_keys_found() -> None:
    assert sharded.extra_state_keys(_model_sd()) == ["decoder.layers.self_attention.linear_qkv._extra_state"]
    assert sharded.extra_state_keys({"w": _model_sd()["decoder.layers.self_attention.linear_qkv.weight"]}) == []


class Fp8Linear(torch.nn.Linear):
    """A linear layer whose extra state is a float32 amax history serialized into uint8, as TE's is."""

    def __init__(self, legacy: bool = False) -> None:
        super().__init__(4, 4)
        self.meta = torch.zeros(3)
        self.legacy = legacy  # older TE: an io.BytesIO

    def get_extra_state(self) -> object:
        raw = self.meta.clone().view(torch.uint8)
        return io.BytesIO(raw.numpy().tobytes()) if self.legacy else raw

    def set_extra_state(self, state: object) -> None:
        if isinstance(state, io.BytesIO):
            state = torch.frombuffer(bytearray(state.getvalue()), dtype=torch.uint8)
        assert isinstance(state, torch.Tensor)
        self.meta = state.clone().view(torch.float32)


class Plain(torch.nn.Linear):
    """megatron-core's own linears: the protocol, holding nothing."""

    def get_extra_state(self) -> None:
        return None


@dataclass
class Job:
    """What extra_state reads of a job: its model chunks and layout."""

    model: list
    layout: ParallelLayout


def _job(tp: int = 2) -> Job:
    return Job([torch.nn.Sequential(Fp8Linear(), Fp8Linear(legacy=True), Plain(4, 4))], ParallelLayout(tp, 1, 1))


@pytest.mark.parametrize("value", [torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.empty(0),
                                   io.BytesIO(b"\x00fp8\xff"), b"raw", torch.tensor([1, 2], dtype=torch.int64)])
def test_encode_decode_round_trip(value: object) -> None:
    flat, rec = extra_state.encode(value, "m")
    assert flat.dtype == torch.uint8 and rec["nbytes"] == flat.numel()
    back = extra_state.decode(flat.clone(), rec, "m")
    if isinstance(value, torch.Tensor):
        assert isinstance(back, torch.Tensor) and back.dtype == value.dtype and torch.equal(back, value)
    elif isinstance(value, io.BytesIO):
        assert isinstance(back, io.BytesIO) and back.getvalue() == value.getvalue()
    else:
        assert back == value


def test_unsupported_kind_is_skipped_with_a_warning(records: list[logging.LogRecord]) -> None:
    assert extra_state.encode({"a": 1}, "decoder.x._extra_state") is None
    assert "decoder.x._extra_state: extra state of type dict is not saved" in " ".join(r.getMessage() for r in records)
    assert extra_state.encode(None, "y") is None


class Pickled(torch.nn.Linear):
    """A module whose extra state is a kind tenplex does not save (a dict)."""

    def get_extra_state(self) -> object:
        return {"a": 1}


def test_an_unsaved_kind_is_warned_once_per_module(records: list[logging.LogRecord]) -> None:
    """Every save collects again; the warning comes at the first, and again for a rebuilt model (the module keeps
    that it was warned about, not the process)."""
    job = Job([torch.nn.Sequential(Pickled(4, 4), Fp8Linear())], ParallelLayout(1, 1, 1))
    assert list(extra_state.collect(job)) == list(extra_state.collect(job)) == [extra_state.entry_name(0, "1")]
    assert len(_warnings(records)) == 1 and "model0.0._extra_state: extra state of type dict" in _warnings(records)[0]
    extra_state.collect(Job([torch.nn.Sequential(Pickled(4, 4))], ParallelLayout(1, 1, 1)))
    assert len(_warnings(records)) == 2


def _save(tmp_path, job: Job) -> str:
    """A real save of one chunk plus the job's extra state, through the engine (world size 1)."""
    w = torch.arange(8, dtype=torch.float32)
    meta = TensorMeta("w", (8,), "float32")
    local = extra_state.collect(job)
    info = {"rank_local": {k: rec for k, (_, rec) in local.items()}}
    res = save_chunks([LocalChunk(meta, Chunk("w", (0,), (8,)), w, True)], str(tmp_path / "ckpt"), 1,
                      job.layout.to_json(), info, lambda infos: {}, local={k: t for k, (t, _) in local.items()})
    return res.path


def _load(path: str, job: Job) -> None:
    dst = torch.zeros(8)
    meta = TensorMeta("w", (8,), "float32")
    load_chunks(path, None, lambda m: [LocalChunk(meta, Chunk("w", (0,), (8,)), dst, True)], lambda m: None,
                local=lambda m, read: extra_state.prepare(job, m, read, 0))
    assert torch.equal(dst, torch.arange(8, dtype=torch.float32))


def _warnings(records: list[logging.LogRecord]) -> list[str]:
    return [r.getMessage() for r in records if r.levelno >= logging.WARNING]


def test_same_layout_restores_bytes_exactly(tmp_path, records: list[logging.LogRecord]) -> None:
    src = _job()
    for i, m in enumerate(src.model[0][:2]):
        m.meta = torch.tensor([1.5, -2.0, float(i)])
    path = _save(tmp_path, src)
    dst = _job()
    _load(path, dst)
    for a, b in zip(src.model[0][:2], dst.model[0][:2]):
        assert torch.equal(a.meta, b.meta)
    assert not _warnings(records)
    assert "of 2 module(s) restored exactly" in " ".join(r.getMessage() for r in records)


def test_new_layout_drops_with_one_warning(tmp_path, records: list[logging.LogRecord]) -> None:
    src = _job(tp=2)
    src.model[0][0].meta = torch.tensor([3.0, 2.0, 1.0])
    path = _save(tmp_path, src)
    dst = _job(tp=1)
    _load(path, dst)
    assert torch.equal(dst.model[0][0].meta, torch.zeros(3))
    (line,) = _warnings(records)
    assert "2 module(s)" in line and "tp=2,pp=1,dp=1" in line and "amax history re-warm" in line


def test_checkpoint_without_extra_state_warns(tmp_path, records: list[logging.LogRecord]) -> None:
    path = _save(tmp_path, Job([torch.nn.Sequential(Plain(4, 4))], ParallelLayout(2, 1, 1)))
    _load(path, _job())
    (line,) = _warnings(records)
    assert "the checkpoint holds none" in line and "re-warm" in line


def _flip_first_byte(path: str, name: str) -> None:
    """Flip one bit of entry ``name``'s first byte in rank 0's file, as a damaged disk would."""
    with open(f"{path}/rank_00000.safetensors", "r+b") as f:
        data = bytearray(f.read())
        header = int.from_bytes(data[:8], "little")
        begin = json.loads(data[8 : 8 + header])[name]["data_offsets"][0]
        f.seek(8 + header + begin)
        f.write(bytes([data[8 + header + begin] ^ 1]))


def test_damaged_entry_refused_naming_file_and_entry(tmp_path) -> None:
    src = _job()
    src.model[0][0].meta = torch.tensor([3.0, 2.0, 1.0])
    path = _save(tmp_path, src)
    name = f"{PREFIX}model0.0._extra_state"
    _flip_first_byte(path, name)
    sections = read_checkpoint_metadata(path).rank_local
    with pytest.raises(CheckpointFileError, match=r"rank_00000\.safetensors: rank-local entry .*model0\.0\._extra_state"):
        reader(path, sections, 0)(name)
    dst = _job()
    with pytest.raises(Exception, match="block checksums"):
        _load(path, dst)
    assert torch.equal(dst.model[0][0].meta, torch.zeros(3))  # nothing handed over


def test_verify_checks_rank_local_entries(tmp_path) -> None:
    """`verify` reads every rank-local byte against its block CRC-32s too, and names a damaged entry and its file."""
    src = _job()
    src.model[0][0].meta = torch.tensor([3.0, 2.0, 1.0])
    path = _save(tmp_path, src)
    good = verify_checkpoint(path, workers=1)
    assert good.ok, good.damage
    with open(f"{path}/metadata.json") as f:
        local = json.load(f)["rank_local"]["0"]["entries"]
    assert good.bytes_checked == 8 * 4 + sum(e["nbytes"] for e in local.values())  # the chunk's and the entries'
    name = f"{PREFIX}model0.0._extra_state"
    _flip_first_byte(path, name)
    bad = verify_checkpoint(path, workers=1)
    assert not bad.ok and bad.damaged_files() == ["rank_00000.safetensors"] and bad.damaged_tensors() == [name]
    assert "rank 0's rank-local entry" in bad.damage[0].why and "fails its checksum in block 0" in bad.damage[0].why


def test_entries_listed_and_read_through_another_source(tmp_path) -> None:
    """What a host-memory restart uses: each rank's stored entries from metadata.json (which a peer sends), and the
    reader over bytes from elsewhere (received from a peer), whose block CRCs are checked all the same."""
    src = _job()
    src.model[0][0].meta = torch.tensor([3.0, 2.0, 1.0])
    path = _save(tmp_path, src)
    meta = read_checkpoint_metadata(path).rank_local
    names = [f"{PREFIX}model0.0._extra_state", f"{PREFIX}model0.1._extra_state"]  # Plain holds none
    assert stored_entries(meta, 0) == [("rank_00000.safetensors", n, 12) for n in names]
    assert stored_entries(meta, 1) == [] and stored_entries({}, 0) == []
    assert entry_sizes(meta) == {("rank_00000.safetensors", n): 12 for n in names}
    sent = {n: read_file_entry(path, "rank_00000.safetensors", n, 12) for n in names}
    got = reader(path, meta, 0, raw=lambda file, name, nbytes: sent[name])(names[0])
    assert torch.equal(got.view(torch.float32), torch.tensor([3.0, 2.0, 1.0]))
    garbled = reader(path, meta, 0, raw=lambda file, name, nbytes: torch.zeros(nbytes, dtype=torch.uint8))
    with pytest.raises(CheckpointFileError, match=r"model0\.0\._extra_state' fails its block checksums"):
        garbled(names[0])
