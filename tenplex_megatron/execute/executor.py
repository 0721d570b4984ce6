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
from tenplex_megatron.storage.safetensors_io import CheckpointFileError, SafetensorsReader, crc32


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

    def __init__(self, ckpt_dir: str, dtypes: dict[str, str], sizes: dict[str, int] | None = None, verify: bool = True):
        self.ckpt_dir = ckpt_dir
        self.dtypes = dtypes
        self.sizes = sizes or {}
        self.verify = verify
        self.readers: dict[str, SafetensorsReader] = {}
        self.verified: set[tuple[str, str]] = set()
        self.bytes_verified = 0

    def flat(self, sc: StoredChunk) -> torch.Tensor:
        loc = sc.location
        reader = self.readers.get(loc.file)
        if reader is None:
            path = os.path.join(self.ckpt_dir, loc.file)
            reader = SafetensorsReader(path)
            expected = self.sizes.get(loc.file)
            if expected is not None and reader.size != expected:
                reader.close()
                raise CheckpointFileError(f"{path}: size {reader.size} bytes, the metadata recorded {expected} (damaged or truncated)")
            self.readers[loc.file] = reader
        t = reader.flat(loc.name, self.dtypes[sc.chunk.key], sc.chunk.numel)
        if self.verify and loc.crc32 is not None and (loc.file, loc.name) not in self.verified:
            got = crc32(t)
            if got != loc.crc32:
                raise CheckpointFileError(
                    f"{reader.path}: tensor {loc.name!r} (of {sc.chunk.key!r}) fails its checksum "
                    f"(crc32 {got:#010x}, recorded {loc.crc32:#010x}): the file is damaged"
                )
            self.verified.add((loc.file, loc.name))
            self.bytes_verified += t.numel() * t.element_size()
        return t

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
