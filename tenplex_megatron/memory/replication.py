"""Copying a snapshot into other nodes' memory: which node sends which rank file to which, at what rate.

Node ``i``'s files go to the next ``replicas - 1`` nodes in the ring of nodes (ordered by first rank); each
node's helper process sends and receives them in the background (``memory/helper.py``), paced by
``--tenplex-replication-rate``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from tenplex_megatron import log as tlog
from tenplex_megatron.engine.save_records import RankFile
from tenplex_megatron.execute.collective import rank, run_phase
from tenplex_megatron.memory import node_dir
from tenplex_megatron.memory.protocol import Receive, Replicate, Send
from tenplex_megatron.memory.state import MemoryTier, start_helpers

log = tlog.get("memory")


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


def node_request(tier: MemoryTier, infos: Sequence[RankFile], it: int) -> tuple[tuple[Send, ...], tuple[Receive, ...]]:
    """What this node's helper sends and receives of snapshot ``it`` (``infos``: every rank's file and size)."""
    order = tier.order()
    node_of = tier.node_of()
    path = node_dir.snapshot_dir(tier.mem, it)
    sends, recvs = [], []
    for r, i in enumerate(infos):
        if not i.file:
            continue
        src = node_of[r]
        for t in tier.targets(src):
            if src == tier.node:
                sends.append(Send(os.path.join(path, i.file), order.index(t), r))
            elif t == tier.node:
                recvs.append(Receive(order.index(src), i.size, os.path.join(path, i.file), r,
                                     node_dir.spare_path(tier.mem, r)))
    return tuple(sends), tuple(recvs)


def replicate(tier: MemoryTier, infos: Sequence[RankFile], it: int, what: str, interval: float | None = None,
              *, unpaced: bool = False) -> int:
    """Collective: have the helpers copy this snapshot's files into the memory of the nodes that keep replicas
    of them (in the background), at :func:`replication_rate` (``unpaced``: at the cap alone, the job is
    stopping); returns the bytes this rank's node will send for this rank's file."""
    if not tier.replicates:
        tier.replicated = it
        return 0
    if tier.replicating is not None:  # the helpers are still copying an older snapshot: this one stays local
        if rank() == 0:
            log.warning("%s: replication of iteration %s is still under way: iteration %s is kept on its own node "
                        "only (iteration %s is the newest replicated snapshot)", what, tier.replicating, it,
                        tier.replicated)
        return 0
    if not tier.helpers_started:
        start_helpers(tier)
    tier.replicating = it
    sends, recvs = node_request(tier, infos, it)
    node_bytes = sum(infos[s.tag].size for s in sends)
    rate = replication_rate(tier.settings.rate_cap, 0.0 if unpaced else tier.settings.pace, interval, node_bytes)

    def start() -> None:
        if tier.leader:
            assert tier.helper is not None
            tier.helper.request(Replicate(it, sends, recvs, rate))

    run_phase(f"{what}: starting the replication", start)
    mine = infos[rank()]
    return mine.size * len(tier.targets(tier.node)) if mine.file else 0
