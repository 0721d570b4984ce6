"""A memory snapshot's rank file: the same bytes and block checksums whether written straight from the tensors
(the CPU's path) or through the pinned staging ring (a GPU's path, forced here with ``TENPLEX_STAGING=copy``),
into a fresh file or over a larger or smaller spare."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tenplex_megatron.memory.shm_write import write_tensors
from tenplex_megatron.storage.safetensors_io import block_crc32

BLOCK = 1 << 12


def _tensors(scale: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(scale)
    return {"a": torch.randn(scale * 1000, generator=g), "b": torch.randint(0, 9, (scale, 33), generator=g),
            "c": torch.randn(7, 5, generator=g).to(torch.bfloat16)}


@pytest.mark.parametrize("spare", [None, 1, 5], ids=["fresh", "over-smaller-spare", "over-larger-spare"])
def test_staged_and_direct_writes_give_the_same_file(tmp_path, monkeypatch, spare) -> None:
    monkeypatch.setenv("TENPLEX_STAGING_MB", "0.01")  # several segments per tensor through the ring
    tensors = _tensors(3)
    out = {}
    for mode in ("direct", "copy"):
        monkeypatch.setenv("TENPLEX_STAGING", mode)
        path = str(tmp_path / f"{mode}.safetensors")
        if spare is not None:  # a retired rank file of another size, written over
            write_tensors(path, _tensors(spare), BLOCK)
        size, crcs = write_tensors(path, tensors, BLOCK, reuse=spare is not None)
        with open(path, "rb") as f:
            out[mode] = (size, crcs, f.read())
        assert len(out[mode][2]) == size
        got = load_file(path)
        assert all(torch.equal(got[k], v) for k, v in tensors.items())
    assert out["direct"] == out["copy"]
    for name, t in tensors.items():
        assert out["copy"][1][name] == block_crc32(t, BLOCK)
