"""Ask the kernel to start reading file ranges now (``MADV_WILLNEED``, ``POSIX_FADV_WILLNEED``), before they are read.

Left alone, the kernel reads a cold file a fault (a memory map) or a read (the
parallel reader's ``preadv``) and a readahead window at a time. Announcing the
ranges a rank will read soon lets the storage work on many of them while the
rank checks and copies the first ones. A hint only: errors are ignored, and it
does nothing where the call is missing or ``TENPLEX_PREFETCH=0`` is set.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import os
from collections.abc import Iterable

MADV_WILLNEED = 3  # <sys/mman.h>, the same on Linux and the BSDs
_GAP = 64 * 1024  # ranges closer than this are announced as one

try:
    _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    _madvise = _libc.madvise
    _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    _madvise.restype = ctypes.c_int
except (OSError, AttributeError):
    _madvise = None


def merge_ranges(ranges: Iterable[tuple[int, int]], gap: int = _GAP) -> list[tuple[int, int]]:
    """Address ranges ``[start, stop)`` sorted and merged where they overlap or lie less than ``gap`` apart."""
    out: list[list[int]] = []
    for a, b in sorted(r for r in ranges if r[1] > r[0]):
        if out and a <= out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def enabled() -> bool:
    """Whether read-ahead hints are given (``TENPLEX_PREFETCH``, on by default)."""
    return os.environ.get("TENPLEX_PREFETCH", "1") != "0"


def advise(fd: int, offset: int, nbytes: int) -> None:
    """Announce bytes ``[offset, offset + nbytes)`` of the open file ``fd`` as needed soon (ignored where unsupported)."""
    if hasattr(os, "posix_fadvise") and nbytes > 0:
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_WILLNEED)


def willneed(ranges: Iterable[tuple[int, int]]) -> int:
    """Announce the address ranges ``[start, stop)`` (of mapped files) as needed soon; returns the calls made."""
    if _madvise is None or not enabled():
        return 0
    page = mmap.PAGESIZE
    calls = 0
    for a, b in merge_ranges(ranges):
        start = a // page * page
        _madvise(start, b - start, MADV_WILLNEED)
        calls += 1
    return calls
