"""Staged assembly (load): pieces read into reused staging buffers, each sent to the device in one transfer, then
scattered there into the destination tensors.

The packing is ``plan/staging.py``'s; the buffers and streams ``storage/staging.py``'s.
On a GPU, buffer k's transfer and scatter run on a side stream while the host
checks and reads buffer k+1; on the CPU the same steps run in order, so the CPU
suite checks the GPU path's indexing bit for bit against the direct copies.
"""

from __future__ import annotations

import math

import torch

from tenplex_megatron.plan.planner import Piece, RankPlan
from tenplex_megatron.plan.ptc import StoredChunk
from tenplex_megatron.plan.staging import stage_batches
from tenplex_megatron.storage.source import Source
from tenplex_megatron.storage.staging import RING, StagingRing, buffer_bytes


def box_view(flat: torch.Tensor, start: int, rect: tuple[int, ...], sel: tuple[int, ...],
             shape: tuple[int, ...]) -> torch.Tensor:
    """The strided sub-box ``sel``/``shape`` of the rectangle ``rect`` stored at ``start`` in ``flat``."""
    t = flat[start : start + math.prod(rect)].view(rect)
    return t[tuple(slice(o, o + s) for o, s in zip(sel, shape))]


def execute_staged(plan: RankPlan, sources: tuple[StoredChunk, ...], files: Source, dst: list[torch.Tensor],
                   flats: dict[int, torch.Tensor], total: int | None = None, count: int = RING) -> tuple[int, int]:
    """Copy the plan's pieces into ``dst`` through a ring of ``count`` staging buffers; returns (bytes, unverified).

    ``flats``: the plan's source chunks already opened (by index); ``total``: the
    staging budget in bytes (default ``TENPLEX_STAGING_MB``). Each piece's
    checksum blocks are checked before its first bytes are staged.
    """
    pieces = plan.pieces
    for p in pieces:
        if p.source not in flats:
            flats[p.source] = files.flat(sources[p.source])
    batches = stage_batches(pieces, lambda p: flats[p.source].element_size(), buffer_bytes(total, count))
    if not batches:
        return 0, 0
    device = dst[pieces[batches[0].slots[0].index].dst].device
    read = unverified = 0
    started: set[int] = set()
    host = staged = None
    # leaving the block, by an error too (a damaged block found after earlier buffers went out), synchronises the
    # side stream and drops the ring's buffers: nothing stays queued on memory that is handed back
    try:
        with StagingRing(device, max(b.nbytes for b in batches), count) as ring:
            for k, batch in enumerate(batches):
                i = k % count
                host = ring.acquire(i)
                for s in batch.slots:
                    p: Piece = pieces[s.index]
                    src = flats[p.source]
                    if s.index not in started:
                        started.add(s.index)
                        nbytes = p.numel * src.element_size()
                        read += nbytes
                        if not files.check(sources[p.source], src, p):
                            unverified += nbytes
                    b = s.box
                    view = box_view(src, b.src_start, b.src_rect, b.src_sel, b.shape)
                    host[s.offset : s.offset + s.nbytes].view(src.dtype).view(b.shape).copy_(view)
                staged = ring.to_device(i, batch.nbytes)
                with ring.side():
                    for s in batch.slots:
                        b = s.box
                        src_dtype = flats[b.source].dtype
                        d = box_view(dst[b.dst], b.dst_start, b.dst_rect, b.dst_sel, b.shape)
                        d.copy_(staged[s.offset : s.offset + s.nbytes].view(src_dtype).view(b.shape))
                ring.release(i)
    finally:
        host = staged = None  # views of the ring's buffers: an error's traceback keeps this frame and its locals
    return read, unverified
