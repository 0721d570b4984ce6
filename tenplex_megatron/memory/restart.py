"""Restart sources in host memory: choose the snapshot to restart from, and load it at any layout.

Every rank lists its node's snapshots; the lists are all-gathered and the newest snapshot complete on the live
nodes (every rank file with a live copy) wins over an older durable checkpoint (``plan/restart_policy.py``, the
same answer on every rank); one the live nodes hold only in part is completed from the durable checkpoint of the
same iteration (the rank files they lack). The plan is the engine's; its source chunks on this node are read
through a memory map, the rest is received over torch.distributed from ranks of the nodes that hold them (whole
checksum blocks covering what each piece reads, once per receiving rank, senders balanced: :func:`fetch_from_peers`)
and verified against the recorded block CRC-32s before anything is copied into the model. A rank's rank-local
entries (Transformer Engine's ``_extra_state``, ``engine/rank_local.py``) come the same ways, from its own rank
file: at the snapshot's layout only (no other can take them back), whole, their block CRC-32s checked by the reader.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch

from tenplex_megatron.engine import rank_local
from tenplex_megatron.engine.adapter import Adapter
from tenplex_megatron.engine.load import LoadResult, load
from tenplex_megatron.execute.collective import broadcast_json, gather_records, rank, run_phase
from tenplex_megatron.memory import node_dir
from tenplex_megatron.memory.peers import exchange
from tenplex_megatron.memory.state import MemoryTier
from tenplex_megatron.plan.peer_schedule import PeerKey, PeerRequest, RankRequests, merge_ranges, schedule
from tenplex_megatron.plan.ptc import StoredChunk, dtype_size
from tenplex_megatron.plan.restart_policy import Choice, DurableListing, ForeignSnapshotError, Snapshot, pick_snapshot
from tenplex_megatron.storage import directory
from tenplex_megatron.storage.block_verify import piece_runs, touched_blocks
from tenplex_megatron.storage.checkpoint_metadata import CheckpointMetadata
from tenplex_megatron.storage.confine import confine_all
from tenplex_megatron.storage.faults import log_open
from tenplex_megatron.storage.files import CheckpointFileError
from tenplex_megatron.storage.parallel_read import Extent, ReadPlan
from tenplex_megatron.storage.safetensors_io import TORCH_DTYPES
from tenplex_megatron.storage.source import Opened
from tenplex_megatron.storage.source_files import SourceFiles
from tenplex_megatron.storage.verify_ckpt import verify_checkpoint


def durable_iteration(load_dir: str | None) -> int | None:
    """The iteration of the newest complete durable checkpoint under ``load_dir`` (None if there is none): the
    tracker file's when it names a complete one (nothing of the checkpoint itself is opened then)."""
    if not load_dir:
        return None
    it = directory.tracker_iteration(load_dir)
    if it is not None and os.path.isdir(os.path.join(load_dir, directory.iter_dir_name(it))):
        return it
    path = directory.find_checkpoint(load_dir)
    return None if path is None else directory.read_checkpoint_metadata(path).require_iteration()


@dataclass(frozen=True)
class NodeListing:
    """One rank's answer when a restart lists the snapshots: its node's (its leader's; none from the others) and,
    from rank 0, the newest durable checkpoint's iteration."""

    held: tuple[Snapshot, ...]
    durable: int | None

    def to_json(self) -> dict[str, Any]:
        return {"held": [s.to_json() for s in self.held], "durable": self.durable}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> NodeListing:
        return cls(tuple(Snapshot.from_json(s) for s in d["held"]), d["durable"])


def choose(tier: MemoryTier, load_dir: str | None,
           exclude: set[tuple[int, str, str]] | frozenset[tuple[int, str, str]] = frozenset()) -> Choice | None:
    """Collective, a query: the snapshot to restart from, or None (load the durable checkpoint, or start afresh).
    Nothing is discarded here: the snapshots newer than where the job restarts are discarded (:func:`discard_after`)
    once the resume sequence has decided (``frontdoor/resume.py``). ``exclude``: (iteration, rank file, node)
    copies found damaged (:func:`damaged_copies`), counted as absent."""
    def local() -> NodeListing:
        held = node_dir.list_snapshots(tier.mem, tier.node) if tier.leader else []
        return NodeListing(tuple(held), durable_iteration(load_dir) if rank() == 0 else None)

    got = gather_records(f"--tenplex-memory {tier.mem}: listing snapshots", local, NodeListing)
    held = [s for g in got for s in g.held]
    if exclude:
        held = [dataclasses.replace(s, present={f: n for f, n in s.present.items()
                                                if (s.iteration, f, s.node) not in exclude}) for s in held]
    newest_durable = got[0].durable
    picked = run_phase("choosing the snapshot to restart from", lambda: _pick(held, tier.settings.job, newest_durable))
    durable_dir = None if not load_dir or newest_durable is None else os.path.join(
        load_dir, directory.iter_dir_name(newest_durable))
    if picked is None and durable_dir is not None and any(s.iteration == newest_durable for s in held):
        # a snapshot of the durable checkpoint's iteration, not whole in live memory: the durable checkpoint's
        # rank files complete it (read only now: a whole snapshot never touches the durable checkpoint)
        def listing() -> dict[str, Any] | None:
            if rank() != 0:
                return None
            try:
                return node_dir.durable_listing(durable_dir).to_json()
            except (OSError, ValueError, CheckpointFileError):  # unreadable: no mixing, the durable load decides
                return None

        found = DurableListing.from_json(broadcast_json(run_phase("listing the durable checkpoint", listing), 0))
        picked = run_phase("choosing the snapshot to restart from",
                           lambda: _pick(held, tier.settings.job, newest_durable, found))
    if picked is None:
        return None
    src = min(tier.nodes[n][0] for n in {n for ns in picked.holders.values() for n in ns})

    def read_meta() -> dict[str, Any] | None:
        if rank() != src:
            return None
        path = node_dir.snapshot_dir(tier.mem, picked.iteration)
        log_open(os.path.join(path, directory.METADATA_FILE))
        return directory.read_metadata(path)

    meta = broadcast_json(run_phase("reading the snapshot's metadata", read_meta), src)
    # every rank types the metadata it was sent (checked as read on ``src``: the same answer on every rank)
    typed = CheckpointMetadata.from_json(
        meta, os.path.join(node_dir.snapshot_dir(tier.mem, picked.iteration), directory.METADATA_FILE))
    return dataclasses.replace(picked, metadata=typed,  # picked.durable: files of the durable iteration
                               durable_dir=durable_dir if picked.durable else None)


def _pick(held: list[Snapshot], job: str, durable_iteration: int | None,
          durable: DurableListing | None = None) -> Choice | None:
    """:func:`pick_snapshot`, another job's snapshot reported as a checkpoint-file error naming it."""
    try:
        return pick_snapshot(held, job, durable_iteration, durable)
    except ForeignSnapshotError as e:
        raise CheckpointFileError(str(e)) from None


def _metadata(choice: Choice) -> CheckpointMetadata:
    """The chosen snapshot's metadata (filled in by :func:`choose` once the choice is made)."""
    if choice.metadata is None:
        raise ValueError(f"snapshot of iteration {choice.iteration}: its metadata was not read")
    return choice.metadata


@dataclass(frozen=True)
class DamagedCopies:
    """One rank's word after a failed load: the rank files of the snapshot its node's memory holds that fail their
    checksums (its node's first rank checks them; none from the others)."""

    node: str
    files: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "files": list(self.files)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DamagedCopies:
        return cls(str(d["node"]), tuple(str(f) for f in d["files"]))


def damaged_copies(tier: MemoryTier, choice: Choice) -> list[tuple[int, str, str]]:
    """Collective, after a failed load only: the (iteration, rank file, node) copies of the chosen snapshot that fail their
    checksums, each node's leader checking every file its memory holds of it (``verify_checkpoint``)."""
    def local() -> DamagedCopies:
        path = node_dir.snapshot_dir(tier.mem, choice.iteration)
        if not tier.leader or not os.path.isdir(path):
            return DamagedCopies(tier.node, ())
        held = {f for f in _metadata(choice).files or {} if os.path.isfile(os.path.join(path, f))}
        return DamagedCopies(tier.node, tuple(sorted(f for f in verify_checkpoint(path, workers=1).damaged_files()
                                                     if f in held)))

    got = gather_records(f"--tenplex-memory {tier.mem}: checking this node's copies of the snapshot", local,
                         DamagedCopies)
    return [(choice.iteration, f, g.node) for g in got for f in g.files]


def discard_after(tier: MemoryTier, start: int | None) -> list[str]:
    """Collective: retire every node's snapshots newer than ``start``, the iteration the job (re)started from
    (every one for None: it started afresh), a timeline it left; returns this node's."""
    return run_phase("discarding the snapshots newer than the restart point",
                     lambda: node_dir.discard_newer(tier.mem, start, tier.dispose, tier.fence) if tier.leader else [])


class MemorySource(SourceFiles):
    """A snapshot's chunks: the rank files this node holds, memory-mapped; the rank files no live node holds, from
    the durable checkpoint of the same iteration; the others, as received from peers."""

    def __init__(self, tier: MemoryTier, choice: Choice, verify: bool):
        path = node_dir.snapshot_dir(tier.mem, choice.iteration)
        meta = _metadata(choice)
        ptc = meta.require_ptc()
        local = [f for f, nodes in choice.holders.items() if tier.node in nodes]
        durable = list(choice.durable)
        sizes = meta.files or {}
        missing = sorted(f for f in [*local, *durable] if f not in sizes)
        if missing:
            raise CheckpointFileError(f"{meta.path}: files: no size recorded for {', '.join(missing)}")
        super().__init__(path, {k: m.dtype for k, m in ptc.tensors.items()},
                         {f: sizes[f] for f in [*local, *durable]}, verify, require_checksums=True, names=local)
        if durable:
            assert choice.durable_dir is not None
            self.elsewhere = confine_all(choice.durable_dir, durable)
            self.paths.update(self.elsewhere)
        self.ptc = ptc
        self.local = set(local)
        self.durable = set(durable)
        self.bytes_from_durable = 0  # read in durable files by this rank (the parallel reader's runs, or checked blocks)
        self.received: dict[tuple[str, str], torch.Tensor] = {}  # (file, tensor) -> its bytes (the parts received)
        self.local_sizes = rank_local.entry_sizes(meta.rank_local)  # (file, rank-local entry) -> its byte count

    def _receive_into(self, key: tuple[str, str], nbytes: int) -> torch.Tensor:
        """The buffer for ``key``'s bytes received from peers (``nbytes``), made on first use."""
        if key not in self.received:
            self.received[key] = torch.empty(nbytes, dtype=torch.uint8)
        return self.received[key]

    def buffer(self, sc: StoredChunk) -> torch.Tensor:
        return self._receive_into((sc.location.file, sc.location.name),
                                  sc.chunk.numel * dtype_size(self.dtypes[sc.chunk.key]))

    def local_buffer(self, key: PeerKey) -> torch.Tensor:
        """Where a rank-local entry received from a peer goes (whole)."""
        return self._receive_into((key.file, key.name), self.local_sizes[(key.file, key.name)])

    def entry(self, file: str, name: str, nbytes: int) -> torch.Tensor:
        if self.stored(file):
            return super().entry(file, name, nbytes)
        got = self.received.get((file, name))
        if got is None or got.numel() != nbytes:
            raise CheckpointFileError(f"{self.ckpt_dir}/{file}: rank-local entry {name!r} was not received from the "
                                      "nodes holding the file")
        return got.clone()

    def stored(self, file: str) -> bool:
        """Whether this rank reads ``file`` from storage itself (its node's memory, or the durable checkpoint)
        rather than receiving it from a peer."""
        return file in self.local or file in self.durable

    def flat(self, sc: StoredChunk) -> torch.Tensor:
        if not self.stored(sc.location.file):
            return self.buffer(sc).view(TORCH_DTYPES[self.dtypes[sc.chunk.key]])
        if sc.location.file in self.local and sc.location.file not in self.readers:
            log_open(os.path.join(self.ckpt_dir, sc.location.file))
        return super().flat(sc)

    def extent(self, sc: StoredChunk) -> Extent | None:
        if not self.stored(sc.location.file):  # received from a peer: in this process's memory already
            return None
        if sc.location.file in self.local and sc.location.file not in self.headers:
            log_open(os.path.join(self.ckpt_dir, sc.location.file))
        return super().extent(sc)

    def read_done(self, plan: ReadPlan) -> None:
        super().read_done(plan)  # every byte this rank read of a durable file (its blocks checked here or by a peer)
        durable = {e.path for e in plan.extents if e.key[0] in self.durable}
        self.bytes_from_durable += sum(run.nbytes for run in plan.runs if run.path in durable)

    def queue(self, sc: StoredChunk, flat: torch.Tensor, piece: Any, todo: list, source: int = -1) -> None:
        # received bytes are this rank's own: their blocks are not shared with other ranks of the node
        n = len(todo)
        super().queue(sc, flat, piece, todo, source if self.stored(sc.location.file) else -1)
        if sc.location.file in self.durable:
            self.bytes_from_durable += sum(b.data.numel() for b in todo[n:])


def _key(sc: StoredChunk) -> PeerKey:
    return PeerKey(sc.location.file, sc.location.name)


def held_everywhere(tier: MemoryTier, choice: Choice) -> bool:
    """Whether every live node holds every rank file of the snapshot (the common case with every node alive and
    K at least the node count): then no rank receives anything, known alike on every rank without a collective."""
    return all(set(tier.nodes) <= set(nodes) for nodes in choice.holders.values())


def fetch_from_peers(tier: MemoryTier, choice: Choice, with_rank_local: bool = False) -> Any:
    """The load's ``fetch`` step: receive the whole checksum blocks of remote chunks that this rank's pieces read
    and (``with_rank_local``: the snapshot's layout is the job's) this rank's own rank-local entries, whole."""
    stats = {"sent": 0, "received": 0}

    def fetch(plan: Any, sources: tuple[StoredChunk, ...], files: MemorySource) -> None:
        def requests() -> RankRequests:
            wanted: dict[int, list[tuple[int, int]]] = {}
            for p in plan.pieces:
                sc = sources[p.source]
                if files.stored(sc.location.file):
                    continue
                size = sc.chunk.numel * dtype_size(files.dtypes[sc.chunk.key])
                bb = sc.location.block_bytes or size
                blocks = touched_blocks(*piece_runs(p), dtype_size(files.dtypes[sc.chunk.key]), bb)
                wanted.setdefault(p.source, []).extend((b * bb, min((b + 1) * bb, size)) for b in blocks)
            own = rank_local.stored_entries(_metadata(choice).rank_local, rank()) if with_rank_local else []
            return RankRequests((*(PeerRequest(_key(sources[s]), lo, hi) for s, rs in wanted.items()
                                   for lo, hi in merge_ranges(rs)),
                                 *(PeerRequest(PeerKey(f, n), 0, nbytes) for f, n, nbytes in own
                                   if not files.stored(f))))

        asked = [g.requests for g in gather_records("load from memory: gathering what each rank receives from peers",
                                                    requests, RankRequests)]
        by_key = {_key(sc): sc for sc in sources}

        def plan_transfers() -> list[Any]:
            senders: dict[PeerKey, list[int]] = {}
            for reqs in asked:
                for q in reqs:
                    if q.key not in senders:
                        holders = choice.holders.get(q.key.file, ())
                        senders[q.key] = sorted(x for n in holders for x in tier.nodes.get(n, []))
            return schedule({r: list(reqs) for r, reqs in enumerate(asked) if reqs}, senders)

        transfers = run_phase("load from memory: scheduling peer transfers", plan_transfers)
        me = rank()
        readers: dict[PeerKey, torch.Tensor] = {}

        def target(k: PeerKey) -> torch.Tensor:
            return files.local_buffer(k) if (k.file, k.name) in files.local_sizes else files.buffer(by_key[k])

        def open_sends() -> None:
            for t in transfers:
                if t.sender == me and t.key not in readers:
                    nbytes = files.local_sizes.get((t.key.file, t.key.name))
                    if nbytes is not None:  # a rank-local entry
                        readers[t.key] = files.entry(t.key.file, t.key.name, nbytes)
                        continue
                    sc = by_key.get(t.key)
                    if sc is None:  # another rank's source: find its chunk in the full PTC
                        sc = next(c for c in files.ptc.chunks if _key(c) == t.key)
                    readers[t.key] = files.flat(sc).view(torch.uint8)
            for t in transfers:
                if t.receiver == me:
                    target(t.key)

        run_phase("load from memory: opening what this rank sends", open_sends)
        sent, received = exchange(transfers, me, lambda k: readers[k], target, tier.group)
        stats["sent"] += sent
        stats["received"] += received

    fetch.stats = stats  # type: ignore[attr-defined]
    return fetch


@dataclass(frozen=True)
class MemoryLoadResult:
    """A load from host memory: the engine's result plus where the bytes came from on this rank."""

    result: LoadResult
    node: str
    bytes_received: int  # from other nodes' memory over torch.distributed
    bytes_sent: int
    bytes_from_durable: int  # of the rank files no live node holds (none when the snapshot is whole in memory)


def load_snapshot(adapter: Adapter, tier: MemoryTier, choice: Choice, *, verify: bool = True) -> MemoryLoadResult:
    """Collective: load the chosen snapshot into the adapter, re-sharded to its layout."""
    label = f"memory:{tier.mem}/{directory.iter_dir_name(choice.iteration)}"

    opened: list[MemorySource] = []

    def opener() -> Opened:
        src = MemorySource(tier, choice, verify)
        opened.append(src)
        return Opened(label, _metadata(choice), src.ptc, src)

    same_layout = getattr(adapter, "prepare_rank_local", None) is not None \
        and _metadata(choice).layout == adapter.layout().to_json()  # rank-local state can apply: fetch it too
    fetch = None if held_everywhere(tier, choice) else fetch_from_peers(tier, choice, same_layout)
    res = load(adapter, label, None, strict=True, verify=verify, opener=opener, host=f"memory-node:{tier.node}",
               fetch=fetch)
    got = fetch.stats if fetch is not None else {"received": 0, "sent": 0}
    return MemoryLoadResult(res, tier.node, got["received"], got["sent"], opened[-1].bytes_from_durable)
