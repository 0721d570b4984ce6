"""The CPUs this process may use: those it may run on, capped by its cgroup's CPU quota (a container's or a
Kubernetes pod's limit), so that thread pools sized from them do not oversubscribe a quota the affinity hides."""

from __future__ import annotations

import math
import os

CGROUP = "/sys/fs/cgroup"


def _quota(root: str = CGROUP) -> float | None:
    """The CPU quota in CPUs (cgroup v2 ``cpu.max``, else v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``); None: no
    limit, or none readable."""
    try:
        with open(os.path.join(root, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as f:
            quota_us = int(f.read())
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as f:
            period_us = int(f.read())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def usable_cpus(root: str = CGROUP) -> int:
    """The CPUs of this process's affinity, at most its cgroup's quota (rounded up), at least 1."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _quota(root)
    return max(1, min(cpus, math.ceil(quota)) if quota is not None else cpus)
