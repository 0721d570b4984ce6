"""One process's view of the host-memory tier: its settings, its node among the job's, the helper process of its
node, and what the job carries from snapshot to snapshot (what is being persisted or replicated, the last
snapshot). :func:`open_tier` makes it, collectively; :func:`start_helpers` (re)starts the nodes' helpers."""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass, field
from typing import Any

from tenplex_megatron import log as tlog
from tenplex_megatron.engine.save_records import RankFile
from tenplex_megatron.execute.collective import broadcast_json, gather_records, rank, run_phase
from tenplex_megatron.memory import mounts, node_dir
from tenplex_megatron.memory.helper import Helper
from tenplex_megatron.memory.peers import cpu_group
from tenplex_megatron.memory.protocol import Remove
from tenplex_megatron.memory.settings import MemorySettings
from tenplex_megatron.storage.lease import LeaseSet

log = tlog.get("memory")


@dataclass
class MemoryTier:
    """The runtime state of one process's tier (its configuration is the frozen ``settings``)."""

    settings: MemorySettings
    node: str = ""
    nodes: dict[str, list[int]] = field(default_factory=dict)  # node id -> its ranks (ascending)
    snapshots: int = 0
    last_snapshot_at: float | None = None  # time.perf_counter() at the start of the last snapshot
    pending: int | None = None  # iteration being persisted in the background
    pending_meta: dict[str, Any] | None = None  # rank 0: its metadata, for the durable commit
    helper: Helper | None = None
    helpers_started: bool = False  # on every node (the same on every rank): at open_tier or the first need
    generation: int = 0  # of the helpers' process group (a new one after a helper died)
    replicating: int | None = None  # iteration whose replicas the helpers are copying
    replicated: int | None = None  # newest iteration with every replica in place (kept until a newer one is)
    last: tuple[int, dict[str, Any], list[str]] | None = None  # the last snapshot: iteration, metadata, own files
    last_files: tuple[RankFile, ...] = ()  # every rank's file of it
    disposing: set[str] = field(default_factory=set)  # retired snapshots this node's helper is deleting
    save_lease: int | None = None  # rank 0's lease generation on the durable directory (0: none), once known
    leases: LeaseSet | None = None  # the job's leases (its Checkpointer's): the fence of every destructive step
    group: object = None  # the gloo group of host-memory traffic between ranks (peers.cpu_group), made at open

    def fence(self, directory: str) -> None:
        """Before a destructive step in ``directory`` (the memory directory, ``--save``): stop when a newer
        generation of its lease owns it (no lease held here: no check)."""
        if self.leases is not None:
            self.leases.fence(directory)

    @property
    def mem(self) -> str:
        """This node's memory directory."""
        return self.settings.mem

    @property
    def replicates(self) -> bool:
        """Whether snapshots are copied to other nodes' memory: more than one node, and more than one copy asked."""
        return len(self.nodes) > 1 and self.settings.replicas > 1

    @property
    def leader(self) -> bool:
        """The node's first rank: makes its directories, commits its snapshots, runs its helper process."""
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

    def targets(self, node: str) -> list[str]:
        """The nodes that hold replicas of ``node``'s files: the next ``replicas - 1`` in the ring."""
        order = self.order()
        i = order.index(node)
        k = min(self.settings.replicas, len(order))
        return [order[(i + j) % len(order)] for j in range(1, k)]

    def protected(self) -> tuple[int, ...]:
        """Snapshots retention keeps besides the newest: being persisted, being replicated, the newest replicated."""
        replicas = self.replicated if self.replicates else None
        return tuple(x for x in (self.pending, self.replicating, replicas) if x is not None)

    def dispose(self, path: str) -> None:
        """Delete a retired snapshot (renamed ``.tenplex-old``) off the training path: by this node's helper
        process when it runs (freeing a GB of tmpfs pages takes a while), else here."""
        if self.leader:  # its rank files (own and replicas) become the spares the next snapshot writes over
            node_dir.keep_spares(path, self.mem, self.held_ranks())
        if self.helper is not None and self.helper.alive:
            self.disposing.add(path)
            self.helper.request(Remove((path,)))
        else:
            shutil.rmtree(path, ignore_errors=True)


@dataclass(frozen=True)
class NodeIdentity:
    """One rank's node, as its memory directory names it (``node_dir.node_id``): gathered to group the ranks."""

    node: str

    def to_json(self) -> str:
        return self.node

    @classmethod
    def from_json(cls, d: str) -> NodeIdentity:
        return cls(str(d))


def open_tier(settings: MemorySettings, *, start_helpers_now: bool = False,
              leases: LeaseSet | None = None) -> MemoryTier:
    """Collective: this process's memory tier (node id read or made, nodes found by gathering every rank's id).

    ``start_helpers_now``: start the nodes' helper processes now rather than at the first snapshot, so that their
    start (an interpreter, torch, their group's rendezvous: seconds) overlaps the model's build and load instead
    of delaying the first snapshot's replication (until it is done, newer snapshots stay on their own node).
    ``leases``: the job's, whose fence every destructive step of the tier passes.
    """
    tier = MemoryTier(settings, leases=leases)

    def local() -> NodeIdentity:
        node = node_dir.node_id(tier.mem)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            mounts.warn_if_not_memory(tier.mem)
        return NodeIdentity(node)

    ids = [g.node for g in gather_records(f"--tenplex-memory {settings.mem}: reading the node id", local,
                                          NodeIdentity)]
    tier.node = ids[rank()]
    for r, n in enumerate(ids):
        tier.nodes.setdefault(n, []).append(r)
    tier.group = cpu_group()  # created collectively now, used by peer loads
    if settings.replicas > len(tier.nodes) and rank() == 0:
        log.warning("--tenplex-replicas %d: only %d live node(s); each snapshot keeps one copy per node",
                    settings.replicas, len(tier.nodes))
    if start_helpers_now:
        start_helpers(tier)
    return tier


def start_helpers(tier: MemoryTier) -> None:
    """Collective: every node's helper process, in a gloo group of their own when there are replicas to copy."""
    tier.generation += 1
    tier.helpers_started = True
    replicate = tier.replicates
    if not (replicate or tier.settings.save_dir):
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
        tier.helper = Helper(group)

    run_phase(f"--tenplex-memory {tier.mem}: starting the helper processes", start)


def close(tier: MemoryTier) -> None:
    """Stop this node's helper (after ``background.drain``)."""
    if tier.helper is not None:
        tier.helper.close()
        tier.helper = None
