"""Checksum verification at load: only the CRC-32 blocks that a plan's pieces actually read are checked, each once.

A stored chunk records one CRC-32 per ``block_bytes`` block of its bytes
(checkpoint format 2), so a rank that needs part of a chunk reads and checks
just the blocks its pieces touch, not the whole chunk. Format 1 recorded one
CRC per chunk: such a chunk is checked whole, as before.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from tenplex_megatron.plan.planner import Piece
from tenplex_megatron.plan.ptc import StoredChunk
from tenplex_megatron.storage.checksum import crc32
from tenplex_megatron.storage.cpus import usable_cpus
from tenplex_megatron.storage.files import CheckpointFileError
from tenplex_megatron.storage.prefetch import willneed


def piece_runs(p: Piece) -> tuple[np.ndarray, int]:
    """The contiguous element runs a piece reads in its source chunk: their sorted start offsets and common length.

    Trailing dimensions the piece spans fully merge into one run; the outer
    ones give one run per index. An empty piece has no runs.
    """
    if p.numel == 0:
        return np.zeros(0, dtype=np.int64), 0
    nd = len(p.shape)
    strides = [math.prod(p.src_rect[i + 1 :]) for i in range(nd)]
    j = nd - 1
    run = p.shape[j]
    while j > 0 and p.shape[j] == p.src_rect[j]:
        j -= 1
        run *= p.shape[j]
    starts = np.array([p.src_start + sum(o * s for o, s in zip(p.src_sel, strides))], dtype=np.int64)
    for i in range(j):
        starts = (starts[:, None] + np.arange(p.shape[i], dtype=np.int64) * strides[i]).ravel()
    return starts, run


def touched_blocks(starts: np.ndarray, run: int, itemsize: int, block_bytes: int) -> list[int]:
    """Indices (ascending) of the ``block_bytes`` blocks that runs of ``run`` elements at ``starts`` overlap."""
    if len(starts) == 0 or run == 0:
        return []
    first = starts * itemsize // block_bytes
    last = ((starts + run) * itemsize - 1) // block_bytes
    lo, hi = int(first[0]), int(last[-1])
    if len(starts) == 1:
        return list(range(lo, hi + 1))
    marks = np.bincount(first - lo, minlength=hi - lo + 2) - np.bincount(last - lo + 1, minlength=hi - lo + 2)
    return (np.flatnonzero(np.cumsum(marks)[: hi - lo + 1] > 0) + lo).tolist()


def default_threads() -> int:
    """Threads for checksums: ``TENPLEX_VERIFY_THREADS``, else this rank's share of the CPUs (torchrun's local ranks), 1-8.

    ``storage.checksum.crc32`` releases the GIL, so blocks are checked in parallel where a rank has cores to spare.
    """
    env = os.environ.get("TENPLEX_VERIFY_THREADS")
    if env:
        return max(1, int(env))
    cpus = usable_cpus()
    return max(1, min(8, cpus // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))


@dataclass(frozen=True)
class Block:
    """One block to check: where it is (for the error), its bytes and the recorded CRC."""

    key: tuple[str, str, int]
    where: str
    start: int
    data: torch.Tensor
    expected: int
    source: int = -1  # index of the stored chunk in the plan's sources (-1: unknown)

    @property
    def shareable(self) -> bool:
        """A fixed-size block of a known source: ranks of one host can split such blocks (``plan/verify_share.py``)."""
        return self.source >= 0 and self.start >= 0


class BlockVerifier:
    """Checks the checksums of the stored bytes a load reads, each block (or old whole chunk) once per process.

    ``require``: a chunk without any recorded checksum is an error (format 2
    always records them); otherwise its bytes are copied unverified.
    """

    def __init__(self, ckpt_dir: str, require: bool = False, threads: int | None = None,
                 path_of: Callable[[str], str] | None = None):
        self.ckpt_dir = ckpt_dir
        self.path_of = path_of or (lambda name: os.path.join(ckpt_dir, name))  # a file's path, for the errors
        self.require = require
        self.threads = threads or default_threads()
        self.verified: set[tuple[str, str, int]] = set()  # (file, tensor, block); block -1: the whole tensor
        self.bytes_verified = 0

    def check(self, sc: StoredChunk, flat: torch.Tensor, p: Piece) -> bool:
        """Verify what piece ``p`` reads of ``flat`` (``sc``'s data) now; returns whether a checksum covers those bytes."""
        todo: list[Block] = []
        covered = self.collect(sc, flat, p, todo)
        self.run(todo)
        return covered

    def collect(self, sc: StoredChunk, flat: torch.Tensor, p: Piece, todo: list[Block], source: int = -1) -> bool:
        """Append to ``todo`` the blocks piece ``p`` reads that are not verified yet; returns whether checksums cover it.

        ``source``: the stored chunk's index in the plan's sources, which names the block alike on every rank.
        """
        loc = sc.location
        where = f"{self.path_of(loc.file)}: tensor {loc.name!r} (of {sc.chunk.key!r})"
        raw = flat.view(torch.uint8)
        if loc.block_crc32 is not None and loc.block_bytes is not None:
            size = loc.block_bytes
            nblocks = -(-raw.numel() // size)
            if len(loc.block_crc32) != nblocks:
                raise CheckpointFileError(
                    f"{where}: the metadata records {len(loc.block_crc32)} block checksums, "
                    f"its {raw.numel()} bytes make {nblocks} blocks of {size}"
                )
            for b in touched_blocks(*piece_runs(p), flat.element_size(), size):
                key = (loc.file, loc.name, b)
                if key not in self.verified:
                    self.verified.add(key)  # claimed now, so a block is queued once; run() raises if it fails
                    todo.append(Block(key, where, b * size, raw[b * size : (b + 1) * size], loc.block_crc32[b], source))
            return True
        if loc.crc32 is not None:
            key = (loc.file, loc.name, -1)
            if key not in self.verified:
                self.verified.add(key)
                todo.append(Block(key, where, -1, raw, loc.crc32))
            return True
        if self.require:
            raise CheckpointFileError(f"{where}: no checksum recorded in the metadata (damaged metadata)")
        return False

    def run(self, todo: list[Block]) -> None:
        """Compute the CRC-32 of every queued block (in ``threads`` threads); raise on the first mismatch, in order."""
        if not todo:
            return
        willneed((b.data.data_ptr(), b.data.data_ptr() + b.data.numel()) for b in todo)  # cold files: read ahead
        if self.threads > 1 and len(todo) > 1:
            with ThreadPoolExecutor(min(self.threads, len(todo))) as pool:
                got = list(pool.map(lambda blk: crc32(blk.data.numpy()), todo))
        else:
            got = [crc32(blk.data.numpy()) for blk in todo]
        for blk, crc in zip(todo, got):
            if crc != blk.expected:
                for other in todo:  # nothing of a failed batch counts as verified
                    self.verified.discard(other.key)
                if blk.start < 0:
                    raise CheckpointFileError(
                        f"{blk.where} fails its checksum (crc32 {crc:#010x}, recorded {blk.expected:#010x}): "
                        "the file is damaged"
                    )
                b = blk.key[2]
                raise CheckpointFileError(
                    f"{blk.where} fails its checksum in block {b} (bytes {blk.start}-{blk.start + blk.data.numel()}, "
                    f"crc32 {crc:#010x}, recorded {blk.expected:#010x}): the file is damaged"
                )
            self.bytes_verified += blk.data.numel()
