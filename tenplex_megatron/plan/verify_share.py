"""Which rank of a host checks which checksum blocks at load, so that each block is checked once per host. Pure Python.

A rank that reads part of a stored block must still check the whole block
(its CRC covers all of it): when TP splits rows, each TP rank would read and
check its peers' halves too (1.3x the bytes it needs at GPT-3 125M, DP2->TP2).
Ranks on one host share a page cache, so one check of a block there covers
every rank of that host that reads it: blocks are split among the ranks that
need them, in contiguous runs, and each rank checks only its part. The split
is a pure function of what every rank needs, so each rank computes it alone.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator

Interval = tuple[int, int, int]  # (source chunk index, first block, last block), inclusive


def to_intervals(blocks: Iterable[tuple[int, int]]) -> list[Interval]:
    """(source, block) pairs as sorted, merged intervals of consecutive blocks of one source."""
    return merge((s, b, b) for s, b in blocks)


def blocks(intervals: Iterable[Interval]) -> Iterator[tuple[int, int]]:
    """Every (source, block) pair the intervals cover (the inverse of :func:`to_intervals`)."""
    for s, lo, hi in intervals:
        for b in range(lo, hi + 1):
            yield s, b


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted intervals with overlapping or adjacent ones of the same source merged."""
    out: list[list[int]] = []
    for s, lo, hi in sorted(intervals):
        if out and out[-1][0] == s and lo <= out[-1][2] + 1:
            out[-1][2] = max(out[-1][2], hi)
        else:
            out.append([s, lo, hi])
    return [(s, lo, hi) for s, lo, hi in out]


def share_blocks(needs: dict[int, list[Interval]], hosts: dict[int, str], rank: int) -> list[Interval]:
    """The blocks ``rank`` checks: of the blocks it needs, those assigned to it among the ranks of its host.

    Every block needed on a host goes to exactly one rank of that host that
    needs it. Where several need a stretch of blocks, the stretch is cut into
    as many contiguous parts as there are such ranks, one each (the rotation
    starts at a different rank per stretch, so the extra block of uneven
    cuts does not always land on the same rank).
    """
    host = hosts[rank]
    by_source: dict[int, list[tuple[int, int, int]]] = defaultdict(list)  # source -> (first, last, rank)
    for r, intervals in needs.items():
        if hosts.get(r) != host:
            continue
        for s, lo, hi in merge(intervals):
            if hi < lo:
                raise ValueError(f"rank {r}: empty block interval {(s, lo, hi)}")
            by_source[s].append((lo, hi, r))
    mine: list[Interval] = []
    for s, lo, hi in merge(needs.get(rank, [])):
        spans = by_source[s]
        cuts = sorted({lo, hi + 1} | {x for a, b, _ in spans for x in (a, b + 1) if lo < x <= hi})
        for a, end in zip(cuts, cuts[1:]):  # elementary stretch [a, end): the same ranks need all of it
            holders = sorted(r for x, y, r in spans if x <= a and end - 1 <= y)
            n = len(holders)
            k = (holders.index(rank) - a) % n  # which part is this rank's
            first = a + (end - a) * k // n
            last = a + (end - a) * (k + 1) // n - 1
            if first <= last:
                mine.append((s, first, last))
    return merge(mine)
