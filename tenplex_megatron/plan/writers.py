"""Who writes which chunk at save: every distinct chunk once, spread over the ranks holding it. Pure.

DP (and TP) replicas hold identical chunks; writing each once, by the least
loaded of its holders, keeps any rank from writing the whole replicated state
and needs no gather onto DP rank 0. A chunk with no main replica (megatron's
``replica_id`` all zeros), e.g. the tied output embedding on the last pipeline
stage, is a copy of another tensor's chunk and is not written at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tenplex_megatron.plan.ptc import Chunk


@dataclass(frozen=True)
class Holding:
    """Rank ``rank`` holds ``chunk`` (``main``: it is megatron's main replica), ``nbytes`` big."""

    rank: int
    chunk: Chunk
    main: bool
    nbytes: int


def assign_writers(holdings: list[Holding]) -> dict[Chunk, int]:
    """Map each chunk that has a main replica to the rank that writes it, balancing bytes."""
    holders: dict[Chunk, list] = {}
    for h in holdings:
        got = holders.get(h.chunk)
        if got is None:
            holders[h.chunk] = [[h.rank], h.main, h.nbytes]
        else:
            got[0].append(h.rank)
            got[1] = got[1] or h.main
    return dict(assign_grouped([(c, ranks, main, nbytes) for c, (ranks, main, nbytes) in holders.items()]))


def assign_grouped(groups: Sequence[tuple[Chunk, Sequence[int], bool, int]]) -> list[tuple[Chunk, int]]:
    """:func:`assign_writers` on chunks already grouped: (chunk, every rank holding it, any main, bytes).

    Largest chunks first (ties by key, offsets, flat range, then order in ``groups``), each
    to its holder that has written the fewest bytes so far (ties: the lowest rank).
    Returns (chunk, writer) in that order.
    """
    order = sorted((-nbytes, c.key, c.offsets, c.flat_range, n)
                   for n, (c, _, main, nbytes) in enumerate(groups) if main)
    written: dict[int, int] = {}
    out: list[tuple[Chunk, int]] = []
    for neg, _, _, _, n in order:
        chunk, ranks = groups[n][0], groups[n][1]
        if len(ranks) == 1:
            rank = ranks[0]
        else:
            rank, least = -1, -1
            for r in ranks:
                w = written.get(r, 0)
                if least < 0 or w < least or w == least and r < rank:
                    rank, least = r, w
        written[rank] = written.get(rank, 0) - neg
        out.append((chunk, rank))
    return out
