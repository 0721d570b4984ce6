"""Carry out one destination rank's part of a re-sharding plan with torch.

Each piece is a strided sub-box of a source rectangle (a zero-copy view of a
memory-mapped shard file) copied into a strided sub-box of a destination
tensor, which lives wherever the model lives (the GPU in production), so the
assembly happens on the device and only the needed pages are read.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch

from tenplex_megatron.plan.planner import RankPlan
from tenplex_megatron.plan.ptc import StoredChunk
from tenplex_megatron.storage.safetensors_io import SafetensorsReader


@dataclass(frozen=True)
class ExecStats:
    """What one rank did: bytes copied from sources, bytes zero-filled, files opened, seconds."""

    bytes_read: int
    bytes_filled: int
    files: int
    seconds: float


def _view(flat: torch.Tensor, start: int, rect: tuple[int, ...], sel: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    t = flat[start : start + math.prod(rect)].view(rect)
    return t[tuple(slice(o, o + s) for o, s in zip(sel, shape))]


class SourceFiles:
    """Opens each shard file once and hands out flat views of the stored chunks."""

    def __init__(self, ckpt_dir: str, dtypes: dict[str, str]):
        self.ckpt_dir = ckpt_dir
        self.dtypes = dtypes
        self.readers: dict[str, SafetensorsReader] = {}

    def flat(self, sc: StoredChunk) -> torch.Tensor:
        reader = self.readers.get(sc.location.file)
        if reader is None:
            reader = self.readers[sc.location.file] = SafetensorsReader(os.path.join(self.ckpt_dir, sc.location.file))
        return reader.flat(sc.location.name, self.dtypes[sc.chunk.key], sc.chunk.numel)

    def close(self) -> None:
        for r in self.readers.values():
            r.close()
        self.readers.clear()


def execute_plan(
    plan: RankPlan, sources: tuple[StoredChunk, ...], files: SourceFiles, dst: list[torch.Tensor]
) -> ExecStats:
    """Fill ``dst`` (one flat tensor per destination chunk, in plan order) from the sources."""
    t0 = time.perf_counter()
    read = filled = 0
    flats: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for p in plan.pieces:
            src = flats.get(p.source)
            if src is None:
                src = flats[p.source] = files.flat(sources[p.source])
            s = _view(src, p.src_start, p.src_rect, p.src_sel, p.shape)
            d = _view(dst[p.dst], p.dst_start, p.dst_rect, p.dst_sel, p.shape)
            d.copy_(s)
            read += s.numel() * s.element_size()
        for f in plan.fills:
            d = _view(dst[f.dst], f.dst_start, f.dst_rect, f.dst_sel, f.shape)
            d.zero_()
            filled += d.numel() * d.element_size()
    return ExecStats(read, filled, len(files.readers), time.perf_counter() - t0)
