"""Point-to-point transfer of byte ranges between ranks over torch.distributed (gloo, CPU tensors).

Carries out a :mod:`tenplex_megatron.plan.peer_schedule` schedule: every rank
posts its sends and receives at once (one tag per transfer, so any number of
transfers between a pair match) and waits for all of them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tenplex_megatron.plan.peer_schedule import PeerKey, Transfer

#: the tag torch.distributed keeps the host-memory gloo group under, among the current world's groups
GROUP_TAG = "tenplex-memory"


def cpu_group() -> object:
    """The job's gloo process group for host-memory traffic: the world's own where it is gloo, else one gloo group
    of every rank, made collectively on first use (``open_tier`` makes it). torch.distributed keeps it with the
    world's other groups (under :data:`GROUP_TAG`), so it ends with the world (``destroy_process_group``, an
    in-process restart's abort) and the next world makes its own: nothing here to reset."""
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    ranks = list(range(dist.get_world_size()))
    group = c10d._find_pg_by_ranks_and_tag(GROUP_TAG, ranks)
    return group if group is not None else c10d._new_group_with_tag(ranks, backend="gloo", pg_tag=GROUP_TAG)


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
