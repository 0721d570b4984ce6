"""Carry out one destination rank's part of a re-sharding plan with torch.

Each piece is a strided sub-box of a source rectangle (a zero-copy view of a
memory-mapped shard file) copied into a strided sub-box of a destination
tensor, which lives wherever the model lives (the GPU in production), so the
assembly happens on the device and only the needed pages are read: through
staging buffers (``staged.py``, a GPU's default) or one copy per piece.
Checksums are checked only over the blocks the pieces read (``verify.py``).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from tenplex_megatron.execute.staged import box_view, execute_staged
from tenplex_megatron.plan.planner import Piece, RankPlan
from tenplex_megatron.plan.ptc import StoredChunk
from tenplex_megatron.plan.verify_share import Interval, to_intervals
from tenplex_megatron.storage.block_verify import Block, piece_runs
from tenplex_megatron.storage.parallel_read import Extent, ReadPlan, checked_blocks, plan_runs, read_runs, slot_size
from tenplex_megatron.storage.prefetch import willneed
from tenplex_megatron.storage.source import Source
from tenplex_megatron.storage.staging import staging_mode


@dataclass(frozen=True)
class ExecStats:
    """What one rank did: bytes copied from sources, zero-filled, files opened, seconds, and how much was verified.

    ``bytes_verified``: stored bytes whose checksum this rank checked (the
    blocks its pieces overlap, less those another rank of its host checks;
    whole chunks for format-1 single CRCs). ``bytes_unverified``: bytes it
    copied that no checksum covered (verification off, or none recorded).
    ``bytes_fetched``: bytes it read out of files: the parallel reader's runs
    (whole blocks and the small gaps between pieces), else about
    ``bytes_verified + bytes_unverified``.
    """

    bytes_read: int
    bytes_filled: int
    files: int
    seconds: float
    bytes_verified: int = 0
    bytes_unverified: int = 0
    bytes_fetched: int = 0  # read out of files (storage or the page cache) by this rank, checked or not


def plain_ops() -> Any:
    """A context in which the executor's own tensor ops (views, host-side copies and checksums of tensors it was
    handed) skip torch-function dispatch where a ``TorchFunctionMode`` is installed (the CPU harness's device
    redirect, a tracer): it adds Python per op, ~20,000 ops in a 125M-parameter load, and has nothing to change
    in them. Without a mode nothing changes (tensor subclasses keep their ``__torch_function__``)."""
    if torch._C._len_torch_function_stack() == 0:
        return contextlib.nullcontext()
    return torch._C.DisableTorchFunction()


def _parallel() -> bool:
    """Whether this load reads through the parallel reader (``TENPLEX_STAGING``; any device's choice is the same)."""
    return staging_mode(torch.device("cpu")) == "parallel"


def prepare_sources(plan: RankPlan, sources: tuple[StoredChunk, ...], files: Source, check: bool = True) -> list[Block]:
    """Open every source chunk the plan reads and verify the blocks its pieces will copy, before anything is copied.

    ``check=False``: only queue the blocks and return them, for :func:`verify_blocks` to check a share of them.
    A source without checksums queues nothing: its chunks are just opened. Under the parallel reader, a chunk it
    reads from a file has its header and size checked here and its blocks checked by the thread that reads them.
    """
    flats: dict[int, torch.Tensor] = {}
    todo: list = []
    parallel = _parallel()
    direct: set[int] = set()
    for p in plan.pieces:
        if p.source in direct:
            continue
        src = flats.get(p.source)
        if src is None:
            if parallel and files.extent(sources[p.source]) is not None:
                direct.add(p.source)
                continue
            src = flats[p.source] = files.flat(sources[p.source])
        files.queue(sources[p.source], src, p, todo, p.source)
    if check:
        files.run(todo)  # all blocks at once
    return todo


def _in_files(plan: RankPlan, sources: tuple[StoredChunk, ...], files: Source,
              ) -> tuple[list[Extent], dict[int, int | None], list[Piece], list[Piece]]:
    """The plan's pieces split by where their chunks lie: in a file the parallel reader can read (re-indexed into
    the returned extents) or not (received bytes, formats without byte offsets); and each source's extent index
    (None: not in a file)."""
    extents: list[Extent] = []
    local: dict[int, int | None] = {}
    mine: list[Piece] = []
    rest: list[Piece] = []
    for p in plan.pieces:
        if p.source not in local:
            e = files.extent(sources[p.source])
            local[p.source] = len(extents) if e is not None else None
            if e is not None:
                extents.append(e)
        j = local[p.source]
        if j is None:
            rest.append(p)
        else:
            mine.append(replace(p, source=j))
    return extents, local, mine, rest


def parallel_blocks(plan: RankPlan, sources: tuple[StoredChunk, ...], files: Source) -> list[Interval]:
    """The checksum blocks the parallel reader checks for ``plan`` (chunks in files with per-block checksums), as
    (source, first, last) intervals: ranks of a host split them as they split :func:`block_intervals`' blocks."""
    if not _parallel() or not files.verifying:
        return []
    extents, local, mine, _ = _in_files(plan, sources, files)
    back = {j: s for s, j in local.items() if j is not None}
    return to_intervals((back[j], b) for j, blocks in checked_blocks(mine, extents).items() for b in blocks)


def block_intervals(todo: list[Block]) -> list[Interval]:
    """The queued blocks that ranks of a host may split among themselves, as (source, first, last) intervals."""
    return to_intervals((b.source, b.key[2]) for b in todo if b.shareable)


def verify_blocks(files: Source, todo: list[Block], mine: list[Interval] | None = None) -> None:
    """Check the queued blocks: all of them, or of the shareable ones only those in ``mine`` (a peer on this
    host checks the rest: the bytes are the same page-cache pages). Old whole-chunk checksums are always checked."""
    if not todo:  # nothing queued: verification off, or a source without checksums
        return
    if mine is not None:
        keep = {(s, b) for s, lo, hi in mine for b in range(lo, hi + 1)}
        todo = [b for b in todo if not b.shareable or (b.source, b.key[2]) in keep]
    files.run(todo)


def _piece_ranges(p: Piece, src: torch.Tensor) -> list[tuple[int, int]]:
    """The address ranges piece ``p`` reads of ``src`` (a source chunk's flat tensor): its contiguous runs, or its
    whole span when the gaps between runs are small (a strided TP slice reads every page of its span anyway)."""
    starts, run = piece_runs(p)
    if len(starts) == 0:
        return []
    base, size = src.data_ptr(), src.element_size()
    if len(starts) == 1 or (int(starts[1]) - int(starts[0]) - run) * size < 64 * 1024:
        return [(base + int(starts[0]) * size, base + (int(starts[-1]) + run) * size)]
    return [(base + a * size, base + (a + run) * size) for a in starts.tolist()]


def execute_plan(
    plan: RankPlan, sources: tuple[StoredChunk, ...], files: Source, dst: list[torch.Tensor],
    peer_checked: frozenset[tuple[int, int]] = frozenset(),
) -> ExecStats:
    """Fill ``dst`` (one flat tensor per destination chunk, in plan order) from the sources, verifying what it reads.

    Blocks already verified (by :func:`prepare_sources`) are not read again for their checksum. Pieces go
    through the parallel reader, through staging buffers (``execute/staged.py``) or are copied one by one from
    the file's map (``TENPLEX_STAGING``: ``storage/staging.py``). ``peer_checked``: (source, block) pairs of
    :func:`parallel_blocks` that another rank of this host checks (the same page-cache bytes): not checked here.
    """
    t0 = time.perf_counter()
    read = filled = unverified = 0
    device = dst[plan.pieces[0].dst].device if plan.pieces else torch.device("cpu")
    pieces = list(plan.pieces)
    opened = 0
    runs = None
    if _parallel():
        pieces, runs, opened = _read_parallel(plan, sources, files, dst, device, peer_checked)
        if runs is not None:
            read, unverified = runs.bytes_read, runs.bytes_unverified
    flats: dict[int, torch.Tensor] = {}
    if not files.verifying:  # verified blocks were announced before their checksums were computed
        ranges: list[tuple[int, int]] = []
        for p in pieces:
            src = flats.get(p.source)
            if src is None:
                src = flats[p.source] = files.flat(sources[p.source])
            if src.device.type == "cpu":
                ranges += _piece_ranges(p, src)
        willneed(ranges)
    for p in pieces:
        if p.source not in flats:
            flats[p.source] = files.flat(sources[p.source])
    staged = staging_mode(device) == "copy" and all(f.device.type == "cpu" for f in flats.values())
    with torch.no_grad():
        if staged:
            read, unverified = execute_staged(plan, sources, files, dst, flats)
        for p in () if staged else pieces:
            src = flats[p.source]
            covered = files.check(sources[p.source], src, p)
            s = box_view(src, p.src_start, p.src_rect, p.src_sel, p.shape)
            d = box_view(dst[p.dst], p.dst_start, p.dst_rect, p.dst_sel, p.shape)
            d.copy_(s)
            nbytes = s.numel() * s.element_size()
            read += nbytes
            if not covered:
                unverified += nbytes
        for f in plan.fills:
            d = box_view(dst[f.dst], f.dst_start, f.dst_rect, f.dst_sel, f.shape)
            d.zero_()
            filled += d.numel() * d.element_size()
    fetched = files.bytes_verified + unverified
    if runs is not None:  # its runs instead of its checked blocks and unverified bytes
        fetched += sum(r.nbytes for r in runs.runs) - runs.bytes_verified - runs.bytes_unverified
    return ExecStats(read, filled, len(files.readers) + opened, time.perf_counter() - t0, files.bytes_verified,
                     unverified, fetched)


def _read_parallel(plan: RankPlan, sources: tuple[StoredChunk, ...], files: Source, dst: list[torch.Tensor],
                   device: torch.device, peer_checked: frozenset[tuple[int, int]] = frozenset(),
                   ) -> tuple[list[Piece], ReadPlan | None, int]:
    """The pieces whose chunks lie in files, through the parallel reader; returns the other pieces (received
    bytes, formats without byte offsets), what it read (None: nothing) and the files read."""
    extents, local, mine, rest = _in_files(plan, sources, files)
    if not mine:
        return rest, None, 0
    verifier = getattr(files, "verifier", None)
    skip = set(verifier.verified) if verifier is not None else set()
    skip.update((*extents[j].key, b) for s, b in peer_checked if (j := local.get(s)) is not None)
    rp = plan_runs(mine, extents, slot_size(), skip)
    read_runs(rp, lambda p: box_view(dst[p.dst], p.dst_start, p.dst_rect, p.dst_sel, p.shape), device)
    files.read_done(rp)
    return rest, rp, len({e.path for e in extents})
