"""Whether boxes are pairwise disjoint, by a sweep instead of comparing every pair. Pure Python.

A checkpoint's chunks of one tensor must not overlap; a metadata file of N chunks must not cost N² to check
(16,000 staggered chunks once took minutes and gigabytes). The boxes are swept along the dimension where their
extents differ most, the ones the sweep line crosses kept sorted along a second dimension: O(N log N) for tensors
of one or two dimensions; with more, the boxes that overlap in both swept dimensions are compared in the others.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape)


def _meet(a: Box, b: Box, dims: Sequence[int]) -> bool:
    return all(max(a[0][d], b[0][d]) < min(a[0][d] + a[1][d], b[0][d] + b[1][d]) for d in dims)


def first_overlap(boxes: Sequence[Box]) -> tuple[int, int] | None:
    """Indices ``(i, j)``, ``i < j``, of two boxes that share an element; None when no two do. Empty boxes share
    nothing; boxes of no dimension (a scalar) all share their one element."""
    live = [i for i, (_, shape) in enumerate(boxes) if all(s > 0 for s in shape)]
    if len(live) < 2:
        return None
    ndim = len(boxes[live[0]][0])
    if ndim == 0:
        return live[0], live[1]
    if ndim == 1:
        best = -1  # the box reaching furthest among those that start earlier
        for i in sorted(live, key=lambda i: boxes[i][0][0]):
            if best >= 0 and boxes[i][0][0] < boxes[best][0][0] + boxes[best][1][0]:
                return min(best, i), max(best, i)
            if best < 0 or boxes[i][0][0] + boxes[i][1][0] > boxes[best][0][0] + boxes[best][1][0]:
                best = i
        return None
    extents = sorted(range(ndim), key=lambda d: -len({(boxes[i][0][d], boxes[i][1][d]) for i in live}))
    p, s, rest = extents[0], extents[1], extents[2:]
    active: list[tuple[int, int, int]] = []  # (start along s, stop along s, index), sorted
    ending: list[tuple[int, int]] = []  # (stop along p, index): a heap of the boxes in ``active``
    for i in sorted(live, key=lambda i: boxes[i][0][p]):
        off, shape = boxes[i]
        while ending and ending[0][0] <= off[p]:  # boxes the sweep line has passed
            _, j = heapq.heappop(ending)
            del active[bisect.bisect_left(active, (boxes[j][0][s], boxes[j][0][s] + boxes[j][1][s], j))]
        lo, hi = off[s], off[s] + shape[s]
        k = bisect.bisect_left(active, (lo, -1, -1))
        if not rest:  # the active boxes are disjoint along s: only the neighbours can meet this one
            for a, b, j in active[max(k - 1, 0):k + 1]:
                if a < hi and b > lo:
                    return min(i, j), max(i, j)
        else:
            for _, b, j in active[:bisect.bisect_left(active, (hi, -1, -1))]:
                if b > lo and _meet(boxes[i], boxes[j], rest):
                    return min(i, j), max(i, j)
        bisect.insort(active, (lo, hi, i))
        heapq.heappush(ending, (off[p] + shape[p], i))
    return None
