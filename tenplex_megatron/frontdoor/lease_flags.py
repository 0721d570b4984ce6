"""The start-up claim of the leases (the flags are rows of ``tenplex_megatron/flags.py``): one definition for both trainers (``pretrain_gpt.py``, the Megatron-LM
hook). Before any process group every rank refuses directories another live job holds; rank 0 takes ``--save``'s
lease and each node's first local rank its ``--tenplex-memory`` directory's (``storage/lease.py``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tenplex_megatron import log
from tenplex_megatron.frontdoor import elastic
from tenplex_megatron.storage import job_identity, lease

_log = log.get("lease")

FENCED_EXIT = 3  # the exit status of a writer fenced by a newer generation (the in-process launcher ends the rest)


def job_id(args: Any) -> str:
    """The job's identity, the same on every rank and elastic round of one launch (``storage/job_identity.py``)."""
    return job_identity.job_id(getattr(args, "tenplex_job_id", None))


def claim(args: Any, prog: str) -> list[str]:
    """Before any process group: check every lease, take this process's (idempotent); SystemExit naming the
    directory and its holder when refused. Returns the directories this process holds."""
    if getattr(args, "tenplex_leases", None) is not None:
        return args.tenplex_leases
    dirs = []
    if getattr(args, "tenplex", False) and getattr(args, "save", None):
        dirs.append((args.save, int(os.environ.get("RANK", "0")) == 0))
    if getattr(args, "tenplex", False) and getattr(args, "tenplex_memory", None):
        dirs.append((args.tenplex_memory, int(os.environ.get("LOCAL_RANK", "0")) == 0))
    take_over = bool(getattr(args, "tenplex_take_over", False))
    ttl = float(getattr(args, "tenplex_lease_ttl", lease.DEFAULT_TTL))
    if ttl <= 0:
        raise SystemExit(f"{prog}: error: --tenplex-lease-ttl must be > 0 seconds, got {ttl:g}")
    mine = []
    try:
        job = job_id(args) if dirs else ""
        for d, take in dirs:
            if take:
                lease.acquire(d, job, ttl, take_over)
                mine.append(d)
            else:
                lease.check(d, job, take_over)
    except lease.LeaseError as e:
        raise SystemExit(f"{prog}: error: {e}") from None
    args.tenplex_leases = mine
    return mine


def fenced(error: BaseException) -> str | None:
    """The message of a lease fence among a collective failure's (a newer generation owns a directory), else None."""
    for failure in getattr(error, "failures", {}).values():
        if failure.kind == lease.FencedError.kind:
            return failure.message
    return str(error) if isinstance(error, lease.FencedError) else None


@contextmanager
def stop_when_fenced(prog: str) -> Iterator[None]:
    """Around a job's saves: a writer fenced by a newer generation (``fenced``) logs why, stops its node's
    torchrun agent (restarting would take the lease back and fence the newer writer in turn) and exits 3."""
    try:
        yield
    except Exception as e:
        why = fenced(e)
        if why is None:
            raise
        _log.error("%s: %s", prog, why)
        elastic.stop_agent_and_exit(FENCED_EXIT)  # every node's agent


def release(args: Any) -> None:
    """A clean end: give back the leases this process holds (the next job takes them at once); a later
    :func:`claim` with the same flags claims them again (a job rebuilt in the same process)."""
    for d in getattr(args, "tenplex_leases", None) or ():
        lease.release(d)
    args.tenplex_leases = None
