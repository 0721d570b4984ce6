"""A frozen copy of the dry-run planning path as of commit e89b510 (before it was made fast): the reference.

tests/unit/test_plan_fast.py checks that the current code gives exactly what this
code gave: the same source PTC, the same per-rank plans and byte totals. Slow on
purpose: do not optimise it, do not import it from the library.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict
from dataclasses import dataclass, field, replace

from tenplex_megatron.plan.geometry import Rect, chunk_rects, intersect
from tenplex_megatron.plan.layout import LayoutError, ParallelLayout, padded_vocab_size, restart_padded_vocab_size
from tenplex_megatron.plan.ptc import PTC, Chunk, Location, PTCError, StoredChunk, TensorMeta, dtype_size

# ---------------------------------------------------------------------------------------------------------------
# writers.py
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Holding:
    """Rank ``rank`` holds ``chunk`` (``main``: it is megatron's main replica), ``nbytes`` big."""

    rank: int
    chunk: Chunk
    main: bool
    nbytes: int


def assign_writers(holdings: list[Holding]) -> dict[Chunk, int]:
    """Map each chunk that has a main replica to the rank that writes it, balancing bytes."""
    holders: dict[Chunk, list[Holding]] = defaultdict(list)
    for h in holdings:
        holders[h.chunk].append(h)
    groups = [(c, hs) for c, hs in holders.items() if any(h.main for h in hs)]
    groups.sort(key=lambda g: (-g[1][0].nbytes, g[0].key, g[0].offsets, g[0].flat_range))
    written: dict[int, int] = defaultdict(int)
    out: dict[Chunk, int] = {}
    for chunk, hs in groups:
        rank = min({h.rank for h in hs}, key=lambda r: (written[r], r))
        written[rank] += hs[0].nbytes
        out[chunk] = rank
    return out


# ---------------------------------------------------------------------------------------------------------------
# shard_layout.py
# ---------------------------------------------------------------------------------------------------------------

def resize_vocab(tensors: dict[str, TensorMeta], padded_vocab: int) -> dict[str, TensorMeta]:
    """The same tensors with every padded-vocabulary dimension set to ``padded_vocab``."""
    out = {}
    for k, t in tensors.items():
        if t.vocab_rows is not None and t.global_shape[0] != padded_vocab:
            t = replace(t, global_shape=(padded_vocab, *t.global_shape[1:]))
        out[k] = t
    return out


def _stage_holds(t: TensorMeta, pp_rank: int, pp: int) -> bool:
    if t.stage == "last":
        return pp_rank == pp - 1
    if t.stage == "first":
        return pp_rank == 0 or (t.tied and pp_rank == pp - 1)
    return pp_rank == 0  # unknown placement: assume the first stage


def _tp_boxes(t: TensorMeta, offsets: list[int], shape: list[int], tp: int, tp_rank: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    if t.tp_axis is None or tp == 1 and t.tp_parts == 1:
        return [(tuple(offsets), tuple(shape))]
    axis = t.tp_axis
    size = t.global_shape[axis]
    if size % (t.tp_parts * tp):
        raise LayoutError(
            f"tensor {t.key!r}: TP={tp} does not divide dimension {axis} of size {size} "
            f"({t.tp_parts} part(s))"
        )
    part = size // t.tp_parts
    per = part // tp
    boxes = []
    for g in range(t.tp_parts):
        off = list(offsets)
        shp = list(shape)
        off[axis] = g * part + tp_rank * per
        shp[axis] = per
        boxes.append((tuple(off), tuple(shp)))
    return boxes


def _local_params(t: TensorMeta, layout: ParallelLayout, tp_rank: int, pp_rank: int) -> list[list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """This model-parallel rank's parameters of tensor ``t``: one list of part boxes per parameter."""
    shape = list(t.global_shape)
    zeros = [0] * len(shape)
    if t.stage == "layers":
        layers = shape[0]
        if layers % layout.pp:
            raise LayoutError(f"PP={layout.pp} does not divide the number of layers ({layers})")
        per = layers // layout.pp
        out = []
        for layer in range(pp_rank * per, (pp_rank + 1) * per):
            off = [layer, *zeros[1:]]
            out.append(_tp_boxes(t, off, [1, *shape[1:]], layout.tp, tp_rank))
        return out
    if not _stage_holds(t, pp_rank, layout.pp):
        return []
    return [_tp_boxes(t, zeros, shape, layout.tp, tp_rank)]


def layout_holdings(
    tensors: dict[str, TensorMeta], layout: ParallelLayout, distributed_optimizer: bool
) -> dict[int, list[tuple[Chunk, bool]]]:
    """Every rank's chunks at ``layout`` (megatron-core's rank order), each with megatron's main-replica flag.

    Main: DP rank 0 for DP-replicated chunks, TP rank 0 for TP-replicated ones,
    never the last stage's copy of a tied embedding.
    """
    params = {k: t for k, t in tensors.items() if t.param is None}
    states: dict[str, list[TensorMeta]] = {}
    for t in tensors.values():
        if t.param is not None:
            states.setdefault(t.param, []).append(t)
    out: dict[int, list[tuple[Chunk, bool]]] = {}
    cache: dict[tuple[int, int], dict[str, list[list[tuple]]]] = {}
    made: dict[tuple, list] = {}
    for rank in range(layout.world_size):
        tp_rank, pp_rank, dp_rank = layout.rank_coords(rank)
        key = (tp_rank, pp_rank)
        if key not in cache:
            cache[key] = {k: _local_params(t, layout, tp_rank, pp_rank) for k, t in sorted(params.items())}
        local = cache[key]
        tied_copy = layout.pp > 1 and pp_rank == layout.pp - 1

        def main(t: TensorMeta, dp_replicated: bool, tied_copy=tied_copy, tp_rank=tp_rank, dp_rank=dp_rank) -> bool:
            if t.tied and tied_copy:
                return False
            if t.tp_axis is None and tp_rank != 0:
                return False
            return dp_rank == 0 or not dp_replicated

        chunks: list[tuple[Chunk, bool]] = []
        keys = list(local) if not distributed_optimizer else []
        replicated = [(k, params[k]) for k in local] + [(st.key, st) for k in keys for st in states.get(k, [])]
        if (key, "chunks") not in made:  # chunk objects shared by the DP replicas of a (TP, PP) rank
            made[(key, "chunks")] = [
                (name, [Chunk(name, off, shp) for boxes in local[t.param or name] for off, shp in boxes])
                for name, t in replicated
            ]
        for (_, cs), (_, t) in zip(made[(key, "chunks")], replicated):
            m = main(t, True)
            chunks.extend((c, m) for c in cs)
        if distributed_optimizer:
            chunks.extend((c, main(tensors[c.key], False)) for c in _dist_opt_chunks(local, states, layout.dp, dp_rank))
        out[rank] = chunks
    return out


def layout_chunks(
    tensors: dict[str, TensorMeta], layout: ParallelLayout, distributed_optimizer: bool
) -> dict[int, list[Chunk]]:
    """Every rank's chunks at ``layout`` (ranks in megatron-core's order)."""
    return {r: [c for c, _ in hs] for r, hs in layout_holdings(tensors, layout, distributed_optimizer).items()}


def source_from_layout(tensors: dict[str, TensorMeta], layout: ParallelLayout, distributed_optimizer: bool) -> PTC:
    """The PTC a tenplex save at ``layout`` would write: each main chunk once, writers balanced."""
    holdings = [
        Holding(rank, c, main, c.numel * dtype_size(tensors[c.key].dtype))
        for rank, hs in layout_holdings(tensors, layout, distributed_optimizer).items()
        for c, main in hs
    ]
    writers = assign_writers(holdings)
    stored = tuple(
        StoredChunk(c, Location(f"rank_{w:05d}.safetensors", f"{c.key}@{c.offsets}#{c.flat}", w)) for c, w in writers.items()
    )
    return PTC(tensors, stored, layout.to_json())


def _dist_opt_chunks(
    local: dict[str, list[list[tuple]]], states: dict[str, list[TensorMeta]], dp: int, dp_rank: int
) -> list[Chunk]:
    entries = [(k, boxes) for k, plist in local.items() if states.get(k) for boxes in plist]
    sizes = [sum(math.prod(shp) for _, shp in boxes) for _, boxes in entries]
    total = sum(sizes)
    padded = -(-total // dp) * dp
    lo, hi = dp_rank * padded // dp, (dp_rank + 1) * padded // dp
    out: list[Chunk] = []
    pos = 0
    for (k, boxes), n in zip(entries, sizes):
        a, b = max(lo, pos) - pos, min(hi, pos + n) - pos
        pos += n
        if a >= b:
            continue
        part_lo = 0
        for off, shp in boxes:
            m = math.prod(shp)
            s, e = max(a, part_lo), min(b, part_lo + m)
            if s < e:
                flat = None if (s - part_lo, e - part_lo) == (0, m) else (s - part_lo, e - part_lo)
                out.extend(Chunk(st.key, off, shp, flat) for st in states[k])
            part_lo += m
    return out


# ---------------------------------------------------------------------------------------------------------------
# planner.py
# ---------------------------------------------------------------------------------------------------------------

class PlanError(ValueError):
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
    rects: list[Rect]


class _Grid:
    """Elementary intervals of one dimension: each cell lists the items that span it."""

    def __init__(self, spans: list[tuple[int, int, int]]):
        self.bounds = sorted({b for lo, hi, _ in spans for b in (lo, hi)})
        self.cells: list[list[int]] = [[] for _ in range(max(len(self.bounds) - 1, 1))]
        for lo, hi, n in spans:
            for c in range(bisect.bisect_left(self.bounds, lo), bisect.bisect_left(self.bounds, hi)):
                self.cells[c].append(n)

    def cell_range(self, lo: int, hi: int) -> range:
        a = max(bisect.bisect_right(self.bounds, lo) - 1, 0)
        b = min(bisect.bisect_left(self.bounds, hi), len(self.cells))
        return range(a, b)


class _Index:
    """A two-level grid (dimension 0, then dimension 1) over a tensor's source rectangles."""

    def __init__(self, sources: list[_Source] | list[_Boxed]):
        self.items: list[tuple[int, Rect]] = [(i, r) for i, s in enumerate(sources) for r in s.rects]
        self.ndim = len(self.items[0][1].offsets) if self.items else 0
        if self.ndim == 0:
            return
        self.top = _Grid([(r.offsets[0], r.end[0], n) for n, (_, r) in enumerate(self.items)])
        self.sub: list[_Grid | None] = []
        for cell in self.top.cells:
            if self.ndim >= 2 and len(cell) > 8:
                self.sub.append(_Grid([(self.items[n][1].offsets[1], self.items[n][1].end[1], n) for n in cell]))
            else:
                self.sub.append(None)

    def query(self, off: tuple[int, ...], end: tuple[int, ...]) -> list[tuple[int, Rect]]:
        if self.ndim == 0:
            return list(self.items)
        seen: set[int] = set()
        out = []
        for c in self.top.cell_range(off[0], end[0]):
            sub = self.sub[c]
            if sub is None:
                ids: list[int] = self.top.cells[c]
            else:
                ids = [n for sc in sub.cell_range(off[1], end[1]) for n in sub.cells[sc]]
            for n in ids:
                if n not in seen:
                    seen.add(n)
                    out.append(self.items[n])
        return out


def _unique_sources(chunks: list[tuple[int, StoredChunk]]) -> list[_Source]:
    by_chunk: dict[Chunk, _Source] = {}
    for slot, sc in chunks:
        src = by_chunk.get(sc.chunk)
        if src is None:
            rects = chunk_rects(sc.chunk.offsets, sc.chunk.shape, sc.chunk.flat)
            src = by_chunk[sc.chunk] = _Source(sc.chunk, [], [], rects)
        src.locations.append(sc.location)
        src.slots.append(slot)
    return sorted(by_chunk.values(), key=lambda s: (s.chunk.offsets, s.chunk.flat_range, s.chunk.shape))


class _Boxed:
    """A lone rectangle in the shape _Index expects of a source."""

    __slots__ = ("rects",)

    def __init__(self, rect: Rect):
        self.rects = [rect]


def _boxes(sources: list[_Source]) -> dict[tuple, list[tuple[int, int, int]]]:
    """Source chunks grouped by their box: sorted (flat start, flat stop, source index) per box."""
    out: dict[tuple, list[tuple[int, int, int]]] = defaultdict(list)
    for i, s in enumerate(sources):
        a, b = s.chunk.flat_range
        out[(s.chunk.offsets, s.chunk.shape)].append((a, b, i))
    for v in out.values():
        v.sort()
    return out


def _check_partition(meta: TensorMeta, sources: list[_Source], index: _Index, boxes: dict) -> None:
    """Source chunks of one tensor must be pairwise disjoint and cover it (so copies are exact).

    Fast path: when the distinct boxes are pairwise disjoint, disjointness reduces to
    non-overlapping flat intervals inside each box. Otherwise every rectangle pair is checked.
    """
    total = sum(s.chunk.numel for s in sources)

    def overlap(i: int, j: int) -> PlanError:
        a, b = sources[i].chunk, sources[j].chunk
        return PlanError(
            f"tensor {meta.key!r}: source chunks overlap ({a.offsets}/{a.shape}/{a.flat} and {b.offsets}/{b.shape}/{b.flat})"
        )

    box_rects = [Rect(off, shp, 0) for off, shp in boxes]
    box_index = _Index([_Boxed(r) for r in box_rects])
    boxes_disjoint = all(
        j == i or intersect(b.offsets, b.shape, r.offsets, r.shape) is None
        for i, b in enumerate(box_rects)
        for j, r in box_index.query(b.offsets, b.end)
    )
    if boxes_disjoint:
        for intervals in boxes.values():
            for (_, b0, i0), (a1, _, i1) in zip(intervals, intervals[1:]):
                if a1 < b0:
                    raise overlap(i0, i1)
    else:
        for i, s in enumerate(sources):
            for r in s.rects:
                for j, other in index.query(r.offsets, r.end):
                    if j != i and intersect(r.offsets, r.shape, other.offsets, other.shape) is not None:
                        raise overlap(i, j)
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


class Planner:
    """Plans destination chunks against one source PTC; per-tensor indexes and per-chunk plans are cached."""

    def __init__(self, source: PTC, dst_tensors: dict[str, TensorMeta]):
        self.source = source
        self.dst_tensors = dst_tensors
        self._by_key: dict[str, list[tuple[int, StoredChunk]]] = defaultdict(list)
        for slot, sc in enumerate(source.chunks):
            self._by_key[sc.chunk.key].append((slot, sc))
        self._prepared: dict[str, tuple[list[_Source], _Index, int | None, int]] = {}
        self._boxes: dict[str, dict[tuple, list[tuple[int, int, int]]]] = {}
        self._memo: dict[Chunk, _ChunkPlan] = {}
        self._bytes_memo: dict[Chunk, tuple[tuple[int, int], ...]] = {}

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

    def prepare(self, key: str) -> tuple[list[_Source], _Index, int | None, int]:
        got = self._prepared.get(key)
        if got is None:
            meta = self.source.tensors[key]
            srcs = _unique_sources(self._by_key.get(key, []))
            index = _Index(srcs)
            boxes = self._boxes[key] = _boxes(srcs)
            _check_partition(meta, srcs, index, boxes)
            got = self._prepared[key] = (srcs, index, _content_limit(meta, self.dst_tensors[key]), dtype_size(meta.dtype))
        return got

    def chunk_plan(self, chunk: Chunk) -> _ChunkPlan:
        cp = self._memo.get(chunk)
        if cp is not None:
            return cp
        try:
            chunk.validate(self.dst_tensors[chunk.key])
        except PTCError as e:
            raise PlanError(str(e)) from None
        srcs, index, limit, itemsize = self.prepare(chunk.key)
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
            srcs, _, _, itemsize = self.prepare(chunk.key)
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
        if got is not None:
            return got
        _, _, limit, itemsize = self.prepare(chunk.key)
        intervals = self._boxes[chunk.key].get((chunk.offsets, chunk.shape)) if limit is None else None
        if intervals and sum(b - a for a, b, _ in intervals) == chunk.box_numel:
            lo, hi = chunk.flat_range
            got = tuple(
                (i, (min(b, hi) - max(a, lo)) * itemsize)
                for a, b, i in intervals[max(bisect.bisect_right(intervals, (lo, float("inf"), 0)) - 1, 0):]
                if a < hi and b > lo
            )
            try:
                chunk.validate(self.dst_tensors[chunk.key])
            except PTCError as e:
                raise PlanError(str(e)) from None
        else:
            got = self.chunk_plan(chunk).by_source
        self._bytes_memo[chunk] = got
        return got

    def rank_bytes(self, rank: int, chunks: list[Chunk], host: str = "", gpus_per_node: int | None = None) -> tuple[int, int]:
        """(bytes read, bytes read from another node's rank) without building pieces: for large dry runs."""
        total = cross = 0
        node = rank // gpus_per_node if gpus_per_node else None
        memo = self._bytes_memo
        for chunk in chunks:
            by_source = memo.get(chunk) or self.chunk_bytes(chunk)
            srcs = self._prepared[chunk.key][0]
            for s_idx, n in by_source:
                total += n
                if node is not None:
                    src = srcs[s_idx]
                    slot = src.slots[0] if len(src.slots) == 1 else _choose(src, rank, host)
                    if self.source.chunks[slot].location.rank // gpus_per_node != node:
                        cross += n
        return total, cross


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


# ---------------------------------------------------------------------------------------------------------------
# cli_plan.py: _plan_model's numbers (GPTDims in, the report's byte figures out)
# ---------------------------------------------------------------------------------------------------------------


def model_report(dims, src: ParallelLayout, dst: ParallelLayout, distopt: bool, gpus_per_node: int | None) -> dict:
    """What ``plan --model`` reported: state, bytes read (total, per rank), cross-node, central baseline."""
    from tenplex_megatron.plan.sim.gpt_catalogue import gpt_tensors

    tensors = gpt_tensors(dims, padded_vocab_size(dims.vocab_size, 128, src.tp))
    source = source_from_layout(tensors, src, distopt)
    padded = restart_padded_vocab_size(dims.vocab_size, 128, dst.tp, padded_vocab_size(dims.vocab_size, 128, src.tp))
    dst_tensors = resize_vocab(tensors, padded)
    chunks = layout_chunks(dst_tensors, dst, distopt)
    planner = Planner(source, dst_tensors)
    planner.check_keys({k for k in dst_tensors}, strict=True)
    per_rank = {r: planner.rank_bytes(r, cs, gpus_per_node=gpus_per_node) for r, cs in chunks.items()}
    state = source.total_bytes()
    reads = [b for b, _ in per_rank.values()]
    dst_bytes = sum(c.numel * dtype_size(dst_tensors[c.key].dtype) for cs in chunks.values() for c in cs)
    return {
        "state_bytes": state, "bytes_total": sum(reads), "bytes_per_rank_max": max(reads),
        "bytes_per_rank_mean": sum(reads) / len(reads),
        "bytes_cross_node": sum(c for _, c in per_rank.values()) if gpus_per_node else None,
        "central_bytes_through_one_rank": state + dst_bytes,
        "per_rank": per_rank,
    }
