"""Files on disk: directory sizes, fsync of a tree, page-cache eviction, and the read()/write() byte counters."""

from __future__ import annotations

import ctypes
import mmap
import os


def dir_size(path: str) -> tuple[int, int]:
    """(bytes, files) of every file under ``path``."""
    total = files = 0
    for base, _, names in os.walk(path):
        for n in names:
            total += os.path.getsize(os.path.join(base, n))
            files += 1
    return total, files


def fsync_tree(path: str) -> None:
    """fsync every file under ``path`` (for systems that do not: the like-for-like with a durable save)."""
    for base, _, names in os.walk(path):
        for n in names:
            fd = os.open(os.path.join(base, n), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def evict_page_cache(path: str) -> int:
    """Drop the page cache of every file under ``path``, so the next read comes from storage; returns the bytes.

    ``POSIX_FADV_DONTNEED`` drops clean, unmapped pages with no root needed (each file is fsynced first: dirty
    pages cannot be dropped), as after a restart on other machines.
    """
    total = 0
    for base, _, names in os.walk(path):
        for n in names:
            fd = os.open(os.path.join(base, n), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


def resident_bytes(path: str) -> int:
    """Bytes of the files under ``path`` whose pages are in the page cache (``mincore`` over a read-only map that
    touches nothing): shows that an eviction worked, so a "cold" read really comes from storage."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = mmap.PAGESIZE
    total = 0
    for base, _, names in os.walk(path):
        for n in names:
            fd = os.open(os.path.join(base, n), os.O_RDONLY)
            try:
                size = os.fstat(fd).st_size
                if not size:
                    continue
                addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                if addr in (None, ctypes.c_void_p(-1).value):
                    raise OSError(ctypes.get_errno(), f"mmap {n}")
                try:
                    vec = ctypes.create_string_buffer((size + page - 1) // page)
                    if libc.mincore(addr, size, vec) != 0:
                        raise OSError(ctypes.get_errno(), f"mincore {n}")
                    total += min(size, sum(b & 1 for b in vec.raw) * page)
                finally:
                    libc.munmap(addr, size)
            finally:
                os.close(fd)
    return total


def io_chars() -> tuple[int, int]:
    """(read_chars, write_chars) of this process, reaped children included (Linux /proc/self/io).

    These count read()/write() system calls, not pages touched through mmap.
    """
    import psutil

    io = psutil.Process().io_counters()
    return int(getattr(io, "read_chars", io.read_bytes)), int(getattr(io, "write_chars", io.write_bytes))
