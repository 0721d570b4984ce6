"""Point-to-point transfer of byte ranges between ranks over torch.distributed (gloo, CPU tensors).

Carries out a :mod:`tenplex_megatron.plan.peer_schedule` schedule: every rank
posts its sends and receives at once (one tag per transfer, so any number of
transfers between a pair match) and waits for all of them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from tenplex_megatron.plan.peer_schedule import PeerKey, Transfer


def cpu_group() -> object:
    """Collective: a gloo process group for host-memory traffic: the world's own where it is gloo, else a new gloo
    group of every rank. The memory tier makes it once when it opens and keeps it (``MemoryTier.group``), so it
    lives as long as the tier and the world: a tier opened in the next world makes its own."""
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return dist.new_group(backend="gloo")


def exchange(transfers: list[Transfer], me: int, source: Callable[[PeerKey], torch.Tensor],
             target: Callable[[PeerKey], torch.Tensor], group: object) -> tuple[int, int]:
    """Collective over the ranks named in ``transfers``: send what ``me`` sends (``source(key)``: a flat uint8
    tensor of the item) and receive into ``target(key)``'s byte ranges; returns (bytes sent, bytes received)."""
    ops = []
    sent = received = 0
    for tag, t in enumerate(transfers):
        if t.sender == me:
            ops.append(dist.P2POp(dist.isend, source(t.key)[t.lo : t.hi].contiguous(), t.receiver, group, tag))
            sent += t.nbytes
        elif t.receiver == me:
            ops.append(dist.P2POp(dist.irecv, target(t.key)[t.lo : t.hi], t.sender, group, tag))
            received += t.nbytes
    if ops:
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    return sent, received
