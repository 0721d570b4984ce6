"""The start-up claim of the leases (the flags are rows of ``tenplex_megatron/flags.py``): one definition for both trainers (``pretrain_gpt.py``, the Megatron-LM
hook). Before any process group every rank refuses directories another live job holds; rank 0 takes ``--save``'s
lease and each node's first local rank its ``--tenplex-memory`` directory's (``storage/lease.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from tenplex_megatron import log
from tenplex_megatron.frontdoor import elastic
from tenplex_megatron.frontdoor.job_config import JobConfig
from tenplex_megatron.storage import job_identity, lease

_log = log.get("lease")

FENCED_EXIT = 3  # the exit status of a writer fenced by a newer generation (the in-process launcher ends the rest)


def claim(config: JobConfig, leases: lease.LeaseSet) -> list[str]:
    """Before any process group: check every lease of the job (``config.lease_dirs()``), take this process's into
    ``leases``; SystemExit naming the directory and its holder when refused. Returns the directories taken."""
    dirs = config.lease_dirs()
    ttl = config.leases.ttl
    if ttl <= 0:
        raise SystemExit(f"{config.prog}: error: --tenplex-lease-ttl must be > 0 seconds, got {ttl:g}")
    mine = []
    try:
        job = job_identity.job_id(config.leases.job_id) if dirs else ""
        for d, take in dirs:
            if take:
                leases.acquire(d, job, ttl, config.leases.take_over)
                mine.append(d)
            else:
                lease.check(d, job, config.leases.take_over)
    except lease.LeaseError as e:
        raise SystemExit(f"{config.prog}: error: {e}") from None
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
