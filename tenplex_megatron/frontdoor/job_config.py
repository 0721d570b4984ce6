"""One job's checkpoint configuration, typed and frozen: what each front door reads from its flags once (or takes
from its API caller), and the only thing the :class:`~tenplex_megatron.frontdoor.checkpointer.Checkpointer` and the
layers below it see of a job's settings (no argparse Namespace below the front doors)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from tenplex_megatron.frontdoor import memory_flags
from tenplex_megatron.memory.settings import MemorySettings
from tenplex_megatron.plan import megatron_ckpt_flags as table
from tenplex_megatron.plan.megatron_ckpt_flags import LoadScope, Retention, SaveScope
from tenplex_megatron.storage import lease


@dataclass(frozen=True)
class LeaseConfig:
    """Which directories the job's process holds, and how: the job's identity, take-over and the lease's ttl."""

    save: str | None = None  # --save, rank 0's lease
    memory: str | None = None  # --tenplex-memory, each node's first local rank's lease
    job_id: str | None = None  # --tenplex-job-id (None: the launch's identity, storage/job_identity.py)
    take_over: bool = False
    ttl: float = lease.DEFAULT_TTL

    @classmethod
    def from_args(cls, args: Any) -> LeaseConfig:
        """The leases of a job from its parsed flags: none without ``--tenplex``."""
        tenplex = bool(getattr(args, "tenplex", False))
        ttl = getattr(args, "tenplex_lease_ttl", None)
        return cls(save=getattr(args, "save", None) if tenplex else None, memory=memory_flags.memory_dir(args),
                   job_id=getattr(args, "tenplex_job_id", None),
                   take_over=bool(getattr(args, "tenplex_take_over", False)),
                   ttl=lease.DEFAULT_TTL if ttl is None else float(ttl))


@dataclass(frozen=True)
class JobConfig:
    """A job's checkpointing as configured: directories, the host-memory tier, the resume sequence's settings
    (scope, Hugging Face start, resave), the save's (scope, retention) and the leases. ``prog`` names the
    program in refusals."""

    prog: str
    tenplex: bool = False
    save: str | None = None
    load: str | None = None
    memory: MemorySettings | None = None
    leases: LeaseConfig = field(default_factory=LeaseConfig)
    verify: bool = True  # check checksums at load (not --tenplex-no-verify)
    trust_pickles: bool = False
    keep: int | None = None  # --tenplex-keep (a snapshot's durable fallback)
    retention: Retention | None = None  # --tenplex-keep, --most-recent-k, --save-retain-interval
    save_scope: SaveScope = SaveScope()
    load_scope: LoadScope = LoadScope()
    pretrained: str | None = None  # --pretrained-checkpoint: a fine-tune's source when --load holds nothing
    init_from_hf: str | None = None
    resave: str | None = None
    exit_on_missing: bool = False  # --exit-on-missing-checkpoint
    async_save: bool = False  # --async-save: every save a snapshot persisted in the background, committed before the next

    @classmethod
    def from_args(cls, args: Any, prog: str) -> JobConfig:
        """The configuration of a job from its parsed flags (the trainer's, or Megatron-LM's with the hook's
        ``--tenplex*`` rows); flags a parser lacks read as their defaults."""
        def flag(name: str, default: Any = None) -> Any:
            value = getattr(args, name, default)
            return default if value is None else value

        tenplex = bool(flag("tenplex", False))
        mem = memory_flags.memory_dir(args)
        leases = LeaseConfig.from_args(args)
        return cls(prog, tenplex, flag("save"), flag("load"),
                   memory_flags.memory_settings(args) if mem else None, leases,
                   verify=not flag("tenplex_no_verify", False), trust_pickles=bool(flag("tenplex_trust_pickles", False)),
                   keep=flag("tenplex_keep"), retention=table.retention(args), save_scope=table.save_scope(args),
                   load_scope=table.load_scope(args), pretrained=flag("pretrained_checkpoint"),
                   init_from_hf=flag("tenplex_init_from_hf"), resave=flag("tenplex_resave"),
                   exit_on_missing=bool(flag("exit_on_missing_checkpoint", False)),
                   async_save=tenplex and bool(flag("async_save", False)))

    @classmethod
    def for_api(cls, prog: str, memory: MemorySettings | None = None) -> JobConfig:
        """A job driven through API calls rather than flags: no lease claimed at start-up (each save directory is
        claimed at its first save), the host-memory tier of ``memory`` or none."""
        return cls(prog, tenplex=True, memory=memory)

    @property
    def finetune_scope(self) -> LoadScope:
        """The scope of a ``--pretrained-checkpoint`` load (Megatron-LM's rule: a fine-tune)."""
        return LoadScope(iteration=self.load_scope.iteration, optimizer=False, rng=False, finetune=True)

    def lease_dirs(self) -> list[tuple[str, bool]]:
        """The directories whose leases the job holds, each with whether this process takes it (rank 0 ``--save``'s,
        each node's first local rank its ``--tenplex-memory`` directory's) or only checks it."""
        dirs = []
        if self.leases.save:
            dirs.append((self.leases.save, int(os.environ.get("RANK", "0")) == 0))
        if self.leases.memory:
            dirs.append((self.leases.memory, int(os.environ.get("LOCAL_RANK", "0")) == 0))
        return dirs
