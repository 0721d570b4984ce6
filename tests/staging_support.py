"""Shared by the staging tests on the CPU (``tests/unit/test_staging.py``) and on a GPU (``tests/gpu``): small
GPT-like tensor descriptions and source shards written by the real writer.

Importable without megatron-core, hypothesis or pytest-xdist, which a GPU machine's system Python
(``scripts/gpu_check.sh``) does not have: only torch and this checkout.
"""

from __future__ import annotations

import math
import os

import torch

from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.planner import Piece
from tenplex_megatron.plan.ptc import PTC, Location, StoredChunk, TensorMeta
from tenplex_megatron.plan.sim.sharding import layout_chunks
from tenplex_megatron.storage.safetensors_io import read_header, write_safetensors

BLOCK = 256  # checksum block of the shards written here: small, so a piece spans several blocks


def staging_tensors(d: int, layers: int) -> dict[str, TensorMeta]:
    """A weight split along TP on axis 1 and one on axis 2 (bf16), a bias (fp16), a vocab-padded embedding and an
    Adam moment: the shapes a staged load must cut; ``d`` scales every TP-split dimension."""
    ts = [
        TensorMeta("w", (layers, 4 * d, 8), "float32", tp_axis=1, stage="layers"),
        TensorMeta("v", (layers, 8, 4 * d), "bfloat16", tp_axis=2, stage="layers"),
        TensorMeta("b", (layers, 4 * d), "float16", stage="layers"),
        TensorMeta("emb", (4 * d + 4, 8), "float32", vocab_rows=4 * d + 1, tp_axis=0, stage="first"),
        TensorMeta("optimizer.state.exp_avg.w", (layers, 4 * d, 8), "float32", tp_axis=1, stage="layers", param="w"),
    ]
    return {t.key: t for t in ts}


def write_source(root: str, tensors: dict[str, TensorMeta], layout: ParallelLayout, dist_opt: bool,
                 full: dict[str, torch.Tensor]) -> PTC:
    """Each rank's distinct chunks in its own shard file, written by the real writer with block CRCs."""
    stored: dict = {}
    for rank, chunks in layout_chunks(tensors, layout, dist_opt).items():
        blobs, mine = {}, []
        for c in chunks:
            if c in stored or any(c == m for m in mine):
                continue
            box = full[c.key][tuple(slice(o, o + n) for o, n in zip(c.offsets, c.shape))].reshape(-1)
            a, b = c.flat_range
            name = f"{c.key}@{c.offsets}#{c.flat}"
            blobs[name] = box[a:b].clone()
            mine.append(c)
        if not blobs:
            continue
        fname = f"rank_{rank:05d}.safetensors"
        _, sums = write_safetensors(os.path.join(root, fname), blobs, block_bytes=BLOCK)
        for c in mine:
            name = f"{c.key}@{c.offsets}#{c.flat}"
            stored[c] = StoredChunk(c, Location(fname, name, rank, block_crc32=sums[name], block_bytes=BLOCK))
    return PTC(tensors, tuple(stored.values()))


def damage_last_byte_read(root: str, sc: StoredChunk, dtype: str, piece: Piece) -> None:
    """Flip one bit of the last byte ``piece`` reads of ``sc`` (in ``root``): its checksum block fails only when that
    piece is checked, after every piece staged before it."""
    last = piece.src_start + sum((s + n - 1) * math.prod(piece.src_rect[d + 1 :])
                                 for d, (s, n) in enumerate(zip(piece.src_sel, piece.shape)))
    itemsize = getattr(torch, dtype).itemsize
    path = os.path.join(root, sc.location.file)
    at = read_header(path)[0][sc.location.name].begin + (last + 1) * itemsize - 1
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ 0x01]))
