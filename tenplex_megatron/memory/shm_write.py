"""A rank file in node memory: one copy per tensor, its block CRCs computed beside the copy.

A memory snapshot's blocking part is :func:`write_tensors`: the safetensors
header, then one ``write`` per tensor from its own memory into tmpfs (the
kernel's single copy; no serialised buffer, no fsync), with the checksums
the format requires computed by a second thread meanwhile (a GPU's tensors go
through pinned staging buffers instead: device-to-host on a side stream while
the previous segment is checksummed and written; ``TENPLEX_STAGING=copy``
takes that path on the CPU too). By default (``TENPLEX_STAGING`` ``auto`` or ``parallel``) the
parallel writer's threads copy segments into the file and checksum them at once
(``storage/parallel_write.py``); ``direct`` keeps one write per tensor. Where a retired
snapshot left its rank file as a spare, the copy goes into those pages: a copy
into fresh tmpfs pages also pays their allocation and zeroing.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO

import torch

from tenplex_megatron.storage import staged_write
from tenplex_megatron.storage.parallel_write import write_parallel
from tenplex_megatron.storage.safetensors_io import block_crc32, header_bytes
from tenplex_megatron.storage.staging import write_mode


def write_tensors(path: str, tensors: dict[str, torch.Tensor], block_bytes: int,
                  after_write: Callable[[], None] | None = None,
                  reuse: bool = False) -> tuple[int, dict[str, tuple[int, ...]]]:
    """Write ``tensors`` to ``path`` as a safetensors file, one ``write`` per tensor straight from its memory (no
    fsync: tmpfs), while a second thread computes each tensor's block CRC-32s (both release the GIL, so on a free
    core the checksums cost no extra time); returns the file's size and the CRCs.

    ``reuse``: ``path`` is a spare file (a retired snapshot's): written over from its start, so the copy lands in
    pages that already exist. Either way the file is sized first: a tmpfs mounted with ``huge=within_size`` then
    backs it with huge pages (a write past the file's end gets small ones), which a restart maps and checks about
    3x faster. ``after_write`` is called once every byte is in place (a fault point for tests).
    """
    head, data = header_bytes(tensors)
    device = next((t.device for t in tensors.values() if t.device.type != "cpu"), torch.device("cpu"))
    with open(path, "r+b" if reuse else "wb") as f:
        f.truncate(len(head) + data)
        mode = write_mode(device)
        if mode == "parallel":  # writer threads: copies into node memory in parallel, CRCs beside them
            crcs = write_parallel(f.fileno(), path, head, tensors, block_bytes)
            if after_write is not None:
                after_write()
            return len(head) + data, crcs
        f.write(head)
        if mode == "copy":  # a GPU's tensors: through the durable save's ring of pinned buffers
            crcs = staged_write.write_tensors(f, tensors, block_bytes)
        else:
            crcs = _write_direct(f, tensors, block_bytes)
        f.flush()
        if after_write is not None:
            after_write()
    return len(head) + data, crcs


def _write_direct(f: BinaryIO, tensors: dict[str, torch.Tensor], block_bytes: int) -> dict[str, tuple[int, ...]]:
    """One ``write`` per tensor straight from its memory, its block CRC-32s computed by a second thread meanwhile;
    returns them once every tensor is written and checksummed."""
    sums: dict[str, Future[tuple[int, ...]]] = {}
    with ThreadPoolExecutor(1, thread_name_prefix="tenplex-crc") as pool:
        for name, t in tensors.items():
            host = t.detach().to("cpu").contiguous()
            sums[name] = pool.submit(block_crc32, host, block_bytes)
            f.write(memoryview(host.reshape(-1).view(torch.uint8).numpy()))
        return {name: fut.result() for name, fut in sums.items()}
