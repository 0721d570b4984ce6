"""The parallel reader (``storage/parallel_read.py``) on the CPU: byte for byte against the direct path at several
thread counts and staging budgets, its runs' index arithmetic, and every fault it must name (a truncated file, a
flipped byte in any block, a short read, an I/O error in one reader thread), the ring freed after each."""

from __future__ import annotations

import gc
import math
import os
import re
import tempfile
import weakref
from unittest import mock

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tenplex_megatron.storage.parallel_read as parallel_read
from tenplex_megatron.execute.executor import execute_plan, parallel_blocks, prepare_sources
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.planner import Piece, plan_reshard
from tenplex_megatron.plan.sim.sharding import layout_chunks
from tenplex_megatron.plan.verify_share import blocks
from tenplex_megatron.storage.parallel_read import ALIGN, default_threads, plan_runs, span, split_at, split_span
from tenplex_megatron.storage.safetensors_io import CheckpointFileError, read_header
from tenplex_megatron.storage.source_files import SourceFiles
from tenplex_megatron.storage.staging import StagingRing
from tests.staging_support import BLOCK, staging_tensors, write_source

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.function_scoped_fixture])
layouts = st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.sampled_from([1, 2]), st.booleans())


def _source(root: str, src=(2, 1, 1, False), seed: int = 0, d: int = 2, layers: int = 2):
    tensors = staging_tensors(d, layers)
    gen = torch.Generator().manual_seed(seed)
    full = {k: torch.randn(t.global_shape, generator=gen).to(getattr(torch, t.dtype)) for k, t in tensors.items()}
    return tensors, write_source(root, tensors, ParallelLayout(*src[:3]), src[3], full)


def _load(root: str, tensors, rp, sources, mode: str, threads: int = 2, mb: float = 256,
          verify: bool = True, peer_checked: frozenset = frozenset()) -> tuple[list[torch.Tensor], object]:
    """One rank's load as ``engine.load`` does it (open and verify, then copy), through ``TENPLEX_STAGING=mode``
    (set and restored here: hypothesis examples cannot use a function-scoped monkeypatch)."""
    env = {"TENPLEX_STAGING": mode, "TENPLEX_READ_THREADS": str(threads), "TENPLEX_STAGING_MB": str(mb)}
    with mock.patch.dict(os.environ, env):
        files = SourceFiles(root, {k: m.dtype for k, m in tensors.items()}, verify=verify, require_checksums=verify)
        out = [torch.full((c.numel,), 7, dtype=getattr(torch, tensors[c.key].dtype)) for c in rp.chunks]
        try:
            prepare_sources(rp, sources, files)
            stats = execute_plan(rp, sources, files, out, peer_checked)
        finally:
            files.close()
    return out, stats


@SETTINGS
@given(layouts, layouts, st.sampled_from([1, 2, 3]), st.sampled_from([1, 2, 4]),
       st.sampled_from([0.0001, 0.002, 0.05, 256]), st.integers(0, 2**31 - 1))
def test_parallel_matches_direct_bit_for_bit(src, dst, d, threads, mb, seed) -> None:
    tensors = staging_tensors(d, 2)
    with tempfile.TemporaryDirectory() as root:
        tensors, source = _source(root, src, seed, d)
        plan = plan_reshard(source, tensors, layout_chunks(tensors, ParallelLayout(*dst[:3]), dst[3]), strict=False)
        rp = plan.ranks[seed % len(plan.ranks)]
        direct, sd = _load(root, tensors, rp, plan.sources, "direct")
        par, sp = _load(root, tensors, rp, plan.sources, "parallel", threads=threads, mb=mb)
    for c, a, b in zip(rp.chunks, direct, par):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), c
    assert sp.bytes_read == sd.bytes_read == rp.bytes_read and sp.bytes_filled == sd.bytes_filled
    assert sp.bytes_unverified == 0 and sp.bytes_verified >= sp.bytes_read // 2


def test_parallel_unverified_counts_every_byte(tmp_path) -> None:
    tensors, source = _source(str(tmp_path))
    plan = plan_reshard(source, tensors, layout_chunks(tensors, ParallelLayout(4, 1, 1), False), strict=False)
    rp = plan.ranks[1]
    direct, _ = _load(str(tmp_path), tensors, rp, plan.sources, "direct", verify=False)
    par, stats = _load(str(tmp_path), tensors, rp, plan.sources, "parallel", verify=False)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(direct, par))
    assert stats.bytes_unverified == stats.bytes_read == rp.bytes_read and stats.bytes_verified == 0


@st.composite
def pieces(draw) -> Piece:
    nd = draw(st.integers(1, 3))
    rect = tuple(draw(st.integers(1, 7)) for _ in range(nd))
    shape = tuple(draw(st.integers(1, n)) for n in rect)
    sel = tuple(draw(st.integers(0, n - s)) for n, s in zip(rect, shape))
    return Piece(0, draw(st.integers(0, 9)), rect, sel, 0, 0, shape, (0,) * nd, shape)


def _elements(p: Piece) -> list[int]:
    st_ = [math.prod(p.src_rect[i + 1 :]) for i in range(len(p.shape))]
    out = []
    for n in range(p.numel):
        idx = [(n // math.prod(p.shape[d + 1 :])) % p.shape[d] for d in range(len(p.shape))]
        out.append(p.src_start + sum((s + i) * k for s, i, k in zip(p.src_sel, idx, st_)))
    return out


@SETTINGS
@given(pieces(), st.integers(1, 30))
def test_split_span_covers_each_element_once_within_the_cap(p: Piece, cap: int) -> None:
    boxes = split_span(p, cap)
    assert sorted(e for b in boxes for e in _elements(b)) == sorted(_elements(p))
    assert all(b.numel == 1 or span(b)[1] - span(b)[0] <= cap for b in boxes)


@SETTINGS
@given(pieces(), st.data())
def test_split_at_ends_the_first_box_by_the_limit_and_covers_each_element_once(p: Piece, data) -> None:
    first, stop = span(p)
    if stop - first < 2:
        return
    limit = data.draw(st.integers(first + 1, stop - 1))
    boxes = split_at(p, limit)
    assert span(boxes[0])[0] == first and span(boxes[0])[1] <= limit
    assert sorted(e for b in boxes for e in _elements(b)) == sorted(_elements(p))
    assert len(boxes) <= 2 * len(p.shape)  # one cut per dimension at most, not halves of halves


@SETTINGS
@given(layouts, layouts, st.sampled_from([ALIGN, 3 * ALIGN, 1024, 4 << 20]), st.integers(0, 2**31 - 1))
def test_runs_fit_a_slot_and_read_every_piece_and_block_once(src, dst, slot, seed) -> None:
    with tempfile.TemporaryDirectory() as root:
        tensors, source = _source(root, src, seed)
        plan = plan_reshard(source, tensors, layout_chunks(tensors, ParallelLayout(*dst[:3]), dst[3]), strict=False)
        rp = plan.ranks[seed % len(plan.ranks)]
        files = SourceFiles(root, {k: m.dtype for k, m in tensors.items()})
        extents = [files.extent(sc) for sc in plan.sources]
        files.close()
    read = plan_runs(rp.pieces, extents, slot)
    assert read.slot_bytes <= max(slot, BLOCK + 2 * ALIGN)
    placed: dict[int, list[int]] = {}
    blocks = []
    for r in read.runs:
        assert 0 < r.nbytes <= read.slot_bytes and r.start % ALIGN == 0
        for b in r.boxes:
            e = extents[b.extent]
            lo, hi = span(b.piece)
            assert 0 <= b.at and b.at + (hi - lo) * e.itemsize <= r.nbytes
            assert r.start + b.at == e.offset + lo * e.itemsize
            placed.setdefault(b.extent, []).extend(_elements(b.piece))
        for blk in r.blocks:
            assert 0 <= blk.at and blk.at + blk.nbytes <= r.nbytes
            blocks.append((blk.extent, blk.index))
    want: dict[int, list[int]] = {}
    for p in rp.pieces:
        want.setdefault(p.source, []).extend(_elements(p))
    assert {k: sorted(v) for k, v in placed.items()} == {k: sorted(v) for k, v in want.items()}
    assert len(blocks) == len(set(blocks)) and read.bytes_verified == sum(
        min(BLOCK, extents[e].nbytes - i * BLOCK) for e, i in blocks)


class RecordingRing(StagingRing):
    """The real ring, remembering itself and weak references to its buffers."""

    made: list[RecordingRing] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.buffers = [weakref.ref(b) for b in self.host]
        RecordingRing.made.append(self)


@pytest.fixture
def case(tmp_path, monkeypatch):
    """A TP2 source read at TP1 by rank 0 through the parallel reader with small slots, its ring recorded."""
    RecordingRing.made = []
    monkeypatch.setattr(parallel_read, "StagingRing", RecordingRing)
    tensors, source = _source(str(tmp_path), d=16, layers=3)
    plan = plan_reshard(source, tensors, layout_chunks(tensors, ParallelLayout(1, 1, 1), False), strict=False)
    return tensors, plan.ranks[0], plan.sources


def _load_fails(tmp_path, case, match: str, **kw) -> None:
    tensors, rp, sources = case
    with pytest.raises(CheckpointFileError, match=match):
        _load(str(tmp_path), tensors, rp, sources, "parallel", mb=0.002, **kw)
    gc.collect()
    assert RecordingRing.made and all(r.closed and r.host == [] for r in RecordingRing.made)
    assert all(b() is None for r in RecordingRing.made for b in r.buffers), "a ring buffer is still referenced"


def _flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ 0x04]))


def test_a_flipped_byte_in_any_block_names_the_file_and_the_block(tmp_path, case) -> None:
    tensors, rp, sources = case
    used = {sources[p.source] for p in rp.pieces}
    sc = max(used, key=lambda s: s.chunk.numel)
    path = os.path.join(str(tmp_path), sc.location.file)
    entry = read_header(path)[0][sc.location.name]
    assert entry.end - entry.begin > 2 * BLOCK  # several blocks, read in several runs of small slots
    for block in range(-(-(entry.end - entry.begin) // BLOCK)):
        at = entry.begin + min(block * BLOCK + 5, entry.end - entry.begin - 1)
        _flip(path, at)
        _load_fails(tmp_path, case, rf"{re.escape(path)}: tensor {re.escape(repr(sc.location.name))}.* fails its "
                                    rf"checksum in block {block} ")
        _flip(path, at)
    _load(str(tmp_path), tensors, rp, sources, "parallel", mb=0.002)  # undamaged again: loads


def test_a_truncated_file_is_named_before_anything_is_read(tmp_path, case) -> None:
    tensors, rp, sources = case
    path = os.path.join(str(tmp_path), sources[rp.pieces[-1].source].location.file)
    os.truncate(path, os.path.getsize(path) - 3)
    with pytest.raises(CheckpointFileError, match=rf"{re.escape(path)}: .*truncated"):
        _load(str(tmp_path), tensors, rp, sources, "parallel")
    assert RecordingRing.made == []  # refused while opening: no ring was made


@pytest.mark.parametrize("threads", [1, 3])
def test_a_short_read_is_an_error_naming_the_file(tmp_path, case, monkeypatch, threads: int) -> None:
    monkeypatch.setenv("TENPLEX_FAULT", "load.preadv:short")
    _load_fails(tmp_path, case, r"\.safetensors: short read: ", threads=threads)


@pytest.mark.parametrize("threads", [1, 3])
def test_an_io_error_in_one_reader_thread_names_the_file(tmp_path, case, monkeypatch, threads: int) -> None:
    monkeypatch.setenv("TENPLEX_FAULT", "load.preadv:eio")
    monkeypatch.setenv("TENPLEX_FAULT_ONCE", str(tmp_path / "fired"))  # one read of one thread fails, the rest run
    _load_fails(tmp_path, case, r"\.safetensors: reading bytes \d+-\d+ failed: .*Input/output error", threads=threads)
    assert (tmp_path / "fired").exists()


def test_default_threads_share_the_cpus_among_local_ranks(monkeypatch) -> None:
    monkeypatch.setenv("TENPLEX_READ_THREADS", "5")
    assert default_threads() == 5
    monkeypatch.setenv("TENPLEX_READ_THREADS", "0")
    with pytest.raises(ValueError, match="TENPLEX_READ_THREADS='0'"):
        default_threads()
    monkeypatch.delenv("TENPLEX_READ_THREADS")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(10_000))
    assert default_threads() == 1


def test_reads_are_announced_ahead_within_the_window(tmp_path, monkeypatch) -> None:
    tensors, source = _source(str(tmp_path), d=16, layers=3)
    plan = plan_reshard(source, tensors, layout_chunks(tensors, ParallelLayout(1, 1, 1), False), strict=False)
    rp = plan.ranks[0]
    events: list[tuple[str, int, int]] = []
    real_preadv = os.preadv
    monkeypatch.setattr(parallel_read.prefetch, "advise", lambda fd, off, n: events.append(("advise", off, n)))
    monkeypatch.setattr(parallel_read.os, "preadv",
                        lambda fd, bufs, off: (events.append(("read", off, 0)), real_preadv(fd, bufs, off))[1])
    monkeypatch.setattr(parallel_read, "PREFETCH_BYTES", 3 * 4096)
    _load(str(tmp_path), tensors, rp, plan.sources, "parallel", threads=1, mb=0.01)
    advised = [(off, n) for kind, off, n in events if kind == "advise"]
    reads = [off for kind, off, _ in events if kind == "read"]
    assert len(advised) > 3 and sorted(reads) == sorted(off for off, _ in advised)  # every read announced once
    for i, (kind, off, _) in enumerate(events):
        if kind == "read":
            assert ("advise", off) in [(k, o) for k, o, _ in events[:i]]  # ...before it is read
    size = dict(advised)
    outstanding = worst = 0  # bytes announced and not yet read
    for kind, off, n in events:
        outstanding += n if kind == "advise" else -size.get(off, 0)
        worst = max(worst, outstanding)
    assert worst <= 3 * 4096 + max(size.values())  # never more than the window and one run ahead
    events.clear()
    monkeypatch.setenv("TENPLEX_PREFETCH", "0")
    _load(str(tmp_path), tensors, rp, plan.sources, "parallel", threads=1, mb=0.01)
    assert events and not [e for e in events if e[0] == "advise"]


def test_blocks_a_peer_checks_are_read_but_not_checked_here(tmp_path) -> None:
    # TP2 -> TP1: the plan's blocks split in two; a flipped byte in the half left to a peer is not this rank's to
    # find, one in its own half is
    tensors, source = _source(str(tmp_path), d=16, layers=3)
    plan = plan_reshard(source, tensors, layout_chunks(tensors, ParallelLayout(1, 1, 1), False), strict=False)
    rp = plan.ranks[0]
    with mock.patch.dict(os.environ, {"TENPLEX_STAGING": "parallel", "TENPLEX_STAGING_MB": "0.01"}):
        files = SourceFiles(str(tmp_path), {k: m.dtype for k, m in tensors.items()})
        every = list(blocks(parallel_blocks(rp, plan.sources, files)))
        size = {(s, b): min(BLOCK, files.extent(plan.sources[s]).nbytes - b * BLOCK) for s, b in every}
        files.close()
    assert len(every) > 4
    peer = frozenset(every[::2])
    sc = plan.sources[every[0][0]]
    path = os.path.join(str(tmp_path), sc.location.file)
    entry = read_header(path)[0][sc.location.name]
    _flip(path, entry.begin + every[0][1] * BLOCK + 3)  # a block the peer checks: every[0] is in every[::2]

    _, stats = _load(str(tmp_path), tensors, rp, plan.sources, "parallel", mb=0.01, peer_checked=peer)
    assert stats.bytes_verified == sum(n for k, n in size.items() if k not in peer) < sum(size.values())
    with pytest.raises(CheckpointFileError, match=rf"fails its checksum in block {every[0][1]} "):
        # the damaged block is this rank's own
        _load(str(tmp_path), tensors, rp, plan.sources, "parallel", mb=0.01, peer_checked=frozenset(every[1::2]))
