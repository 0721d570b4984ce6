"""Peak memory of a block: RSS and anonymous memory, sampled by a thread (psutil), for a rank or a process tree."""

from __future__ import annotations

import ctypes
import gc
import threading
from typing import Any

SAMPLE_SECONDS = 0.005


class PeakRSS:
    """RSS just before the block and its peak during it (sampled every 5 ms), and the same for anonymous memory.

    Anonymous memory is RSS less file-backed and shared pages: what the process allocated, without the page-cache
    pages of files it maps, which the kernel can drop at any time (a load through mmap counts the pages it touches
    in its RSS, not in its anonymous memory). ``tree``: the sums over this process and its children (pool workers).
    """

    def __init__(self, tree: bool = False) -> None:
        self._tree = tree

    def __enter__(self) -> PeakRSS:
        import psutil

        self._proc = psutil.Process()
        self.before, self.anon_before = self._sample()
        self.peak, self.anon_peak = self.before, self.anon_before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> tuple[int, int]:
        procs: list[Any] = [self._proc, *(self._proc.children(recursive=True) if self._tree else ())]
        rss = anon = 0
        for p in procs:
            try:
                m = p.memory_info()
            except Exception:  # noqa: BLE001 - a pool worker may exit between listing and reading
                continue
            rss, anon = rss + m.rss, anon + m.rss - m.shared
        return rss, anon

    def _update(self) -> None:
        rss, anon = self._sample()
        self.peak, self.anon_peak = max(self.peak, rss), max(self.anon_peak, anon)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_SECONDS):
            self._update()

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._update()

    def record(self) -> dict[str, int]:
        """The four figures, as stored in the workers' JSON."""
        return {"rss_before": self.before, "rss_peak": self.peak, "anon_before": self.anon_before,
                "anon_peak": self.anon_peak}


def release_memory() -> None:
    """Return freed heap pages to the OS, so the next call's RSS baseline is not lowered by the previous one."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
