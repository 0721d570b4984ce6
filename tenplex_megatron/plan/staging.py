"""Staged assembly, the index arithmetic: which pieces (split to fit) go into which staging buffer, and where.

A load through staging buffers reads each piece's elements, packed in row-major
order, into a bounded buffer, copies the buffer to the device in one transfer
and scatters every piece from it into its destination. This module decides the
packing: pieces in source order, each split along its outermost dimensions into
boxes that fit a buffer, boxes packed at aligned offsets. Pure: never imports torch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from tenplex_megatron.plan.planner import Piece

ALIGN = 64  # bytes: every box starts at a multiple of this in its buffer (any dtype's view is aligned there)


@dataclass(frozen=True)
class Slot:
    """One box of a piece in a staging buffer: ``box`` (a sub-piece of the plan's piece ``index``) at ``offset`` bytes."""

    index: int
    box: Piece
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Batch:
    """What one staging buffer holds: its slots, in order, and the bytes used (the transfer's size)."""

    slots: tuple[Slot, ...]
    nbytes: int


def split_piece(p: Piece, max_numel: int) -> list[Piece]:
    """``p`` as boxes of at most ``max_numel`` elements, in row-major order of ``p``'s elements.

    Split along the outermost dimension whose inner extent fits, one index at a
    time in the dimensions outside it; each box is a :class:`Piece` of its own.
    """
    if max_numel < 1:
        raise ValueError(f"a staging buffer must hold at least one element, got {max_numel}")
    if p.numel <= max_numel:
        return [p]
    nd = len(p.shape)
    d = next(i for i in range(nd) if math.prod(p.shape[i + 1 :]) <= max_numel)
    step = max_numel // math.prod(p.shape[d + 1 :])
    boxes = []
    for outer in itertools.product(*(range(n) for n in p.shape[:d])):
        for a in range(0, p.shape[d], step):
            b = min(step, p.shape[d] - a)
            off = (*outer, a)
            src_sel = tuple(s + o for s, o in zip(p.src_sel, off)) + p.src_sel[d + 1 :]
            dst_sel = tuple(s + o for s, o in zip(p.dst_sel, off)) + p.dst_sel[d + 1 :]
            shape = (1,) * d + (b,) + p.shape[d + 1 :]
            boxes.append(replace(p, src_sel=src_sel, dst_sel=dst_sel, shape=shape))
    return boxes


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def stage_batches(pieces: Sequence[Piece], itemsize: Callable[[Piece], int], capacity: int) -> list[Batch]:
    """Pack the pieces into batches of at most ``capacity`` bytes each, in source order (source, then offset).

    ``itemsize``: a piece's element size in bytes. A piece too large for a
    buffer is split (:func:`split_piece`); empty pieces are left out.
    """
    if capacity < ALIGN:
        raise ValueError(f"staging buffers must hold at least {ALIGN} bytes, got {capacity}")
    order = sorted(range(len(pieces)), key=lambda i: (pieces[i].source, pieces[i].src_start, i))
    batches: list[Batch] = []
    slots: list[Slot] = []
    used = 0
    for i in order:
        p = pieces[i]
        if p.numel == 0:
            continue
        size = itemsize(p)
        for box in split_piece(p, capacity // size):
            nbytes = box.numel * size
            at = _align(used)
            if slots and at + nbytes > capacity:
                batches.append(Batch(tuple(slots), used))
                slots, at = [], 0
            slots.append(Slot(i, box, at, nbytes))
            used = at + nbytes
    if slots:
        batches.append(Batch(tuple(slots), used))
    return batches
