"""Files on disk: directory sizes, fsync of a tree, page-cache eviction, and the read()/write() byte counters."""

from __future__ import annotations

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


def io_chars() -> tuple[int, int]:
    """(read_chars, write_chars) of this process, reaped children included (Linux /proc/self/io).

    These count read()/write() system calls, not pages touched through mmap.
    """
    import psutil

    io = psutil.Process().io_counters()
    return int(getattr(io, "read_chars", io.read_bytes)), int(getattr(io, "write_chars", io.write_bytes))
