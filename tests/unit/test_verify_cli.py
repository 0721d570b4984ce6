"""``python -m tenplex_megatron verify``: every stored byte, file size and tensor partition checked without a model.

Checkpoints are written by the real ``save_chunks`` (one process), then damaged on disk: a flipped byte, a
truncated file, a missing file, chunks that overlap or leave a gap, a file name outside the directory, a
malformed metadata file. Each damage must give exit status 1 naming the file and the tensor.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tenplex_megatron import cli
from tenplex_megatron.engine.chunks import LocalChunk
from tenplex_megatron.engine.save import save_chunks
from tenplex_megatron.plan.ptc import Chunk, TensorMeta
from tenplex_megatron.storage.safetensors_io import BLOCK_BYTES, read_header
from tenplex_megatron.storage.verify_ckpt import verify_checkpoint
from tests.harness import ROOT, downgrade_to_format_1, rewrite_metadata

FULL = torch.randn(1024, 768, generator=torch.Generator().manual_seed(5))  # 3 MiB: each half 2 blocks (1 + 0.5 MiB)
BIAS = torch.arange(10, dtype=torch.float32)
HALVES = [Chunk("w", (0, 0), (1024, 768), (0, 393_216)), Chunk("w", (0, 0), (1024, 768), (393_216, 786_432))]


def _local(key: str, full: torch.Tensor, chunk: Chunk) -> LocalChunk:
    box = full[tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.shape))].reshape(-1)
    a, b = chunk.flat_range
    return LocalChunk(TensorMeta(key, tuple(full.shape), "float32"), chunk, box[a:b].clone(), True)


def _save(save: str, it: int) -> str:
    chunks = [_local("w", FULL, c) for c in HALVES] + [_local("b", BIAS, Chunk("b", (0,), (10,)))]
    return save_chunks(chunks, save, it, {"tp": 1}, {}, lambda infos: {}).path


@pytest.fixture
def ckpt(tmp_path) -> str:
    return _save(str(tmp_path / "save"), 3)


def _meta(ckpt: str) -> dict:
    with open(os.path.join(ckpt, "metadata.json")) as f:
        return json.load(f)


def _verify(capsys, *args: str) -> tuple[int, str, str]:
    rc = cli.main(["verify", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _chunk_of(ckpt: str, flat_start: int) -> dict:
    return next(c["at"] for c in _meta(ckpt)["ptc"]["chunks"] if c["key"] == "w" and c["flat"][0] == flat_start)


def test_a_good_checkpoint_passes_and_every_stored_byte_is_checked(ckpt: str, capsys) -> None:
    rc, out, err = _verify(capsys, os.path.dirname(ckpt))
    assert rc == 0, out + err
    assert out.startswith(f"OK       {ckpt}: iteration 3, 1 files, 2 tensors in 3 stored chunks, ")
    assert "verify: 1 of 1 checkpoints intact" in out and "GB/s" in out and err == ""
    rc, out, _ = _verify(capsys, ckpt, "--json", "--workers", "3")
    got = json.loads(out)
    assert rc == 0 and got["ok"] and len(got["checkpoints"]) == 1
    r = got["checkpoints"][0]
    stored = FULL.numel() * 4 + BIAS.numel() * 4
    assert r["bytes_stored"] == r["bytes_checked"] == stored  # every stored byte read and compared
    assert r["blocks"] == 2 * 2 + 1 and r["threads"] == 3 and r["damage"] == [] and r["files"] == 1


@pytest.mark.parametrize("workers", [1, 4])
def test_a_flipped_byte_fails_naming_file_tensor_and_block(ckpt: str, capsys, workers: int) -> None:
    at = _chunk_of(ckpt, 393_216)
    path = os.path.join(ckpt, at["file"])
    begin = read_header(path)[0][at["name"]].begin
    with open(path, "r+b") as f:  # one bit in the second block of the second half
        f.seek(begin + BLOCK_BYTES + 77)
        b = f.read(1)[0]
        f.seek(begin + BLOCK_BYTES + 77)
        f.write(bytes([b ^ 0x08]))
    rc, out, _ = _verify(capsys, ckpt, "--workers", str(workers))
    assert rc == 1
    assert f"DAMAGED  {ckpt}: 1 problem (" in out
    assert (f"rank_00000.safetensors: tensor '{at['name']}' (of 'w') fails its checksum in block 1 "
            f"(bytes {BLOCK_BYTES}-{393_216 * 4} of the tensor") in out
    assert "damaged files:   rank_00000.safetensors" in out and "damaged tensors: w" in out
    assert "verify: 0 of 1 checkpoints intact" in out


def test_a_truncated_file_fails_naming_it_and_every_tensor_cut_off(ckpt: str, capsys) -> None:
    path = os.path.join(ckpt, "rank_00000.safetensors")
    size = os.path.getsize(path)
    entries, _ = read_header(path)
    with open(path, "r+b") as f:
        f.truncate(size - BLOCK_BYTES)  # cuts into the last stored tensor(s)
    cut = sorted(name for name, e in entries.items() if e.end > size - BLOCK_BYTES)
    rc, out, _ = _verify(capsys, ckpt)
    assert rc == 1
    assert f"rank_00000.safetensors: size {size - BLOCK_BYTES} bytes, the metadata recorded {size}" in out
    for name in cut:
        assert f"tensor '{name}'" in out and "(truncated file)" in out
    report = verify_checkpoint(ckpt)
    assert report.damaged_files() == ["rank_00000.safetensors"] and set(report.damaged_tensors()) >= {"w"}
    assert 0 < report.bytes_checked < report.bytes_stored  # what is still there is checked


def test_a_missing_file_fails_naming_it_and_its_tensors(ckpt: str, capsys) -> None:
    os.remove(os.path.join(ckpt, "rank_00000.safetensors"))
    rc, out, _ = _verify(capsys, ckpt)
    assert rc == 1
    assert "rank_00000.safetensors: file is missing (it holds 3 stored chunks)" in out
    assert "damaged tensors: b, w" in out


def test_chunks_that_overlap_or_leave_a_gap_fail_naming_the_tensor(ckpt: str, capsys, tmp_path) -> None:
    def overlap(meta: dict) -> None:  # the second half starts 100 elements early (same size: the file agrees)
        c = next(c for c in meta["ptc"]["chunks"] if c["key"] == "w" and c["flat"][0] == 393_216)
        c["flat"] = [393_116, 786_332]

    rewrite_metadata(ckpt, overlap)
    rc, out, _ = _verify(capsys, ckpt)
    assert rc == 1 and "tensor 'w': source chunks overlap" in out and "damaged tensors: w" in out

    gap = _save(str(tmp_path / "gap"), 1)
    rewrite_metadata(gap, lambda meta: meta["ptc"].update(chunks=[c for c in meta["ptc"]["chunks"] if c["key"] != "b"]))
    rc, out, _ = _verify(capsys, gap)
    assert rc == 1 and "tensor 'b': the checkpoint's chunks cover 0 of 10 elements" in out
    assert "damaged files:   metadata.json" in out and "damaged tensors: b" in out


def test_a_name_outside_the_checkpoint_is_reported_and_not_read(ckpt: str, capsys, tmp_path) -> None:
    def out_of_dir(meta: dict) -> None:
        meta["ptc"]["chunks"][0]["at"]["file"] = "../outside.safetensors"

    with open(tmp_path / "save" / "outside.safetensors", "wb") as f:
        f.write(b"\0" * 64)
    rewrite_metadata(ckpt, out_of_dir)
    rc, out, _ = _verify(capsys, ckpt)
    assert rc == 1
    assert "names the file '../outside.safetensors', which has a '..' component" in out


def test_all_checks_every_checkpoint_and_reports_a_damaged_metadata_file(tmp_path, capsys) -> None:
    save = str(tmp_path / "save")
    for it in (1, 2, 3):
        _save(save, it)
    os.makedirs(os.path.join(save, "iter_0000009"))  # another format's: not checked
    with open(os.path.join(save, "iter_0000009", "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist"}, f)
    rc, out, _ = _verify(capsys, save, "--all")
    assert rc == 0 and out.count("OK       ") == 3 and "3 of 3 checkpoints intact" in out
    rc, out, _ = _verify(capsys, save)  # the tracker's: iteration 3 only
    assert rc == 0 and out.count("OK       ") == 1 and "iter_0000003" in out
    with open(os.path.join(save, "iter_0000002", "metadata.json"), "r+") as f:
        f.truncate(40)  # a copy that stopped half-way: a load would skip it silently
    rc, out, _ = _verify(capsys, save, "--all", "--json")
    got = json.loads(out)
    assert rc == 1 and not got["ok"] and [c["ok"] for c in got["checkpoints"]] == [True, False, True]
    bad = got["checkpoints"][1]
    assert bad["path"].endswith("iter_0000002") and bad["damaged_files"] == ["metadata.json"]
    assert "malformed JSON" in bad["damage"][0]["why"]


def test_progress_lines_go_to_stderr_and_bad_arguments_are_refused(ckpt: str, capsys, tmp_path) -> None:
    rc, out, err = _verify(capsys, ckpt, "--progress-every", "0")
    assert rc == 0
    lines = err.splitlines()
    assert lines and all(line.startswith("verify: iter_0000003: ") and "GB/s" in line for line in lines)
    assert "(100%)" in lines[-1]
    rc, _, err = _verify(capsys, ckpt, "--workers", "0")
    assert rc == 2 and "--workers must be at least 1" in err
    rc, _, err = _verify(capsys, str(tmp_path / "nothing"))
    assert rc == 2 and "no tenplex checkpoint here" in err


def test_verify_runs_with_torch_blocked(ckpt: str) -> None:
    code = ("import sys; sys.modules['torch'] = None\n"
            "from tenplex_megatron import cli\n"
            f"rc = cli.main(['verify', {ckpt!r}])\n"
            "assert not [m for m, mod in sys.modules.items() if mod is not None and m.split('.')[0] == 'torch']\n"
            "sys.exit(rc)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"}, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.startswith(f"OK       {ckpt}")


def test_a_format_1_checkpoint_is_checked_whole_chunk_by_chunk(ckpt: str, capsys) -> None:
    downgrade_to_format_1(ckpt)  # one CRC-32 per stored tensor, no block sums
    report = verify_checkpoint(ckpt)
    assert report.ok and report.blocks == 3 and report.bytes_checked == report.bytes_stored
    at = _chunk_of(ckpt, 0)
    path = os.path.join(ckpt, at["file"])
    with open(path, "r+b") as f:
        f.seek(read_header(path)[0][at["name"]].begin + 12345)
        f.write(b"\xff")
    rc, out, _ = _verify(capsys, ckpt)
    assert rc == 1 and f"rank_00000.safetensors: tensor '{at['name']}' (of 'w') fails its checksum (crc32 " in out
