"""The parallel reader: a plan's pieces read with ``os.preadv`` by a pool of threads into one ring, checked, placed.

Which bytes a rank needs is known before the first read (the plan), so they
are read as merged contiguous byte runs of a few MiB (nearby ranges merged,
whole checksum blocks), many in flight at once, each straight into a slot of
one ring of host buffers allocated once within the staging budget (pinned for
a GPU). The thread that read a run checks the CRC-32 of every block in it
(``storage.checksum.crc32`` and ``os.preadv`` release the GIL) and, for a CPU
destination, copies the pieces into the destination tensors; for a GPU the
main thread sends the slot to the device on the ring's side stream and
scatters the pieces there. A slot is reused once its pieces are placed (a CUDA
event). No memory map, no whole-shard staging; the kernel is told of the next
:data:`PREFETCH_BYTES` of reads ahead of them (``POSIX_FADV_WILLNEED``), so a cold
load keeps the storage busy. Any error (a short read, a
damaged block, an I/O error in one thread) names the file (and the block),
cancels the reads not started, waits for those running and frees the ring.
The index arithmetic (:func:`plan_runs`) is pure; :func:`read_runs` does the I/O.
"""

from __future__ import annotations

import bisect
import math
import os
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np
import torch

from tenplex_megatron import log as tlog
from tenplex_megatron.flags import FlagError
from tenplex_megatron.plan.planner import Piece
from tenplex_megatron.storage import prefetch
from tenplex_megatron.storage.block_verify import piece_runs, touched_blocks
from tenplex_megatron.storage.checksum import crc32
from tenplex_megatron.storage.cpus import usable_cpus
from tenplex_megatron.storage.faults import fail, fault_kind
from tenplex_megatron.storage.files import CheckpointFileError
from tenplex_megatron.storage.staging import StagingRing, staging_bytes

LOG = tlog.get("parallel_read")

RUN_BYTES = 4 << 20  # the largest read: a few MiB keeps many in flight and each one's CRC in cache
GAP = 64 << 10  # byte ranges closer than this are read as one (the gap is read and dropped)
ALIGN = 64  # a run starts at a multiple of this in the file's offsets, so any dtype's view of a slot is aligned
MAX_THREADS = 16
PREFETCH_BYTES = 512 << 20  # how far ahead of the reads the kernel is told what comes (a cold load's queue depth)


def default_threads() -> int:
    """Reader threads: ``TENPLEX_READ_THREADS``, else this rank's share of the CPUs (torchrun's local ranks), 1-16."""
    env = os.environ.get("TENPLEX_READ_THREADS", "").strip()
    if env:
        try:
            n = int(env)
        except ValueError:
            raise FlagError(f"TENPLEX_READ_THREADS={env!r}: expected an integer >= 1") from None
        if n < 1:
            raise FlagError(f"TENPLEX_READ_THREADS={env!r}: expected an integer >= 1")
        return n
    cpus = usable_cpus()
    return max(1, min(MAX_THREADS, cpus // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))


def slot_size(budget: int | None = None, threads: int | None = None) -> int:
    """One slot's bytes: :data:`RUN_BYTES`, less where the staging budget (default ``TENPLEX_STAGING_MB``) cannot
    hold a slot for each thread and two more (a block larger than that raises it: :func:`plan_runs`)."""
    budget = staging_bytes() if budget is None else budget
    return max(ALIGN, min(RUN_BYTES, budget // ((threads or default_threads()) + 2) // ALIGN * ALIGN))


@dataclass(frozen=True)
class Extent:
    """Where a stored chunk's bytes lie in a file, and the checksums that cover them.

    ``block_bytes`` and ``crcs``: one CRC-32 per block of the chunk's bytes (the
    last block may be short; a format-1 whole-chunk CRC is one block of
    ``nbytes``); None: no checksum, the bytes are read unverified. ``where``
    names the chunk in errors; ``key`` names it in the set of verified blocks.
    """

    path: str
    offset: int
    nbytes: int
    itemsize: int
    dtype: torch.dtype
    block_bytes: int | None
    crcs: tuple[int, ...] | None
    where: str
    key: tuple[str, str]
    whole: bool = False  # the one CRC-32 is the whole chunk's (format 1)


@dataclass(frozen=True)
class Block:
    """One checksum block to check in a run: its place in the slot, its size, the recorded CRC and its names."""

    at: int
    nbytes: int
    expected: int
    index: int
    extent: int


@dataclass(frozen=True)
class Box:
    """A piece (or part of one) read from a run: the sub-box ``piece`` of extent ``extent`` at ``at`` bytes of the slot
    (where that chunk's byte ``first`` lies)."""

    piece: Piece
    extent: int
    at: int
    first: int


@dataclass(frozen=True)
class Run:
    """One read: bytes ``[start, stop)`` of ``path``, the blocks to check in them and the boxes they serve."""

    path: str
    start: int
    stop: int
    blocks: tuple[Block, ...]
    boxes: tuple[Box, ...]

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ReadPlan:
    """Every run of one load in file order, the slot size they need and the bytes checked and unverified."""

    runs: tuple[Run, ...]
    extents: tuple[Extent, ...]
    slot_bytes: int
    bytes_read: int
    bytes_unverified: int
    bytes_verified: int


def _strides(rect: Sequence[int]) -> list[int]:
    return [math.prod(rect[i + 1 :]) for i in range(len(rect))]


def span(p: Piece) -> tuple[int, int]:
    """The first and one past the last element (in its source chunk) that piece ``p`` reads."""
    st = _strides(p.src_rect)
    first = p.src_start + sum(o * s for o, s in zip(p.src_sel, st))
    return first, first + sum((n - 1) * s for n, s in zip(p.shape, st)) + 1


def _sub(p: Piece, d: int, a: int, n: int) -> Piece:
    """Indices ``[a, a+n)`` of ``p``'s dimension ``d``."""
    src_sel = p.src_sel[:d] + (p.src_sel[d] + a,) + p.src_sel[d + 1 :]
    dst_sel = p.dst_sel[:d] + (p.dst_sel[d] + a,) + p.dst_sel[d + 1 :]
    return replace(p, src_sel=src_sel, dst_sel=dst_sel, shape=p.shape[:d] + (n,) + p.shape[d + 1 :])


def split_span(p: Piece, cap: int) -> list[Piece]:
    """``p`` as boxes each spanning at most ``cap`` elements of its source chunk (single elements at worst)."""
    first, stop = span(p)
    if stop - first <= cap or p.numel <= 1:
        return [p]
    d = next(i for i, n in enumerate(p.shape) if n > 1)
    one = span(_sub(p, d, 0, 1))
    width = one[1] - one[0]
    if width > cap:
        return [b for i in range(p.shape[d]) for b in split_span(_sub(p, d, i, 1), cap)]
    k = max(1, (cap - width) // _strides(p.src_rect)[d] + 1)
    return [_sub(p, d, a, min(k, p.shape[d] - a)) for a in range(0, p.shape[d], k)]


def split_at(p: Piece, limit: int) -> list[Piece]:
    """``p`` (whose first element lies before element ``limit`` of its chunk) cut into a first box that ends at or
    before ``limit`` and the boxes of the rest: along its outermost dimension of more than one index, as many whole
    indices as end there, else the first index's own box cut the same way one dimension further in."""
    d = next(i for i, n in enumerate(p.shape) if n > 1)
    one = span(_sub(p, d, 0, 1))
    i = min(p.shape[d] - 1, (limit - one[1]) // _strides(p.src_rect)[d] + 1) if one[1] <= limit else 0
    if i >= 1:
        return [_sub(p, d, 0, i), _sub(p, d, i, p.shape[d] - i)]
    return [*split_at(_sub(p, d, 0, 1), limit), _sub(p, d, 1, p.shape[d] - 1)]


def _merge(lo: np.ndarray, hi: np.ndarray, gap: int) -> list[tuple[int, int]]:
    """Ranges ``[lo, hi)`` (sorted by ``lo``) merged where they overlap or lie at most ``gap`` apart."""
    if len(lo) == 0:
        return []
    reach = np.maximum.accumulate(hi)
    new = np.flatnonzero(lo[1:] > reach[:-1] + gap) + 1
    firsts = np.concatenate(([0], new))
    lasts = np.concatenate((new - 1, [len(lo) - 1]))
    return list(zip(lo[firsts].tolist(), reach[lasts].tolist()))


def _needed(e: Extent, pieces: list[Piece]) -> tuple[list[tuple[int, int]], list[int]]:
    """The chunk-relative byte ranges to read for ``pieces`` (whole checksum blocks, nearby ranges merged) and the
    blocks whose checksums cover the bytes they copy."""
    los, his, blocks = [], [], set()
    for p in pieces:
        if e.block_bytes is not None:
            a, b = span(p)
            if b - a == p.numel:  # one contiguous range: its blocks without numpy
                blocks.update(range(a * e.itemsize // e.block_bytes, (b * e.itemsize - 1) // e.block_bytes + 1))
                continue
        starts, run = piece_runs(p)
        if e.block_bytes is not None:
            blocks.update(touched_blocks(starts, run, e.itemsize, e.block_bytes))
        else:
            los.append(starts * e.itemsize)
            his.append((starts + run) * e.itemsize)
    if e.block_bytes is not None:
        b = sorted(blocks)
        ranges: list[list[int]] = []
        for x in b:  # whole blocks, merged as _merge would (a few per chunk: no numpy)
            lo, hi = x * e.block_bytes, min((x + 1) * e.block_bytes, e.nbytes)
            if ranges and lo <= ranges[-1][1] + GAP:
                ranges[-1][1] = max(ranges[-1][1], hi)
            else:
                ranges.append([lo, hi])
        return [(lo, hi) for lo, hi in ranges], b
    lo, hi = np.concatenate(los), np.concatenate(his)
    order = np.argsort(lo, kind="stable")
    return _merge(lo[order], hi[order], GAP), []


def checked_blocks(pieces: Sequence[Piece], extents: Sequence[Extent]) -> dict[int, list[int]]:
    """The checksum blocks, by extent, that a read of ``pieces`` checks: the blocks their bytes touch, in extents
    with per-block checksums (ranks of a host split these: ``plan/verify_share.py``; a format-1 whole-chunk checksum
    is left out: each rank reading it checks it)."""
    per_extent: dict[int, list[Piece]] = {}
    for p in pieces:
        e = extents[p.source]
        if p.numel and e.block_bytes is not None and e.crcs is not None and not e.whole:
            per_extent.setdefault(p.source, []).append(p)
    return {i: _needed(extents[i], ps)[1] for i, ps in per_extent.items()}


def _tally(pieces: Sequence[Piece], extents: Sequence[Extent]) -> tuple[dict[int, list[Piece]], int, int]:
    """The non-empty pieces by extent, the bytes they copy and of those the bytes no checksum covers."""
    per_extent: dict[int, list[Piece]] = {}
    read = unverified = 0
    for p in pieces:
        if p.numel == 0:
            continue
        e = extents[p.source]
        per_extent.setdefault(p.source, []).append(p)
        read += p.numel * e.itemsize
        if e.crcs is None:
            unverified += p.numel * e.itemsize
    return per_extent, read, unverified


def _file_ranges(needed: dict[int, tuple[list[tuple[int, int]], list[int]]],
                 extents: Sequence[Extent]) -> dict[str, list[tuple[int, int, int, int]]]:
    """The byte ranges to read by file, in file offsets: path -> (lo, hi, cut unit, extent)."""
    wanted: dict[str, list[tuple[int, int, int, int]]] = {}
    for i, (ranges, _) in needed.items():
        e = extents[i]
        for lo, hi in ranges:  # a chunk's ranges are disjoint, and so are chunks' bytes
            wanted.setdefault(e.path, []).append((e.offset + lo, e.offset + hi, e.block_bytes or e.itemsize, i))
    return wanted


def _cut_spans(wanted: dict[str, list[tuple[int, int, int, int]]], extents: Sequence[Extent],
               slot: int) -> list[tuple[str, int, int]]:
    """The reads, in file order: nearby ranges merged up to ``slot`` bytes, a larger range cut at its chunk's units
    (blocks, elements) so no checksum block or element straddles two reads."""
    spans: list[tuple[str, int, int]] = []
    for path in sorted(wanted):
        cur: list[int] = []
        for lo, hi, step, i in sorted(wanted[path]):
            if cur and lo <= cur[1] + GAP and hi - cur[0] <= slot:
                cur[1] = max(cur[1], hi)
                continue
            if cur:
                spans.append((path, cur[0], cur[1]))
            start = lo // ALIGN * ALIGN
            base = extents[i].offset
            while hi - start > slot:  # one range larger than a slot: cut at units (blocks, elements) of its chunk
                cut = base + (start + slot - base) // step * step
                spans.append((path, start, cut))
                start = cut // ALIGN * ALIGN
            cur = [start, hi]
        if cur:
            spans.append((path, cur[0], cur[1]))
    return spans


def _run_finder(spans: list[tuple[str, int, int]]) -> Callable[[str, int, int], int | None]:
    """A lookup of the read holding bytes ``[lo, hi)`` of a file (None: no one read holds them all)."""
    starts: dict[str, list[int]] = {}
    idx: dict[str, list[int]] = {}
    for k, (path, lo, _) in enumerate(spans):
        starts.setdefault(path, []).append(lo)
        idx.setdefault(path, []).append(k)

    def run_of(path: str, lo: int, hi: int) -> int | None:
        j = bisect.bisect_right(starts[path], lo) - 1
        if j < 0:
            return None
        k = idx[path][j]
        return k if spans[k][2] >= hi else None

    return run_of


def _place_boxes(pieces: Sequence[Piece], extents: Sequence[Extent], slot: int, spans: list[tuple[str, int, int]],
                 run_of: Callable[[str, int, int], int | None]) -> list[list[Box]]:
    """Each read's boxes: every piece split so that each of its boxes lies in one read."""
    boxes: list[list[Box]] = [[] for _ in spans]
    for p in pieces:
        if p.numel == 0:
            continue
        e = extents[p.source]
        todo = split_span(p, max(1, (slot - 2 * ALIGN) // e.itemsize))
        while todo:
            box = todo.pop()
            a, b = span(box)
            k = run_of(e.path, e.offset + a * e.itemsize, e.offset + b * e.itemsize)
            if k is None:  # it runs past the end of the run holding its first element: cut it there
                j = run_of(e.path, e.offset + a * e.itemsize, e.offset + (a + 1) * e.itemsize)
                if j is None:  # cannot happen: every byte a piece reads lies in a run
                    raise AssertionError(f"{e.where}: element {a} lies in no read")
                todo.extend(split_at(box, (spans[j][2] - e.offset) // e.itemsize))
                continue
            boxes[k].append(Box(box, p.source, e.offset + a * e.itemsize - spans[k][1], a))
    return boxes


def _place_blocks(needed: dict[int, tuple[list[tuple[int, int]], list[int]]], extents: Sequence[Extent],
                  verified: set[tuple[str, str, int]], spans: list[tuple[str, int, int]],
                  run_of: Callable[[str, int, int], int | None]) -> tuple[list[list[Block]], int]:
    """Each read's blocks to check (each block named once, none in ``verified``) and the bytes they cover; a
    checksum count that does not fit the chunk's size is a damaged metadata record."""
    blocks: list[list[Block]] = [[] for _ in spans]
    done: set[tuple[str, str, int]] = set(verified)
    bytes_verified = 0
    for i, (_, touched) in needed.items():
        e = extents[i]
        if e.block_bytes is None or e.crcs is None:
            continue
        nblocks = -(-e.nbytes // e.block_bytes) if e.nbytes else 0
        if len(e.crcs) != nblocks:
            raise CheckpointFileError(f"{e.where}: the metadata records {len(e.crcs)} block checksums, its "
                                      f"{e.nbytes} bytes make {nblocks} blocks of {e.block_bytes}")
        for blk in touched:
            key = (*e.key, blk)
            if key in done:
                continue
            done.add(key)
            b0 = blk * e.block_bytes
            n = min(e.block_bytes, e.nbytes - b0)
            k = run_of(e.path, e.offset + b0, e.offset + b0 + n)
            if k is None:  # cannot happen: runs are cut at block boundaries only
                raise AssertionError(f"{e.where}: block {blk} split across reads")
            blocks[k].append(Block(e.offset + b0 - spans[k][1], n, e.crcs[blk], blk, i))
            bytes_verified += n
    return blocks, bytes_verified


def plan_runs(pieces: Sequence[Piece], extents: Sequence[Extent], slot_bytes: int,
              verified: set[tuple[str, str, int]] | None = None) -> ReadPlan:
    """The runs that read ``pieces`` (``piece.source`` indexes ``extents``): merged, cut to ``slot_bytes`` (raised to
    the largest checksum block), each block to check named once (none already in ``verified``)."""
    verified = verified or set()
    unit = max([min(e.block_bytes, e.nbytes) for e in extents if e.block_bytes] + [ALIGN])
    slot = max(slot_bytes, unit + 2 * ALIGN)
    per_extent, read, unverified = _tally(pieces, extents)
    needed = {i: _needed(extents[i], ps) for i, ps in per_extent.items()}
    spans = _cut_spans(_file_ranges(needed, extents), extents, slot)
    run_of = _run_finder(spans)
    boxes = _place_boxes(pieces, extents, slot, spans, run_of)
    blocks, bytes_verified = _place_blocks(needed, extents, verified, spans, run_of)
    runs = tuple(Run(path, lo, hi, tuple(blocks[k]), tuple(boxes[k])) for k, (path, lo, hi) in enumerate(spans))
    return ReadPlan(runs, tuple(extents), max((r.nbytes for r in runs), default=0), read, unverified, bytes_verified)


def src_view(slot: torch.Tensor, box: Box, e: Extent) -> torch.Tensor:
    """The strided sub-box ``box.piece`` of its source chunk, as it lies in ``slot`` (uint8, the run's bytes)."""
    p = box.piece
    a, b = span(p)
    raw = slot[box.at : box.at + (b - a) * e.itemsize]
    if box.at % e.itemsize:  # a valid but unaligned file: view a copy
        raw = raw.clone()
    flat = raw.view(e.dtype)
    return flat.as_strided(p.shape, _strides(p.src_rect), flat.storage_offset())


class _Inline:
    """A pool of no threads: each task runs when submitted, on the calling thread (its error kept in its future)."""

    def submit(self, fn: Callable[..., None], *args: object) -> Future:
        fut: Future = Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as err:  # handed to the caller by fut.result(), as a pool's would be
            fut.set_exception(err)
        return fut

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        return None


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _ring_shape(plan: ReadPlan, threads: int | None, budget: int | None) -> tuple[int, int]:
    """The ring's slots (at least two, within ``budget``) and the reader threads worth starting for ``plan``."""
    threads = threads or default_threads()
    budget = staging_bytes() if budget is None else budget
    count = max(2, min(threads + 2, len(plan.runs), budget // max(1, plan.slot_bytes)))
    threads = max(1, min(threads, count, len(plan.runs), -(-sum(r.nbytes for r in plan.runs) // RUN_BYTES)))
    return count, threads


def _fill(fd: int, run: Run, view: memoryview, rank: int) -> None:
    """Read ``run``'s bytes into ``view`` with ``os.preadv``; a short read or an I/O error names the file."""
    kind = fault_kind("load.preadv", rank)
    want = run.nbytes // 2 if kind == "short" else run.nbytes
    got = 0
    try:
        if kind != "short":
            fail("load.preadv", rank, kind)
        while got < want:
            n = os.preadv(fd, [view[got:want]], run.start + got)
            if n == 0:
                break
            got += n
    except OSError as err:
        raise CheckpointFileError(f"{run.path}: reading bytes {run.start}-{run.stop} failed: {err}") from err
    if got < run.nbytes:
        raise CheckpointFileError(f"{run.path}: short read: {got} of bytes {run.start}-{run.stop} "
                                  "(truncated or damaged)")


def _check_run(run: Run, view: memoryview, extents: tuple[Extent, ...]) -> None:
    """Check the CRC-32 of every block ``run`` names; a mismatch names the chunk and the block."""
    for blk in run.blocks:
        crc = crc32(view[blk.at : blk.at + blk.nbytes])
        if crc != blk.expected:
            e = extents[blk.extent]
            start = blk.index * (e.block_bytes or 0)
            if e.whole:
                raise CheckpointFileError(f"{e.where} fails its checksum (crc32 {crc:#010x}, recorded "
                                          f"{blk.expected:#010x}): the file is damaged")
            raise CheckpointFileError(
                f"{e.where} fails its checksum in block {blk.index} (bytes {start}-{start + blk.nbytes}, "
                f"crc32 {crc:#010x}, recorded {blk.expected:#010x}): the file is damaged")


def _read_run(run: Run, slot: torch.Tensor, fd: int, rank: int, extents: tuple[Extent, ...],
              dst_view: Callable[[Piece], torch.Tensor], on_host: bool) -> None:
    """A reader thread's work: read ``run`` into ``slot``, check its blocks and, for a CPU destination, place it."""
    view = memoryview(slot[: run.nbytes].numpy())
    _fill(fd, run, view, rank)
    _check_run(run, view, extents)
    if on_host:
        with torch.no_grad():
            for box in run.boxes:
                dst_view(box.piece).copy_(src_view(slot, box, extents[box.extent]))


def _place(ring: StagingRing, i: int, run: Run, fut: Future, extents: tuple[Extent, ...],
           dst_view: Callable[[Piece], torch.Tensor], on_host: bool) -> None:
    """Wait for the read into slot ``i``; for a GPU destination, send the slot over and scatter its boxes there."""
    fut.result()
    if not on_host:
        staged = ring.to_device(i, run.nbytes)
        with ring.side(), torch.no_grad():
            for box in run.boxes:
                dst_view(box.piece).copy_(src_view(staged, box, extents[box.extent]))
        ring.release(i)


def _announce(plan: ReadPlan, fds: dict[str, int], k: int, ahead: int, announced: int) -> tuple[int, int]:
    """Tell the kernel of run ``k`` and the runs up to :data:`PREFETCH_BYTES` beyond it not yet announced; returns
    the next run to announce and the bytes announced past run ``k``."""
    while ahead < len(plan.runs) and (ahead <= k or announced < PREFETCH_BYTES):
        r = plan.runs[ahead]
        prefetch.advise(fds[r.path], r.start, r.nbytes)
        announced += r.nbytes
        ahead += 1
    return ahead, announced - plan.runs[k].nbytes


def _stream(plan: ReadPlan, fds: dict[str, int], ring: StagingRing, pool: ThreadPoolExecutor | _Inline, count: int,
            pending: deque[tuple[int, Run, Future]], dst_view: Callable[[Piece], torch.Tensor], on_host: bool) -> None:
    """Submit every run into a free slot of the ring (placing the oldest read when none is free), the kernel told of
    the reads ahead, then place the rest."""
    free = deque(range(count))
    rank = _rank()
    hint = prefetch.enabled()
    ahead = announced = 0  # runs announced to the kernel, and their bytes not yet submitted
    for k, run in enumerate(plan.runs):
        if hint:
            ahead, announced = _announce(plan, fds, k, ahead, announced)
        if not free:
            i, done, fut = pending.popleft()
            _place(ring, i, done, fut, plan.extents, dst_view, on_host)
            free.append(i)
        i = free.popleft()
        pending.append((i, run, pool.submit(_read_run, run, ring.acquire(i), fds[run.path], rank, plan.extents,
                                            dst_view, on_host)))
    while pending:
        i, done, fut = pending.popleft()
        _place(ring, i, done, fut, plan.extents, dst_view, on_host)


def _open_all(plan: ReadPlan, fds: dict[str, int]) -> None:
    """Open each file ``plan`` reads once, into ``fds`` as it goes (so the caller closes whatever was opened)."""
    for path in dict.fromkeys(r.path for r in plan.runs):
        try:
            fds[path] = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as err:
            raise CheckpointFileError(f"{path}: cannot open for reading: {err}") from err


def read_runs(plan: ReadPlan, dst_view: Callable[[Piece], torch.Tensor], device: torch.device,
              threads: int | None = None, budget: int | None = None) -> None:
    """Carry out ``plan``: reads in ``threads`` threads into a ring of slots within ``budget`` bytes (default
    ``TENPLEX_STAGING_MB``; at least two slots), checks, copies into ``dst_view(piece)`` (the destination box)."""
    if not plan.runs:
        return
    count, threads = _ring_shape(plan, threads, budget)
    on_host = device.type != "cuda"
    fds: dict[str, int] = {}
    try:
        _open_all(plan, fds)
        with StagingRing(device, plan.slot_bytes, count) as ring:
            # one thread's worth of work (a small load): read on this thread, no pool to start and join
            pool = ThreadPoolExecutor(threads, thread_name_prefix="tenplex-read") if threads > 1 else _Inline()
            pending: deque[tuple[int, Run, Future]] = deque()
            try:
                _stream(plan, fds, ring, pool, count, pending, dst_view, on_host)
            finally:
                pool.shutdown(wait=True, cancel_futures=True)  # no thread writes into the ring once it is freed
                pending.clear()
    finally:
        for fd in fds.values():
            os.close(fd)
