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
from dataclasses import dataclass, field

from tenplex_megatron.plan.geometry import Rect, chunk_rects, intersect
from tenplex_megatron.plan.ptc import PTC, Chunk, Location, PTCError, StoredChunk, TensorMeta, dtype_size


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


class _Index:
    """Elementary-interval index on dimension 0 of a tensor's source rectangles."""

    def __init__(self, sources: list[_Source]):
        self.items: list[tuple[int, Rect]] = [(i, r) for i, s in enumerate(sources) for r in s.rects]
        self.bounds = sorted({b for _, r in self.items if r.offsets for b in (r.offsets[0], r.end[0])})
        self.cells: list[list[int]] = [[] for _ in range(max(len(self.bounds) - 1, 1))]
        for n, (_, r) in enumerate(self.items):
            if not r.offsets:
                self.cells[0].append(n)
                continue
            lo = bisect.bisect_left(self.bounds, r.offsets[0])
            hi = bisect.bisect_left(self.bounds, r.end[0])
            for c in range(lo, hi):
                self.cells[c].append(n)

    def query(self, off: tuple[int, ...], end: tuple[int, ...]) -> list[tuple[int, Rect]]:
        if not off:
            return [self.items[n] for n in self.cells[0]]
        lo = max(bisect.bisect_right(self.bounds, off[0]) - 1, 0)
        hi = bisect.bisect_left(self.bounds, end[0])
        seen: set[int] = set()
        out = []
        for c in range(lo, min(hi, len(self.cells))):
            for n in self.cells[c]:
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


def _check_partition(meta: TensorMeta, sources: list[_Source], index: _Index) -> None:
    """Source chunks of one tensor must be pairwise disjoint and cover it (so copies are exact)."""
    total = 0
    for i, s in enumerate(sources):
        total += s.chunk.numel
        for r in s.rects:
            for j, other in index.query(r.offsets, r.end):
                if j != i and intersect(r.offsets, r.shape, other.offsets, other.shape) is not None:
                    raise PlanError(
                        f"tensor {meta.key!r}: source chunks overlap "
                        f"({s.chunk.offsets}/{s.chunk.shape}/{s.chunk.flat} and "
                        f"{sources[j].chunk.offsets}/{sources[j].chunk.shape}/{sources[j].chunk.flat})"
                    )
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
    by_key: dict[str, list[tuple[int, StoredChunk]]] = defaultdict(list)
    for slot, sc in enumerate(source.chunks):
        by_key[sc.chunk.key].append((slot, sc))
    wanted_keys = {c.key for chunks in dst_chunks.values() for c in chunks}
    for key in sorted(wanted_keys):
        if key not in dst_tensors:
            raise PlanError(f"destination chunk of tensor {key!r} has no tensor metadata")
        if key not in source.tensors:
            raise PlanError(f"tensor {key!r} of the model is not in the checkpoint")
    unused = tuple(sorted(set(source.tensors) - set(dst_tensors)))
    if strict and unused:
        raise PlanError(f"the checkpoint has tensors the model lacks: {', '.join(unused[:5])}")

    prepared: dict[str, tuple[list[_Source], _Index, int | None]] = {}

    def prepare(key: str) -> tuple[list[_Source], _Index, int | None]:
        if key not in prepared:
            meta = source.tensors[key]
            srcs = _unique_sources(by_key.get(key, []))
            index = _Index(srcs)
            _check_partition(meta, srcs, index)
            prepared[key] = (srcs, index, _content_limit(meta, dst_tensors[key]))
        return prepared[key]

    out_ranks: dict[int, RankPlan] = {}
    for rank in sorted(dst_chunks if ranks is None else ranks):
        chunks = tuple(dst_chunks.get(rank, []))
        pieces: list[Piece] = []
        fills: list[Fill] = []
        bytes_by_file: dict[str, int] = defaultdict(int)
        host = hosts.get(rank, "")
        for d_idx, chunk in enumerate(chunks):
            dmeta = dst_tensors[chunk.key]
            try:
                chunk.validate(dmeta)
            except PTCError as e:
                raise PlanError(str(e)) from None
            srcs, index, limit = prepare(chunk.key)
            itemsize = dtype_size(source.tensors[chunk.key].dtype)
            covered = 0
            for dr in chunk_rects(chunk.offsets, chunk.shape, chunk.flat):
                d_off, d_shape = dr.offsets, dr.shape
                if limit is not None and d_off[0] + d_shape[0] > limit:
                    pad_lo = max(d_off[0], limit)
                    pad_shape = (d_off[0] + d_shape[0] - pad_lo, *d_shape[1:])
                    fills.append(Fill(d_idx, dr.start, dr.shape, (pad_lo - d_off[0], *([0] * (len(d_shape) - 1))), pad_shape))
                    covered += math.prod(pad_shape)
                    d_shape = (max(limit - d_off[0], 0), *d_shape[1:])
                    if d_shape[0] == 0:
                        continue
                d_end = tuple(o + s for o, s in zip(d_off, d_shape))
                for s_idx, sr in index.query(d_off, d_end):
                    box = intersect(d_off, d_shape, sr.offsets, sr.shape)
                    if box is None:
                        continue
                    x_off, x_shape = box
                    src = srcs[s_idx]
                    slot = _choose(src, rank, host)
                    loc = source.chunks[slot].location
                    n = math.prod(x_shape)
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
                    bytes_by_file[loc.file] += n * itemsize
                    covered += n
            if covered != chunk.numel:
                raise PlanError(
                    f"tensor {chunk.key!r}: destination chunk offsets {chunk.offsets} sizes {chunk.shape} "
                    f"flat {chunk.flat} on rank {rank} is covered {covered} times-elements, expected {chunk.numel}"
                )
        out_ranks[rank] = RankPlan(
            rank=rank,
            chunks=chunks,
            pieces=tuple(pieces),
            fills=tuple(fills),
            bytes_read=sum(bytes_by_file.values()),
            bytes_by_file=dict(bytes_by_file),
        )
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
