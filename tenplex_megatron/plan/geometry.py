"""Chunk geometry: a flat range of a box as a few contiguous rectangles, and box intersection.

A flat range ``[a, b)`` of a box in row-major order is the union of at most
``2*ndim - 1`` rectangles, each contiguous in the chunk's flat storage. Every
chunk is stored flat, so a rectangle is one contiguous byte range on disk and
an intersection of two rectangles is a strided view of each. Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Rect:
    """A rectangle in global coordinates and where its first element sits in the chunk's flat storage."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    start: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> tuple[int, ...]:
        return tuple(o + s for o, s in zip(self.offsets, self.shape))


def _decompose(a: int, b: int, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Local (offsets, shape, flat start) rectangles covering flat ``[a, b)`` of a box of ``shape``."""
    if a >= b:
        return []
    if not shape:
        return [((), (), a)]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    out: list[tuple[tuple[int, ...], tuple[int, ...], int]] = []
    if a % inner:
        row = a // inner
        row_end = min(b, (row + 1) * inner)
        base = row * inner
        for off, shp, st in _decompose(a - base, row_end - base, shape[1:]):
            out.append(((row, *off), (1, *shp), st + base))
        a = row_end
    if a >= b:
        return out
    r0, r1 = a // inner, b // inner
    if r1 > r0:
        out.append(((r0, *([0] * (len(shape) - 1))), (r1 - r0, *shape[1:]), a))
        a = r1 * inner
    if a < b:
        row = a // inner
        for off, shp, st in _decompose(0, b - a, shape[1:]):
            out.append(((row, *off), (1, *shp), st + a))
    return out


def chunk_rects(offsets: tuple[int, ...], shape: tuple[int, ...], flat: tuple[int, int] | None) -> list[Rect]:
    """Rectangles (global coordinates) of a chunk; ``start`` is relative to the chunk's stored data."""
    a, b = flat if flat is not None else (0, math.prod(shape))
    rects = []
    for off, shp, st in _decompose(a, b, tuple(shape)):
        rects.append(Rect(tuple(o + g for o, g in zip(off, offsets)), shp, st - a))
    return rects


def intersect(
    off_a: tuple[int, ...], shp_a: tuple[int, ...], off_b: tuple[int, ...], shp_b: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The intersection box of two boxes, or None when they do not overlap."""
    lo = []
    size = []
    for oa, sa, ob, sb in zip(off_a, shp_a, off_b, shp_b):
        start = max(oa, ob)
        stop = min(oa + sa, ob + sb)
        if stop <= start:
            return None
        lo.append(start)
        size.append(stop - start)
    return tuple(lo), tuple(size)
