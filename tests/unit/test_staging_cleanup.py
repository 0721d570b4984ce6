"""The staging ring on error paths (CPU): an error raised after some buffers went out closes the ring, and its
buffers are released even while the error (and its traceback, which keeps the frames that used them) is alive.

On a GPU the same ``finally`` also synchronises the side stream before the device buffers go back to the caching
allocator (``tests/gpu/test_gpu_assembly.py`` checks ``torch.cuda.memory_allocated`` there); on the CPU what can be
checked is that the ring is closed, refuses further use, and that nothing holds its buffers any more.
"""

from __future__ import annotations

import errno
import gc
import re
import weakref
from collections import deque
from types import TracebackType
from typing import Any

import numpy as np
import pytest
import torch

from tenplex_megatron.execute import staged as staged_mod
from tenplex_megatron.execute.staged import execute_staged
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.planner import plan_reshard
from tenplex_megatron.plan.sim.sharding import layout_chunks
from tenplex_megatron.storage import staged_write
from tenplex_megatron.storage.safetensors_io import CheckpointFileError
from tenplex_megatron.storage.source_files import SourceFiles
from tenplex_megatron.storage.staging import StagingRing
from tests.staging_support import damage_last_byte_read, staging_tensors, write_source


class RecordingRing(StagingRing):
    """The real ring, recording itself, weak references to its buffers, their address ranges (plain numbers: they
    keep nothing alive) and how many buffers it sent out."""

    made: list[RecordingRing] = []

    def __init__(self, device: torch.device, size: int, count: int = 3):
        super().__init__(device, size, count)
        self.buffers = [weakref.ref(t) for t in self.host]
        self.ranges = [(t.data_ptr(), t.data_ptr() + t.numel()) for t in (*self.host, *self.dev)]
        self.released = 0
        RecordingRing.made.append(self)

    def release(self, i: int) -> None:
        self.released += 1
        super().release(i)


@pytest.fixture
def recording(monkeypatch) -> list[RecordingRing]:
    RecordingRing.made = []
    monkeypatch.setattr(staged_mod, "StagingRing", RecordingRing)
    monkeypatch.setattr(staged_write, "StagingRing", RecordingRing)
    return RecordingRing.made


def _views_kept(tb: TracebackType | None, ranges: list[tuple[int, int]]) -> list[str]:
    """The locals of the traceback's frames (looking into containers, numpy arrays and memoryviews) that still
    point into one of ``ranges``: what would keep a ring buffer's memory from being released."""
    found: list[str] = []
    seen: set[int] = set()

    def inside(ptr: int) -> bool:
        return any(lo <= ptr < hi for lo, hi in ranges)

    def visit(obj: Any, where: str, depth: int) -> None:
        if id(obj) in seen or depth > 4:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.untyped_storage().nbytes() and inside(obj.untyped_storage().data_ptr()):
                found.append(where)
        elif isinstance(obj, np.ndarray):
            if obj.size and inside(obj.__array_interface__["data"][0]):
                found.append(where)
        elif isinstance(obj, memoryview):
            visit(obj.obj, where, depth + 1)
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v, where, depth + 1)
        elif isinstance(obj, list | tuple | deque | set):
            for v in obj:
                visit(v, where, depth + 1)

    while tb is not None:
        for name, value in tb.tb_frame.f_locals.items():
            visit(value, f"{tb.tb_frame.f_code.co_name}: {name}", 0)
        tb = tb.tb_next
    return found


def _assert_released(ring: RecordingRing, err: pytest.ExceptionInfo) -> None:
    """The ring is closed and refuses use; neither it nor any frame the error keeps holds a view of its buffers."""
    gc.collect()
    assert ring.closed and ring.host == [] and ring.dev == [] and ring.stream is None
    assert [r() for r in ring.buffers] == [None] * len(ring.buffers), "a ring buffer is still referenced"
    assert _views_kept(err.tb, ring.ranges) == []
    with pytest.raises(RuntimeError, match="closed"):
        ring.acquire(0)


def test_load_error_after_some_buffers_closes_the_ring(tmp_path, recording) -> None:
    tensors = staging_tensors(2, 2)
    gen = torch.Generator().manual_seed(7)
    full = {k: torch.randn(t.global_shape, generator=gen).to(getattr(torch, t.dtype)) for k, t in tensors.items()}
    source = write_source(str(tmp_path), tensors, ParallelLayout(2, 1, 1), False, full)
    plan = plan_reshard(source, tensors, layout_chunks(tensors, ParallelLayout(1, 2, 1), False), strict=False)
    rp = plan.ranks[0]
    last = rp.pieces[-1]  # found only after the earlier pieces' buffers went out
    sc = plan.sources[last.source]
    damage_last_byte_read(str(tmp_path), sc, tensors[sc.chunk.key].dtype, last)
    recording.clear()  # the rings of writing the source (TENPLEX_STAGING=copy, as the multi-process suite sets)
    files = SourceFiles(str(tmp_path), {k: m.dtype for k, m in tensors.items()}, require_checksums=True)
    out = [torch.zeros(c.numel, dtype=getattr(torch, tensors[c.key].dtype)) for c in rp.chunks]
    with pytest.raises(CheckpointFileError, match=re.escape(sc.location.name)) as err:
        execute_staged(rp, plan.sources, files, out, {}, total=192, count=3)  # 64-byte buffers: many batches
    files.close()
    (ring,) = recording
    assert ring.released >= 3, f"the error came after {ring.released} buffers, not mid-way"
    _assert_released(ring, err)  # `err` (and its traceback) is still alive here


def test_save_error_after_some_writes_closes_the_ring(monkeypatch, recording) -> None:
    """/dev/full takes writes into the file object's buffer, then fails its first flush with ENOSPC, as a full
    disk does half-way through a shard."""
    monkeypatch.setenv("TENPLEX_STAGING", "copy")
    tensors = {"a": torch.randn(1000), "b": torch.randn(33, 7).to(torch.bfloat16), "c": torch.arange(300)}
    f = open("/dev/full", "wb", buffering=2048)
    try:
        with pytest.raises(OSError, match="No space left") as err:
            staged_write.write_tensors(f, tensors, 256, total=3 * 512, count=3)  # 512-byte segments: ~17 of them
    finally:
        try:
            f.close()
        except OSError:  # what is left in its buffer cannot be written either
            pass
    (ring,) = recording
    assert ring.released >= 5, f"the error came after {ring.released} buffers, not mid-way"
    _assert_released(ring, err)
    assert err.value.errno == errno.ENOSPC


def test_a_closed_ring_stays_closed() -> None:
    with StagingRing(torch.device("cpu"), 256, 2) as ring:
        host = ring.acquire(1)
        host[:4] = torch.arange(4, dtype=torch.uint8)
        assert torch.equal(ring.to_device(1, 4), torch.arange(4, dtype=torch.uint8))
        ring.release(1)
    assert ring.closed and ring.host == []
    ring.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        ring.to_device(0, 4)


def test_the_original_error_is_raised_through_the_ring() -> None:
    with pytest.raises(KeyError, match="original"):
        with StagingRing(torch.device("cpu"), 64, 1):
            raise KeyError("original")
