"""The parallel writer (``storage/parallel_write.py``) on the CPU: a shard and a host-memory snapshot file
byte-identical to the sequential writer's, with the same block CRCs, at several thread counts and budgets; a full
disk (``/dev/full``, an injected ENOSPC in one writer thread) is an error naming the file."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenplex_megatron.memory import shm_write
from tenplex_megatron.storage.safetensors_io import CheckpointFileError, block_crc32, write_safetensors

SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
specs = st.lists(st.tuples(st.integers(0, 3000), st.sampled_from(["float32", "bfloat16", "int64", "uint8"])),
                 min_size=1, max_size=5)


def _tensors(spec) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.randint(0, 100, (n,)).to(getattr(torch, dt)) for i, (n, dt) in enumerate(spec)}


def _written(monkeypatch, tmp, mode: str, write, tensors, threads: int = 2, mb: float = 256):
    monkeypatch.setenv("TENPLEX_STAGING", mode)
    monkeypatch.setenv("TENPLEX_READ_THREADS", str(threads))
    monkeypatch.setenv("TENPLEX_STAGING_MB", str(mb))
    path = os.path.join(tmp, f"{mode}-{threads}-{mb}.safetensors")
    size, sums = write(path, tensors)
    with open(path, "rb") as f:
        return f.read(), size, sums


@SETTINGS
@given(specs, st.sampled_from([1, 2, 4]), st.sampled_from([0.0001, 0.004, 256]), st.sampled_from([64, 256, 1 << 20]))
def test_a_shard_is_byte_identical_to_the_sequential_writers(monkeypatch, tmp_path_factory, spec, threads, mb,
                                                             block) -> None:
    tensors = _tensors(spec)
    tmp = str(tmp_path_factory.mktemp("w"))
    write = lambda path, ts: write_safetensors(path, ts, block_bytes=block)  # noqa: E731
    direct = _written(monkeypatch, tmp, "direct", write, tensors)
    par = _written(monkeypatch, tmp, "parallel", write, tensors, threads, mb)
    assert par == direct
    assert par[2] == {k: block_crc32(t, block) for k, t in tensors.items()}


@SETTINGS
@given(specs, st.sampled_from([1, 3]), st.sampled_from([0.0001, 256]))
def test_a_snapshot_file_is_byte_identical_to_the_direct_writers(monkeypatch, tmp_path_factory, spec, threads,
                                                                 mb) -> None:
    tensors = _tensors(spec)
    tmp = str(tmp_path_factory.mktemp("s"))
    write = lambda path, ts: shm_write.write_tensors(path, ts, 256)  # noqa: E731
    assert _written(monkeypatch, tmp, "parallel", write, tensors, threads, mb) == _written(
        monkeypatch, tmp, "direct", write, tensors)


@pytest.mark.parametrize("threads", [1, 3])
def test_a_full_disk_names_the_file(monkeypatch, threads: int) -> None:
    monkeypatch.setenv("TENPLEX_STAGING", "parallel")
    monkeypatch.setenv("TENPLEX_READ_THREADS", str(threads))
    with pytest.raises(CheckpointFileError, match=r"/dev/full: writing bytes 0-\d+ failed: .*No space left"):
        write_safetensors("/dev/full", {"a": torch.randn(1000)}, block_bytes=256)


@pytest.mark.parametrize("threads", [1, 3])
def test_enospc_in_one_writer_thread_names_the_file(tmp_path, monkeypatch, threads: int) -> None:
    monkeypatch.setenv("TENPLEX_STAGING", "parallel")
    monkeypatch.setenv("TENPLEX_READ_THREADS", str(threads))
    monkeypatch.setenv("TENPLEX_STAGING_MB", "0.001")  # segments of a few hundred bytes: many writes
    monkeypatch.setenv("TENPLEX_FAULT", "save.pwrite:enospc")
    monkeypatch.setenv("TENPLEX_FAULT_ONCE", str(tmp_path / "fired"))
    path = str(tmp_path / "shard.safetensors")
    with pytest.raises(CheckpointFileError, match=rf"{path}: writing bytes \d+-\d+ failed: .*No space left"):
        write_safetensors(path, {"a": torch.randn(5000), "b": torch.arange(3000)}, block_bytes=256)
    assert (tmp_path / "fired").exists()
