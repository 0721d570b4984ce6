"""The re-sharding planner: a pure function from (source PTC, destination chunks) to copies.

For every destination chunk it lists the source rectangles that cover it, with
the exact strided sub-box to copy, choosing among source replicas so that
reads stay on the destination's host where possible and are spread over the
replicas by a rotation that depends only on the destination rank, so each
rank computes for itself exactly the plan a planner of the whole job would. It proves that every destination element is written exactly once
(by a copy, or by a zero fill of vocabulary padding that did not exist in the
source) and reports the bytes each destination rank reads. Never imports torch.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tenplex_megatron.errors import TenplexError
from tenplex_megatron.plan.box_overlap import first_overlap
from tenplex_megatron.plan.geometry import Rect, chunk_rects, intersect
from tenplex_megatron.plan.ptc import PTC, Chunk, Location, PTCError, StoredChunk, TensorMeta, dtype_size


class PlanError(TenplexError, ValueError):
    """The destination cannot be built from the source; the message names the tensor."""


@dataclass(frozen=True)
class Piece:
    """Copy ``shape`` elements: source rectangle sub-box -> destination rectangle sub-box."""

    source: int  # index into ReshardPlan.sources
    src_start: int
    src_rect: tuple[int, ...]
    src_sel: tuple[int, ...]
    dst: int  # index into the destination rank's chunk list
    dst_start: int
    dst_rect: tuple[int, ...]
    dst_sel: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Fill:
    """Zero-fill a destination sub-box (vocabulary padding rows the source did not have)."""

    dst: int
    dst_start: int
    dst_rect: tuple[int, ...]
    dst_sel: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class RankPlan:
    """One destination rank's part of the plan."""

    rank: int
    chunks: tuple[Chunk, ...]
    pieces: tuple[Piece, ...]
    fills: tuple[Fill, ...]
    bytes_read: int
    bytes_by_file: dict[str, int]


@dataclass(frozen=True)
class ReshardPlan:
    """The whole plan: sources (one chosen location each) and every destination rank's copies."""

    sources: tuple[StoredChunk, ...]  # the source PTC's chunks; Piece.source indexes them
    ranks: dict[int, RankPlan]
    unused_tensors: tuple[str, ...] = field(default_factory=tuple)

    @property
    def total_bytes_read(self) -> int:
        return sum(r.bytes_read for r in self.ranks.values())

    def bytes_per_rank(self) -> dict[int, int]:
        return {r: p.bytes_read for r, p in sorted(self.ranks.items())}


@dataclass
class _Source:
    chunk: Chunk
    locations: list[Location]
    slots: list[int]  # index of each location's StoredChunk in the source PTC
    _rects: list[Rect] | None = None

    @property
    def rects(self) -> list[Rect]:
        """The chunk's rectangles, worked out when first needed (a box matched whole never needs them)."""
        if self._rects is None:
            self._rects = chunk_rects(self.chunk.offsets, self.chunk.shape, self.chunk.flat)
        return self._rects


class _Index:
    """The source rectangles of one tensor, found by the destination box they meet: O(N log N) to build.

    Along dimension 0 a query is output-sensitive: the rectangles starting inside the box are one slice of those
    sorted by start, and those starting before it and reaching into it are a stabbing query of a segment tree
    (each rectangle held by O(log N) nodes). Dimension 1, where there is one, filters what dimension 0 returns.
    A grid of cells listing every rectangle that spans them grew as N squared on a valid partition (N thin rows
    beside N full-height columns); this does not.
    """

    def __init__(self, sources: list[_Source]):
        self.items: list[tuple[int, Rect]] = [(i, r) for i, s in enumerate(sources) for r in s.rects]
        self.ndim = len(self.items[0][1].offsets) if self.items else 0
        if self.ndim == 0:
            return
        self.by_start = sorted(range(len(self.items)), key=lambda n: (self.items[n][1].offsets[0], n))
        self.starts = [self.items[n][1].offsets[0] for n in self.by_start]
        self.ends = sorted(r.end[0] for _, r in self.items)
        self.bounds = sorted({b for _, r in self.items for b in (r.offsets[0], r.end[0])})
        self.size = 1 << max(len(self.bounds) - 1, 1).bit_length()
        self.nodes: dict[int, list[int]] = defaultdict(list)
        for n, (_, r) in enumerate(self.items):  # the canonical nodes of the rectangle's cells [lo, hi)
            lo = bisect.bisect_left(self.bounds, r.offsets[0]) + self.size
            hi = bisect.bisect_left(self.bounds, r.end[0]) + self.size
            while lo < hi:
                if lo & 1:
                    self.nodes[lo].append(n)
                    lo += 1
                if hi & 1:
                    hi -= 1
                    self.nodes[hi].append(n)
                lo >>= 1
                hi >>= 1

    def _reaching(self, a: int) -> list[int]:
        """The rectangles starting before ``a`` and ending after it along dimension 0 (a stabbing query)."""
        cell = bisect.bisect_right(self.bounds, a) - 1
        if cell < 0 or cell >= len(self.bounds) - 1:
            return []
        out = []
        p = cell + self.size
        while p:
            out.extend(n for n in self.nodes.get(p, ()) if self.items[n][1].offsets[0] < a)
            p >>= 1
        return out

    def query(self, off: tuple[int, ...], end: tuple[int, ...]) -> list[tuple[int, Rect]]:
        """The rectangles meeting the box ``[off, end)`` along dimensions 0 and 1, in the order of their start."""
        if self.ndim == 0:
            return list(self.items)
        inside = self.by_start[bisect.bisect_left(self.starts, off[0]): bisect.bisect_left(self.starts, end[0])]
        ids = self._reaching(off[0]) + inside
        if self.ndim >= 2:
            ids = [n for n in ids if self.items[n][1].offsets[1] < end[1] and self.items[n][1].end[1] > off[1]]
        return [self.items[n] for n in sorted(ids, key=lambda n: self._order(n, off))]

    def _order(self, n: int, off: tuple[int, ...]) -> tuple[int, int, int]:
        """Where rectangle ``n`` comes in a query from ``off``: the plans' order of pieces, kept as it always was (by
        the first elementary interval of dimension 0 it meets; in an interval crowded by over 8 rectangles, by the
        first of dimension 1 next; then by index), so that every plan is the same list as before."""
        r = self.items[n][1]
        x0 = max(r.offsets[0], off[0])
        lo = self.bounds[max(bisect.bisect_right(self.bounds, x0) - 1, 0)]
        crowded = self.ndim >= 2 and bisect.bisect_right(self.starts, lo) - bisect.bisect_right(self.ends, lo) > 8
        return x0, max(r.offsets[1], off[1]) if crowded else 0, n


def _unique_sources(chunks: list[tuple[int, StoredChunk]]) -> list[_Source]:
    by_chunk: dict[Chunk, _Source] = {}
    for slot, sc in chunks:
        src = by_chunk.get(sc.chunk)
        if src is None:
            src = by_chunk[sc.chunk] = _Source(sc.chunk, [], [])
        src.locations.append(sc.location)
        src.slots.append(slot)
    return sorted(by_chunk.values(), key=lambda s: (s.chunk.offsets, s.chunk.flat_range, s.chunk.shape))


def _boxes(sources: list[_Source]) -> dict[tuple, list[tuple[int, int, int]]]:
    """Source chunks grouped by their box: sorted (flat start, flat stop, source index) per box."""
    out: dict[tuple, list[tuple[int, int, int]]] = defaultdict(list)
    for i, s in enumerate(sources):
        a, b = s.chunk.flat_range
        out[(s.chunk.offsets, s.chunk.shape)].append((a, b, i))
    for v in out.values():
        v.sort()
    return out


def _extents_disjoint(boxes: Iterable[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """True when, along every dimension, the distinct extents of the boxes never overlap.

    Then any two distinct boxes (which differ along some dimension) are disjoint: the
    usual case of TP/PP grids, checked in O(n log n) instead of pairwise.
    """
    boxes = list(boxes)
    for d in range(len(boxes[0][0]) if boxes else 0):
        extents = sorted({(off[d], off[d] + shp[d]) for off, shp in boxes})
        if any(b[0] < a[1] for a, b in zip(extents, extents[1:])):
            return False
    return True


def _check_partition(meta: TensorMeta, sources: list[_Source], boxes: dict) -> None:
    """Source chunks of one tensor must be pairwise disjoint and cover it (so copies are exact).

    Fast path: when the distinct boxes are pairwise disjoint, disjointness reduces to
    non-overlapping flat intervals inside each box. Otherwise the chunks' rectangles are swept
    (:func:`first_overlap`): O(N log N), never every pair.
    """
    total = sum(s.chunk.numel for s in sources)

    def overlap(i: int, j: int) -> PlanError:
        a, b = sources[i].chunk, sources[j].chunk
        return PlanError(
            f"tensor {meta.key!r}: source chunks overlap ({a.offsets}/{a.shape}/{a.flat} and {b.offsets}/{b.shape}/{b.flat})"
        )

    boxes_disjoint = _extents_disjoint(boxes) or first_overlap(list(boxes)) is None
    if boxes_disjoint:
        for intervals in boxes.values():
            for (_, b0, i0), (a1, _, i1) in zip(intervals, intervals[1:]):
                if a1 < b0:
                    raise overlap(i0, i1)
    else:
        owners = [i for i, s in enumerate(sources) for _ in s.rects]
        hit = first_overlap([(r.offsets, r.shape) for s in sources for r in s.rects])
        if hit is not None:
            raise overlap(owners[hit[0]], owners[hit[1]])
    if total != meta.numel:
        raise PlanError(
            f"tensor {meta.key!r}: the checkpoint's chunks cover {total} of {meta.numel} elements "
            f"of shape {meta.global_shape} (a rank's shard is missing)"
        )


def _content_limit(src: TensorMeta, dst: TensorMeta) -> int | None:
    """Rows of dim 0 to copy when only the vocabulary padding differs; None when shapes match."""
    if src.global_shape == dst.global_shape:
        return None
    if (
        src.vocab_rows is not None
        and src.vocab_rows == dst.vocab_rows
        and len(src.global_shape) == len(dst.global_shape)
        and src.global_shape[1:] == dst.global_shape[1:]
    ):
        return src.vocab_rows
    raise PlanError(
        f"tensor {dst.key!r}: checkpoint shape {src.global_shape} does not match model shape {dst.global_shape}"
    )


@dataclass(frozen=True)
class _ChunkPlan:
    """The rank-independent plan of one destination chunk (memoised: DP replicas share it)."""

    key: str
    copies: tuple[tuple[int, Rect, Rect, tuple[int, ...], tuple[int, ...]], ...]  # (source idx, src rect, dst rect, box)
    fills: tuple[tuple[Rect, tuple[int, ...], tuple[int, ...]], ...]
    by_source: tuple[tuple[int, int], ...]  # (source idx, bytes)
    bytes: int


_INF = float("inf")


def _flat_bytes(intervals: list[tuple[int, int, int]], lo: int, hi: int, itemsize: int) -> tuple[tuple[int, int], ...]:
    """(source index, bytes) of flat ``[lo, hi)`` of a box from its sources' sorted (start, stop, index) intervals."""
    if len(intervals) == 1:  # the box is one source chunk
        a, b, i = intervals[0]
        return ((i, (min(b, hi) - max(a, lo)) * itemsize),) if a < hi and b > lo else ()
    return tuple(
        (i, (min(b, hi) - max(a, lo)) * itemsize)
        for a, b, i in intervals[max(bisect.bisect_right(intervals, (lo, _INF, 0)) - 1, 0):]
        if a < hi and b > lo
    )


class _Prepared:
    """One tensor made ready to plan: its distinct source chunks, their boxes, and a spatial index built on demand."""

    def __init__(self, srcs: list[_Source], limit: int | None, itemsize: int):
        self.srcs = srcs
        self.limit = limit  # rows of dim 0 to copy (vocabulary padding changed), None: shapes match
        self.itemsize = itemsize
        self.boxes = _boxes(srcs)
        # box -> its flat intervals when they cover it whole: a destination chunk in such a box
        # needs no geometry, only interval arithmetic
        self.whole = {box: v for box, v in self.boxes.items() if sum(b - a for a, b, _ in v) == math.prod(box[1])}
        # the rank that wrote each source chunk when it has one location, -1 when replicas give a choice
        self.writer = [s.locations[0].rank if len(s.slots) == 1 else -1 for s in srcs]
        self._index: _Index | None = None

    def index(self) -> _Index:
        if self._index is None:
            self._index = _Index(self.srcs)
        return self._index


class Planner:
    """Plans destination chunks against one source PTC; per-tensor indexes and per-chunk plans are cached."""

    def __init__(self, source: PTC, dst_tensors: dict[str, TensorMeta]):
        self.source = source
        self.dst_tensors = dst_tensors
        self._by_key: dict[str, list[tuple[int, StoredChunk]]] = defaultdict(list)
        for slot, sc in enumerate(source.chunks):
            self._by_key[sc.chunk.key].append((slot, sc))
        self._prepared: dict[str, _Prepared] = {}
        self._memo: dict[Chunk, _ChunkPlan] = {}
        self._bytes_memo: dict[Chunk, tuple[tuple[int, int], ...]] = {}
        self._valid_boxes: set[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = set()

    def check_keys(self, keys: set[str], strict: bool) -> tuple[str, ...]:
        for key in sorted(keys):
            if key not in self.dst_tensors:
                raise PlanError(f"destination chunk of tensor {key!r} has no tensor metadata")
            if key not in self.source.tensors:
                raise PlanError(f"tensor {key!r} of the model is not in the checkpoint")
        unused = tuple(sorted(set(self.source.tensors) - set(self.dst_tensors)))
        if strict and unused:
            raise PlanError(f"the checkpoint has tensors the model lacks: {', '.join(unused[:5])}")
        return unused

    def prepare(self, key: str) -> _Prepared:
        got = self._prepared.get(key)
        if got is None:
            meta = self.source.tensors[key]
            srcs = _unique_sources(self._by_key.get(key, []))
            got = _Prepared(srcs, _content_limit(meta, self.dst_tensors[key]), dtype_size(meta.dtype))
            _check_partition(meta, srcs, got.boxes)
            self._prepared[key] = got
        return got

    def _validate(self, chunk: Chunk) -> None:
        """A destination chunk must lie inside its tensor.

        Whether a box fits depends only on the tensor's shape, so each (shape, box) is
        checked once (a parameter and its optimizer states share them); a flat range every time.
        """
        meta = self.dst_tensors[chunk.key]
        box = (meta.global_shape, chunk.offsets, chunk.shape)
        flat = chunk.flat
        if box in self._valid_boxes and (flat is None or 0 <= flat[0] <= flat[1] <= chunk.box_numel):
            return
        try:
            chunk.validate(meta)
        except PTCError as e:
            raise PlanError(str(e)) from None
        self._valid_boxes.add(box)

    def chunk_plan(self, chunk: Chunk) -> _ChunkPlan:
        cp = self._memo.get(chunk)
        if cp is not None:
            return cp
        self._validate(chunk)
        prep = self.prepare(chunk.key)
        index, limit, itemsize = prep.index(), prep.limit, prep.itemsize
        copies = []
        fills = []
        by_source: dict[int, int] = defaultdict(int)
        covered = 0
        for dr in chunk_rects(chunk.offsets, chunk.shape, chunk.flat):
            d_off, d_shape = dr.offsets, dr.shape
            if limit is not None and d_off[0] + d_shape[0] > limit:
                pad_lo = max(d_off[0], limit)
                pad_shape = (d_off[0] + d_shape[0] - pad_lo, *d_shape[1:])
                fills.append((dr, (pad_lo - d_off[0], *([0] * (len(d_shape) - 1))), pad_shape))
                covered += math.prod(pad_shape)
                d_shape = (max(limit - d_off[0], 0), *d_shape[1:])
                if d_shape[0] == 0:
                    continue
            d_end = tuple(o + s for o, s in zip(d_off, d_shape))
            for s_idx, sr in index.query(d_off, d_end):
                box = intersect(d_off, d_shape, sr.offsets, sr.shape)
                if box is None:
                    continue
                n = math.prod(box[1])
                copies.append((s_idx, sr, dr, box[0], box[1]))
                by_source[s_idx] += n * itemsize
                covered += n
        if covered != chunk.numel:
            raise PlanError(
                f"tensor {chunk.key!r}: destination chunk offsets {chunk.offsets} sizes {chunk.shape} "
                f"flat {chunk.flat} is covered by {covered} source elements, expected {chunk.numel}"
            )
        cp = self._memo[chunk] = _ChunkPlan(
            chunk.key, tuple(copies), tuple(fills), tuple(sorted(by_source.items())), sum(by_source.values())
        )
        return cp

    def rank_plan(self, rank: int, chunks: tuple[Chunk, ...], host: str = "") -> RankPlan:
        pieces: list[Piece] = []
        fills: list[Fill] = []
        bytes_by_file: dict[str, int] = defaultdict(int)
        for d_idx, chunk in enumerate(chunks):
            cp = self.chunk_plan(chunk)
            prep = self.prepare(chunk.key)
            srcs, itemsize = prep.srcs, prep.itemsize
            for s_idx, sr, dr, x_off, x_shape in cp.copies:
                slot = _choose(srcs[s_idx], rank, host)
                pieces.append(
                    Piece(
                        source=slot,
                        src_start=sr.start,
                        src_rect=sr.shape,
                        src_sel=tuple(x - o for x, o in zip(x_off, sr.offsets)),
                        dst=d_idx,
                        dst_start=dr.start,
                        dst_rect=dr.shape,
                        dst_sel=tuple(x - o for x, o in zip(x_off, dr.offsets)),
                        shape=x_shape,
                    )
                )
                bytes_by_file[self.source.chunks[slot].location.file] += math.prod(x_shape) * itemsize
            for dr, sel, shape in cp.fills:
                fills.append(Fill(d_idx, dr.start, dr.shape, sel, shape))
        return RankPlan(rank, chunks, tuple(pieces), tuple(fills), sum(bytes_by_file.values()), dict(bytes_by_file))

    def chunk_bytes(self, chunk: Chunk) -> tuple[tuple[int, int], ...]:
        """(source index, bytes) read for a destination chunk; flat-interval fast path when the boxes match."""
        got = self._bytes_memo.get(chunk)
        if got is None:
            got = self._bytes_memo[chunk] = self._chunk_bytes(chunk)
        return got

    def _chunk_bytes(self, chunk: Chunk) -> tuple[tuple[int, int], ...]:
        prep = self._prepared.get(chunk.key) or self.prepare(chunk.key)
        intervals = prep.whole.get((chunk.offsets, chunk.shape)) if prep.limit is None else None
        if intervals is None:
            return self.chunk_plan(chunk).by_source
        lo, hi = chunk.flat or (0, chunk.box_numel)
        got = _flat_bytes(intervals, lo, hi, prep.itemsize)
        self._validate(chunk)
        return got

    def rank_bytes(self, rank: int, chunks: list[Chunk], host: str = "", gpus_per_node: int | None = None) -> tuple[int, int]:
        """(bytes read, bytes read from another node's rank) without building pieces: for large dry runs."""
        return self.runs_bytes([(chunks, (rank,))], {rank: host}, gpus_per_node)[rank]

    def runs_bytes(
        self,
        runs: Iterable[tuple[Sequence[Chunk], Sequence[int]]],
        hosts: dict[int, str] | None = None,
        gpus_per_node: int | None = None,
    ) -> dict[int, tuple[int, int]]:
        """:meth:`rank_bytes` of every rank, from (chunks, ranks holding them) runs: each run is planned once.

        A rank's figures are the sums over the runs it is in. Sources with one location are
        tallied by node once per run; only replicated sources are chosen rank by rank.
        """
        hosts = hosts or {}
        out: dict[int, tuple[int, int]] = {}
        memo = self._bytes_memo
        for chunks, ranks in runs:
            total = 0
            by_writer: dict[int, int] = defaultdict(int)  # bytes from sources with one location, by writer rank
            choices: list[tuple[_Source, int]] = []  # (replicated source, bytes): the replica depends on the rank
            for chunk in chunks:
                by_source = memo.get(chunk)
                if by_source is None:
                    by_source = memo[chunk] = self._chunk_bytes(chunk)
                if not gpus_per_node:
                    total += sum(n for _, n in by_source)
                    continue
                prep = self._prepared[chunk.key]
                for s_idx, n in by_source:
                    total += n
                    w = prep.writer[s_idx]
                    if w < 0:
                        choices.append((prep.srcs[s_idx], n))
                    else:
                        by_writer[w] += n
            by_node: dict[int, int] = defaultdict(int)
            if gpus_per_node:
                for w, n in by_writer.items():
                    by_node[w // gpus_per_node] += n
            single = sum(by_writer.values())
            for rank in ranks:
                cross = 0
                if gpus_per_node:
                    node = rank // gpus_per_node
                    cross = single - by_node.get(node, 0)
                    for src, n in choices:
                        if self.source.chunks[_choose(src, rank, hosts.get(rank, ""))].location.rank // gpus_per_node != node:
                            cross += n
                t, c = out.get(rank, (0, 0))
                out[rank] = (t + total, c + cross)
        return out


def plan_reshard(
    source: PTC,
    dst_tensors: dict[str, TensorMeta],
    dst_chunks: dict[int, list[Chunk]],
    *,
    hosts: dict[int, str] | None = None,
    ranks: list[int] | None = None,
    strict: bool = True,
) -> ReshardPlan:
    """Plan how each destination rank fills its chunks from ``source``.

    ``dst_chunks`` maps every destination rank to the chunks it holds; ``ranks``
    limits planning to some of them (every rank computes the same plan for
    itself). ``hosts`` maps destination ranks to host names for local-first reads.
    """
    hosts = hosts or {}
    planner = Planner(source, dst_tensors)
    unused = planner.check_keys({c.key for chunks in dst_chunks.values() for c in chunks}, strict)
    out_ranks = {
        rank: planner.rank_plan(rank, tuple(dst_chunks.get(rank, [])), hosts.get(rank, ""))
        for rank in sorted(dst_chunks if ranks is None else ranks)
    }
    return ReshardPlan(sources=source.chunks, ranks=out_ranks, unused_tensors=unused)


def _choose(src: _Source, rank: int, host: str) -> int:
    """A replica for destination ``rank``: one on its host if any, then rotate over ranks to spread reads.

    The choice depends only on (chunk, destination rank), so every rank computes
    the same plan for itself as a planner of the whole job would.
    """
    if len(src.slots) == 1:
        return src.slots[0]
    pool = [(loc.rank, slot) for loc, slot in zip(src.locations, src.slots) if host and loc.host == host]
    pool = sorted(pool or ((loc.rank, slot) for loc, slot in zip(src.locations, src.slots)))
    offset = sum(src.chunk.offsets) + src.chunk.flat_range[0]
    return pool[(rank + offset) % len(pool)][1]


def partition_errors(source: PTC) -> dict[str, str]:
    """Tensor key -> why its stored chunks do not partition it (overlap, or a gap); empty when every tensor's do.

    The check a load makes per tensor it plans, here for all of them at once (``verify`` uses it).
    """
    planner = Planner(source, source.tensors)
    out: dict[str, str] = {}
    for key in source.tensors:
        try:
            planner.prepare(key)
        except (PlanError, PTCError) as e:
            out[key] = str(e)
    return out
