"""Collective host-memory snapshot: each rank's chunks copied into its node's memory, committed on every node.

A snapshot writes each rank's chunks into its node's memory directory in the format of a tenplex checkpoint (the
same writer assignment, files and metadata as :func:`engine.save.save_chunks`, the rank's rank-local entries
included: Transformer Engine's ``_extra_state`` in its own file, listed in metadata.json's ``rank_local`` section)
and commits it on every node atomically (``directory.commit``); then the nodes' helper processes copy its whole
files and metadata into the memory of ``replicas - 1`` other nodes (``memory/replication.py``) and, every
``persist_interval`` snapshots, to the durable ``--save`` directory (``memory/background.py``), both off the
training path. Every phase runs through the phase runner, so
a failure on any rank is raised on all of them.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from tenplex_megatron import log as tlog
from tenplex_megatron.engine import rng
from tenplex_megatron.engine.adapter import Adapter
from tenplex_megatron.engine.save import (
    RankLocal,
    SaveResult,
    build_metadata,
    describe_for_save,
    local_records,
    local_tensors,
    rank_tensors,
    save,
    writer_assignment,
)
from tenplex_megatron.engine.save_records import RankFile, RankHoldings
from tenplex_megatron.errors import TenplexError
from tenplex_megatron.execute.collective import broadcast_json, gather_records, rank, run_phase
from tenplex_megatron.execute.executor import plain_ops
from tenplex_megatron.memory import background, node_dir, replication
from tenplex_megatron.memory.shm_write import write_tensors
from tenplex_megatron.memory.state import MemoryTier
from tenplex_megatron.storage import directory, formats
from tenplex_megatron.storage.faults import log_open, maybe_fail
from tenplex_megatron.storage.safetensors_io import BLOCK_BYTES

log = tlog.get("memory")
HEADER_MARGIN = 1 << 20  # per rank file: the safetensors header and alignment, over the tensors' bytes


class MemoryFullError(TenplexError, RuntimeError):
    """A snapshot would not fit the memory directory of a node (found before anything is written)."""


@dataclass(frozen=True)
class SnapshotResult:
    """What a snapshot did on this rank: the blocking part's seconds, bytes, and what the background finished."""

    path: str
    iteration: int
    seconds: float  # the stall: until the snapshot was committed in memory on every node
    bytes_written: int  # by this rank into its node's memory
    bytes_replicated: int  # sent by this rank to other nodes' memory
    persisting: bool  # a background persist of this snapshot was started
    persisted: tuple[str, ...] = ()  # durable checkpoints committed during this call
    removed: tuple[str, ...] = ()
    fallback: SaveResult | None = None  # the durable save made instead, when the snapshot did not fit
    phases: tuple[tuple[str, float], ...] = ()  # the stall's parts on this rank: (phase, seconds), in order


class _Clock:
    """The stall's phases on this rank: each :meth:`mark` ends one."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.marks: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        self.marks.append((name, time.perf_counter()))

    def stall(self) -> float:
        """Seconds from the start to the last mark."""
        return self.marks[-1][1] - self.t0

    def phases(self) -> tuple[tuple[str, float], ...]:
        starts = [self.t0, *(t for _, t in self.marks[:-1])]
        return tuple((n, t - s) for (n, t), s in zip(self.marks, starts, strict=True))


def snapshot(adapter: Adapter, tier: MemoryTier, *, persist: bool | None = None,
             rng_state: bool = True) -> SnapshotResult:
    """Collective: snapshot the adapter's state into host memory (replicated); persist it in the background.

    ``persist``: True forces a durable copy of this snapshot, False skips it, None follows ``persist_interval``.
    ``rng_state``: False (``--no-save-rng``) records no RNG streams, in the snapshot and its durable copy alike (a
    load re-seeds); what else it holds is the adapter's (``--no-save-optim``: an adapter that describes no optimizer).
    """
    if persist and tier.pending is not None:
        background.drain(tier)  # a forced persist waits for the one under way
    clock = _Clock()
    it = adapter.iteration()
    what = f"memory snapshot of iteration {it} in {tier.mem}"
    chunks, local = run_phase(f"{what}: describing the job", lambda: describe_for_save(adapter))
    clock.mark("describe")
    gathered = gather_records(f"{what}: gathering chunk lists", lambda: _node_room(tier, chunks, local), NodeRoom)
    clock.mark("gather")
    holdings, writers, all_meta = writer_assignment([g.holdings for g in gathered])
    commit_durable = background.resolve(tier, [g.persist for g in gathered], what)
    clock.mark("assign")
    short = _shortfall(tier, holdings, writers, gathered)
    if short and tier.settings.fallback and tier.settings.save_dir:
        return _save_durable_instead(adapter, tier, it, f"{what}: does not fit ({'; '.join(short)})", rng_state)
    persisting = _persist_now(tier, persist) and (tier.pending is None or commit_durable)
    removed: list[str] = []
    persisted: list[str] = []
    run_phase(f"{what}: preparing",
              lambda: _prepare(tier, it, what, short, removed, persisted, commit=commit_durable, persist=persisting))
    clock.mark("prepare")
    if commit_durable:
        tier.pending = tier.pending_meta = None
    size, sums = run_phase(f"{what}: copying into node memory",
                           lambda: _write_rank_file(tier, chunks, writers, it, local))
    clock.mark("copy")
    infos = gather_records(f"{what}: gathering file lists",
                           lambda: _file_info(adapter, tier, size, sums, local, rng_state), RankFile)
    clock.mark("infos")
    meta = broadcast_json(run_phase(f"{what}: building metadata",
                                    lambda: _metadata(adapter, tier, writers, infos, all_meta, it)), 0)
    clock.mark("metadata")
    path = run_phase(f"{what}: committing in memory", lambda: _commit(tier, it, meta, removed))
    clock.mark("commit")
    interval = _remember(tier, it, meta, infos, clock.t0)
    sent = replication.replicate(tier, infos, it, what, interval)
    if persisting:
        background.start_persist(tier, what)
    return SnapshotResult(path, it, clock.stall(), size, sent, persisting, tuple(persisted), tuple(removed),
                          phases=clock.phases())


@dataclass(frozen=True)
class NodeRoom:
    """One rank's word at the start of a snapshot: its chunk list and rank-local bytes, the room in its node's
    memory directory (free, and used by committed snapshots) and its node's background work (:func:`_node_room`)."""

    holdings: RankHoldings
    local: int
    free: int
    used: int
    persist: background.NodeProgress

    def to_json(self) -> dict[str, Any]:
        return {"holdings": self.holdings.to_json(), "local": self.local, "free": self.free, "used": self.used,
                "persist": self.persist.to_json()}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> NodeRoom:
        return cls(RankHoldings.from_json(d["holdings"]), int(d["local"]), int(d["free"]), int(d["used"]),
                   background.NodeProgress.from_json(d["persist"]))


def _node_room(tier: MemoryTier, chunks: Any, local: RankLocal) -> NodeRoom:
    """This rank's chunk list and rank-local bytes, and (its node's first rank) the room in the node's memory
    directory and the background work's progress: gathered, so every rank decides alike."""
    committed = directory.committed_iterations(tier.mem) if tier.leader else []
    spares = node_dir.spare_bytes(tier.mem, tier.held_ranks()) if tier.leader else 0
    return NodeRoom(RankHoldings.of(chunks), sum(t.numel() for t, _ in local.values()),
                    node_dir.free_bytes(tier.mem) + spares, node_dir.used_bytes(tier.mem, committed),
                    background.node_progress(tier, 0.0))


def _shortfall(tier: MemoryTier, holdings: Any, writers: dict[Any, int], gathered: list[NodeRoom]) -> list[str]:
    """For each node the snapshot (its own files and the replicas it keeps) would not fit: a line saying so."""
    node_of = tier.node_of()
    written = {r: g.local for r, g in enumerate(gathered) if g.local}
    for h in holdings:
        if writers.get(h.chunk) == h.rank:
            written[h.rank] = written.get(h.rank, 0) + h.nbytes
    need: dict[str, int] = {}
    for r, nbytes in written.items():
        for n in [node_of[r], *tier.targets(node_of[r])]:
            need[n] = need.get(n, 0) + nbytes + HEADER_MARGIN
    short = []
    for n, nbytes in need.items():
        lead = tier.nodes[n][0]
        avail = gathered[lead].free
        if tier.settings.limit is not None:
            avail = min(avail, tier.settings.limit - gathered[lead].used)
        if nbytes > avail:
            short.append(f"node {n} (rank {lead}): {nbytes / 1e6:.1f} MB needed, {max(avail, 0) / 1e6:.1f} MB "
                         "available")
    return short


def _save_durable_instead(adapter: Adapter, tier: MemoryTier, it: int, why: str, rng_state: bool) -> SnapshotResult:
    """Collective (``--tenplex-memory-fallback``): a durable save where the snapshot does not fit."""
    save_dir = tier.settings.save_dir
    assert save_dir is not None
    if rank() == 0:
        log.warning("%s: saving to %s instead", why, save_dir)
    res = save(adapter, save_dir, tier.settings.durable_keep, rng_state=rng_state, fence=tier.fence)
    return SnapshotResult(res.path, it, res.seconds, res.bytes_written, 0, False, (res.path,), res.removed, res)


def _persist_now(tier: MemoryTier, persist: bool | None) -> bool:
    """Whether this snapshot should be persisted: as asked, else every ``persist_interval`` snapshots."""
    if tier.settings.save_dir is None:
        return False
    return persist if persist is not None else (tier.snapshots + 1) % tier.settings.persist_interval == 0


def _prepare(tier: MemoryTier, it: int, what: str, short: list[str], removed: list[str], persisted: list[str], *,
             commit: bool, persist: bool) -> None:
    """Refuse a snapshot that does not fit (before anything is written); make the staging directories (the node's
    first rank: memory; rank 0: durable, when persisting) and commit the durable checkpoint that is ready."""
    if short:
        limit = tier.settings.limit
        raise MemoryFullError(
            f"{what}: does not fit the memory directory ({'; '.join(short)}"
            + ("" if limit is None else f"; --tenplex-memory-limit {limit / 1e9:g} GB")
            + "); nothing was written: free memory, lower --tenplex-memory-keep or --tenplex-replicas, "
            "or pass --tenplex-memory-fallback to save to --save instead")
    if tier.leader:
        removed.extend(_clear_stale(tier))
        directory.prepare_partial(tier.mem, it, tier.fence)
    if rank() == 0 and commit:
        persisted.append(background.commit_durable(tier, removed))
    if rank() == 0 and persist:
        save_dir = tier.settings.save_dir
        assert save_dir is not None
        removed.extend(p for p in directory.partial_dirs(save_dir) if directory.remove_partial(p, tier.fence))  # killed persists
        directory.prepare_partial(save_dir, it, tier.fence)


def _clear_stale(tier: MemoryTier) -> list[str]:
    """What earlier snapshots left in the node's memory: half-written ones (killed), retired ones whose deleter
    died, and spare files of another job's or layout's ranks; returns what went."""
    removed = [p for p in directory.partial_dirs(tier.mem) if directory.remove_partial(p, tier.fence)]
    removed += [p for p in node_dir.retired(tier.mem)
                if p not in tier.disposing and directory.remove_own(p, formats.is_tenplex_checkpoint)]
    removed += node_dir.drop_spares(tier.mem, tier.held_ranks())
    return removed


def _write_rank_file(tier: MemoryTier, chunks: Any, writers: dict[Any, int], it: int, local: RankLocal
                     ) -> tuple[int, dict[str, tuple[int, ...]]]:
    """This rank's file of the snapshot in the node's staging directory (over its spare file's pages where one
    waits): its chunks and rank-local entries; returns its size and block CRCs (nothing to write: 0, {})."""
    me = rank()
    mine = rank_tensors(chunks, writers, me, local_tensors(local))
    if not mine:
        return 0, {}
    path = os.path.join(directory.partial_dir(tier.mem, it), directory.rank_file_name(me))
    log_open(path)
    spare = node_dir.spare_path(tier.mem, me)
    reuse = os.path.isfile(spare) and not os.path.islink(spare)
    if reuse:
        os.replace(spare, path)  # its pages are written over: no fresh tmpfs pages to allocate and zero
    with plain_ops():
        return write_tensors(path, mine, BLOCK_BYTES, after_write=lambda: maybe_fail("memory.write", me, it),
                             reuse=reuse)


def _file_info(adapter: Adapter, tier: MemoryTier, size: int, sums: dict[str, tuple[int, ...]],
               local: RankLocal, rng_state: bool) -> RankFile:
    """This rank's part of the metadata: its RNG state (unless left out) and rank-local records, its file (name,
    size, block CRCs) and node."""
    return RankFile({**({"rng": rng.capture(tracker=adapter.rng_tracker)} if rng_state else {}), **local_records(local)},
                    directory.rank_file_name(rank()) if sums else None, size, tier.node, BLOCK_BYTES, sums)


def _metadata(adapter: Adapter, tier: MemoryTier, writers: dict[Any, int], infos: list[RankFile],
              all_meta: Any, it: int) -> dict[str, Any] | None:
    """Rank 0: the snapshot's metadata as JSON (a durable checkpoint's, naming the job); None elsewhere."""
    if rank() != 0:
        return None
    fields = {"framework": adapter.framework, **adapter.metadata().to_json()}
    path = os.path.join(node_dir.snapshot_dir(tier.mem, it), directory.METADATA_FILE)
    return build_metadata(writers, infos, all_meta, adapter.layout().to_json(), it, fields, path,
                          memory_job=tier.settings.job).to_json()


def _commit(tier: MemoryTier, it: int, meta: dict[str, Any], removed: list[str]) -> str:
    """The node's first rank: commit the files this node wrote, then retire what retention lets go."""
    path = node_dir.snapshot_dir(tier.mem, it)
    if tier.leader:
        maybe_fail("memory.commit", rank(), it)
        staging = directory.partial_dir(tier.mem, it)
        here = {n: s for n, s in meta["files"].items() if os.path.isfile(os.path.join(staging, n))}
        path = directory.commit(tier.mem, it, meta, here, dispose=tier.dispose, fence=tier.fence)
        removed.extend(node_dir.retain(tier.mem, tier.settings.keep, (*tier.protected(), it), tier.dispose,
                                       tier.fence))
    return path


def _remember(tier: MemoryTier, it: int, meta: dict[str, Any], infos: list[RankFile], t0: float
              ) -> float | None:
    """Record the committed snapshot in the tier's state; returns the time since the previous one started."""
    tier.snapshots += 1
    tier.last = (it, meta, [f for r in tier.nodes[tier.node] if (f := infos[r].file)])
    tier.last_files = tuple(infos)
    interval = None if tier.last_snapshot_at is None else t0 - tier.last_snapshot_at
    tier.last_snapshot_at = t0
    return interval
