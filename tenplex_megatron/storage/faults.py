"""Fault injection points for the crash-safety tests (inert unless TENPLEX_FAULT is set).

``TENPLEX_FAULT=<point>[@<rank>][#<iteration>][:<kind>]`` makes rank ``<rank>``
(every rank if omitted) fail at ``<point>`` (of the save of ``<iteration>``, if
given). Kinds: ``kill`` (default) SIGKILLs the process, ``enospc`` raises
``OSError(ENOSPC)``, ``eperm`` raises ``OSError(EPERM)`` (a filesystem refusing the call), ``error`` raises ``RuntimeError``, ``typeerror`` raises
``TypeError`` (a type no code path expects: the phase runner must still carry
it to every rank). Points, in the order a save or load passes them:
``save.gather`` (chunk lists), ``save.tensors`` (shard file half written),
``save.metadata_callback`` (building metadata.json; rank 0 only), ``save.metadata``
(metadata written, not renamed; rank 0 only), ``save.commit`` (just before the
rename; rank 0 only), ``load.read`` (planned, files opened), ``load.verify``
(before checksums), ``load.copy`` (before copying), ``load.restore`` (tensors
copied, before the framework's non-tensor state). Host-memory snapshots (``--tenplex-memory``):
``memory.write`` (a rank's snapshot file half written in node memory), ``memory.replicate`` (replicas being
received), ``memory.commit`` (before a node's snapshot is renamed into place), ``persist.copy`` (the background
helper half way through copying a file to durable storage). ``lease.link`` (taking a lease generation by
``link(2)``; with ``eperm``: a filesystem without hard links).
``TENPLEX_FAULT_ONCE=<file>``: the fault fires once, in whichever process reaches it first (it creates ``<file>``
exclusively; afterwards the fault is inert), so that a job restarted by torchrun's agent runs on (the fault
benchmark, ``benchmarks/faults.py``).

The other test hook is :func:`log_open`: with ``TENPLEX_OPEN_LOG`` naming a file, every host-memory path a
process opens is appended there (the tests check that a restart reads only its own node's memory).
"""

from __future__ import annotations

import errno
import os
import signal

POINTS = ("save.gather", "save.tensors", "save.metadata_callback", "save.metadata", "save.commit",
          "load.read", "load.verify", "load.copy", "load.restore")
MEMORY_POINTS = ("memory.write", "memory.replicate", "memory.commit", "persist.copy")  # --tenplex-memory saves
LEASE_POINTS = ("lease.link",)  # taking a lease (storage/lease.py)
RANK0_ONLY = ("save.metadata_callback", "save.metadata", "save.commit")  # only rank 0 builds metadata and commits
OPEN_LOG_ENV = "TENPLEX_OPEN_LOG"  # tests: every memory-tier path a process opens is appended here


def log_open(path: str) -> None:
    """Record a path this process opens in a memory directory (only when ``TENPLEX_OPEN_LOG`` names a file)."""
    log = os.environ.get(OPEN_LOG_ENV)
    if log:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\t{os.path.abspath(path)}\n")


def maybe_fail(point: str, rank: int, iteration: int | None = None) -> None:
    spec = os.environ.get("TENPLEX_FAULT")
    if not spec:
        return
    where, _, kind = spec.partition(":")
    where, _, it = where.partition("#")
    name, _, r = where.partition("@")
    if name != point or (r != "" and int(r) != rank):
        return
    if it != "" and iteration is not None and int(it) != iteration:
        return
    kind = kind or "kill"
    once = os.environ.get("TENPLEX_FAULT_ONCE")
    if once:
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "eperm":
        raise OSError(errno.EPERM, os.strerror(errno.EPERM), f"injected at {point}")
    if kind == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"injected at {point}")
    if kind == "typeerror":
        raise TypeError(f"injected unexpected TypeError at {point} on rank {rank}")
    raise RuntimeError(f"injected fault at {point} on rank {rank}")
