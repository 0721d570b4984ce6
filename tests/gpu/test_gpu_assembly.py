"""Opt-in GPU tests (`pytest -m gpu`): destination tensors assembled on the GPU from memory-mapped shards.

Not run in CI (no GPU there). Written in a session without a GPU: not yet run.
"""

from __future__ import annotations

import pytest
import torch

from tenplex_megatron.execute.executor import SourceFiles, execute_plan
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.planner import plan_reshard
from tenplex_megatron.plan.ptc import PTC, Location, StoredChunk, TensorMeta
from tenplex_megatron.plan.sim.sharding import layout_chunks
from tenplex_megatron.storage.safetensors_io import write_safetensors

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _tensors() -> dict[str, TensorMeta]:
    w = TensorMeta("w", (4, 96, 64), "float32", tp_axis=1, stage="layers")
    s = TensorMeta("optimizer.state.exp_avg.w", (4, 96, 64), "float32", tp_axis=1, stage="layers", param="w")
    b = TensorMeta("b", (4, 64), "bfloat16", stage="layers")
    return {t.key: t for t in (w, s, b)}


@pytest.mark.parametrize("src,dst", [((2, 1, 2), (1, 2, 1)), ((1, 2, 1), (4, 1, 1))])
def test_plan_executes_into_cuda_tensors(tmp_path, src, dst) -> None:
    tensors = _tensors()
    full = {k: torch.randn(t.global_shape).to(getattr(torch, t.dtype)) for k, t in tensors.items()}
    stored, blobs = {}, {}
    for rank, chunks in layout_chunks(tensors, ParallelLayout(*src), True).items():
        for c in chunks:
            if c in stored:
                continue
            box = full[c.key][tuple(slice(o, o + n) for o, n in zip(c.offsets, c.shape))].reshape(-1)
            a, b = c.flat_range
            name = f"{c.key}@{c.offsets}#{c.flat}"
            blobs[name] = box[a:b].clone()
            stored[c] = StoredChunk(c, Location("shard.safetensors", name, rank))
    write_safetensors(str(tmp_path / "shard.safetensors"), blobs)
    source = PTC(tensors, tuple(stored.values()))
    dst_chunks = layout_chunks(tensors, ParallelLayout(*dst), True)
    plan = plan_reshard(source, tensors, dst_chunks)
    files = SourceFiles(str(tmp_path), {k: t.dtype for k, t in tensors.items()})
    for rp in plan.ranks.values():
        out = [torch.empty(c.numel, dtype=getattr(torch, tensors[c.key].dtype), device="cuda") for c in rp.chunks]
        execute_plan(rp, plan.sources, files, out)
        for c, got in zip(rp.chunks, out):
            assert got.is_cuda
            box = full[c.key][tuple(slice(o, o + n) for o, n in zip(c.offsets, c.shape))].reshape(-1)
            a, b = c.flat_range
            assert torch.equal(got.cpu(), box[a:b])
    files.close()


def test_nccl_collectives_carry_json(tmp_path) -> None:
    import os

    import torch.distributed as dist

    from tenplex_megatron.execute.collective import all_gather_json

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        assert all_gather_json({"a": [1, 2]}) == [{"a": [1, 2]}]
    finally:
        dist.destroy_process_group()
