"""One job's checkpointing, owned by one object: the leases, the host-memory tier, the resume sequence and the
save, in the one order every front door follows; :meth:`Checkpointer.close` gives all of it back, so that a job
restarted in the same process (an in-process restart at a new world size) builds a new one.

The sequence: build from the job's :class:`~tenplex_megatron.frontdoor.job_config.JobConfig` (claim the leases,
before any process group), :meth:`~Checkpointer.memory` (collective: open the host-memory tier, its helper processes
started), :meth:`~Checkpointer.sources` (a query: where a restart would load from; nothing changes),
:meth:`~Checkpointer.resume` (collective: the one resume order of ``frontdoor/resume.py``, a damaged copy falling
back to the next, then ``--tenplex-resave``), :meth:`~Checkpointer.save` (collective: a snapshot into host memory,
else a durable save with the job's retention and scope, under the lease's fence), :meth:`~Checkpointer.finish`
(collective: the last snapshot replicated and persisted), then :meth:`~Checkpointer.close` (local: the helpers
stopped, the leases released, the heartbeat thread ended). The framework comes in as an
:class:`~tenplex_megatron.frontdoor.resume.Engine`, so that the trainer, the Megatron-LM hook, the public API and the
DeepSpeed calls share it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

from tenplex_megatron import log
from tenplex_megatron.engine.adapter import Adapter
from tenplex_megatron.engine.load import LoadResult
from tenplex_megatron.engine.save import SaveResult
from tenplex_megatron.errors import TenplexError
from tenplex_megatron.execute.collective import rank, run_phase
from tenplex_megatron.frontdoor import lease_flags, memory_flags, restart_sources, resume
from tenplex_megatron.frontdoor.job_config import JobConfig
from tenplex_megatron.frontdoor.resume import Engine, Resumed
from tenplex_megatron.memory import state
from tenplex_megatron.memory.settings import MemorySettings
from tenplex_megatron.memory.snapshot import SnapshotResult, snapshot
from tenplex_megatron.memory.state import MemoryTier
from tenplex_megatron.plan.megatron_ckpt_flags import LoadScope, SaveScope
from tenplex_megatron.storage import job_identity, lease

_log = log.get("checkpointer")


class CheckpointerClosedError(TenplexError, RuntimeError):
    """A closed :class:`Checkpointer` was used: build a new one (the job's flags are still there)."""


class Checkpointer:
    """One job's leases, host-memory tier, resume sequence and save, built from its :class:`JobConfig`. Building
    it claims the leases (before any process group: another live job's directory is refused with SystemExit
    naming it) into a :class:`~tenplex_megatron.storage.lease.LeaseSet` of its own, released by :meth:`close`;
    ``leases``: a set a launcher claimed for the process once instead (a job continuing in place keeps it through
    every call: used for the fence, left held at close); ``helpers_at_open``: the host-memory tier's helper
    processes started when it opens (False: at :meth:`start_background` or the first snapshot that needs them, so
    that their start, an interpreter and torch, does not compete with a re-formed world's build and load)."""

    def __init__(self, config: JobConfig, leases: lease.LeaseSet | None = None, *,
                 helpers_at_open: bool = True) -> None:
        self.config = config
        self._helpers_at_open = helpers_at_open
        self.prog = config.prog
        self._owns_leases = leases is None
        self._lease_set = lease.LeaseSet() if leases is None else leases
        if self._owns_leases:
            lease_flags.claim(config, self._lease_set)
        self._tier: MemoryTier | None = None
        self._opened = False
        self._closed = False
        self._claimed: set[str] = set()
        self._sources: dict[tuple[str | None, bool], restart_sources.Sources] = {}
        self._resumed = False  # the resume sequence ran (else the first save starts a new timeline)

    @classmethod
    def for_api(cls, prog: str, memory: MemorySettings | None = None) -> Checkpointer:
        """A job driven through API calls rather than flags (the public megatron-core calls, DeepSpeed's): no
        lease claimed at start-up (each save directory is claimed at its first save, :meth:`claim_dir`); the
        host-memory tier of ``memory`` (DeepSpeed's ``open_memory``), opened by :meth:`memory`, or none."""
        return cls(JobConfig.for_api(prog, memory))

    @property
    def leases(self) -> tuple[str, ...]:
        """The directories whose leases this process holds for the job (released by :meth:`close`)."""
        return self._lease_set.directories

    def fence(self, directory: str) -> None:
        """The job's writers' fence (``storage/lease.py``): before a destructive step in ``directory``, stop when a
        newer generation of its lease owns it."""
        self._lease_set.fence(directory)

    def claim_dir(self, save_dir: str, job_id: str | None = None, take_over: bool = False,
                  ttl: float = lease.DEFAULT_TTL) -> None:
        """Collective, once per directory: rank 0 takes ``save_dir``'s lease for ``job_id`` (default: the launch's
        id), the other ranks check it; another live job's lease is refused on every rank (a
        :class:`~tenplex_megatron.storage.lease.LeaseError` naming the directory and its holder) before anything is
        written. Rank 0's lease is released by :meth:`close`."""
        self._check_open()
        key = os.path.abspath(save_dir)
        if key in self._claimed:
            return

        def claim() -> None:  # the launch's id read on every rank inside the phase: a failure there is raised on all
            job = job_identity.job_id(job_id)
            if rank() == 0:
                self._lease_set.acquire(save_dir, job, ttl, take_over, remedy=lease.API_REMEDY)
            else:
                lease.check(save_dir, job, take_over, remedy=lease.API_REMEDY)

        run_phase(f"lease of {save_dir}", claim)
        self._claimed.add(key)

    # -- the host-memory tier ----------------------------------------------------------------------------------

    @property
    def wants_memory(self) -> bool:
        """Whether the job runs the host-memory tier (``--tenplex --tenplex-memory DIR``, or an API caller's)."""
        return self.config.memory is not None

    def memory(self) -> MemoryTier | None:
        """Collective at the first call (every rank reaches it): the job's host-memory tier, its helper processes
        started; None without one. Later calls return the same tier."""
        self._check_open()
        if not self._opened:
            self._tier = (memory_flags.open_settings(self.config.memory, self._lease_set, self._helpers_at_open)
                          if self.wants_memory else None)
            self._opened = True
        return self._tier

    def start_background(self) -> None:
        """Collective: the host-memory tier's helper processes started where they were left for later
        (``helpers_at_open=False``); nothing where they run already, or without an open tier."""
        if self._tier is not None and not self._closed and not self._tier.helpers_started:
            state.start_helpers(self._tier)

    @property
    def tier(self) -> MemoryTier | None:
        """The host-memory tier, when :meth:`memory` opened one."""
        return self._tier

    # -- the resume sequence -----------------------------------------------------------------------------------

    def sources(self, load_dir: str | None = None, *, memory: bool = True) -> restart_sources.Sources:
        """A query (collective where the tier is open, else local): where a restart under ``load_dir`` (default:
        the job's ``--load``) would load from, in ``restart_sources.py``'s order, the tier opened first;
        ``memory=False`` leaves host memory out (a load of another directory than the job's). Found once per
        directory: :meth:`resume` takes what this found; nothing is discarded or changed."""
        load_dir = self.config.load if load_dir is None else load_dir
        key = (load_dir, memory)
        if key not in self._sources:
            tier = self.memory() if memory else None
            self._sources[key] = restart_sources.find_sources(tier, load_dir, tenplex=self.config.tenplex)
        return self._sources[key]

    def resume(self, engine: Engine, load_dir: str | None = None, *, own: bool = True) -> Resumed:
        """Collective: the job's state from the first source that has one, in the one resume order
        (``frontdoor/resume.py``), under ``load_dir`` (default: the job's ``--load``); snapshots of a timeline the
        job left discarded; then ``--tenplex-resave``. ``own``: the job's own load directory (host memory and the
        checkpoint flags' scope apply; not to another directory a front door loads)."""
        self._check_open()
        load_dir = self.config.load if load_dir is None else load_dir
        got = resume.scoped(self.config, engine, load_dir) if own else None
        if got is None:
            sources = self.sources(load_dir, memory=own)
            got = resume.from_sources(self.config, engine, self._tier if own else None, sources, load_dir)
        self._sources.clear()  # what the sequence found is spent: a later query looks again
        resume.forget_other_timelines(self.memory() if own else None, got)
        self._resumed = True
        if self.config.resave and got.kind in ("scoped", "memory", "durable", "adopted"):
            engine.save(self.config.resave, None, SaveScope(), self.fence)
        return got

    # -- the save ----------------------------------------------------------------------------------------------

    def save(self, engine: Engine, *, persist: bool | None = None) -> SnapshotResult | SaveResult:
        """Collective: a snapshot into host memory through ``engine.adapter()`` when the tier is open
        (``persist`` as :func:`~tenplex_megatron.memory.snapshot.snapshot` takes it), else a durable save under
        ``--save`` with the job's retention and scope; a writer fenced by a newer generation of its directory stops
        (:meth:`fenced`)."""
        if self.config.save is None:
            raise NoSaveDirError(f"{self.prog}: a save needs a save directory (--save)")
        if self.config.async_save and persist is None:  # --async-save: every save durable, the previous one first
            persist = True
        with self.fenced():
            if self.memory() is not None:
                if not self._resumed:  # nothing was loaded (no --load): the snapshots older runs left are discarded
                    resume.forget_other_timelines(self._tier, Resumed("scratch"))
                    self._resumed = True
                scope = self.config.save_scope  # --no-save-optim, --no-save-rng: the snapshot holds what a save would
                return self.snapshot(engine.adapter(scope), persist=persist, rng_state=scope.rng)
            return engine.save(self.config.save, self.config.retention, self.config.save_scope, self.fence)

    def snapshot(self, adapter: Adapter, *, persist: bool | None = None, rng_state: bool = True) -> SnapshotResult:
        """Collective: a snapshot of ``adapter``'s state into the host-memory tier (``persist`` and ``rng_state`` as
        :func:`~tenplex_megatron.memory.snapshot.snapshot` takes them); a job without the tier is refused."""
        tier = self.memory()
        if tier is None:
            raise NoMemoryTierError(f"{self.prog}: a host-memory snapshot needs the host-memory tier "
                                    "(--tenplex-memory)")
        return snapshot(adapter, tier, persist=persist, rng_state=rng_state)

    @contextlib.contextmanager
    def fenced(self) -> Iterator[None]:
        """Around a job's saves: a newer generation owning a directory logs why, stops the node's torchrun agent
        and exits 3 (``lease_flags.stop_when_fenced``)."""
        with lease_flags.stop_when_fenced(self.prog):
            yield

    def finish(self, *, over: bool, say: Callable[[str], None] | None = None) -> tuple[str, ...]:
        """Collective, when the job stops: the last snapshot replicated and, when training is ``over``, persisted
        (each durable checkpoint committed meanwhile said through ``say``); returns their paths. Nothing without
        the tier."""
        if self._tier is not None and not self._closed:
            return memory_flags.finish(self._tier, over=over, say=say)
        return ()

    # -- the end -----------------------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._closed

    def close(self) -> None:
        """Local and idempotent: stop this node's helper process and close its shared-memory handles, release the
        leases this process holds and end the lease heartbeat when no lease is left; a closed Checkpointer refuses
        further use."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._tier is not None:
                state.close(self._tier)
        finally:
            self._tier = None
            if self._owns_leases:
                self._lease_set.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointerClosedError(f"{self.prog}: this job's Checkpointer is closed: build a new one")


class NoSaveDirError(TenplexError, ValueError):
    """A save was asked of a job with no save directory (``--save``)."""


class NoMemoryTierError(TenplexError, ValueError):
    """A host-memory snapshot was asked of a job without the host-memory tier (``--tenplex-memory``)."""


def save_for_api(engine: Engine, save_dir: str, keep: int | None, prog: str, checkpointer: Checkpointer | None, *,
                 job_id: str | None = None, take_over: bool = False) -> SaveResult:
    """Collective, an API call's save (the public megatron-core API, DeepSpeed's): ``save_dir`` claimed through the
    caller's ``checkpointer`` (held until it closes) or one for this call (released at its end), then a durable
    save of everything under the lease's fence."""
    ckpt = checkpointer if checkpointer is not None else Checkpointer.for_api(prog)
    try:
        ckpt.claim_dir(save_dir, job_id, take_over, lease.DEFAULT_TTL)
        return engine.save(save_dir, keep, SaveScope(), ckpt.fence)
    finally:
        if checkpointer is None:
            ckpt.close()


def load_for_api(engine: Engine, load_dir: str, iteration: int | None, prog: str,
                 checkpointer: Checkpointer | None) -> LoadResult | None:
    """Collective, an API call's load: ``iteration``'s checkpoint (no fallback), else the resume sequence over
    ``load_dir`` (not the job's own: no host memory, no scope), a damaged newest copy falling back to the next;
    None where there is nothing to load (the caller names its own refusal)."""
    if iteration is not None:
        return engine.load(load_dir, LoadScope(iteration=int(iteration)))
    ckpt = checkpointer if checkpointer is not None else Checkpointer.for_api(prog)
    try:
        return ckpt.resume(engine, load_dir, own=False).result
    finally:
        if checkpointer is None:
            ckpt.close()
