"""Opt-in GPU tests (`pytest -m gpu tests/gpu`): destination tensors assembled on the GPU from memory-mapped shards.

The staged path (pinned staging buffers, a side stream, CUDA events guarding
buffer reuse) against the per-piece path and the original tensors, and the
staged save from GPU tensors against the CPU writer's bytes. Deselected
elsewhere (pytest.ini: ``-m "not gpu"``). Written in a session without a GPU:
not yet run on one (issue #15 point 3).
"""

from __future__ import annotations

import os

import pytest
import torch

from tenplex_megatron.execute.executor import SourceFiles, execute_plan
from tenplex_megatron.execute.staged import execute_staged
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.planner import plan_reshard
from tenplex_megatron.plan.sim.sharding import layout_chunks
from tenplex_megatron.storage.safetensors_io import write_safetensors
from tenplex_megatron.storage.staging import StagingRing
from tests.unit.test_staging import _tensors, _write_source

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TRANSITIONS = [((2, 1, 2, True), (1, 2, 1, False)), ((1, 2, 1, False), (4, 1, 1, True)), ((4, 1, 1, False), (2, 2, 1, False))]


def test_ring_is_pinned_and_uses_a_side_stream() -> None:
    ring = StagingRing(torch.device("cuda"), 1 << 20, 3)
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


@pytest.mark.parametrize("src,dst", TRANSITIONS)
@pytest.mark.parametrize("total,count", [(64, 1), (192, 3), (4096, 2), (256 << 20, 3)])
def test_staged_into_cuda_matches_per_piece_on_cpu(tmp_path, monkeypatch, src, dst, total, count) -> None:
    monkeypatch.setenv("TENPLEX_STAGING", "direct")  # the reference: execute_plan's per-piece copies on the CPU
    tensors = _tensors(3, 4)
    gen = torch.Generator().manual_seed(total + count)
    full = {k: torch.randn(t.global_shape, generator=gen).to(getattr(torch, t.dtype)) for k, t in tensors.items()}
    source = _write_source(str(tmp_path), tensors, ParallelLayout(*src[:3]), src[3], full)
    plan = plan_reshard(source, tensors, layout_chunks(tensors, ParallelLayout(*dst[:3]), dst[3]), strict=False)
    for rp in plan.ranks.values():
        files = SourceFiles(str(tmp_path), {k: m.dtype for k, m in tensors.items()}, require_checksums=True)
        ref = [torch.zeros(c.numel, dtype=getattr(torch, tensors[c.key].dtype)) for c in rp.chunks]
        execute_plan(rp, plan.sources, files, ref)
        got = [torch.zeros(c.numel, dtype=getattr(torch, tensors[c.key].dtype), device="cuda") for c in rp.chunks]
        read, unverified = execute_staged(rp, plan.sources, files, got, {}, total, count)
        files.close()
        assert read == rp.bytes_read and unverified == 0
        for c, a, b in zip(rp.chunks, ref, got):
            assert b.is_cuda and torch.equal(a.view(torch.uint8), b.cpu().view(torch.uint8)), c


@pytest.mark.parametrize("mode", ["copy", "direct", "auto"])
def test_execute_plan_into_cuda_tensors(tmp_path, monkeypatch, mode) -> None:
    monkeypatch.setenv("TENPLEX_STAGING", mode)
    monkeypatch.setenv("TENPLEX_STAGING_MB", "0.01")
    tensors = _tensors(2, 2)
    full = {k: torch.randn(t.global_shape).to(getattr(torch, t.dtype)) for k, t in tensors.items()}
    source = _write_source(str(tmp_path), tensors, ParallelLayout(2, 1, 1), False, full)
    plan = plan_reshard(source, tensors, layout_chunks(tensors, ParallelLayout(1, 2, 1), False), strict=False)
    files = SourceFiles(str(tmp_path), {k: m.dtype for k, m in tensors.items()})
    for rp in plan.ranks.values():
        out = [torch.empty(c.numel, dtype=getattr(torch, tensors[c.key].dtype), device="cuda") for c in rp.chunks]
        execute_plan(rp, plan.sources, files, out)
        torch.cuda.synchronize()
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
    size2, sums2 = write_safetensors(str(tmp_path / "gpu.safetensors"), {k: t.cuda() for k, t in host.items()},
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
