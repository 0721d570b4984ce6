"""Writing tensors' bytes to a shard file: straight from host memory, or through staging buffers.

Through staging (``TENPLEX_STAGING=copy``, or ``serial`` on a GPU): each tensor's bytes go
in buffer-sized segments into a ring of pinned host buffers, copied from the
GPU on a side stream while the previous segment is checksummed and written, so
a save does not stall on one device-to-host copy per tensor. Either way the
file's bytes and block checksums are the same.
"""

from __future__ import annotations

from collections import deque
from typing import BinaryIO

import numpy as np
import torch

from tenplex_megatron.storage.checksum import crc32
from tenplex_megatron.storage.staging import RING, StagingRing, buffer_bytes, write_mode


class BlockSums:
    """CRC-32 of each ``block`` bytes of a stream fed in arbitrary pieces (the last block may be short)."""

    def __init__(self, block: int):
        self.block = block
        self.crcs: list[int] = []
        self.cur = 0
        self.fill = 0

    def update(self, data: np.ndarray) -> None:
        pos, n = 0, len(data)
        while pos < n:
            take = min(self.block - self.fill, n - pos)
            self.cur = crc32(data[pos : pos + take], self.cur)
            self.fill += take
            pos += take
            if self.fill == self.block:
                self.crcs.append(self.cur)
                self.cur = self.fill = 0

    def result(self) -> tuple[int, ...]:
        return (*self.crcs, self.cur) if self.fill else tuple(self.crcs)


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def write_tensors(f: BinaryIO, tensors: dict[str, torch.Tensor], block_bytes: int, total: int | None = None,
                  count: int = RING) -> dict[str, tuple[int, ...]]:
    """Write each tensor's bytes to ``f`` in order; returns each one's block CRCs (``block_bytes`` blocks).

    ``total``: the staging budget in bytes (default ``TENPLEX_STAGING_MB``).
    """
    device = next((t.device for t in tensors.values() if t.device.type != "cpu"), torch.device("cpu"))
    sums = {name: BlockSums(block_bytes) for name in tensors}
    if write_mode(device) == "direct":
        for name, t in tensors.items():
            host = _raw(t.to("cpu")).numpy()
            sums[name].update(host)
            f.write(memoryview(host))
        return {name: s.result() for name, s in sums.items()}
    cap = buffer_bytes(total, count)
    raws = {name: _raw(t) for name, t in tensors.items()}
    segments = [(name, lo, min(r.numel(), lo + cap)) for name, r in raws.items() for lo in range(0, r.numel(), cap)]
    if segments:
        pending: deque[tuple[int, str, torch.Tensor]] = deque()
        # leaving the block, by an error too (a failed write, ENOSPC), synchronises the side stream before the
        # ring's pinned buffers, still the target of queued device-to-host copies, are dropped
        with StagingRing(device, max(hi - lo for _, lo, hi in segments), count) as ring:

            def write_oldest() -> None:
                i, name, out = pending.popleft()
                try:
                    ring.acquire(i)  # its device-to-host copy is done
                    data = out.numpy()
                    sums[name].update(data)
                    f.write(memoryview(data))
                finally:
                    out = data = None  # views of a ring buffer: a failed write's traceback keeps this frame

            try:
                for k, (name, lo, hi) in enumerate(segments):
                    i = k % count
                    ring.acquire(i)
                    pending.append((i, name, ring.from_device(i, raws[name][lo:hi])))
                    ring.release(i)
                    while len(pending) >= count:  # buffer i comes round again only after it was written
                        write_oldest()
                while pending:
                    write_oldest()
            finally:
                pending.clear()  # views of the ring's buffers, left there by an error
    return {name: s.result() for name, s in sums.items()}
