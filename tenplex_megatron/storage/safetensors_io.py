"""Safetensors files: written with fsync, read through our own validating header parser (``safetensors_header``) and mmap.

Reading never trusts the file: the header length, JSON, dtypes, shapes and
byte ranges are checked against the file size before anything is mapped, and
every error names the file (and the tensor). Tensors come back as zero-copy
views of a private memory map, so a sliced copy reads only the pages it needs.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from types import MappingProxyType

import torch

from tenplex_megatron.plan.ptc import DTYPE_SIZES
from tenplex_megatron.storage.bounded import open_regular
from tenplex_megatron.storage.checksum import crc32 as buffer_crc32
from tenplex_megatron.storage.files import CheckpointFileError, fsync_dir, fsync_file  # noqa: F401 (re-exported)
from tenplex_megatron.storage.parallel_write import write_parallel
from tenplex_megatron.storage.safetensors_header import (  # noqa: F401 (re-exported)
    MAX_HEADER_BYTES,
    ST_CODES,
    ST_DTYPES,
    TensorEntry,
    read_header,
)
from tenplex_megatron.storage.staged_write import write_tensors
from tenplex_megatron.storage.staging import write_mode

BLOCK_BYTES = 1 << 20  # checksum granularity: a load verifies only the blocks it reads

TORCH_DTYPES = MappingProxyType({name: getattr(torch, name) for name in DTYPE_SIZES})


def torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def crc32(t: torch.Tensor) -> int:
    """CRC-32 of a contiguous CPU tensor's bytes."""
    return buffer_crc32(t.reshape(-1).view(torch.uint8).numpy())


def block_crc32(data: torch.Tensor, block_bytes: int = BLOCK_BYTES) -> tuple[int, ...]:
    """CRC-32 of each ``block_bytes`` block of a contiguous CPU tensor's bytes (the last may be short; none if empty).

    Per-block sums let a reader verify just the blocks it copies instead of whole chunks.
    """
    raw = data.reshape(-1).view(torch.uint8).numpy()
    return tuple(buffer_crc32(raw[i : i + block_bytes]) for i in range(0, len(raw), block_bytes))


def header_bytes(tensors: dict[str, torch.Tensor]) -> tuple[bytes, int]:
    """The safetensors header (length prefix included, data aligned to 8 bytes) and the data section's size."""
    header: dict[str, object] = {}
    offset = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": ST_CODES[torch_dtype_name(t.dtype)], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # align the data section to 8 bytes, as the reference writer does
    return struct.pack("<Q", len(raw)) + raw, offset


def write_safetensors(
    path: str, tensors: dict[str, torch.Tensor], after_write=None, block_bytes: int = BLOCK_BYTES
) -> tuple[int, dict[str, tuple[int, ...]]]:
    """Write ``tensors`` to ``path`` in safetensors format and fsync it; returns its size and each tensor's block CRCs.

    The CRCs are :func:`block_crc32` of each tensor's bytes in ``block_bytes``
    blocks. Tensors are streamed from their own memory, or through bounded
    staging buffers (a GPU's, ``storage/staged_write.py``): no serialised copy
    of the whole file is built, so the writer's peak memory stays near the shard itself.
    """
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    head, _ = header_bytes(tensors)
    device = next((t.device for t in tensors.values() if t.device.type != "cpu"), torch.device("cpu"))
    if write_mode(device) == "parallel":
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o666)
        try:
            sums = write_parallel(fd, path, head, tensors, block_bytes)
            if after_write is not None:
                after_write()
            os.fsync(fd)  # one fsync for the whole file
        finally:
            os.close(fd)
        return os.path.getsize(path), sums
    with open(path, "wb") as f:
        f.write(head)
        sums = write_tensors(f, tensors, block_bytes)
        f.flush()
        if after_write is not None:
            after_write()
        os.fsync(f.fileno())
    return os.path.getsize(path), sums


class SafetensorsReader:
    """A validated, memory-mapped safetensors file; ``flat(name)`` is a zero-copy 1-D view."""

    def __init__(self, path: str):
        self.path = path
        self.entries, self.size = read_header(path)
        with open_regular(path) as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if self.size else None
        self._buf = torch.frombuffer(self._mm, dtype=torch.uint8) if self._mm is not None else torch.empty(0, dtype=torch.uint8)

    def flat(self, name: str, expect_dtype: str | None = None, expect_numel: int | None = None) -> torch.Tensor:
        entry = self.entries.get(name)
        if entry is None:
            raise CheckpointFileError(f"{self.path}: tensor {name!r} is not in the file")
        if expect_dtype is not None and entry.dtype != expect_dtype:
            raise CheckpointFileError(f"{self.path}: tensor {name!r} has dtype {entry.dtype}, metadata says {expect_dtype}")
        numel = math.prod(entry.shape)
        if expect_numel is not None and numel != expect_numel:
            raise CheckpointFileError(f"{self.path}: tensor {name!r} has {numel} elements, metadata says {expect_numel}")
        raw = self._buf[entry.begin : entry.end]
        if entry.begin % DTYPE_SIZES[entry.dtype]:
            raw = raw.clone()  # a valid but unaligned file: read through a copy instead of a view
        return raw.view(TORCH_DTYPES[entry.dtype])

    def close(self) -> None:
        """Drop this reader's references; the map is unmapped when the last view of it is gone.

        Never ``mmap.close()``: tensors from ``torch.frombuffer`` do not pin the
        buffer, so closing would leave live views pointing at unmapped memory.
        """
        self._buf = torch.empty(0, dtype=torch.uint8)
        self._mm = None
