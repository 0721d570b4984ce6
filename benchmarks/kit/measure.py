"""A timed call (worker side), the same in every benchmark: between barriers, with its peak memory and I/O bytes.

Before the call freed heap pages go back to the OS (so a previous call's garbage does not lower the baseline);
then a barrier, the clock starts, the call runs, a barrier, the clock stops: a rank's time includes waiting for
the slowest rank, and a repetition's time is the max over ranks (:mod:`benchmarks.kit.stats`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from benchmarks.kit.disk import io_chars
from benchmarks.kit.memory import PeakRSS, release_memory
from tenplex_megatron.execute.collective import all_gather_json

T = TypeVar("T")


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def timed(fn: Callable[[], T], tree: bool = False) -> tuple[T, dict[str, Any]]:
    """Run ``fn`` (collective when torch.distributed is up); its result and this rank's record.

    The record: ``seconds``, ``rss_before``/``rss_peak``, ``anon_before``/``anon_peak`` (:class:`PeakRSS`, of the
    process tree with ``tree``), ``rchar``/``wchar`` (bytes through read()/write() calls, not mmap).
    """
    release_memory()
    _barrier()
    r0, w0 = io_chars()
    with PeakRSS(tree=tree) as mem:
        t0 = time.perf_counter()
        out = fn()
        _barrier()
        seconds = time.perf_counter() - t0
    r1, w1 = io_chars()
    return out, {"seconds": seconds, **mem.record(), "rchar": r1 - r0, "wchar": w1 - w0}


def gathered(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's ``record``, in rank order (collective): one repetition's entry in a worker's JSON."""
    return all_gather_json(record)


def rotated(systems: list[str], rep: int) -> list[str]:
    """The order of ``systems`` in repetition ``rep``: round-robin, the first one moving back one place each time."""
    k = rep % len(systems) if systems else 0
    return systems[k:] + systems[:k]
