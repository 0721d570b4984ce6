"""Staging buffers between host memory and the device: the mode (``TENPLEX_STAGING``), the budget and a reused ring.

Loads and saves move bytes through a small ring of bounded host buffers
(pinned when the device is a GPU) and, on a GPU, a side stream, so reading or
writing one buffer overlaps the transfer of the previous one; CUDA events
guard each buffer's reuse. On the CPU the same code runs with no pinning and
no streams, which lets the CPU suite check the GPU algorithm's indexing.
A ring is a context manager: on leaving it, normally or by an error, the side
stream is synchronised and the buffers are dropped (see :meth:`StagingRing.close`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from types import TracebackType

import torch

from tenplex_megatron import log as tlog
from tenplex_megatron.flags import FlagError

LOG = tlog.get("staging")

MODES = ("parallel", "serial", "copy", "direct", "auto")
DEFAULT_MB = 256.0
RING = 3  # buffers: one being filled, one in transfer, one being scattered or written
MIN_BYTES = 64


def _mode() -> str:
    """``TENPLEX_STAGING``, checked: one of :data:`MODES`."""
    mode = os.environ.get("TENPLEX_STAGING", "auto").strip().lower() or "auto"
    if mode not in MODES:
        raise FlagError(f"TENPLEX_STAGING={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def staging_mode(device: torch.device) -> str:
    """How a load reads, from ``TENPLEX_STAGING``: ``parallel`` (``storage/parallel_read.py``: reader threads, one
    ring; ``auto``, the default), ``copy`` (one host thread through staging buffers) or ``direct`` (per-piece
    copies from the file's map). ``serial``: the one-thread path suited to ``device``, ``copy`` for a GPU and
    ``direct`` for the CPU."""
    mode = _mode()
    if mode == "auto":
        return "parallel"
    if mode == "serial":
        return "direct" if device.type == "cpu" else "copy"
    return mode


def write_mode(device: torch.device) -> str:
    """How a save or snapshot leaves ``device``: ``parallel`` (``storage/parallel_write.py``: writer threads, the
    default: ``auto``), ``copy`` (one thread through the staging ring) or ``direct`` (one write per tensor);
    ``serial`` as for a load."""
    return staging_mode(device)


def staging_bytes() -> int:
    """The staging budget of one load or save, all ring buffers together: ``TENPLEX_STAGING_MB`` (default 256)."""
    raw = os.environ.get("TENPLEX_STAGING_MB", "")
    try:
        mb = float(raw) if raw.strip() else DEFAULT_MB
    except ValueError:
        raise FlagError(f"TENPLEX_STAGING_MB={raw!r}: expected a number of megabytes") from None
    if not mb > 0:
        raise FlagError(f"TENPLEX_STAGING_MB={raw!r}: must be positive")
    return int(mb * (1 << 20))


def buffer_bytes(total: int | None = None, count: int = RING) -> int:
    """One ring buffer's size for a budget of ``total`` bytes (default :func:`staging_bytes`), a multiple of 64."""
    total = staging_bytes() if total is None else total
    return max(MIN_BYTES, total // count // MIN_BYTES * MIN_BYTES)


class StagingRing:
    """``count`` reusable host buffers of ``size`` bytes (pinned for a GPU) and, for a GPU, their device twins.

    Use: :meth:`acquire` a host buffer (waits until its last transfer is done),
    fill it (load) or have :meth:`from_device` fill it (save), :meth:`to_device`,
    work on the side stream inside :meth:`side`, then :meth:`release`. Use it as a
    context manager (``with StagingRing(...) as ring:``): leaving the block, normally
    or by an error, synchronises the side stream and drops the buffers (:meth:`close`).
    A CUDA device without an index is the current device, made explicit here, so the
    stream, the buffers and the events are all on one named device.
    """

    def __init__(self, device: torch.device, size: int, count: int = RING):
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.cuda = device.type == "cuda"
        self.count = count
        self.closed = False
        self.host = [torch.empty(size, dtype=torch.uint8, pin_memory=self.cuda) for _ in range(count)]
        self.dev = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(count)] if self.cuda else []
        self.events: list[torch.cuda.Event | None] = [None] * count
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        if self.stream is not None:  # the side stream starts after what the caller queued (allocating, zeroing dst)
            self.stream.wait_stream(torch.cuda.current_stream(device))

    def __enter__(self) -> StagingRing:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close(quiet=exc_type is not None)

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("this staging ring is closed: its buffers were released")

    def acquire(self, i: int) -> torch.Tensor:
        """Host buffer ``i``, once the transfers and scatters queued on it last are done."""
        self._check_open()
        ev = self.events[i]
        if ev is not None:
            ev.synchronize()
            self.events[i] = None
        return self.host[i]

    def to_device(self, i: int, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of host buffer ``i`` on the device: an async copy on the side stream (a GPU), else itself."""
        self._check_open()
        if self.stream is None:
            return self.host[i][:nbytes]
        with torch.cuda.stream(self.stream):
            return self.dev[i][:nbytes].copy_(self.host[i][:nbytes], non_blocking=True)

    def from_device(self, i: int, src: torch.Tensor) -> torch.Tensor:
        """Copy ``src`` (1-D uint8) into host buffer ``i``: async on the side stream from a GPU; :meth:`release` then
        :meth:`acquire` again before reading it."""
        self._check_open()
        out = self.host[i][: src.numel()]
        if self.stream is None:
            out.copy_(src)
            return out
        with torch.cuda.stream(self.stream):
            out.copy_(src, non_blocking=True)
        return out

    @contextlib.contextmanager
    def side(self) -> Iterator[None]:
        """Run the enclosed device work on the side stream (nothing changes on the CPU)."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

    def release(self, i: int) -> None:
        """Mark buffer ``i``'s queued work: the next :meth:`acquire` of it waits for that."""
        if self.stream is not None:
            ev = torch.cuda.Event()
            ev.record(self.stream)
            self.events[i] = ev

    def finish(self) -> None:
        """Wait for everything queued: the caller's stream may then use what was written on the side stream."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self.stream.synchronize()

    def close(self, quiet: bool = False) -> None:
        """:meth:`finish`, then drop the buffers, events and stream (idempotent); the ring cannot be used after.

        On an error path (a damaged block found after some buffers went out, a
        failed write) transfers and scatters may still be queued on the side
        stream: the device buffers must not go back to the caching allocator
        (whose next allocation on the caller's stream could reuse them) and the
        caller must not go on with destination tensors still being written until
        they are done. ``quiet`` (an error is already on its way): a second error
        while synchronising (a sticky CUDA error) is logged, not raised, so the
        first one is what the caller sees. The buffers' memory is released once
        no view of them is left: the callers drop theirs in ``finally`` too (an
        error's traceback keeps their frames, and with them their locals). Pinned
        host memory goes back to torch's caching host allocator, device memory to
        its caching allocator.
        """
        if self.closed:
            return
        self.closed = True
        try:
            self.finish()
        except Exception:
            if not quiet:
                raise
            LOG.warning("staging ring on %s: synchronising after an error failed as well", self.device, exc_info=True)
        finally:
            self.host, self.dev, self.events, self.stream = [], [], [], None
