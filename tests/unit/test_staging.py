"""Staged assembly and staged save on the CPU: the GPU path's indexing checked bit for bit against the direct path.

Random TP/PP/DP transitions over random tensor shapes (hypothesis): source
shards written by the real writer, one destination rank's plan executed
through staging buffers (as small as 64 bytes: pieces split, buffers reused)
and by per-piece copies, the results compared element by element with each
other and with the original tensors; checksums verified throughout.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import tempfile
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenplex_megatron.execute.executor import execute_plan
from tenplex_megatron.execute.staged import box_view, execute_staged
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.planner import Piece, plan_reshard
from tenplex_megatron.plan.sim.sharding import layout_chunks
from tenplex_megatron.plan.staging import ALIGN, split_piece, stage_batches
from tenplex_megatron.storage.safetensors_io import CheckpointFileError, block_crc32, read_header, write_safetensors
from tenplex_megatron.storage.source_files import SourceFiles
from tenplex_megatron.storage.staged_write import write_tensors
from tenplex_megatron.storage.staging import buffer_bytes, staging_bytes, staging_mode, write_mode
from tests.staging_support import staging_tensors, write_source

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@contextlib.contextmanager
def _mode(mode: str) -> Iterator[None]:
    """``TENPLEX_STAGING=mode`` for the block (hypothesis tests cannot use monkeypatch), then as it was."""
    old = os.environ.get("TENPLEX_STAGING")
    os.environ["TENPLEX_STAGING"] = mode
    try:
        yield
    finally:
        if old is None:
            del os.environ["TENPLEX_STAGING"]
        else:
            os.environ["TENPLEX_STAGING"] = old


def _elements(p: Piece) -> list[tuple[int, int]]:
    """(source flat index, destination flat index) of each element of ``p``, in row-major order of its box."""
    def flat(start: int, rect: tuple[int, ...], idx: tuple[int, ...]) -> int:
        return start + sum(i * math.prod(rect[d + 1 :]) for d, i in enumerate(idx))

    out = []
    for n in range(p.numel):
        idx = tuple((n // math.prod(p.shape[d + 1 :])) % p.shape[d] for d in range(len(p.shape)))
        out.append((flat(p.src_start, p.src_rect, tuple(a + b for a, b in zip(p.src_sel, idx))),
                    flat(p.dst_start, p.dst_rect, tuple(a + b for a, b in zip(p.dst_sel, idx)))))
    return out


@st.composite
def pieces(draw) -> Piece:
    nd = draw(st.integers(1, 3))
    rect = tuple(draw(st.integers(1, 6)) for _ in range(nd))
    shape = tuple(draw(st.integers(1, n)) for n in rect)
    sel = tuple(draw(st.integers(0, n - s)) for n, s in zip(rect, shape))
    drect = tuple(s + draw(st.integers(0, 2)) for s in shape)
    dsel = tuple(draw(st.integers(0, n - s)) for n, s in zip(drect, shape))
    return Piece(draw(st.integers(0, 2)), draw(st.integers(0, 5)), rect, sel, 0, draw(st.integers(0, 5)), drect, dsel,
                 shape)


@SETTINGS
@given(pieces(), st.integers(1, 40))
def test_split_piece_covers_each_element_once_in_order(p: Piece, cap: int) -> None:
    boxes = split_piece(p, cap)
    assert all(0 < b.numel <= cap for b in boxes)
    assert [e for b in boxes for e in _elements(b)] == _elements(p)


@SETTINGS
@given(st.lists(pieces(), min_size=1, max_size=6), st.integers(ALIGN, 4 * ALIGN), st.sampled_from([1, 2, 4, 8]))
def test_batches_fit_and_cover_every_piece(ps: list[Piece], cap: int, size: int) -> None:
    batches = stage_batches(ps, lambda p: size, cap)
    seen: dict[int, list[tuple[int, int]]] = {i: [] for i in range(len(ps))}
    for b in batches:
        assert 0 < b.nbytes <= cap
        end = 0
        for s in b.slots:
            assert s.offset % ALIGN == 0 and s.offset >= end and s.nbytes == s.box.numel * size
            end = s.offset + s.nbytes
            seen[s.index] += _elements(s.box)
        assert end == b.nbytes
    assert all(seen[i] == _elements(p) for i, p in enumerate(ps))


layouts = st.tuples(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]), st.sampled_from([1, 2]), st.booleans())


@SETTINGS
@given(layouts, layouts, st.integers(1, 3), st.sampled_from([2, 4]), st.sampled_from([64, 192, 1024, 1 << 20]),
       st.sampled_from([1, 2, 3]), st.integers(0, 2**31 - 1))
def test_staged_copy_matches_direct_bit_for_bit(src, dst, d, layers, total, count, seed) -> None:
    tensors = staging_tensors(d, layers)
    gen = torch.Generator().manual_seed(seed)
    full = {k: torch.randn(t.global_shape, generator=gen).to(getattr(torch, t.dtype)) for k, t in tensors.items()}
    with tempfile.TemporaryDirectory() as root:
        source = write_source(root, tensors, ParallelLayout(*src[:3]), src[3], full)
        want = layout_chunks(tensors, ParallelLayout(*dst[:3]), dst[3])
        plan = plan_reshard(source, tensors, want, strict=False)
        rank = seed % len(plan.ranks)
        rp = plan.ranks[rank]
        outs = []
        for mode in ("direct", "copy"):
            files = SourceFiles(root, {k: m.dtype for k, m in tensors.items()}, verify=True, require_checksums=True)
            out = [torch.full((c.numel,), 7, dtype=getattr(torch, tensors[c.key].dtype)) for c in rp.chunks]
            try:
                if mode == "direct":
                    with _mode("direct"):
                        stats = execute_plan(rp, plan.sources, files, out)
                    read, unverified = stats.bytes_read, stats.bytes_unverified
                else:
                    read, unverified = execute_staged(rp, plan.sources, files, out, {}, total, count)
                    for f in rp.fills:  # what execute_plan does after either path
                        box_view(out[f.dst], f.dst_start, f.dst_rect, f.dst_sel, f.shape).zero_()
            finally:
                files.close()
            assert unverified == 0
            outs.append((out, read))
        (direct, read_d), (copy, read_c) = outs
        assert read_c == read_d == rp.bytes_read
        for c, a, b in zip(rp.chunks, direct, copy):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), c
            meta = tensors[c.key]
            box = full[c.key][tuple(slice(o, o + n) for o, n in zip(c.offsets, c.shape))].reshape(-1)
            lo, hi = c.flat_range
            real = torch.ones(c.shape, dtype=torch.bool)
            if meta.vocab_rows is not None:  # padding rows the source did not hold: the plan does not copy them
                real[max(0, meta.vocab_rows - c.offsets[0]):] = False
            keep = real.reshape(-1)[lo:hi]
            assert torch.equal(b[keep], box[lo:hi][keep]), c


def test_staged_copy_detects_a_damaged_block(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TENPLEX_STAGING", "copy")
    monkeypatch.setenv("TENPLEX_STAGING_MB", "0.0005")  # 524-byte budget: many tiny buffers
    tensors = staging_tensors(2, 2)
    full = {k: torch.randn(t.global_shape).to(getattr(torch, t.dtype)) for k, t in tensors.items()}
    source = write_source(str(tmp_path), tensors, ParallelLayout(2, 1, 1), False, full)
    plan = plan_reshard(source, tensors, layout_chunks(tensors, ParallelLayout(1, 2, 1), False), strict=False)
    rp = plan.ranks[0]
    sc = plan.sources[rp.pieces[0].source]
    path = str(tmp_path / sc.location.file)
    begin = read_header(path)[0][sc.location.name].begin
    with open(path, "r+b") as f:
        f.seek(begin + 3)
        b = f.read(1)[0]
        f.seek(begin + 3)
        f.write(bytes([b ^ 0x10]))
    files = SourceFiles(str(tmp_path), {k: m.dtype for k, m in tensors.items()})
    out = [torch.empty(c.numel, dtype=getattr(torch, tensors[c.key].dtype)) for c in rp.chunks]
    with pytest.raises(CheckpointFileError, match=re.escape(sc.location.name) + ".*block 0"):
        execute_plan(rp, plan.sources, files, out)
    files.close()


@settings(max_examples=15, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 700), st.sampled_from(["float32", "bfloat16", "int64", "uint8"])),
                min_size=1, max_size=5),
       st.sampled_from([64, 128, 320, 4096]), st.sampled_from([1, 2, 3]), st.sampled_from([7, 64, 256, 1 << 20]))
def test_staged_save_writes_the_same_bytes_and_checksums(specs, total, count, block) -> None:
    tensors = {f"t{i}": torch.randint(0, 100, (n,)).to(getattr(torch, dt)) for i, (n, dt) in enumerate(specs)}
    files = []
    for mode in ("direct", "copy"):
        with _mode(mode):
            f = io.BytesIO()
            sums = write_tensors(f, tensors, block, total, count)
        files.append((f.getvalue(), sums))
    assert files[0] == files[1]
    raw = b"".join(t.view(torch.uint8).numpy().tobytes() for t in tensors.values())
    assert files[0][0] == raw
    assert files[0][1] == {k: block_crc32(t, block) for k, t in tensors.items()}  # the writer's reference sums


def test_staged_save_file_is_byte_identical(tmp_path, monkeypatch) -> None:
    tensors = {"a": torch.randn(1000), "b": torch.randn(33, 7).to(torch.bfloat16), "c": torch.zeros(0)}
    got = []
    for mode in ("direct", "copy"):
        monkeypatch.setenv("TENPLEX_STAGING", mode)
        monkeypatch.setenv("TENPLEX_STAGING_MB", "0.001")
        path = str(tmp_path / f"{mode}.safetensors")
        size, sums = write_safetensors(path, tensors, block_bytes=512)
        with open(path, "rb") as f:
            got.append((f.read(), size, sums))
    assert got[0] == got[1]


def test_settings_are_checked(monkeypatch) -> None:
    monkeypatch.setenv("TENPLEX_STAGING", "zero")
    with pytest.raises(ValueError, match="TENPLEX_STAGING='zero'"):
        staging_mode(torch.device("cpu"))
    monkeypatch.setenv("TENPLEX_STAGING", "auto")
    # the default of a load and of a save on any device: the reader and writer threads
    for dev in (torch.device("cpu"), torch.device("cuda")):
        assert staging_mode(dev) == "parallel" and write_mode(dev) == "parallel"
    monkeypatch.setenv("TENPLEX_STAGING", "serial")  # one thread: the staging ring for a GPU, the file's map on a CPU
    for mode in (staging_mode, write_mode):
        assert mode(torch.device("cpu")) == "direct" and mode(torch.device("cuda")) == "copy"
    monkeypatch.setenv("TENPLEX_STAGING_MB", "lots")
    with pytest.raises(ValueError, match="TENPLEX_STAGING_MB='lots'"):
        staging_bytes()
    monkeypatch.setenv("TENPLEX_STAGING_MB", "3")
    assert staging_bytes() == 3 << 20 and buffer_bytes(count=3) == 1 << 20
