"""Opt-in GPU tests (`pytest -m gpu tests/gpu`): destination tensors assembled on the GPU from memory-mapped shards.

The staged path (pinned staging buffers, a side stream, CUDA events guarding
buffer reuse) against the per-piece path and the original tensors, and the
staged save from GPU tensors against the CPU writer's bytes, a host-memory
snapshot file written from GPU tensors through the pinned ring, and the ring
on error paths (side stream synchronised, device buffers released). Deselected
elsewhere (pytest.ini: ``-m "not gpu"``); ``scripts/gpu_check.sh`` runs them with
a GPU machine's own torch. Imports nothing that needs megatron-core, hypothesis
or pytest-xdist. Written in sessions without a GPU: not yet run on one
(issue #15 point 3, issue #33).
"""

from __future__ import annotations

import errno
import os

import pytest
import torch

from tenplex_megatron.execute.executor import execute_plan
from tenplex_megatron.execute.staged import execute_staged
from tenplex_megatron.memory import shm_write
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.planner import plan_reshard
from tenplex_megatron.plan.sim.sharding import layout_chunks
from tenplex_megatron.storage import staged_write
from tenplex_megatron.storage.safetensors_io import CheckpointFileError, write_safetensors
from tenplex_megatron.storage.source_files import SourceFiles
from tenplex_megatron.storage.staging import StagingRing
from tests.staging_support import damage_last_byte_read, staging_tensors, write_source

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TRANSITIONS = [((2, 1, 2, True), (1, 2, 1, False)), ((1, 2, 1, False), (4, 1, 1, True)), ((4, 1, 1, False), (2, 2, 1, False))]


def test_ring_is_pinned_and_uses_a_side_stream() -> None:
    ring = StagingRing(torch.device("cuda"), 1 << 20, 3)
    assert ring.device == torch.device("cuda", torch.cuda.current_device())  # the index made explicit
    assert all(h.is_pinned() for h in ring.host) and all(d.is_cuda for d in ring.dev)
    assert ring.stream is not None and ring.stream != torch.cuda.current_stream()
    host = ring.acquire(0)
    host[:8] = torch.arange(8, dtype=torch.uint8)
    dev = ring.to_device(0, 8)
    ring.release(0)
    assert ring.events[0] is not None
    ring.acquire(0)  # waits on the event
    assert torch.equal(dev.cpu(), torch.arange(8, dtype=torch.uint8))
    ring.finish()
    ring.close()
    assert ring.closed and ring.host == [] and ring.dev == [] and ring.stream is None


@pytest.mark.parametrize("src,dst", TRANSITIONS)
@pytest.mark.parametrize("total,count", [(64, 1), (192, 3), (4096, 2), (256 << 20, 3)])
def test_staged_into_cuda_matches_per_piece_on_cpu(tmp_path, monkeypatch, src, dst, total, count) -> None:
    monkeypatch.setenv("TENPLEX_STAGING", "direct")  # the reference: execute_plan's per-piece copies on the CPU
    tensors = staging_tensors(3, 4)
    gen = torch.Generator().manual_seed(total + count)
    full = {k: torch.randn(t.global_shape, generator=gen).to(getattr(torch, t.dtype)) for k, t in tensors.items()}
    source = write_source(str(tmp_path), tensors, ParallelLayout(*src[:3]), src[3], full)
    plan = plan_reshard(source, tensors, layout_chunks(tensors, ParallelLayout(*dst[:3]), dst[3]), strict=False)
    for rp in plan.ranks.values():
        files = SourceFiles(str(tmp_path), {k: m.dtype for k, m in tensors.items()}, require_checksums=True)
        ref = [torch.zeros(c.numel, dtype=getattr(torch, tensors[c.key].dtype)) for c in rp.chunks]
        execute_plan(rp, plan.sources, files, ref)
        got = [torch.zeros(c.numel, dtype=getattr(torch, tensors[c.key].dtype), device="cuda:0") for c in rp.chunks]
        read, unverified = execute_staged(rp, plan.sources, files, got, {}, total, count)
        files.close()
        assert read == rp.bytes_read and unverified == 0
        for c, a, b in zip(rp.chunks, ref, got):
            assert b.is_cuda and torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8)), c


@pytest.mark.parametrize("mode", ["parallel", "copy", "direct", "auto"])
def test_execute_plan_into_cudastaging_tensors(tmp_path, monkeypatch, mode) -> None:
    monkeypatch.setenv("TENPLEX_STAGING", mode)
    monkeypatch.setenv("TENPLEX_STAGING_MB", "0.01")
    tensors = staging_tensors(2, 2)
    full = {k: torch.randn(t.global_shape).to(getattr(torch, t.dtype)) for k, t in tensors.items()}
    source = write_source(str(tmp_path), tensors, ParallelLayout(2, 1, 1), False, full)
    plan = plan_reshard(source, tensors, layout_chunks(tensors, ParallelLayout(1, 2, 1), False), strict=False)
    files = SourceFiles(str(tmp_path), {k: m.dtype for k, m in tensors.items()})
    for rp in plan.ranks.values():
        out = [torch.empty(c.numel, dtype=getattr(torch, tensors[c.key].dtype), device="cuda:0") for c in rp.chunks]
        execute_plan(rp, plan.sources, files, out)
        torch.cuda.synchronize(0)
        for c, got in zip(rp.chunks, out):
            box = full[c.key][tuple(slice(o, o + n) for o, n in zip(c.offsets, c.shape))].reshape(-1)
            lo, hi = c.flat_range
            rows = tensors[c.key].vocab_rows
            if rows is not None:  # only the real vocabulary rows come from the source
                n = max(0, min(c.shape[0], rows - c.offsets[0])) * (c.numel // c.shape[0])
                lo, hi = lo, min(hi, n)
            assert torch.equal(got.cpu()[: hi - lo], box[lo:hi]), c
    files.close()


@pytest.mark.parametrize("mb", ["0.0001", "0.01", "256"])
def test_staged_save_from_cuda_is_byte_identical(tmp_path, monkeypatch, mb) -> None:
    host = {"a": torch.randn(100_000), "b": torch.randn(333, 7).to(torch.bfloat16), "c": torch.zeros(0),
            "d": torch.randint(0, 9, (5000,))}
    monkeypatch.setenv("TENPLEX_STAGING", "direct")
    size, sums = write_safetensors(str(tmp_path / "cpu.safetensors"), host, block_bytes=4096)
    monkeypatch.setenv("TENPLEX_STAGING", "copy")
    monkeypatch.setenv("TENPLEX_STAGING_MB", mb)
    size2, sums2 = write_safetensors(str(tmp_path / "gpu.safetensors"), {k: t.to("cuda:0") for k, t in host.items()},
                                     block_bytes=4096)
    assert (size2, sums2) == (size, sums)
    assert (tmp_path / "gpu.safetensors").read_bytes() == (tmp_path / "cpu.safetensors").read_bytes()


def test_nccl_collectives_carry_json(tmp_path) -> None:
    import torch.distributed as dist

    from tenplex_megatron.execute.collective import all_gather_json

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        assert all_gather_json({"a": [1, 2]}) == [{"a": [1, 2]}]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mb", ["0.01", "256"])
def test_snapshot_file_from_cuda_through_the_pinned_ring(tmp_path, monkeypatch, mb) -> None:
    """A host-memory snapshot's rank file (``memory/shm_write.py``) written from CUDA tensors (``auto``: the
    parallel writer, device-to-host through the pinned ring on a side stream) is the same file, with the same
    checksums, as one written from the CPU."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else str(tmp_path)
    host = {"a": torch.randn(300_001), "b": torch.randn(1000, 77).to(torch.bfloat16), "c": torch.zeros(0),
            "d": torch.randint(0, 9, (70_000,))}
    monkeypatch.setenv("TENPLEX_STAGING_MB", mb)
    paths = [os.path.join(root, f"tenplex-gpu-test-{os.getpid()}-{n}.safetensors") for n in ("cpu", "cuda")]
    try:
        monkeypatch.setenv("TENPLEX_STAGING", "auto")  # writer threads; CUDA's tensors through the pinned ring
        got = [shm_write.write_tensors(paths[0], host, 4096),
               shm_write.write_tensors(paths[1], {k: t.to("cuda:0") for k, t in host.items()}, 4096)]
        assert got[0] == got[1]
        with open(paths[0], "rb") as a, open(paths[1], "rb") as b:
            assert a.read() == b.read()
    finally:
        for p in paths:
            if os.path.exists(p):
                os.remove(p)


def test_load_error_on_cuda_synchronises_and_releases_the_ring(tmp_path, monkeypatch) -> None:
    """A damaged block found after some buffers went to the device: the error reaches the caller, the side stream
    is done and the device buffers are back with the caching allocator while the error is still alive."""
    tensors = staging_tensors(64, 2)
    full = {k: torch.randn(t.global_shape).to(getattr(torch, t.dtype)) for k, t in tensors.items()}
    source = write_source(str(tmp_path), tensors, ParallelLayout(2, 1, 1), False, full)
    plan = plan_reshard(source, tensors, layout_chunks(tensors, ParallelLayout(1, 2, 1), False), strict=False)
    rp = plan.ranks[0]
    sc = plan.sources[rp.pieces[-1].source]
    damage_last_byte_read(str(tmp_path), sc, tensors[sc.chunk.key].dtype, rp.pieces[-1])
    out = [torch.zeros(c.numel, dtype=getattr(torch, tensors[c.key].dtype), device="cuda:0") for c in rp.chunks]
    torch.cuda.synchronize(0)
    before = torch.cuda.memory_allocated(0)
    files = SourceFiles(str(tmp_path), {k: m.dtype for k, m in tensors.items()}, require_checksums=True)
    with pytest.raises(CheckpointFileError) as err:
        execute_staged(rp, plan.sources, files, out, {}, 3 * 4096, 3)
    files.close()
    assert torch.cuda.memory_allocated(0) == before, "the ring's device buffers are still allocated"
    torch.cuda.synchronize(0)  # nothing the ring queued failed
    assert err.value is not None


def test_save_error_on_cuda_synchronises_and_releases_the_ring(monkeypatch) -> None:
    monkeypatch.setenv("TENPLEX_STAGING", "copy")
    tensors = {"a": torch.randn(1 << 20, device="cuda:0"), "b": torch.randn(3000, 7, device="cuda:0").to(torch.bfloat16)}
    torch.cuda.synchronize(0)
    before = torch.cuda.memory_allocated(0)
    f = open("/dev/full", "wb", buffering=3 * 65536)  # a full disk: the buffer's first flush fails with ENOSPC
    try:
        with pytest.raises(OSError, match="No space left") as err:
            staged_write.write_tensors(f, tensors, 4096, total=3 * 65536, count=3)
    finally:
        try:
            f.close()
        except OSError:
            pass
    assert torch.cuda.memory_allocated(0) == before, "the ring's device buffers are still allocated"
    torch.cuda.synchronize(0)
    assert err.value.errno == errno.ENOSPC


def test_parallel_load_error_on_cuda_synchronises_and_releases_the_ring(tmp_path, monkeypatch) -> None:
    """The parallel reader into CUDA tensors: a damaged block found after some slots went to the device names the
    file and the block; the reader threads are joined and the ring's device memory is released."""
    monkeypatch.setenv("TENPLEX_STAGING", "parallel")
    monkeypatch.setenv("TENPLEX_STAGING_MB", "0.01")
    monkeypatch.setenv("TENPLEX_READ_THREADS", "4")
    tensors = staging_tensors(64, 2)
    full = {k: torch.randn(t.global_shape).to(getattr(torch, t.dtype)) for k, t in tensors.items()}
    source = write_source(str(tmp_path), tensors, ParallelLayout(2, 1, 1), False, full)
    plan = plan_reshard(source, tensors, layout_chunks(tensors, ParallelLayout(1, 2, 1), False), strict=False)
    rp = plan.ranks[0]
    sc = plan.sources[rp.pieces[-1].source]
    damage_last_byte_read(str(tmp_path), sc, tensors[sc.chunk.key].dtype, rp.pieces[-1])
    out = [torch.zeros(c.numel, dtype=getattr(torch, tensors[c.key].dtype), device="cuda:0") for c in rp.chunks]
    torch.cuda.synchronize(0)
    before = torch.cuda.memory_allocated(0)
    files = SourceFiles(str(tmp_path), {k: m.dtype for k, m in tensors.items()}, require_checksums=True)
    with pytest.raises(CheckpointFileError, match=rf"{sc.location.file}: tensor .* fails its checksum in block"):
        execute_plan(rp, plan.sources, files, out)
    files.close()
    assert torch.cuda.memory_allocated(0) == before, "the ring's device buffers are still allocated"
    torch.cuda.synchronize(0)


def test_parallel_save_from_cuda_is_the_cpu_file(tmp_path, monkeypatch) -> None:
    """The parallel writer from CUDA tensors (device-to-host into the pinned ring, CRCs and writes in threads)
    writes the file and the block CRCs the CPU's sequential writer does."""
    host = {"a": torch.randn(300_001), "b": torch.randn(1000, 77).to(torch.bfloat16), "c": torch.zeros(0)}
    monkeypatch.setenv("TENPLEX_STAGING", "direct")
    ref = write_safetensors(str(tmp_path / "cpu.safetensors"), host, block_bytes=4096)
    monkeypatch.setenv("TENPLEX_STAGING", "parallel")
    monkeypatch.setenv("TENPLEX_STAGING_MB", "0.05")
    got = write_safetensors(str(tmp_path / "cuda.safetensors"), {k: t.to("cuda:0") for k, t in host.items()},
                            block_bytes=4096)
    assert got == ref
    assert (tmp_path / "cpu.safetensors").read_bytes() == (tmp_path / "cuda.safetensors").read_bytes()
