"""docs/concepts.md's worked example through the real planner: a 6 x 4 fp32 weight saved at TP2 (two chunks, one
file each) and loaded at TP3. The page's figure and its steps are what the plan says, piece by piece."""

from __future__ import annotations

import numpy as np

from tenplex_megatron.plan.planner import plan_reshard
from tenplex_megatron.plan.ptc import PTC, Chunk, Location, StoredChunk, TensorMeta

KEY = "decoder.layers.mlp.linear_fc1.weight"


def test_a_tensor_saved_on_2_ranks_loads_on_3() -> None:
    meta = TensorMeta(KEY, (6, 4), "float32", tp_axis=0)
    source = PTC({KEY: meta}, (StoredChunk(Chunk(KEY, (0, 0), (3, 4)), Location("rank0.safetensors", KEY, rank=0)),
                               StoredChunk(Chunk(KEY, (3, 0), (3, 4)), Location("rank1.safetensors", KEY, rank=1))))
    dst = {r: [Chunk(KEY, (2 * r, 0), (2, 4))] for r in range(3)}
    plan = plan_reshard(source, {KEY: meta}, dst)

    # (file, first source row, first destination row, rows) of each piece, per rank: the page's step 3
    pieces = {r: [(plan.sources[p.source].location.file, p.src_sel[0], p.dst_sel[0], p.shape[0])
                  for p in rp.pieces] for r, rp in plan.ranks.items()}
    assert pieces == {0: [("rank0.safetensors", 0, 0, 2)],
                      1: [("rank0.safetensors", 2, 0, 1), ("rank1.safetensors", 0, 1, 1)],
                      2: [("rank1.safetensors", 1, 0, 2)]}
    row_bytes = 4 * 4
    assert plan.bytes_per_rank() == {r: 2 * row_bytes for r in range(3)}  # each rank reads exactly its share
    assert plan.ranks[1].bytes_by_file == {"rank0.safetensors": row_bytes, "rank1.safetensors": row_bytes}

    # Executed by hand with numpy: every destination row is the tensor's own, written once.
    full = np.arange(24, dtype=np.float32).reshape(6, 4)
    stored = {"rank0.safetensors": full[0:3], "rank1.safetensors": full[3:6]}
    for r, rp in plan.ranks.items():
        out, written = np.full((2, 4), np.nan, dtype=np.float32), np.zeros(2, dtype=int)
        for p in rp.pieces:
            src = stored[plan.sources[p.source].location.file]
            (sr, sc), (dr, dc), (n, m) = p.src_sel, p.dst_sel, p.shape
            out[dr:dr + n, dc:dc + m] = src[sr:sr + n, sc:sc + m]
            written[dr:dr + n] += 1
        assert (written == 1).all() and np.array_equal(out, full[2 * r:2 * r + 2])
