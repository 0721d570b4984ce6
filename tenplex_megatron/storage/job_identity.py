"""A job's identity for the directories' leases (``lease.py``): the same on every rank and every elastic round of one
launch, different for an unrelated launch, so that a second job on a directory is refused and a restart is not.

In order: an explicit id (``--tenplex-job-id``); the Slurm job (``SLURM_JOB_ID``: a requeued job takes its
directory back at once, whatever torchrun's run id, and a run id copied into two jobs' batch scripts cannot make
them one); torchrun's run id unless it is its default ``none`` (``--rdzv-id``; ``--standalone`` and torch 2.13's
single-node launch without ``--master-port`` make a fresh uuid per launch); under torchrun with run id ``none`` (a
static rendezvous: ``--master-port``, ``--master-addr``/``--node-rank``; a c10d rendezvous without ``--rdzv-id``) a
random token kept in the agents' store at ``MASTER_ADDR:MASTER_PORT`` (the first reader of a launch creates it,
every rank and restart round of the same agents reads it back, another launch has another store), or ``none`` with
a warning where the agents share no store with the workers; without torchrun ``MASTER_ADDR:MASTER_PORT``, else
``host:pid``.
"""

from __future__ import annotations

import datetime
import os
import socket
import uuid
from collections.abc import Mapping

from tenplex_megatron import log as tlog
from tenplex_megatron.storage.lease import LeaseError

log = tlog.get("lease")

#: the key of the launch's token in torchrun's agent store (outside the prefixes torch's own keys use)
TOKEN_KEY = "tenplex_megatron/job-token"
STORE_TIMEOUT_S = 60.0  # the agents' store exists before the workers start: this only bounds a broken launch
_DEFAULT_RUN_ID = "none"  # torchrun's --rdzv-id default: not an identity


class JobIdentityError(LeaseError):
    """The launch's identity could not be read from torchrun's agent store (no lease can be checked without it)."""


def job_id(explicit: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """The job's identity, the same on every rank of one launch and every restart round of its torchrun agents."""
    if explicit:
        return str(explicit)
    env = os.environ if env is None else env
    slurm = slurm_job_id(env)
    if slurm:
        return slurm
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != _DEFAULT_RUN_ID:
        return run_id
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if run_id == _DEFAULT_RUN_ID:
        if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and addr and port:
            return f"torchrun-{launch_token(addr, int(port))}"
        if env.get("RANK", "0") == "0":  # the agents keep no store the workers see: nothing names this launch
            log.warning("torchrun's run id is 'none' and its agents share no store with the workers "
                        "(TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): another launch like this one on the same "
                        "directories counts as the same job; give it --rdzv-id or --tenplex-job-id")
        return run_id
    if addr and port:
        return f"{addr}:{port}"
    return f"{socket.gethostname()}:{os.getpid()}"


def slurm_job_id(env: Mapping[str, str]) -> str | None:
    """The Slurm job's identity, ``slurm-ID@CLUSTER``: the same on every node and task of the job and after each
    requeue (``SLURM_JOB_ID`` stays, ``SLURM_RESTART_COUNT`` grows), another for every other job (an array's tasks
    each have their own ``SLURM_JOB_ID``; a heterogeneous job's components share ``SLURM_HET_JOB_ID``; the cluster's
    name keeps two clusters' job ids apart on a shared filesystem); None outside Slurm."""
    job = env.get("SLURM_HET_JOB_ID") or env.get("SLURM_JOB_ID")
    if not job:
        return None
    cluster = env.get("SLURM_CLUSTER_NAME")
    return f"slurm-{job}@{cluster}" if cluster else f"slurm-{job}"


def launch_token(addr: str, port: int, timeout: float = STORE_TIMEOUT_S) -> str:
    """The launch's token in the torchrun agents' store at ``addr:port``, created by the first caller of the launch
    (``compare_set``: every other caller, on any rank and in any restart round, reads the same one back)."""
    from torch.distributed import TCPStore

    try:
        store = TCPStore(addr, port, is_master=False, timeout=datetime.timedelta(seconds=timeout))
        got = store.compare_set(TOKEN_KEY, "", uuid.uuid4().hex[:16])
    except (RuntimeError, OSError) as e:  # torch's DistNetworkError and DistStoreError are RuntimeErrors
        raise JobIdentityError(
            f"cannot read this job's identity from torchrun's agent store at {addr}:{port} "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); give the job an id: --tenplex-job-id "
            "(save_checkpoint's job_id) or torchrun's --rdzv-id") from None
    return got.decode() if isinstance(got, bytes) else str(got)
