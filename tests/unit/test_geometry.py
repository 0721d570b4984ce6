"""chunk_rects (a flat range of a box as contiguous rectangles) and intersect, checked by brute force."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tenplex_megatron.plan.geometry import Rect, chunk_rects, intersect


def _linear(local: tuple[int, ...], shape: tuple[int, ...]) -> int:
    """Row-major linear index of a local coordinate in a box of ``shape``."""
    idx = 0
    for x, s in zip(local, shape):
        idx = idx * s + x
    return idx


def check_rects(offsets: tuple[int, ...], shape: tuple[int, ...], flat: tuple[int, int] | None) -> list[Rect]:
    """Assert every property of chunk_rects for one chunk by enumerating its elements."""
    a, b = flat if flat is not None else (0, math.prod(shape))
    rects = chunk_rects(offsets, shape, flat)
    ndim = len(shape)
    assert len(rects) <= max(2 * ndim - 1, 1), rects
    covered: list[int] = []
    for r in rects:
        assert len(r.offsets) == ndim and len(r.shape) == ndim
        assert all(s > 0 for s in r.shape), r  # no empty rectangles
        assert r.numel == math.prod(r.shape)
        assert r.end == tuple(o + s for o, s in zip(r.offsets, r.shape))
        # inside the box (global coordinates)
        assert all(o <= ro and ro + rs <= o + s for o, s, ro, rs in zip(offsets, shape, r.offsets, r.shape)), r
        # contiguous in the chunk's storage: the rect's elements, in row-major order, are
        # exactly [start, start + numel) of the flat range (relative to its first element)
        lin = [
            _linear(tuple(ro + x - o for ro, x, o in zip(r.offsets, local, offsets)), shape) - a
            for local in itertools.product(*(range(s) for s in r.shape))
        ]
        assert lin == list(range(r.start, r.start + r.numel)), (r, lin)
        covered.extend(lin)
    # disjoint, and the union is exactly the flat range
    assert sorted(covered) == list(range(b - a))
    assert len(covered) == len(set(covered))
    # listed in storage order
    assert [r.start for r in rects] == sorted(r.start for r in rects)
    return rects


def _random_case(rng: random.Random) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, int] | None]:
    ndim = rng.randint(1, 4)
    shape = tuple(rng.randint(1, 5) for _ in range(ndim))
    offsets = tuple(rng.randint(0, 3) for _ in range(ndim))
    n = math.prod(shape)
    if rng.random() < 0.15:
        return offsets, shape, None
    a = rng.randint(0, n)
    b = rng.randint(a, n)
    return offsets, shape, (a, b)


def test_chunk_rects_random_brute_force() -> None:
    rng = random.Random(1234)
    counts = []
    for _ in range(1500):
        offsets, shape, flat = _random_case(rng)
        counts.append(len(check_rects(offsets, shape, flat)))
    assert max(counts) >= 5  # the generator does reach multi-rectangle decompositions


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 4), (2, 2, 3, 2)])
def test_chunk_rects_every_flat_range_of_a_box(shape: tuple[int, ...]) -> None:
    n = math.prod(shape)
    offsets = tuple(range(1, len(shape) + 1))
    for a in range(n + 1):
        for b in range(a, n + 1):
            check_rects(offsets, shape, (a, b))


@pytest.mark.parametrize(
    "offsets,shape,flat,expected",
    [
        # whole box: one rectangle
        ((0, 0), (3, 4), None, [Rect((0, 0), (3, 4), 0)]),
        ((2, 5), (3, 4), (0, 12), [Rect((2, 5), (3, 4), 0)]),
        # whole rows only
        ((0, 0), (3, 4), (4, 12), [Rect((1, 0), (2, 4), 0)]),
        # head partial row, whole rows, tail partial row
        ((0, 0), (3, 4), (2, 11), [Rect((0, 2), (1, 2), 0), Rect((1, 0), (1, 4), 2), Rect((2, 0), (1, 3), 6)]),
        # inside one row
        ((10, 0), (3, 4), (5, 7), [Rect((11, 1), (1, 2), 0)]),
        # empty range
        ((0, 0), (3, 4), (5, 5), []),
        # 1-D: always one rectangle
        ((3,), (10,), (2, 9), [Rect((5,), (7,), 0)]),
    ],
)
def test_chunk_rects_table(offsets, shape, flat, expected) -> None:
    assert chunk_rects(offsets, shape, flat) == expected
    check_rects(offsets, shape, flat)


def test_chunk_rects_worst_case_count() -> None:
    # a flat range starting and ending mid-way in every dimension needs 2*ndim - 1 rectangles
    shape = (3, 3, 3)
    a = _linear((0, 1, 1), shape)
    b = _linear((2, 1, 1), shape) + 1
    assert len(check_rects((0, 0, 0), shape, (a, b))) == 2 * 3 - 1


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=4).map(tuple),
)
def test_chunk_rects_hypothesis(data, shape: tuple[int, ...]) -> None:
    n = math.prod(shape)
    offsets = tuple(data.draw(st.lists(st.integers(0, 4), min_size=len(shape), max_size=len(shape))))
    a = data.draw(st.integers(0, n))
    b = data.draw(st.integers(a, n))
    check_rects(offsets, shape, (a, b))


@pytest.mark.parametrize(
    "a_off,a_shp,b_off,b_shp,expected",
    [
        ((0, 0), (4, 4), (2, 2), (4, 4), ((2, 2), (2, 2))),
        ((0, 0), (4, 4), (1, 1), (2, 2), ((1, 1), (2, 2))),  # containment
        ((0, 0), (4, 4), (0, 0), (4, 4), ((0, 0), (4, 4))),  # identical
        ((0, 0), (4, 4), (4, 0), (2, 4), None),  # touching edges do not overlap
        ((0, 0), (4, 4), (0, 4), (4, 1), None),
        ((0, 0), (4, 4), (5, 5), (1, 1), None),
        ((0, 0), (4, 4), (2, 9), (1, 1), None),  # overlaps in dim 0 only
        ((3,), (5,), (0,), (4,), ((3,), (1,))),
        ((0, 0, 0), (2, 3, 4), (1, 1, 1), (5, 5, 5), ((1, 1, 1), (1, 2, 3))),
        ((), (), (), (), ((), ())),  # scalars always overlap
    ],
)
def test_intersect_table(a_off, a_shp, b_off, b_shp, expected) -> None:
    assert intersect(a_off, a_shp, b_off, b_shp) == expected
    assert intersect(b_off, b_shp, a_off, a_shp) == expected  # symmetric


def test_intersect_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(400):
        ndim = rng.randint(1, 3)
        boxes = [
            (tuple(rng.randint(0, 4) for _ in range(ndim)), tuple(rng.randint(1, 4) for _ in range(ndim)))
            for _ in range(2)
        ]

        def cells(off, shp):
            return set(itertools.product(*(range(o, o + s) for o, s in zip(off, shp))))

        common = cells(*boxes[0]) & cells(*boxes[1])
        got = intersect(*boxes[0], *boxes[1])
        if not common:
            assert got is None
        else:
            assert got is not None and cells(*got) == common
