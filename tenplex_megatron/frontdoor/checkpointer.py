"""One job's checkpointing, owned by one object: the leases, the host-memory tier, the restart sources and the
save/load sequence, in the one order every front door follows; :meth:`Checkpointer.close` gives all of it back, so
that a job restarted in the same process (an in-process restart at a new world size) builds a new one.

The sequence: build (claim the leases, before any process group), :meth:`~Checkpointer.memory` (collective: open
the ``--tenplex-memory`` tier, its helper processes started), :meth:`~Checkpointer.sources` (where a restart loads
from), :meth:`~Checkpointer.restart` (collective: load, re-sharded, a damaged copy falling back to the next),
:meth:`~Checkpointer.save` (collective: a snapshot into host memory, else a durable save with ``keep``, under the
lease's fence), :meth:`~Checkpointer.finish` (collective: the last snapshot replicated and persisted), then
:meth:`~Checkpointer.close` (local: the helpers stopped, the leases released, the heartbeat thread ended). The
engine comes in as an :class:`~tenplex_megatron.engine.adapter.Adapter` factory and its loaders, so that the
trainer, the Megatron-LM hook and the DeepSpeed calls share it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

from tenplex_megatron import log
from tenplex_megatron.engine.adapter import Adapter
from tenplex_megatron.engine.load import LoadResult
from tenplex_megatron.engine.save import SaveResult
from tenplex_megatron.errors import TenplexError
from tenplex_megatron.execute.collective import rank, run_phase
from tenplex_megatron.flags import FlagError
from tenplex_megatron.frontdoor import lease_flags, memory_flags, restart_sources
from tenplex_megatron.memory import fallback, state
from tenplex_megatron.memory.restart import discard_after
from tenplex_megatron.memory.settings import MemorySettings
from tenplex_megatron.memory.snapshot import SnapshotResult, snapshot
from tenplex_megatron.memory.state import MemoryTier
from tenplex_megatron.storage import job_identity, lease

_log = log.get("checkpointer")


class CheckpointerClosedError(TenplexError, RuntimeError):
    """A closed :class:`Checkpointer` was used: build a new one (the job's flags are still there)."""


class Checkpointer:
    """One job's leases, host-memory tier, restart sources and save/load sequence, built from its parsed flags
    (``args``: the ``--tenplex*`` flags of ``tenplex_megatron/flags.py``, with ``save`` and ``load``); ``prog``
    names the program in refusals. Building it claims the leases (before any process group: another live job's
    directory is refused with SystemExit naming it)."""

    def __init__(self, args: Any, prog: str, memory: MemorySettings | None = None) -> None:
        self.args, self.prog = args, prog
        self.leases: tuple[str, ...] = tuple(lease_flags.claim(args, prog))
        self._settings = memory  # the tier's settings given by an API caller (else the flags say)
        self._tier: MemoryTier | None = None
        self._opened = False
        self._closed = False
        self._claimed: set[str] = set()

    @classmethod
    def for_api(cls, prog: str, memory: MemorySettings | None = None) -> Checkpointer:
        """A job driven through API calls rather than flags (the DeepSpeed front door): no lease claimed at start-up
        (each save directory is claimed at its first save, :meth:`claim_dir`); the host-memory tier of ``memory``
        (DeepSpeed's ``open_memory``), opened by :meth:`memory`, or none."""
        return cls(argparse.Namespace(tenplex=False, save=None, load=None, tenplex_memory=None), prog, memory)

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
                lease.acquire(save_dir, job, ttl, take_over, remedy=lease.API_REMEDY)
            else:
                lease.check(save_dir, job, take_over, remedy=lease.API_REMEDY)

        run_phase(f"lease of {save_dir}", claim)
        self._claimed.add(key)
        if rank() == 0:
            self.args.tenplex_leases = [*(self.args.tenplex_leases or ()), save_dir]
        self.leases = tuple(self.args.tenplex_leases or ())

    # -- the sequence ------------------------------------------------------------------------------------------

    @property
    def wants_memory(self) -> bool:
        """Whether the job runs the host-memory tier (``--tenplex --tenplex-memory DIR``, or an API caller's)."""
        return self._settings is not None or bool(getattr(self.args, "tenplex", False)
                                                  and getattr(self.args, "tenplex_memory", None))

    @property
    def memory_opened(self) -> bool:
        """Whether :meth:`memory` has run (the tier opened, or found not wanted)."""
        return self._opened

    def memory(self) -> MemoryTier | None:
        """Collective at the first call (every rank reaches it): the ``--tenplex-memory`` tier (or the API caller's),
        its helper processes started; None without one. Later calls return the same tier."""
        self._check_open()
        if not self._opened:
            self._tier = (memory_flags.open_settings(self._settings) if self._settings is not None
                          else memory_flags.open_memory(self.args) if self.wants_memory else None)
            self._opened = True
        return self._tier

    def sources(self, load_dir: str | None, *, tenplex: bool | None = None,
                memory: bool = True) -> restart_sources.Sources:
        """Where a restart loads from (``restart_sources.py``'s order) under ``load_dir``, the tier opened first;
        ``memory=False`` leaves host memory out (a load of another directory than the job's)."""
        tier = self.memory() if memory else None
        return restart_sources.find_sources(tier, load_dir, tenplex=bool(
            getattr(self.args, "tenplex", False) if tenplex is None else tenplex))

    def restart(self, adapter: Callable[[], Adapter], load_durable: Callable[[str], LoadResult],
                sources: restart_sources.Sources, load_dir: str | None, *,
                memory: bool = True, verify: bool | None = None) -> fallback.Restart:
        """Collective: load ``sources``' snapshot or durable checkpoint, re-sharded (``verify``, by default unless
        ``--tenplex-no-verify``: check the checksums); a damaged copy falls back to the next (``memory/fallback.py``)."""
        self._check_open()
        if verify is None:
            verify = not getattr(self.args, "tenplex_no_verify", False)
        tier = self._tier if memory else None
        return restart_sources.restart(adapter, load_durable, tier, sources, load_dir, verify=verify)

    def forget_older_snapshots(self) -> None:
        """A job that starts afresh (nothing loaded): the snapshots older runs left in the tier are discarded."""
        tier = self.memory()
        if tier is not None:
            discard_after(tier, None)

    def save(self, adapter: Callable[[], Adapter], save_durable: Callable[[], SaveResult], *,
             persist: bool | None = None) -> SnapshotResult | SaveResult:
        """Collective: a snapshot into host memory through ``adapter()`` when the tier is open (``persist`` as
        :func:`~tenplex_megatron.memory.snapshot.snapshot` takes it), else ``save_durable()`` (which applies
        ``--tenplex-keep``); a writer fenced by a newer generation of its directory stops (:meth:`fenced`)."""
        with self.fenced():
            if self.memory() is not None:
                return self.snapshot(adapter(), persist=persist)
            return save_durable()

    def snapshot(self, adapter: Adapter, *, persist: bool | None = None) -> SnapshotResult:
        """Collective: a snapshot of ``adapter``'s state into the host-memory tier (``persist`` as
        :func:`~tenplex_megatron.memory.snapshot.snapshot` takes it); a job without the tier is refused."""
        tier = self.memory()
        if tier is None:
            raise FlagError(f"{self.prog}: a host-memory snapshot needs the host-memory tier (--tenplex-memory)")
        return snapshot(adapter, tier, persist=persist)

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

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run."""
        return self._closed

    @property
    def tier(self) -> MemoryTier | None:
        """The host-memory tier, when :meth:`memory` opened one."""
        return self._tier

    # -- the end -----------------------------------------------------------------------------------------------

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
            lease_flags.release(self.args)
            lease.stop_heartbeat_when_idle()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointerClosedError(f"{self.prog}: this job's Checkpointer is closed: build a new one")
