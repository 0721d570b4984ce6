"""Block checksums: a load verifies only the CRC-32 blocks overlapping what it copies, and catches damage there."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tenplex_megatron.engine.chunks import LocalChunk
from tenplex_megatron.engine.load import load_chunks
from tenplex_megatron.engine.save import save_chunks
from tenplex_megatron.execute.executor import ExecStats, execute_plan, prepare_sources
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.planner import Piece, plan_reshard
from tenplex_megatron.plan.ptc import PTC, Chunk, Location, PTCError, StoredChunk, TensorMeta
from tenplex_megatron.plan.sim.sharding import layout_chunks
from tenplex_megatron.storage.block_verify import default_threads, piece_runs, touched_blocks
from tenplex_megatron.storage.safetensors_io import (
    BLOCK_BYTES,
    CheckpointFileError,
    block_crc32,
    crc32,
    read_header,
    write_safetensors,
)
from tenplex_megatron.storage.source_files import SourceFiles
from tests.harness import downgrade_to_format_1, rewrite_metadata

FILE = "shard.safetensors"


def _store(tmp_path, data: dict[str, torch.Tensor], block_bytes: int | None, old_crc: bool = False) -> PTC:
    """Write each tensor as one stored chunk with block CRCs (``old_crc``: one CRC, as old checkpoints had)."""
    _, sums = write_safetensors(str(tmp_path / FILE), {k: t.reshape(-1) for k, t in data.items()},
                                block_bytes=block_bytes or BLOCK_BYTES)
    tensors = {k: TensorMeta(k, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for k, t in data.items()}
    chunks = []
    for k, t in data.items():
        if old_crc:
            loc = Location(FILE, k, crc32=crc32(t.contiguous()))
        else:
            loc = Location(FILE, k, block_crc32=sums[k], block_bytes=block_bytes or BLOCK_BYTES)
        chunks.append(StoredChunk(Chunk(k, (0,) * t.dim(), tuple(t.shape)), loc))
    return PTC(tensors, tuple(chunks))


def _load(tmp_path, source: PTC, want: list[Chunk], verify: bool = True) -> tuple[list[torch.Tensor], ExecStats]:
    """Plan and execute one rank's load of ``want`` as ``load_chunks`` does: verify up front, then copy."""
    plan = plan_reshard(source, source.tensors, {0: want}, strict=False)
    rp = plan.ranks[0]
    files = SourceFiles(str(tmp_path), {k: m.dtype for k, m in source.tensors.items()}, verify=verify)
    try:
        prepare_sources(rp, plan.sources, files)
        out = [torch.empty(c.numel, dtype=getattr(torch, source.tensors[c.key].dtype)) for c in rp.chunks]
        stats = execute_plan(rp, plan.sources, files, out)
    finally:
        files.close()
    return out, stats


def _flip(tmp_path, name: str, pos: int) -> None:
    """Flip one bit of byte ``pos`` of tensor ``name``'s data in the shard file."""
    path = str(tmp_path / FILE)
    begin = read_header(path)[0][name].begin
    with open(path, "r+b") as f:
        f.seek(begin + pos)
        b = f.read(1)[0]
        f.seek(begin + pos)
        f.write(bytes([b ^ 0x10]))


def _expected(w: torch.Tensor, c: Chunk) -> torch.Tensor:
    box = w[tuple(slice(o, o + n) for o, n in zip(c.offsets, c.shape))].reshape(-1)
    a, b = c.flat_range
    return box[a:b]


def _read_bytes(c: Chunk, cols: int, item: int) -> set[int]:
    """The bytes of a stored (rows, cols) tensor that box chunk ``c`` reads."""
    (r0, c0), (h, w) = c.offsets, c.shape
    return {((r0 + i) * cols + c0 + j) * item + k for i in range(h) for j in range(w) for k in range(item)}


W = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)  # 192 bytes, a row is 32


def test_flipped_byte_outside_the_read_blocks_passes_inside_fails_naming_file_tensor_block(tmp_path) -> None:
    source = _store(tmp_path, {"w": W}, block_bytes=32)  # one block per row
    want = [Chunk("w", (0, 0), (2, 8))]
    _flip(tmp_path, "w", 4 * 32 + 5)  # row 4: not read
    out, stats = _load(tmp_path, source, want)
    assert torch.equal(out[0], _expected(W, want[0]))
    assert stats.bytes_read == 64 and stats.bytes_verified == 64
    _flip(tmp_path, "w", 1 * 32 + 31)  # last byte of row 1: read
    with pytest.raises(CheckpointFileError) as e:
        _load(tmp_path, source, want)
    msg = str(e.value)
    assert FILE in msg and "tensor 'w'" in msg and "block 1" in msg and "fails its checksum" in msg
    out, stats = _load(tmp_path, source, want, verify=False)  # skipped: the damaged bytes come through
    assert not torch.equal(out[0], _expected(W, want[0])) and stats.bytes_verified == 0 and stats.bytes_read == 64


@pytest.mark.parametrize("block", [8, 20, 28, 32, 64, 4096])
@pytest.mark.parametrize("box", [((1, 0), (2, 8)), ((2, 3), (3, 4)), ((5, 7), (1, 1)), ((0, 0), (6, 8)), ((0, 0), (6, 2))])
def test_exactly_the_blocks_the_piece_reads_are_checked(tmp_path, block: int, box) -> None:
    """Every byte of the tensor in turn: damage is caught iff its block holds a byte the load copies.

    A column slice is strided: with blocks smaller than the gap between its rows, the blocks in the gaps are
    neither read nor checked.
    """
    source = _store(tmp_path, {"w": W}, block_bytes=block)
    want = Chunk("w", *box)
    blocks = {b // block for b in _read_bytes(want, 8, 4)}
    _, stats = _load(tmp_path, source, [want])
    assert stats.bytes_verified == sum(min(192, (b + 1) * block) - b * block for b in blocks)
    assert stats.bytes_read == want.numel * 4 and stats.bytes_unverified == 0
    for pos in range(192):
        _flip(tmp_path, "w", pos)
        if pos // block in blocks:
            with pytest.raises(CheckpointFileError, match=rf"{FILE}: tensor 'w' .*block {pos // block} "):
                _load(tmp_path, source, [want])
        else:
            out, _ = _load(tmp_path, source, [want])
            assert torch.equal(out[0], _expected(W, want))
        _flip(tmp_path, "w", pos)  # undo


@pytest.mark.parametrize(
    "starts,run,item,block,want",
    [
        ([0], 8, 4, 32, [0]),  # ends exactly on a block boundary
        ([8], 1, 4, 32, [1]),  # starts exactly on one
        ([7], 2, 4, 32, [0, 1]),  # straddles one
        ([0, 16, 32], 4, 4, 32, [0, 2, 4]),  # gaps between runs skip whole blocks
        ([0, 8, 16], 8, 4, 32, [0, 1, 2]),  # adjacent runs, one block each
        ([3, 5], 1, 2, 64, [0]),  # many runs in one block
        ([], 4, 4, 32, []),
        ([5], 0, 4, 32, []),
    ],
)
def test_touched_blocks_at_boundaries(starts, run, item, block, want) -> None:
    assert touched_blocks(np.array(starts, dtype=np.int64), run, item, block) == want


def test_piece_runs_are_exactly_the_elements_a_piece_reads() -> None:
    w = TensorMeta("w", (4, 12, 10), "float32", tp_axis=2, stage="layers")  # column split: strided pieces
    s = TensorMeta("optimizer.state.exp_avg.w", (4, 12, 10), "float32", tp_axis=2, stage="layers", param="w")
    tensors = {t.key: t for t in (w, s)}
    strided = 0
    for src, dst in [((2, 1, 1), (1, 1, 2)), ((1, 2, 2), (2, 1, 1)), ((2, 2, 1), (1, 1, 4)), ((1, 1, 1), (2, 2, 1))]:
        src_chunks = layout_chunks(tensors, ParallelLayout(*src), True)
        stored = {c: StoredChunk(c, Location("f", "x")) for cs in src_chunks.values() for c in cs}
        dst_chunks = layout_chunks(tensors, ParallelLayout(*dst), True)
        plan = plan_reshard(PTC(tensors, tuple(stored.values())), tensors, dst_chunks)
        for p in (p for rp in plan.ranks.values() for p in rp.pieces):
            idx = torch.arange(plan.sources[p.source].chunk.numel)
            t = idx[p.src_start : p.src_start + torch.Size(p.src_rect).numel()].view(p.src_rect)
            seen = t[tuple(slice(o, o + n) for o, n in zip(p.src_sel, p.shape))].reshape(-1)
            starts, run = piece_runs(p)
            runs = torch.from_numpy((starts[:, None] + np.arange(run)).reshape(-1))
            assert torch.equal(runs, seen), p  # in order, each element once
            strided += len(starts) > 1
    assert strided  # the column slices are strided: several runs


def test_piece_runs_of_an_empty_piece() -> None:
    p = Piece(0, 0, (0, 4), (0, 0), 0, 0, (0, 4), (0, 0), (0, 4))
    starts, run = piece_runs(p)
    assert len(starts) == 0 and touched_blocks(starts, run, 4, 32) == []


def test_tensor_smaller_than_a_block_is_one_short_block(tmp_path) -> None:
    small = torch.arange(10, dtype=torch.int16)  # 20 bytes, default 1 MiB blocks
    source = _store(tmp_path, {"b": small}, block_bytes=None)
    assert source.chunks[0].location.block_crc32 == (crc32(small),)
    _, stats = _load(tmp_path, source, [Chunk("b", (3,), (2,))])
    assert stats.bytes_verified == 20 and stats.bytes_read == 4
    _flip(tmp_path, "b", 19)  # not in the piece, but in its (only) block
    with pytest.raises(CheckpointFileError, match="tensor 'b' .*block 0 "):
        _load(tmp_path, source, [Chunk("b", (3,), (2,))])


def test_empty_tensors_have_no_blocks_and_verify_nothing(tmp_path) -> None:
    assert block_crc32(torch.zeros(0, 4)) == ()
    source = _store(tmp_path, {"e": torch.zeros(0, 4), "w": W}, block_bytes=64)
    assert source.chunks[0].location.block_crc32 == ()
    out, stats = _load(tmp_path, source, [Chunk("e", (0, 0), (0, 4)), Chunk("w", (0, 0), (1, 8))])
    assert out[0].numel() == 0 and stats.bytes_verified == 64


def test_block_count_that_does_not_match_the_tensor_is_an_error(tmp_path) -> None:
    source = _store(tmp_path, {"w": W}, block_bytes=64)
    loc = source.chunks[0].location
    bad = PTC(source.tensors, (StoredChunk(source.chunks[0].chunk, Location(FILE, "w", block_crc32=loc.block_crc32[:2],
                                                                             block_bytes=64)),))
    with pytest.raises(CheckpointFileError, match=r"tensor 'w' .*2 block checksums"):
        _load(tmp_path, bad, [Chunk("w", (0, 0), (1, 8))])


def test_old_single_crc_metadata_is_verified_whole(tmp_path) -> None:
    source = _store(tmp_path, {"w": W}, block_bytes=None, old_crc=True)
    old = {"file": FILE, "name": "w", "rank": 0, "host": "", "crc32": source.chunks[0].location.crc32}
    loc = Location.from_json(old)
    assert loc.block_crc32 is None and loc.block_bytes is None and loc == source.chunks[0].location
    want = [Chunk("w", (0, 0), (1, 8))]
    out, stats = _load(tmp_path, source, want)
    assert torch.equal(out[0], _expected(W, want[0])) and stats.bytes_verified == 192 and stats.bytes_read == 32
    _flip(tmp_path, "w", 191)  # far from what is read: the whole chunk is still checked
    with pytest.raises(CheckpointFileError, match=rf"{FILE}: tensor 'w' .*fails its checksum"):
        _load(tmp_path, source, want)
    _load(tmp_path, source, want, verify=False)


def test_location_json_round_trip_and_validation() -> None:
    loc = Location("f", "n", 3, "h", block_crc32=(1, 2, 0xFFFFFFFF), block_bytes=BLOCK_BYTES)
    d = loc.to_json()
    assert d["block_bytes"] == BLOCK_BYTES and d["block_crc32"] == [1, 2, 0xFFFFFFFF] and "crc32" not in d
    assert Location.from_json(json.loads(json.dumps(d))) == loc
    assert "block_crc32" not in Location("f", "n").to_json()
    with pytest.raises(ValueError, match="together"):
        Location("f", "n", block_crc32=(1,))
    with pytest.raises(ValueError, match="positive"):
        Location("f", "n", block_crc32=(), block_bytes=0)
    ptc = PTC({"w": TensorMeta("w", (2,), "float32")}, (StoredChunk(Chunk("w", (0,), (2,)), loc),)).to_json()
    ptc["chunks"][0]["at"].pop("block_bytes")
    with pytest.raises(PTCError, match="together"):
        PTC.from_json(ptc)


def test_default_blocks_on_a_multi_mib_tensor_read_in_part(tmp_path) -> None:
    big = torch.randn(800_000, generator=torch.Generator().manual_seed(1))  # 3.05 MiB: 4 blocks, the last short
    source = _store(tmp_path, {"big": big}, block_bytes=None)
    assert len(source.chunks[0].location.block_crc32) == 4
    want = [Chunk("big", (0,), (800_000,), (300_000, 300_010))]  # a DP shard's flat range, inside block 1
    out, stats = _load(tmp_path, source, want)
    assert torch.equal(out[0], big[300_000:300_010])
    assert stats.bytes_read == 40 and stats.bytes_verified == BLOCK_BYTES
    _flip(tmp_path, "big", 3 * BLOCK_BYTES + 7)
    _load(tmp_path, source, want)
    _flip(tmp_path, "big", BLOCK_BYTES + 7)
    with pytest.raises(CheckpointFileError, match=rf"{FILE}: tensor 'big' .*block 1 "):
        _load(tmp_path, source, want)


def _local(key: str, full: torch.Tensor, chunk: Chunk) -> LocalChunk:
    box = full[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.shape))].reshape(-1)
    a, b = chunk.flat_range
    return LocalChunk(TensorMeta(key, tuple(full.shape), "float32"), chunk, box[a:b].clone(), True)


def test_save_records_block_crcs_and_load_verifies_only_what_it_reads(tmp_path) -> None:
    full = torch.randn(1024, 768, generator=torch.Generator().manual_seed(2))  # 3 MiB: 3 blocks
    save = str(tmp_path / "ckpt")
    halves = [Chunk("w", (0, 0), (1024, 768), (0, 393_216)), Chunk("w", (0, 0), (1024, 768), (393_216, 786_432))]
    res = save_chunks([_local("w", full, c) for c in halves], save, 1, {"tp": 1}, {}, lambda infos: {})
    with open(os.path.join(res.path, "metadata.json")) as f:
        at = [c["at"] for c in json.load(f)["ptc"]["chunks"]]
    assert all(a["block_bytes"] == BLOCK_BYTES and len(a["block_crc32"]) == 2 and "crc32" not in a for a in at)

    want = Chunk("w", (0, 0), (1024, 768), (100, 200))
    dst = _local("w", torch.zeros_like(full), want)
    loaded = load_chunks(save, None, lambda meta: [dst], lambda meta: None, strict=True)
    assert torch.equal(dst.data, full.reshape(-1)[100:200])
    assert loaded.stats.bytes_read == 400 and loaded.stats.bytes_verified == BLOCK_BYTES

    name = at[1]["name"]  # damage the second half, which this load does not read
    path = os.path.join(res.path, at[1]["file"])
    begin = read_header(path)[0][name].begin
    with open(path, "r+b") as f:
        f.seek(begin + 10)
        f.write(b"\xff\xff")
    load_chunks(save, None, lambda meta: [dst], lambda meta: None, strict=True)
    whole = _local("w", torch.zeros_like(full), Chunk("w", (0, 0), (1024, 768)))
    with pytest.raises(Exception, match=rf"{at[1]['file']}: tensor '{name}'.*block 0 "):
        load_chunks(save, None, lambda meta: [whole], lambda meta: None, strict=True)
    assert loaded.stats.bytes_unverified == 0
    off = load_chunks(save, None, lambda meta: [dst], lambda meta: None, strict=True, verify=False)
    assert off.stats.bytes_verified == 0 and off.stats.bytes_unverified == off.stats.bytes_read == 400


def _saved_halves(tmp_path) -> tuple[str, torch.Tensor]:
    full = torch.randn(1024, 768, generator=torch.Generator().manual_seed(3))  # 3 MiB
    halves = [Chunk("w", (0, 0), (1024, 768), (0, 393_216)), Chunk("w", (0, 0), (1024, 768), (393_216, 786_432))]
    res = save_chunks([_local("w", full, c) for c in halves], str(tmp_path / "ckpt"), 1, {"tp": 1}, {},
                      lambda infos: {})
    return res.path, full


def test_format_1_checkpoint_with_one_crc_per_chunk_still_loads_checked_whole(tmp_path) -> None:
    ckpt, full = _saved_halves(tmp_path)
    downgrade_to_format_1(ckpt)  # one CRC-32 of each stored tensor
    want = Chunk("w", (0, 0), (1024, 768), (100, 200))
    dst = _local("w", torch.zeros_like(full), want)
    loaded = load_chunks(ckpt, None, lambda meta: [dst], lambda meta: None, strict=True)
    assert loaded.metadata.format_version == 1 and torch.equal(dst.data, full.reshape(-1)[100:200])
    assert loaded.stats.bytes_read == 400 and loaded.stats.bytes_verified == 393_216 * 4  # the whole first half
    with open(os.path.join(ckpt, "metadata.json")) as f:
        at = next(c["at"] for c in json.load(f)["ptc"]["chunks"] if c["flat"][0] == 0)
    path = os.path.join(ckpt, at["file"])
    with open(path, "r+b") as f:  # damage the first half far from what is read: a single CRC still catches it
        f.seek(read_header(path)[0][at["name"]].begin + BLOCK_BYTES + 100)
        f.write(b"\xff\xff")
    with pytest.raises(Exception, match=rf"{at['file']}: tensor '{at['name']}'.* fails its checksum \(crc32"):
        load_chunks(ckpt, None, lambda meta: [dst], lambda meta: None, strict=True)


def test_format_2_chunk_without_checksums_is_an_error_naming_file_and_tensor(tmp_path) -> None:
    ckpt, full = _saved_halves(tmp_path)
    names: list[tuple[str, str]] = []

    def strip(meta: dict) -> None:
        at = meta["ptc"]["chunks"][0]["at"]
        names.append((at["file"], at["name"]))
        del at["block_bytes"], at["block_crc32"]

    rewrite_metadata(ckpt, strip)
    dst = _local("w", torch.zeros_like(full), Chunk("w", (0, 0), (1024, 768), (0, 10)))
    (file, name), = names
    with pytest.raises(Exception, match=rf"{file}: tensor '{name}'.*no checksum recorded"):
        load_chunks(ckpt, None, lambda meta: [dst], lambda meta: None, strict=True)
    load_chunks(ckpt, None, lambda meta: [dst], lambda meta: None, strict=True, verify=False)


@pytest.mark.parametrize("threads", [1, 3])
def test_blocks_checked_in_threads_catch_the_same_damage(tmp_path, monkeypatch, threads: int) -> None:
    monkeypatch.setenv("TENPLEX_STAGING", "direct")  # the map's verifier (the parallel reader checks while reading)
    source = _store(tmp_path, {"w": W, "v": W + 1}, block_bytes=16)
    want = [Chunk("w", (1, 0), (3, 8)), Chunk("v", (0, 2), (6, 3))]
    plan = plan_reshard(source, source.tensors, {0: want}, strict=False)

    def load() -> SourceFiles:
        files = SourceFiles(str(tmp_path), {k: m.dtype for k, m in source.tensors.items()}, threads=threads)
        prepare_sources(plan.ranks[0], plan.sources, files)
        files.close()
        return files

    assert load().bytes_verified == 3 * 32 + 6 * 32  # w: rows 1-3; v: 2 blocks of each row
    _flip(tmp_path, "v", 5 * 32 + 17)  # row 5, cols 4-7: block 11, read (cols 2-4)
    with pytest.raises(CheckpointFileError, match=r"tensor 'v' .*block 11 "):
        load()


def test_default_threads_share_the_cpus_among_local_ranks(monkeypatch) -> None:
    monkeypatch.setenv("TENPLEX_VERIFY_THREADS", "5")
    assert default_threads() == 5
    monkeypatch.delenv("TENPLEX_VERIFY_THREADS")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(10_000))
    assert default_threads() == 1
