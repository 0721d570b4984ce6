"""Safetensors files: written with fsync, read through our own validating header parser and mmap.

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
from dataclasses import dataclass

import torch

from tenplex_megatron.plan.ptc import DTYPE_SIZES
from tenplex_megatron.storage.checksum import crc32 as buffer_crc32
from tenplex_megatron.storage.files import CheckpointFileError, fsync_dir, fsync_file  # noqa: F401 (re-exported)

MAX_HEADER_BYTES = 64 * 1024 * 1024
BLOCK_BYTES = 1 << 20  # checksum granularity: a load verifies only the blocks it reads

ST_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}
TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPE_SIZES}


def torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


def crc32(t: torch.Tensor) -> int:
    """CRC-32 of a contiguous CPU tensor's bytes."""
    return buffer_crc32(t.reshape(-1).view(torch.uint8).numpy())


def block_crc32(data: torch.Tensor, block_bytes: int = BLOCK_BYTES) -> tuple[int, ...]:
    """CRC-32 of each ``block_bytes`` block of a contiguous CPU tensor's bytes (the last may be short; none if empty).

    Per-block sums let a reader verify just the blocks it copies instead of whole chunks.
    """
    raw = data.reshape(-1).view(torch.uint8).numpy()
    return tuple(buffer_crc32(raw[i : i + block_bytes]) for i in range(0, len(raw), block_bytes))


ST_CODES = {v: k for k, v in ST_DTYPES.items()}


def write_safetensors(
    path: str, tensors: dict[str, torch.Tensor], after_write=None, block_bytes: int = BLOCK_BYTES
) -> tuple[int, dict[str, tuple[int, ...]]]:
    """Write ``tensors`` to ``path`` in safetensors format and fsync it; returns its size and each tensor's block CRCs.

    The CRCs are :func:`block_crc32` of each tensor's bytes in ``block_bytes``
    blocks. Tensors are streamed from their own memory (a GPU tensor is copied
    to the host one at a time): no serialised copy of the whole file is built,
    so the writer's peak memory stays near the shard itself.
    """
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be positive, got {block_bytes}")
    header: dict[str, object] = {}
    offset = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": ST_CODES[torch_dtype_name(t.dtype)], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # align the data section to 8 bytes, as the reference writer does
    sums: dict[str, tuple[int, ...]] = {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, t in tensors.items():
            host = t.detach().to("cpu").contiguous()
            sums[name] = block_crc32(host, block_bytes)
            f.write(memoryview(host.reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        if after_write is not None:
            after_write()
        os.fsync(f.fileno())
    return os.path.getsize(path), sums


def read_header(path: str) -> tuple[dict[str, TensorEntry], int]:
    """Parse and validate a safetensors header; returns the entries and the file size."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointFileError(f"{path}: truncated ({size} bytes, no safetensors header)")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointFileError(f"{path}: header length {n} does not fit in the file ({size} bytes)")
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointFileError(f"{path}: file is missing") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:  # RecursionError: deeply nested JSON
        raise CheckpointFileError(f"{path}: malformed safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointFileError(f"{path}: safetensors header is not a JSON object")
    base = 8 + n
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = ST_DTYPES[info["dtype"]]
            shape = tuple(int(x) for x in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError, OverflowError) as e:  # OverflowError: int(Infinity)
            raise CheckpointFileError(f"{path}: tensor {name!r}: malformed header entry ({e})") from None
        if any(s < 0 for s in shape) or begin < 0 or end < begin:
            raise CheckpointFileError(f"{path}: tensor {name!r}: invalid shape or offsets")
        if end - begin != math.prod(shape) * DTYPE_SIZES[dtype]:
            raise CheckpointFileError(f"{path}: tensor {name!r}: byte range does not match shape {shape}")
        if base + end > size:
            raise CheckpointFileError(
                f"{path}: tensor {name!r}: data ends at byte {base + end} but the file has {size} "
                "(truncated file)"
            )
        entries[name] = TensorEntry(dtype, shape, base + begin, base + end)
    return entries, size


class SafetensorsReader:
    """A validated, memory-mapped safetensors file; ``flat(name)`` is a zero-copy 1-D view."""

    def __init__(self, path: str):
        self.path = path
        self.entries, self.size = read_header(path)
        with open(path, "rb") as f:
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
