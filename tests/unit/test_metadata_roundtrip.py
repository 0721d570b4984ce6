"""The write side of metadata.json is typed: a save composes a ``CheckpointMetadata`` from its typed parts (the
adapter's layout and own record, the PTC, files, RNG streams, rank-local sections) and writes its ``to_json``, the
inverse of ``from_json``: a real save's record, and a host-memory snapshot's, read back equal."""

from __future__ import annotations

import json
import types
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tenplex_megatron.engine.chunks import LocalChunk
from tenplex_megatron.engine.load import load, saved_layout
from tenplex_megatron.engine.save import save, writer_assignment
from tenplex_megatron.engine.save_records import RankFile, RankHoldings
from tenplex_megatron.integrations.deepspeed.record import DeepSpeedLayout, DeepSpeedRecord
from tenplex_megatron.integrations.megatron_core.record import MegatronCoreRecord
from tenplex_megatron.memory import snapshot
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.ptc import Chunk, TensorMeta
from tenplex_megatron.storage.checkpoint_metadata import CheckpointMetadata
from tenplex_megatron.storage.directory import read_checkpoint_metadata
from tenplex_megatron.storage.source import Metadata

LOCAL = "rank_local:m._extra_state"


def _record(*, optimizer: bool = True) -> MegatronCoreRecord:
    return MegatronCoreRecord(
        consumed_samples=96, model={"vocab_size": 50, "seed": 3, "num_layers": 2}, padded_vocab_size=64,
        use_distributed_optimizer=True,
        optimizer={"param_groups": [{"lr": 1e-3}], "step": 12} if optimizer else None,
        scheduler={"num_steps": 12} if optimizer else None, extra={"num_floating_point_operations_so_far": 7.5},
        megatron_core={"version": "0.16.1", "state_layout": "x"})


@dataclass
class _Adapter:
    """One rank's ``w`` and rank-local bytes, with megatron-core's typed layout and record."""

    record: MegatronCoreRecord
    framework: str = "megatron-core"
    seed: int = 3
    rng_tracker: bool = False
    it: int = 12

    def __post_init__(self) -> None:
        self.w = torch.arange(8, dtype=torch.float32)
        self.state = torch.tensor([1.0, 2.0])

    def layout(self) -> ParallelLayout:
        return ParallelLayout(1, 1, 1)

    def iteration(self) -> int:
        return self.it

    def describe(self) -> list[LocalChunk]:
        return [LocalChunk(TensorMeta("w", (8,), "float32"), Chunk("w", (0,), (8,)), self.w, True)]

    def describe_for_load(self, metadata: Metadata) -> list[LocalChunk]:
        return self.describe()

    def rank_local(self) -> dict[str, Any]:
        return {LOCAL: (self.state.view(torch.uint8), {"nbytes": 8, "kind": "tensor"})}

    def metadata(self) -> MegatronCoreRecord:
        return self.record

    def restore(self, metadata: Metadata) -> None:
        self.it = metadata.require_iteration()

    def after_load(self, metadata: Metadata) -> None:
        return None


@pytest.mark.parametrize("optimizer", [True, False])
def test_saved_metadata_round_trips(tmp_path, optimizer: bool) -> None:
    a = _Adapter(_record(optimizer=optimizer))
    path = save(a, str(tmp_path / "ckpt")).path
    m = read_checkpoint_metadata(path)
    assert CheckpointMetadata.from_json(m.to_json(), m.path) == m
    assert m.to_json() == dict(m.raw)  # what the save wrote is what the record writes
    assert m.to_json() == json.loads(json.dumps(m.to_json()))  # plain JSON
    assert (m.framework, m.iteration, m.layout, m.consumed_samples) == ("megatron-core", 12, {"tp": 1, "pp": 1, "dp": 1}, 96)
    assert m.weights_only is not optimizer and m.padded_vocab_size == 64 and m.use_distributed_optimizer is True
    assert m.record("extra") == {"num_floating_point_operations_so_far": 7.5}
    assert m.record("optimizer") == a.record.to_json()["optimizer"]
    assert set(m.rank_local) == {0} and m.rank_local[0].entries[LOCAL].nbytes == 8
    assert set(m.rng) == {0}


def test_load_hands_back_typed_extra_and_layout(tmp_path) -> None:
    path = save(_Adapter(_record()), str(tmp_path / "ckpt")).path
    back = _Adapter(_record())
    back.it = 0
    res = load(back, path)
    assert res.layout == ParallelLayout(1, 1, 1) and res.source_layout == {"tp": 1, "pp": 1, "dp": 1}
    assert res.extra == {"num_floating_point_operations_so_far": 7.5}
    with pytest.raises(TypeError):
        res.extra["x"] = 1  # type: ignore[index]  # a read-only view
    assert res.metadata is not None and res.metadata["extra"] == dict(res.extra)  # raw, as before
    assert res.iteration == 12 and res.rng_exact


def test_snapshot_metadata_round_trips(tmp_path) -> None:
    a = _Adapter(_record())
    chunks = a.describe()
    _, writers, all_meta = writer_assignment([RankHoldings.of(chunks)])
    infos = [RankFile({"rng": {"python": "x"}, "rank_local": {LOCAL: {"nbytes": 8}}}, "rank_00000.safetensors", 64,
                      "node-a", 1 << 20, {"w@0": (1, 2), LOCAL: (3,)})]
    tier = types.SimpleNamespace(mem=str(tmp_path / "mem"), settings=types.SimpleNamespace(job="job-1"))
    doc = snapshot._metadata(a, tier, writers, infos, all_meta, 12)
    assert doc is not None
    m = CheckpointMetadata.from_json(doc, "mem/iter_0000012/metadata.json")
    assert m.to_json() == doc and CheckpointMetadata.from_json(m.to_json(), m.path) == m
    assert m.memory_job == "job-1" and m.rank_local[0].entries[LOCAL].block_crc32 == (3,)
    assert m.rng == {0: {"python": "x"}} and m.files == {"rank_00000.safetensors": 64}


def test_deepspeed_records() -> None:
    lay = DeepSpeedLayout(dp=4, zero_stage=2)
    assert lay.to_json() == {"tp": 1, "pp": 1, "dp": 4, "zero_stage": 2}
    assert DeepSpeedLayout.from_json(lay.to_json()) == lay
    assert saved_layout(DeepSpeedLayout, {"tp": 2, "pp": 1, "dp": 1}) is None  # no ZeRO stage: not DeepSpeed's
    rec = DeepSpeedRecord(5, 40, 0, 8, 2, {"param_groups": [], "step": 5}, None, {"k": 1})
    assert rec.to_json()["extra"] == {"k": 1} and rec.to_json()["zero_stage"] == 2


def test_a_restart_reads_each_copys_metadata_once(tmp_path, monkeypatch) -> None:
    """The resume sequence finds and reads a checkpoint once: the query reads each copy's metadata.json once (and
    checks it), and the load of the chosen copy takes that record instead of finding and reading it again; the
    older copies are not listed while the newest loads."""
    from tenplex_megatron.frontdoor.checkpointer import Checkpointer
    from tenplex_megatron.storage import directory, formats

    ckpt = str(tmp_path / "ckpt")
    first = _Adapter(_record())
    save(first, ckpt)
    first.it = 13
    newest = save(first, ckpt).path
    reads: list[str] = []
    real = formats.load_metadata_json

    def counted(path: str) -> Any:
        reads.append(path)
        return real(path)

    monkeypatch.setattr(formats, "load_metadata_json", counted)
    monkeypatch.setattr(directory, "load_metadata_json", counted)
    back = _Adapter(_record())
    back.it = 0
    engine = types.SimpleNamespace(adapter=lambda: back,
                                   load=lambda path, scope=None, metadata=None: load(back, path, metadata=metadata))
    with Checkpointer.for_api("test") as checkpointer:
        got = checkpointer.resume(engine, ckpt, own=False)
    assert got.kind == "durable" and got.result.path == newest and back.it == 13
    assert sorted(reads) == sorted({*reads}) and newest in reads, reads  # each copy read once, the newest among them
