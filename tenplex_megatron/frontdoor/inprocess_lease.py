"""The checkpoint leases of a job that continues in place (``--tenplex-inprocess``): taken once, at the job's start,
and kept by the survivors through every in-place restart.

A lease generation is one job's right to write a directory (``storage/lease.py``). In place any rank may die while
the others continue, so no single rank may be a lease's only holder. The rank that takes a directory's lease (rank
0 for ``--save``, each node's first rank for its ``--tenplex-memory`` directory) takes it in the name of the
in-process launcher, its parent, which outlives every rank (the liveness another job checks); it publishes the
generation in the job's store (served by the launcher) and the directory's other ranks adopt that generation and
renew it too, so the lease stays live while any of them lives. A restart in place takes no new generation: the
survivors never fence themselves and no other job finds the lease gone in between. Before each call every holder
checks that its generation is still the newest: a newer one (another job took the directory over) stops the rank
with exit status 3 (``lease_flags.FENCED_EXIT``), and the launcher ends the ranks left.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any

from tenplex_megatron import log as tlog
from tenplex_megatron.frontdoor import lease_flags
from tenplex_megatron.frontdoor.job_config import JobConfig
from tenplex_megatron.storage import job_identity, lease

log = tlog.get("lease")

KEY = "tenplex-lease/{taker}/{directory}"  # in the job's store: the generation the taker took, as JSON


def directories(config: JobConfig) -> list[tuple[str, int]]:
    """The directories whose leases the job holds, each with the initial rank that takes it: ``--save`` (rank 0)
    and this node's ``--tenplex-memory`` directory (the node's first rank)."""
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    out = [(config.leases.save, 0)] if config.leases.save else []
    if config.leases.memory:
        out.append((config.leases.memory, rank - local))
    return out


def claim(config: JobConfig, store: Any, timeout: float) -> lease.LeaseSet:
    """Every rank, before NVRx's wrapper: take (the taker, for the launcher) or adopt (the others) each directory's
    lease; SystemExit naming the directory and its holder when another live job holds it, or naming the taker when
    its generation does not come within ``timeout`` seconds. Returns the leases this process holds, kept through
    every call (each call's Checkpointer fences its writers with them)."""
    prog, ttl, take_over = config.prog, config.leases.ttl, config.leases.take_over
    if ttl <= 0:
        raise SystemExit(f"{prog}: error: --tenplex-lease-ttl must be > 0 seconds, got {ttl:g}")
    rank = int(os.environ.get("RANK", "0"))
    held = lease.LeaseSet()
    try:
        dirs = directories(config)
        job = job_identity.job_id(config.leases.job_id) if dirs else ""
        for d, taker in dirs:
            key = KEY.format(taker=taker, directory=os.path.abspath(d))
            if rank == taker:
                try:
                    got = held.acquire(d, job, ttl, take_over, holder_pid=os.getppid())
                except lease.LeaseError as e:
                    store.set(key, json.dumps({"error": str(e)}))
                    raise
                store.set(key, json.dumps({"generation": got.generation, "token": got.token}))
            else:
                lease.check(d, job, take_over)
                taken = _taken(store, key, d, taker, timeout, prog)
                if "error" in taken:
                    raise lease.LeaseError(taken["error"])
                held.adopt(d, int(taken["generation"]), str(taken["token"]))
    except lease.LeaseError as e:
        raise SystemExit(f"{prog}: error: {e}") from None
    return held


def _taken(store: Any, key: str, directory: str, taker: int, timeout: float, prog: str) -> dict[str, Any]:
    """The taker's published generation (or its refusal), waited for up to ``timeout`` seconds."""
    try:
        store.wait([key], timedelta(seconds=timeout))
        return dict(json.loads(store.get(key)))
    except RuntimeError as e:  # torch's DistStoreError: the taker died or hangs before taking it
        raise SystemExit(f"{prog}: error: the lease of {directory} was not taken by rank {taker} within {timeout:g} s "
                         f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def check_kept(held: lease.LeaseSet, prog: str) -> None:
    """At each call's start: every directory's generation is still this job's, else the rank stops (logged, exit
    status 3: ``lease_flags.stop_when_fenced``)."""
    with lease_flags.stop_when_fenced(prog):
        for d in held.directories:
            held.fence(d)


def release(held: lease.LeaseSet) -> None:
    """The job's clean end, in every survivor: give the leases back and end the heartbeat."""
    held.close()
