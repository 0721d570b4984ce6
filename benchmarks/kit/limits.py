"""Physical limits a load is compared with, timed like the loads (every rank its share, max over ranks, median).

``read_cold``: a sequential read of the checkpoint's files from storage (the caller evicts the page cache first:
what cold loads are compared with); ``read_readinto`` / ``read_mmap``: the same bytes from the page cache, by
``readinto`` and by a copy out of a fresh ``mmap`` (tenplex's access path); ``memory_copy``: a memory-to-memory
copy of those bytes (what warm loads are compared with).
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable

import numpy as np

KINDS = ("read_cold", "read_readinto", "read_mmap", "memory_copy")


def split(total: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous byte ranges covering ``[0, total)``, as equal as possible."""
    cuts = [total * i // parts for i in range(parts + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(parts)]


def limit_op(kind: str, path: str, rank: int, world: int) -> tuple[Callable[[], None], int]:
    """Set up (untimed) this rank's share of a physical-limit operation on the files under ``path``.

    The files, back to back in name order, are cut into ``world`` contiguous shares; rank r takes share r, into
    a preallocated, pre-faulted buffer. Returns the operation to time and its byte count.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown physical limit {kind!r}; known: {', '.join(KINDS)}")
    segments, total = [], 0  # (file, its first byte in the concatenation, size)
    for f in sorted(os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs):
        n = os.path.getsize(f)
        segments.append((f, total, n))
        total += n
    lo, hi = split(total, world)[rank]
    buf = np.ones(hi - lo, dtype=np.uint8)  # written once: its pages are faulted in before timing
    view = memoryview(buf)
    # (file, first byte in it, count, first byte in buf)
    parts = [(f, max(lo, start) - start, min(hi, start + n) - max(lo, start), max(lo, start) - lo)
             for f, start, n in segments if max(lo, start) < min(hi, start + n)]

    def readinto() -> None:
        for f, off, count, at in parts:
            with open(f, "rb", buffering=0) as fh:
                fh.seek(off)
                done = 0
                while done < count:
                    k = fh.readinto(view[at + done : at + count])
                    if not k:
                        raise OSError(f"{f}: short read")
                    done += k

    def mapped() -> None:
        for f, off, count, at in parts:
            with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                src = np.frombuffer(mm, dtype=np.uint8)
                np.copyto(buf[at : at + count], src[off : off + count])
                del src  # the map cannot close while a view of it lives

    if kind in ("read_readinto", "read_cold"):
        return readinto, hi - lo
    if kind == "read_mmap":
        return mapped, hi - lo
    readinto()
    dst = np.zeros_like(buf)
    dst.fill(1)
    return (lambda: np.copyto(dst, buf)), hi - lo
