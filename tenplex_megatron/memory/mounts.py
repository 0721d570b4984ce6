"""Where a memory directory lives: the mount holding it, whether it is memory-backed, whether it has huge pages.

Read from /proc/self/mounts once per call; what a user should change (a disk instead of a tmpfs, a tmpfs without
huge pages) is logged, never fatal.
"""

from __future__ import annotations

import os

from tenplex_megatron import log as tlog

log = tlog.get("memory")
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs", "hugetlbfs")


def mount_of(path: str, mounts: str | None = None) -> tuple[str, str, tuple[str, ...]]:
    """The mount holding ``path``: its mount point, filesystem type and options (from ``mounts``, the text of
    /proc/self/mounts, read when not given; empty where unknown)."""
    real = os.path.realpath(path)
    best: tuple[str, str, tuple[str, ...]] = ("", "", ())
    if mounts is None:
        try:
            with open("/proc/self/mounts") as f:
                mounts = f.read()
        except OSError:
            return best
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        mnt = parts[1].replace("\\040", " ")
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[0]):
            best = (mnt, parts[2], tuple(parts[3].split(",")))
    return best


def filesystem_type(path: str) -> str:
    """The filesystem type of the mount holding ``path`` (from /proc/self/mounts; "" where unknown)."""
    return mount_of(path)[1]


def huge_pages_hint(path: str, mounts: str | None = None) -> str | None:
    """A line for a memory directory on a tmpfs mounted without huge pages (``huge=within_size`` or ``always``):
    its files then have 4 KiB pages, which a restart maps and a helper receives into at about 3x the cost."""
    mnt, kind, options = mount_of(path, mounts)
    if kind != "tmpfs" or any(o in ("huge=always", "huge=within_size") for o in options):
        return None
    return (f"--tenplex-memory {path}: {mnt} is a tmpfs without huge pages; one mounted with huge=within_size "
            "restarts faster and replicates with half the CPU (docs/host-memory.md: Huge pages for the memory directory)")


def say_huge_pages_hint(path: str) -> None:
    """Log :func:`huge_pages_hint` for ``path`` (information: shown by rank 0), asked by each node's first rank."""
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        hint = huge_pages_hint(path)
        if hint:
            log.info(hint)


def warn_if_not_memory(path: str) -> bool:
    """Warn (naming it) when ``path`` is not on a memory-backed filesystem; returns whether it is."""
    kind = filesystem_type(path)
    if kind in MEMORY_FILESYSTEMS:
        return True
    log.warning("--tenplex-memory %s: on a %s filesystem, not memory-backed (tmpfs): snapshots there are disk "
                "writes, not memory copies", path, kind or "unknown")
    return False
