"""Fault injection points for the crash-safety tests (inert unless TENPLEX_FAULT is set).

``TENPLEX_FAULT=<point>[@<rank>][#<iteration>][:<kind>]`` makes rank ``<rank>``
(every rank if omitted) fail at ``<point>`` (of the save of ``<iteration>``, if
given); several faults are separated by commas (each fires where it matches). Kinds: ``kill`` (default) SIGKILLs
the process, ``stop`` SIGSTOPs it (a hung rank), ``enospc`` raises
``OSError(ENOSPC)``, ``eio`` raises ``OSError(EIO)`` (a failing device), ``short`` (a read that stops short;
``load.preadv`` only, elsewhere it raises like ``error``), ``eperm`` raises ``OSError(EPERM)`` (a filesystem refusing the call), ``error`` raises ``RuntimeError``, ``typeerror`` raises
``TypeError`` (a type no code path expects: the phase runner must still carry
it to every rank); any other kind, or a point not registered, is a ``FlagError`` naming ``TENPLEX_FAULT``.
Points (:data:`ALL_POINTS`, the one registry: :func:`maybe_fail` refuses a name not in it), in the order a save or
load passes them:
``save.gather`` (chunk lists), ``save.pwrite`` (in a writer thread of the parallel writer, before its write:
``enospc`` there is a full disk half-way through a shard or snapshot), ``save.tensors`` (shard file half written),
``save.metadata_callback`` (building metadata.json; rank 0 only), ``save.metadata``
(metadata written, not renamed; rank 0 only), ``save.commit`` (just before the
rename; rank 0 only), ``load.read`` (planned, files opened), ``load.verify``
(before checksums), ``load.copy`` (before copying), ``load.restore`` (tensors
copied, before the framework's non-tensor state), ``load.preadv`` (in a reader thread of the parallel reader,
before its read: ``eio`` raises ``OSError(EIO)``, ``short`` makes that read stop half way). Host-memory snapshots (``--tenplex-memory``):
``memory.write`` (a rank's snapshot file half written in node memory), ``memory.replicate`` (replicas being
received), ``memory.commit`` (before a node's snapshot is renamed into place), ``persist.copy`` (the background
helper half way through copying a file to durable storage). ``lease.link`` (taking a lease generation by
``link(2)``; with ``eperm``: a filesystem without hard links). ``reform.start`` (a re-forming job's generation,
its process group just made; ``#`` names the generation, not an iteration: ``training/reform.py``).
``TENPLEX_FAULT_ONCE=<file>``: the fault fires once, in whichever process reaches it first (it creates ``<file>``
exclusively; afterwards the fault is inert), so that a job restarted by torchrun's agent runs on (the fault
benchmark, ``benchmarks/faults.py``); with several faults, each fires once (its own file, ``<file>.<index>``).

The other test hook is :func:`log_open`: with ``TENPLEX_OPEN_LOG`` naming a file, every host-memory path a
process opens is appended there (the tests check that a restart reads only its own node's memory).
"""

from __future__ import annotations

import errno
import os
import signal
from dataclasses import dataclass

from tenplex_megatron.flags import FlagError

POINTS = ("save.gather", "save.pwrite", "save.tensors", "save.metadata_callback", "save.metadata", "save.commit",
          "load.read", "load.verify", "load.copy", "load.preadv", "load.restore")
MEMORY_POINTS = ("memory.write", "memory.replicate", "memory.commit", "persist.copy")  # --tenplex-memory saves
LEASE_POINTS = ("lease.link",)  # taking a lease (storage/lease.py)
REFORM_POINTS = ("reform.start",)  # a generation's process group made (training/reform.py; # is the generation)
ALL_POINTS = POINTS + MEMORY_POINTS + LEASE_POINTS + REFORM_POINTS  # the one registry: maybe_fail refuses any other name
RANK0_ONLY = ("save.metadata_callback", "save.metadata", "save.commit")  # only rank 0 builds metadata and commits
KINDS = ("kill", "stop", "enospc", "eperm", "eio", "short", "error", "typeerror")
FAULT_ENV = "TENPLEX_FAULT"
OPEN_LOG_ENV = "TENPLEX_OPEN_LOG"  # tests: every memory-tier path a process opens is appended here


@dataclass(frozen=True)
class Fault:
    """One parsed ``TENPLEX_FAULT``: where (a registered point, a rank or every rank, a save's iteration or any) and
    what happens there."""

    point: str
    rank: int | None
    iteration: int | None
    kind: str

    @classmethod
    def parse(cls, spec: str) -> Fault:
        """``<point>[@<rank>][#<iteration>][:<kind>]``; a FlagError naming ``TENPLEX_FAULT`` and what is wrong."""
        where, _, kind = spec.partition(":")
        where, _, it = where.partition("#")
        name, _, r = where.partition("@")
        bad = f"{FAULT_ENV}={spec!r}"
        if name not in ALL_POINTS:
            raise FlagError(f"{bad}: unknown fault point {name!r} (storage/faults.py: {', '.join(ALL_POINTS)})")
        if (kind or "kill") not in KINDS:
            raise FlagError(f"{bad}: unknown fault kind {kind!r} ({', '.join(KINDS)})")
        try:
            return cls(name, int(r) if r != "" else None, int(it) if it != "" else None, kind or "kill")
        except ValueError:
            raise FlagError(f"{bad}: the rank after @ and the iteration after # must be integers") from None

    def fires(self, point: str, rank: int, iteration: int | None) -> bool:
        """Whether this fault is meant for ``point`` on ``rank`` (in the save of ``iteration``, when given)."""
        return (self.point == point and (self.rank is None or self.rank == rank)
                and (self.iteration is None or iteration is None or self.iteration == iteration))


def log_open(path: str) -> None:
    """Record a path this process opens in a memory directory (only when ``TENPLEX_OPEN_LOG`` names a file)."""
    log = os.environ.get(OPEN_LOG_ENV)
    if log:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\t{os.path.abspath(path)}\n")


def fault_kind(point: str, rank: int, iteration: int | None = None) -> str | None:
    """The kind of the fault ``TENPLEX_FAULT`` sets at ``point`` for ``rank`` (None: none here, or a
    ``TENPLEX_FAULT_ONCE`` fault that already fired). Claims a once-only fault: the caller must act on it."""
    if point not in ALL_POINTS:
        raise ValueError(f"fault at {point!r}: not a registered fault point (storage/faults.py ALL_POINTS)")
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return None
    every = [Fault.parse(one) for one in spec.split(",")]  # each checked, before any fires
    fault = next((f for f in every if f.fires(point, rank, iteration)), None)
    if fault is None:
        return None
    once = os.environ.get("TENPLEX_FAULT_ONCE")
    if once and len(every) > 1:  # each of several faults once: its own file
        once = f"{once}.{every.index(fault)}"
    if once:
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return None
    return fault.kind


def maybe_fail(point: str, rank: int, iteration: int | None = None) -> None:
    """Fail here as ``TENPLEX_FAULT`` says (inert without it). ``point`` must be registered (:data:`ALL_POINTS`): a
    fault point the tests cannot name is refused, as is a ``TENPLEX_FAULT`` naming no registered point."""
    if point not in ALL_POINTS:
        raise ValueError(f"maybe_fail({point!r}): not a registered fault point (storage/faults.py ALL_POINTS)")
    fail(point, rank, fault_kind(point, rank, iteration))


def fail(point: str, rank: int, kind: str | None) -> None:
    """Act out a fault of ``kind`` at ``point`` (None: nothing)."""
    if kind is None:
        return
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "stop":  # alive but stuck; a SIGCONT lets it go on from here
        os.kill(os.getpid(), signal.SIGSTOP)
        return
    for name, code in (("eperm", errno.EPERM), ("enospc", errno.ENOSPC), ("eio", errno.EIO)):
        if kind == name:
            raise OSError(code, os.strerror(code), f"injected at {point}")
    if kind == "typeerror":
        raise TypeError(f"injected unexpected TypeError at {point} on rank {rank}")
    raise RuntimeError(f"injected fault at {point} on rank {rank}")
