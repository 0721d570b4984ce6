"""The host-memory tier's settings: what ``--tenplex-memory`` and its flags (or DeepSpeed's ``open_memory``) ask
for, frozen and validated once, here; the state a job carries from snapshot to snapshot is ``memory/state.py``."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from tenplex_megatron.flags import FlagError

AUTO_PACE = 0.5  # --tenplex-replication-rate auto: a replication takes half the time between two snapshots


@dataclass(frozen=True)
class MemorySettings:
    """One job's host-memory tier as configured: where, for which job, how often persisted, how many copies.

    ``replication_rate``: the MB/s a node's helper sends replicas at (0: unlimited), or ``"auto"`` (paced to take
    :data:`AUTO_PACE` of the time between two snapshots). Every value is checked when the settings are made; a bad
    one is a :class:`~tenplex_megatron.flags.FlagError` naming its flag.
    """

    mem: str  # the node-local memory directory (made absolute)
    job: str  # the job's identity (its durable directory): a snapshot of another job is never loaded
    save_dir: str | None  # where snapshots are persisted (None: never)
    persist_interval: int = 1
    replicas: int = 2
    keep: int = 1
    limit: int | None = None  # bytes the snapshots of a node may use (None: whatever the filesystem has free)
    fallback: bool = False  # a snapshot that does not fit: a durable save instead of an error
    durable_keep: int | None = None
    replication_rate: float | str = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "mem", os.path.abspath(self.mem))
        for flag, value in (("persist-interval", self.persist_interval), ("replicas", self.replicas),
                            ("memory-keep", self.keep)):
            if not isinstance(value, int) or value < 1:
                raise FlagError(f"--tenplex-{flag} must be >= 1, got {value}")
        if self.limit is not None and not self.limit > 0:
            raise FlagError(f"--tenplex-memory-limit must be > 0 (GB), got {self.limit / 1e9}")
        if self.replication_rate != "auto":
            try:
                rate = float(self.replication_rate)
            except (TypeError, ValueError):
                raise FlagError(f"--tenplex-replication-rate (replication_rate): expected MB/s (>= 0; 0: unlimited) "
                                f"or 'auto', got {self.replication_rate!r}") from None
            if math.isnan(rate) or rate < 0:
                raise FlagError(f"--tenplex-replication-rate must be >= 0 (MB/s; 0: unlimited), got {rate}")
            object.__setattr__(self, "replication_rate", rate)

    @property
    def rate_cap(self) -> float:
        """The MB/s cap on replication (0: none; ``auto`` has none, only its pace)."""
        return 0.0 if self.replication_rate == "auto" else float(self.replication_rate)

    @property
    def pace(self) -> float:
        """The share of the time between two snapshots a replication takes (0: not paced by it)."""
        return AUTO_PACE if self.replication_rate == "auto" else 0.0
