"""Collective host-memory snapshot: node-local copy, replication to peers' memory, background persist.

A snapshot writes each rank's chunks into its node's memory directory in the
format of a tenplex checkpoint (the same writer assignment, files and
metadata as :func:`engine.save.save_chunks`), copies each node's files into
the memory of ``replicas - 1`` other nodes over torch.distributed (a gloo
group of its own), and commits the snapshot on every node atomically
(``directory.commit``). Every ``persist_interval`` snapshots, a helper process
per node (``storage/persist_helper.py``: not a thread of the training
process) copies the node's own files to the durable ``--save`` staging
directory in the background; the job commits the durable checkpoint at a later
snapshot, once every node's helper has answered. Every phase runs through the
phase runner, so a failure on any rank is raised on all of them.
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any

from tenplex_megatron.engine import rng
from tenplex_megatron.engine.adapter import Adapter
from tenplex_megatron.engine.chunks import holdings_json
from tenplex_megatron.engine.save import SaveResult, build_metadata, rank_tensors, save, writer_assignment
from tenplex_megatron.execute.collective import all_gather_json, broadcast_json, gather_phase, rank, run_phase
from tenplex_megatron.execute.executor import plain_ops
from tenplex_megatron.execute.peer import cpu_group
from tenplex_megatron.storage import directory, memory_tier
from tenplex_megatron.storage.faults import maybe_fail
from tenplex_megatron.storage.persist_helper import PersistHelper
from tenplex_megatron.storage.safetensors_io import BLOCK_BYTES
from tenplex_megatron.storage.shm_write import write_tensors

HEADER_MARGIN = 1 << 20  # per rank file: the safetensors header and alignment, over the tensors' bytes


AUTO_PACE = 0.5  # --tenplex-replication-rate auto: a replication takes half the time between two snapshots


class MemoryFullError(RuntimeError):
    """A snapshot would not fit the memory directory of a node (found before anything is written)."""


@dataclass
class MemoryTier:
    """One process's view of the host-memory tier: its node and the state carried from save to save."""

    mem: str
    job: str  # the job's identity (its durable directory): a snapshot of another job is never loaded
    save_dir: str | None
    persist_interval: int = 1
    replicas: int = 2
    keep: int = 1
    limit: int | None = None  # bytes the snapshots of a node may use (None: whatever the filesystem has free)
    fallback: bool = False  # a snapshot that does not fit: a durable save instead of an error
    durable_keep: int | None = None
    replication_rate: float = 0.0  # MB/s a node's helper sends replicas at (0: unlimited)
    replication_pace: float = 0.0  # >0 (``auto``): replication paced to take this share of the snapshot interval
    last_snapshot_at: float | None = None  # time.perf_counter() at the start of the last snapshot
    node: str = ""
    nodes: dict[str, list[int]] = field(default_factory=dict)  # node id -> its ranks (ascending)
    snapshots: int = 0
    pending: int | None = None  # iteration being persisted in the background
    pending_meta: dict[str, Any] | None = None  # rank 0: its metadata, for the durable commit
    helper: PersistHelper | None = None
    helpers_started: bool = False  # on every node (the same on every rank): at open_tier or the first need
    generation: int = 0  # of the helpers' process group (a new one after a helper died)
    replicating: int | None = None  # iteration whose replicas the helpers are copying
    replicated: int | None = None  # newest iteration with every replica in place (kept until a newer one is)
    last: tuple[int, dict[str, Any], list[str]] | None = None  # the last snapshot: iteration, metadata, own files
    last_files: list[dict[str, Any]] = field(default_factory=list)  # every rank's file of it: name, size
    disposing: set[str] = field(default_factory=set)  # retired snapshots this node's helper is deleting

    @property
    def leader(self) -> bool:
        """The node's first rank: makes its directories, commits its snapshots, runs its persist helper."""
        return self.nodes[self.node][0] == rank()

    def node_of(self) -> dict[int, str]:
        return {r: n for n, rs in self.nodes.items() for r in rs}

    def held_ranks(self) -> list[int]:
        """The ranks whose files this node's snapshots hold: its own and those it keeps replicas of (their spare
        files are written over by the next snapshot and the next replication)."""
        return sorted(r for n, rs in self.nodes.items() for r in rs if n == self.node or self.node in self.targets(n))

    def order(self) -> list[str]:
        """Nodes in the order of their first rank (the ring replicas follow)."""
        return sorted(self.nodes, key=lambda n: self.nodes[n][0])

    def dispose(self, path: str) -> None:
        """Delete a retired snapshot (renamed ``.tenplex-old``) off the training path: by this node's helper
        process when it runs (freeing a GB of tmpfs pages takes a while), else here."""
        if self.leader:  # its rank files (own and replicas) become the spares the next snapshot writes over
            memory_tier.keep_spares(path, self.mem, self.held_ranks())
        if self.helper is not None and self.helper.alive:
            self.disposing.add(path)
            self.helper.request("remove", 0, paths=[path])
        else:
            shutil.rmtree(path, ignore_errors=True)

    def targets(self, node: str) -> list[str]:
        """The nodes that hold replicas of ``node``'s files: the next ``replicas - 1`` in the ring."""
        order = self.order()
        i = order.index(node)
        k = min(self.replicas, len(order))
        return [order[(i + j) % len(order)] for j in range(1, k)]


def open_tier(mem: str, job: str, save_dir: str | None, start_helpers: bool = False, **options: Any) -> MemoryTier:
    """Collective: this process's memory tier (node id read or made, nodes found by gathering every rank's id).

    ``start_helpers``: start the nodes' helper processes now rather than at the first snapshot, so that their
    start (an interpreter, torch, their group's rendezvous: seconds) overlaps the model's build and load instead
    of delaying the first snapshot's replication (until it is done, newer snapshots stay on their own node).
    """
    tier = MemoryTier(mem=os.path.abspath(mem), job=job, save_dir=save_dir, **options)

    def local() -> str:
        node = memory_tier.node_id(tier.mem)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            memory_tier.warn_if_not_memory(tier.mem)
        return node

    ids = gather_phase(f"--tenplex-memory {mem}: reading the node id", local)
    tier.node = ids[rank()]
    for r, n in enumerate(ids):
        tier.nodes.setdefault(n, []).append(r)
    cpu_group()  # created collectively now, used by peer loads
    if tier.replicas > len(tier.nodes) and rank() == 0:
        warnings.warn(f"--tenplex-replicas {tier.replicas}: only {len(tier.nodes)} live node(s); each snapshot keeps "
                      "one copy per node", stacklevel=2)
    if start_helpers:
        _start_helpers(tier)
    return tier


def _start_helpers(tier: MemoryTier) -> None:
    """Collective: every node's helper process, in a gloo group of their own when there are replicas to copy."""
    tier.generation += 1
    tier.helpers_started = True
    replicate = len(tier.nodes) > 1 and tier.replicas > 1
    if not (replicate or tier.save_dir):
        return

    # the helpers' group key in the job's store: rank 0's, the same on every node (torchrun's restart count is
    # each agent's own: a node that joined later counts differently) and new for every start (the store may be
    # the rendezvous store, kept across restarts)
    token = broadcast_json(uuid.uuid4().hex if rank() == 0 else None, 0) if replicate else ""

    def start() -> None:
        if not tier.leader:
            return
        if tier.helper is not None:  # a restart after a helper failed: the others may wait on it in the group
            tier.helper.proc.kill()
            tier.helper.close()
        tier.disposing.clear()  # what the old helper did not delete yet: the next snapshot does
        group = None
        if replicate:
            store = f"{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ['MASTER_PORT']}"
            prefix = f"tenplex-memory-helpers/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{token}"
            group = (store, prefix, tier.order().index(tier.node), len(tier.nodes))
        tier.helper = PersistHelper(group)

    run_phase(f"--tenplex-memory {tier.mem}: starting the helper processes", start)


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


def _poll(tier: MemoryTier, wait: float) -> dict[str, str] | None:
    """This node's answers for the pending persist and replication: "ok", an error, or "running"."""
    if not tier.leader or (tier.pending is None and tier.replicating is None):
        return None
    out = {}
    for op, it in (("persist", tier.pending), ("replicate", tier.replicating)):
        if it is None:
            continue
        if tier.helper is None:
            out[op] = "error: no helper process on this node"
            continue
        got = tier.helper.poll(op, it, wait)
        out[op] = "running" if got is None else "ok" if got.get("ok") else f"error: {got.get('error')}"
    return out


def _settle(answers: list[dict[str, str] | None], op: str) -> tuple[bool, str | None]:
    """From every leader's answer about ``op``: (finished on every node, the error that ended it)."""
    said = [a[op] for a in answers if a is not None and op in a]
    if not said:
        return False, None
    errors = [a for a in said if a.startswith("error")]
    if errors:
        return False, errors[0]
    return all(a == "ok" for a in said), None


def _resolve(tier: MemoryTier, answers: list[dict[str, str] | None], what: str) -> bool:
    """Apply every node's answers: replication done or failed (a failed helper: all helpers restart);
    returns whether the pending durable checkpoint can be committed now. Collective when helpers restart."""
    done, error = _settle(answers, "replicate")
    restart = False
    if done:
        tier.replicated, tier.replicating = tier.replicating, None
    elif error is not None:
        if rank() == 0:
            warnings.warn(f"{what}: replication of iteration {tier.replicating} failed: {error}; the helpers "
                          "restart", stacklevel=3)
        tier.replicating = None
        restart = True
    commit, error = _settle(answers, "persist")
    if error is not None:
        if rank() == 0:
            warnings.warn(f"{what}: background persist of iteration {tier.pending} failed: {error}; its staging "
                          "directory is removed by the next persist", stacklevel=3)
        tier.pending = tier.pending_meta = None
        restart = restart or len(tier.nodes) > 1 and tier.replicas > 1

    def local() -> bool:
        if done and tier.leader:  # the older snapshot the replicated one protected can go now
            memory_tier.retain(tier.mem, tier.keep, _protected(tier), tier.dispose)
        return restart or (tier.leader and tier.helper is not None and not tier.helper.alive)

    if any(gather_phase(f"{what}: checking the helper processes", local)):
        if rank() == 0 and (tier.replicating is not None or (tier.pending is not None and not commit)):
            warnings.warn(f"{what}: the helper processes restart: the replication of iteration {tier.replicating} "
                          f"and the persist of iteration {tier.pending} under way are abandoned", stacklevel=3)
        tier.replicating = None  # what the old helpers were doing is lost with them
        if not commit:
            tier.pending = tier.pending_meta = None
        _start_helpers(tier)
    return commit


def _protected(tier: MemoryTier) -> tuple[int, ...]:
    """Snapshots retention keeps besides the newest: being persisted, being replicated, the newest replicated."""
    replicas = tier.replicated if len(tier.nodes) > 1 and tier.replicas > 1 else None
    return tuple(x for x in (tier.pending, tier.replicating, replicas) if x is not None)


def _commit_durable(tier: MemoryTier, removed: list[str]) -> str:
    """Rank 0: commit the pending durable checkpoint (every node's files are in its staging directory)."""
    assert tier.save_dir is not None and tier.pending_meta is not None and tier.pending is not None
    meta = tier.pending_meta
    path = directory.commit(tier.save_dir, tier.pending, meta, meta["files"],
                            fault=lambda point: maybe_fail(point, 0, tier.pending))
    if tier.durable_keep is not None:
        removed.extend(directory.apply_retention(tier.save_dir, tier.durable_keep))
    return path


def busy(tier: MemoryTier) -> bool:
    """Collective: whether any node's helper is still replicating or persisting (nothing is waited for)."""
    return any(a is not None and "running" in a.values() for a in all_gather_json(_poll(tier, 0.0)))


def drain(tier: MemoryTier) -> tuple[str, ...]:
    """Collective: wait for the pending replication and background persist; commit the persisted checkpoint;
    returns the durable path (if any)."""
    persisted: list[str] = []
    while tier.pending is not None or tier.replicating is not None:
        answers = gather_phase("waiting for the helper processes", lambda: _poll(tier, 0.5))
        if _resolve(tier, answers, "waiting for the helper processes"):
            persisted.append(run_phase("committing the persisted checkpoint",
                                       lambda: _commit_durable(tier, []) if rank() == 0 else ""))
            tier.pending = tier.pending_meta = None
    return tuple(p for p in persisted if p)


def close(tier: MemoryTier) -> None:
    """Stop this node's helper (after :func:`drain`)."""
    if tier.helper is not None:
        tier.helper.close()
        tier.helper = None


def snapshot(adapter: Adapter, tier: MemoryTier, persist: bool | None = None) -> SnapshotResult:
    """Collective: snapshot the adapter's state into host memory (replicated); persist it in the background.

    ``persist``: True forces a durable copy of this snapshot, False skips it,
    None follows ``persist_interval``.
    """
    if persist and tier.pending is not None:
        drain(tier)  # a forced persist waits for the one under way
    t0 = time.perf_counter()
    marks: list[tuple[str, float]] = []

    def mark(name: str) -> None:
        marks.append((name, time.perf_counter()))

    me = rank()
    it = adapter.iteration()
    what = f"memory snapshot of iteration {it} in {tier.mem}"
    chunks = run_phase(f"{what}: describing the job", adapter.describe)
    mark("describe")

    def local() -> dict[str, Any]:
        committed = directory.committed_iterations(tier.mem) if tier.leader else []
        spares = memory_tier.spare_bytes(tier.mem, tier.held_ranks()) if tier.leader else 0
        return {"holdings": holdings_json(chunks), "free": memory_tier.free_bytes(tier.mem) + spares,
                "used": memory_tier.used_bytes(tier.mem, committed), "persist": _poll(tier, 0.0)}

    gathered = gather_phase(f"{what}: gathering chunk lists", local)
    mark("gather")
    holdings, writers, all_meta = writer_assignment([g["holdings"] for g in gathered])
    commit_durable = _resolve(tier, [g["persist"] for g in gathered], what)
    mark("assign")
    node_of = tier.node_of()
    written: dict[int, int] = {}
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
        avail = gathered[lead]["free"]
        if tier.limit is not None:
            avail = min(avail, tier.limit - gathered[lead]["used"])
        if nbytes > avail:
            short.append(f"node {n} (rank {lead}): {nbytes / 1e6:.1f} MB needed, {max(avail, 0) / 1e6:.1f} MB "
                         "available")
    if short and tier.fallback and tier.save_dir:
        if me == 0:
            warnings.warn(f"{what}: does not fit ({'; '.join(short)}): saving to {tier.save_dir} instead",
                          stacklevel=2)
        res = save(adapter, tier.save_dir, tier.durable_keep)
        return SnapshotResult(res.path, it, res.seconds, res.bytes_written, 0, False, (res.path,), res.removed, res)
    want = tier.save_dir is not None and (persist if persist is not None
                                          else (tier.snapshots + 1) % tier.persist_interval == 0)
    persisting = want and (tier.pending is None or commit_durable)
    removed: list[str] = []
    persisted: list[str] = []

    def prepare() -> None:
        if short:
            raise MemoryFullError(
                f"{what}: does not fit the memory directory ({'; '.join(short)}"
                + ("" if tier.limit is None else f"; --tenplex-memory-limit {tier.limit / 1e9:g} GB")
                + "); nothing was written: free memory, lower --tenplex-memory-keep or --tenplex-replicas, "
                "or pass --tenplex-memory-fallback to save to --save instead")
        if tier.leader:
            for stale in directory.partial_dirs(tier.mem):  # left by a snapshot that was killed
                if directory.remove_partial(stale):
                    removed.append(stale)
            for stale in memory_tier.retired(tier.mem):  # retired, but the helper deleting it died
                if stale not in tier.disposing and directory.remove_own(stale, directory.is_tenplex_checkpoint):
                    removed.append(stale)
            removed.extend(memory_tier.drop_spares(tier.mem, tier.held_ranks()))  # another job's or layout's
            directory.prepare_partial(tier.mem, it)
        if me == 0 and commit_durable:
            persisted.append(_commit_durable(tier, removed))
        if me == 0 and persisting:
            assert tier.save_dir is not None
            for stale in directory.partial_dirs(tier.save_dir):  # a persist that was killed
                if directory.remove_partial(stale):
                    removed.append(stale)
            directory.prepare_partial(tier.save_dir, it)

    run_phase(f"{what}: preparing", prepare)
    mark("prepare")
    if commit_durable:
        tier.pending = tier.pending_meta = None
    staging = directory.partial_dir(tier.mem, it)

    def write() -> tuple[int, dict[str, tuple[int, ...]]]:
        mine = rank_tensors(chunks, writers, me)
        if not mine:
            return 0, {}
        path = os.path.join(staging, directory.rank_file_name(me))
        memory_tier.log_open(path)
        spare = memory_tier.spare_path(tier.mem, me)
        reuse = os.path.isfile(spare) and not os.path.islink(spare)
        if reuse:
            os.replace(spare, path)  # its pages are written over: no fresh tmpfs pages to allocate and zero
        with plain_ops():
            return write_tensors(path, mine, BLOCK_BYTES, after_write=lambda: maybe_fail("memory.write", me, it),
                                 reuse=reuse)

    size, sums = run_phase(f"{what}: copying into node memory", write)
    mark("copy")

    def info() -> dict[str, Any]:
        return {"info": {"rng": rng.capture(tracker=adapter.rng_tracker)},
                "file": directory.rank_file_name(me) if sums else None, "size": size, "host": tier.node,
                "block_bytes": BLOCK_BYTES, "block_crc32": {name: list(crcs) for name, crcs in sums.items()}}

    infos = gather_phase(f"{what}: gathering file lists", info)
    mark("infos")

    def build() -> dict[str, Any] | None:
        if me != 0:
            return None

        def metadata(rank_infos: list[dict[str, Any]]) -> dict[str, Any]:
            return {"framework": adapter.framework, **adapter.metadata(),
                    "rng": {str(r): i["rng"] for r, i in enumerate(rank_infos)}, "memory_job": tier.job}

        return build_metadata(writers, infos, all_meta, adapter.layout(), it, metadata)

    meta = broadcast_json(run_phase(f"{what}: building metadata", build), 0)
    mark("metadata")

    def commit() -> str:
        path = memory_tier.snapshot_dir(tier.mem, it)
        if tier.leader:
            maybe_fail("memory.commit", me, it)
            here = {n: s for n, s in meta["files"].items() if os.path.isfile(os.path.join(staging, n))}
            path = directory.commit(tier.mem, it, meta, here, dispose=tier.dispose)
            removed.extend(memory_tier.retain(tier.mem, tier.keep, (*_protected(tier), it), tier.dispose))
        return path

    path = run_phase(f"{what}: committing in memory", commit)
    mark("commit")
    tier.snapshots += 1
    stall = time.perf_counter() - t0
    phases = tuple((n, b - a) for (n, b), (_, a) in zip(marks, [("", t0), *marks[:-1]], strict=True))
    tier.last = (it, meta, [infos[r]["file"] for r in tier.nodes[tier.node] if infos[r]["file"]])
    tier.last_files = [{"file": i["file"], "size": i["size"]} for i in infos]
    interval = None if tier.last_snapshot_at is None else t0 - tier.last_snapshot_at
    tier.last_snapshot_at = t0
    sent = _replicate(tier, infos, it, what, interval)
    if persisting:
        _start_persist(tier, what)
    return SnapshotResult(path, it, stall, size, sent, persisting, tuple(persisted), tuple(removed), phases=phases)


def _start_persist(tier: MemoryTier, what: str) -> None:
    """Collective: hand the last snapshot's files of each node's own ranks to the node's helper process."""
    assert tier.last is not None and tier.save_dir is not None
    it, meta, own = tier.last
    if not tier.helpers_started:
        _start_helpers(tier)
    tier.pending = it
    if rank() == 0:
        tier.pending_meta = meta

    def start() -> None:
        if not tier.leader:
            return
        assert tier.save_dir is not None
        assert tier.helper is not None
        src = memory_tier.snapshot_dir(tier.mem, it)
        tier.helper.request("persist", it, copies=[
            (os.path.join(src, f), os.path.join(directory.partial_dir(tier.save_dir, it), f)) for f in own])

    run_phase(f"{what}: starting the background persist", start)


def replicate_last(tier: MemoryTier) -> tuple[str, ...]:
    """Collective: make sure the last snapshot has all its replicas (the job stops: its restart relies on them);
    returns the durable checkpoints committed meanwhile."""
    done = drain(tier)
    if tier.last is None or tier.replicated == tier.last[0] or len(tier.nodes) < 2 or tier.replicas < 2:
        return done
    _replicate(tier, tier.last_files, tier.last[0], f"replicating iteration {tier.last[0]}", unpaced=True)
    return done + drain(tier)


def persist_last(tier: MemoryTier) -> tuple[str, ...]:
    """Collective: make the last snapshot durable now (the end of training) unless it is already; returns the
    durable checkpoints committed."""
    done = drain(tier)
    if tier.last is None or tier.save_dir is None:
        return done
    it = tier.last[0]
    save_dir = tier.save_dir

    def prepare() -> bool:
        already = directory.find_checkpoint(save_dir) is not None and directory.tracker_iteration(save_dir) == it
        if rank() == 0 and not already:
            for stale in directory.partial_dirs(save_dir):
                directory.remove_partial(stale)
            directory.prepare_partial(save_dir, it)
        return already

    already = broadcast_json(run_phase(f"persisting iteration {it}: preparing", prepare), 0)
    if already:
        return done
    _start_persist(tier, f"persisting iteration {it}")
    return done + drain(tier)


def finish(tier: MemoryTier, over: bool) -> tuple[str, ...]:
    """Collective, when the job stops: the last snapshot replicated to K nodes (a restart finds it in memory) and,
    when training is ``over``, persisted; otherwise the background persist under way is awaited. A paced
    replication goes at full speed from here on (no training left to spare). Returns the durable checkpoints
    committed meanwhile."""
    if tier.leader and tier.helper is not None:
        tier.helper.hurry()
    done = replicate_last(tier)
    return done + (persist_last(tier) if over else drain(tier))


def replication_options(rate: float | str) -> dict[str, float]:
    """The tier's options for a replication rate (``--tenplex-replication-rate``): a cap in MB/s, or ``auto``;
    anything else is a ValueError naming it."""
    if rate == "auto":
        return {"replication_rate": 0.0, "replication_pace": AUTO_PACE}
    try:
        cap = float(rate)
    except (TypeError, ValueError):
        cap = -1.0
    if not cap >= 0:
        raise ValueError(f"replication_rate: expected MB/s (>= 0; 0: unlimited) or 'auto', got {rate!r}")
    return {"replication_rate": cap}


def replication_rate(cap_mb: float, pace: float, interval: float | None, node_bytes: int) -> float:
    """Bytes/s a node's helper sends a snapshot's replicas at (0: all at once). ``cap_mb``: the MB/s cap (0: none);
    ``pace`` > 0 (``--tenplex-replication-rate auto``): the replication takes ``pace`` times ``interval``, the time
    since the previous snapshot (none yet: not paced by it). A node with nothing to send still paces (any
    positive rate): whether a replication is cut into rounds must be the same on every node."""
    rate = cap_mb * 1e6
    if pace > 0 and interval is not None and interval > 0:
        paced = node_bytes / (pace * interval) if node_bytes else 1e30  # nothing to send: no wait
        rate = min(rate, paced) if rate > 0 else paced
    return rate


def _replicate(tier: MemoryTier, infos: list[dict[str, Any]], it: int, what: str, interval: float | None = None,
               unpaced: bool = False) -> int:
    """Collective: have the helpers copy this snapshot's files into the memory of the nodes that keep replicas
    of them (in the background), at :func:`replication_rate` (``unpaced``: at the cap alone, the job is
    stopping); returns the bytes this rank's node will send for this rank's file."""
    if len(tier.nodes) < 2 or tier.replicas < 2:
        tier.replicated = it
        return 0
    if tier.replicating is not None:  # the helpers are still copying an older snapshot: this one stays local
        if rank() == 0:
            warnings.warn(f"{what}: replication of iteration {tier.replicating} is still under way: iteration {it} "
                          "is kept on its own node only (iteration "
                          f"{tier.replicated} is the newest replicated snapshot)", stacklevel=3)
        return 0
    if not tier.helpers_started:
        _start_helpers(tier)
    tier.replicating = it
    order = tier.order()
    node_of = tier.node_of()
    path = memory_tier.snapshot_dir(tier.mem, it)
    sends, recvs = [], []
    for r, i in enumerate(infos):
        if not i["file"]:
            continue
        src = node_of[r]
        for t in tier.targets(src):
            if src == tier.node:
                sends.append([os.path.join(path, i["file"]), order.index(t), r])
            elif t == tier.node:
                recvs.append([order.index(src), int(i["size"]), os.path.join(path, i["file"]), r,
                              memory_tier.spare_path(tier.mem, r)])

    node_bytes = sum(int(infos[r]["size"]) for _, _, r in sends)
    rate = replication_rate(tier.replication_rate, 0.0 if unpaced else tier.replication_pace, interval, node_bytes)

    def start() -> None:
        if tier.leader:
            assert tier.helper is not None
            tier.helper.request("replicate", it, sends=sends, recvs=recvs, rate=rate)

    run_phase(f"{what}: starting the replication", start)
    mine = infos[rank()]
    return int(mine["size"]) * len(tier.targets(tier.node)) if mine["file"] else 0
