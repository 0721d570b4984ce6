"""A rank file in node memory with one copy per tensor, and its block CRCs computed later from the file.

A memory snapshot's blocking part is :func:`write_mapped`: the safetensors
header, then the file's full size allocated at once (``posix_fallocate``) and
mapped with its pages populated, then one ``copy_`` per tensor into the map -
no checksums, no serialised buffer, no fsync (the file is in tmpfs). The
checksums the checkpoint format requires are :func:`file_block_crc32` of the
written file, computed afterwards by the node's helper process.
"""

from __future__ import annotations

import json
import mmap
import os
import struct

import torch

from tenplex_megatron.storage.checksum import crc32
from tenplex_megatron.storage.safetensors_header import ST_CODES, read_header
from tenplex_megatron.storage.safetensors_io import torch_dtype_name

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def header_bytes(tensors: dict[str, torch.Tensor]) -> tuple[bytes, int]:
    """The safetensors header (length prefix included, data aligned to 8 bytes) and the data section's size."""
    header: dict[str, object] = {}
    offset = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": ST_CODES[torch_dtype_name(t.dtype)], "shape": list(t.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, offset


def write_mapped(path: str, tensors: dict[str, torch.Tensor], after_write=None) -> int:
    """Write ``tensors`` to ``path`` as a safetensors file by copying each into a preallocated map; returns its size.

    ``after_write`` is called once every byte is in place (a fault point for tests).
    """
    head, data = header_bytes(tensors)
    size = len(head) + data
    with open(path, "wb+") as f:
        if size:
            os.posix_fallocate(f.fileno(), 0, size)
        mm = mmap.mmap(f.fileno(), size, flags=mmap.MAP_SHARED | _POPULATE) if size else None
    if mm is not None:
        mm[: len(head)] = head
        buf = torch.frombuffer(mm, dtype=torch.uint8)
        offset = len(head)
        for t in tensors.values():
            n = t.numel() * t.element_size()
            if n:
                buf[offset : offset + n].view(t.dtype).copy_(t.detach().reshape(-1))
            offset += n
        del buf  # the map goes when its last view does (never mm.close(): see SafetensorsReader.close)
    if after_write is not None:
        after_write()
    return size


def file_block_crc32(path: str, block_bytes: int) -> dict[str, list[int]]:
    """CRC-32 of each ``block_bytes`` block of each tensor's bytes in the safetensors file ``path`` (validated
    header; the file read through a read-only map)."""
    entries, size = read_header(path)
    out: dict[str, list[int]] = {}
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
    view = memoryview(mm) if mm is not None else memoryview(b"")
    try:
        for name, e in entries.items():
            out[name] = [crc32(view[i : min(i + block_bytes, e.end)]) for i in range(e.begin, e.end, block_bytes)]
    finally:
        view.release()
        if mm is not None:
            mm.close()
    return out
