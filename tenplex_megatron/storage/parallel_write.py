"""The parallel writer: a shard's bytes written by a pool of threads with ``os.pwrite``, each segment's block CRC-32s
computed by the thread that writes it.

The file's layout is known before the first byte (the safetensors header gives every tensor's offset), so each
tensor is cut into segments of whole checksum blocks (a few MiB) and the threads write them at their offsets in
any order; the caller fsyncs the file once. Host tensors are written straight from their memory; a GPU's go
device-to-host into the slots of one pinned ring on its side stream first, a slot reused once its write is done.
A failed write (ENOSPC, EIO) names the file and the bytes, cancels the writes not started, waits for the running
ones and frees the ring. The bytes and CRCs are those of ``storage/staged_write.py``'s sequential writer.
"""

from __future__ import annotations

import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from tenplex_megatron.storage.checksum import crc32
from tenplex_megatron.storage.faults import maybe_fail
from tenplex_megatron.storage.files import CheckpointFileError
from tenplex_megatron.storage.parallel_read import RUN_BYTES, _Inline, default_threads, slot_size
from tenplex_megatron.storage.staging import StagingRing, staging_bytes


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _pwrite(fd: int, path: str, data: memoryview, offset: int) -> None:
    done = 0
    try:
        while done < len(data):
            done += os.pwrite(fd, data[done:], offset + done)
    except OSError as err:
        raise CheckpointFileError(f"{path}: writing bytes {offset}-{offset + len(data)} failed: {err}") from err


def write_parallel(fd: int, path: str, head: bytes, tensors: dict[str, torch.Tensor], block_bytes: int,
                   threads: int | None = None, budget: int | None = None) -> dict[str, tuple[int, ...]]:
    """Write ``head`` at offset 0 of the open file ``fd`` (``path``, for errors) and each tensor's bytes after it,
    in order, in ``threads`` threads; returns each tensor's block CRC-32s (``block_bytes`` blocks). No fsync."""
    threads = threads or default_threads()
    budget = staging_bytes() if budget is None else budget
    seg = max(block_bytes, slot_size(budget, threads) // block_bytes * block_bytes)
    raws = {name: _raw(t) for name, t in tensors.items()}
    tasks: list[tuple[str, int, int, int]] = []  # (tensor, lo, hi, file offset of lo)
    at = len(head)
    for name, r in raws.items():
        tasks += [(name, lo, min(r.numel(), lo + seg), at + lo) for lo in range(0, r.numel(), seg)]
        at += r.numel()
    total = at
    threads = max(1, min(threads, len(tasks), -(-total // RUN_BYTES)))
    device = next((r.device for r in raws.values() if r.device.type != "cpu"), torch.device("cpu"))
    rank = int(os.environ.get("RANK", "0"))
    parts: dict[tuple[str, int], tuple[int, ...]] = {}

    def work(name: str, lo: int, data: torch.Tensor, offset: int, ready: torch.cuda.Event | None) -> None:
        if ready is not None:
            ready.synchronize()  # its device-to-host copy is done
        view = memoryview(data.numpy())
        parts[(name, lo)] = tuple(crc32(view[i : i + block_bytes]) for i in range(0, len(view), block_bytes))
        try:
            maybe_fail("save.pwrite", rank)
        except OSError as err:
            raise CheckpointFileError(f"{path}: writing bytes {offset}-{offset + len(view)} failed: {err}") from err
        _pwrite(fd, path, view, offset)

    _pwrite(fd, path, memoryview(head), 0)
    on_host = device.type != "cuda"
    count = 1 if on_host else max(2, min(threads + 2, len(tasks)))
    with StagingRing(device, 0 if on_host else seg, count) as ring:
        pool = ThreadPoolExecutor(threads, thread_name_prefix="tenplex-write") if threads > 1 else _Inline()
        pending: deque[tuple[int, Future]] = deque()
        try:
            free = deque(range(count))
            for name, lo, hi, offset in tasks:
                src = raws[name][lo:hi]
                if on_host:
                    if src.device.type != "cpu":
                        src = src.cpu()
                    pending.append((0, pool.submit(work, name, lo, src, offset, None)))
                    while len(pending) > 2 * threads:  # bounded queue: errors surface early
                        pending.popleft()[1].result()
                    continue
                if not free:
                    i, fut = pending.popleft()
                    fut.result()
                    free.append(i)
                i = free.popleft()
                ring.acquire(i)
                out = ring.from_device(i, src)
                ring.release(i)
                pending.append((i, pool.submit(work, name, lo, out, offset, ring.events[i])))
            while pending:
                pending.popleft()[1].result()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)  # no thread reads the ring once it is freed
            pending.clear()
            out = src = None
    return {name: tuple(c for lo in range(0, r.numel(), seg) for c in parts[(name, lo)]) for name, r in raws.items()}
