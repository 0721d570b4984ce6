"""Collectives over torch.distributed: JSON all-gather and the phase runner that keeps every rank in step.

JSON travels as bytes in tensors (nothing is pickled). Every collective phase
of a save or a load runs through :func:`run_phase` (as PyTorch DCP's
``_DistWrapper`` does): whatever a rank raises, of any type, is caught and
gathered, and every rank raises one :class:`RankFailure` naming each failing
rank with the exception's type and message. No rank is left waiting in a
collective for a peer that already failed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


class RankFailure(RuntimeError):
    """One or more ranks failed a phase; the message lists each rank with its exception's type and message."""

    def __init__(self, message: str, failures: dict[int, str]):
        super().__init__(message)
        self.failures = failures  # rank -> "Type: message"


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_json(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (JSON-serialisable), in rank order."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [json.loads(json.dumps(obj))]
    data = json.dumps(obj).encode()
    dev = _device()
    size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    n = int(max(int(s) for s in sizes))
    buf = torch.zeros(n, dtype=torch.uint8, device=dev)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    bufs = [torch.zeros_like(buf) for _ in sizes]
    dist.all_gather(bufs, buf)
    return [json.loads(b[: int(s)].cpu().numpy().tobytes().decode()) for b, s in zip(bufs, sizes)]


def _describe(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= 2000 else text[:2000] + " [...]"


def check_all(error: BaseException | None, what: str) -> None:
    """Collective: raise on every rank if any rank passed an error, listing all of them."""
    msgs = all_gather_json(None if error is None else _describe(error))
    failed = {r: m for r, m in enumerate(msgs) if m is not None}
    if failed:
        lines = "\n".join(f"  rank {r}: {m}" for r, m in failed.items())
        raise RankFailure(f"{what} failed on {len(failed)} rank(s):\n{lines}", failed) from error


def run_phase(what: str, fn: Callable[[], T]) -> T:
    """Collective: run ``fn`` on every rank; if it raised anything on any rank, raise on all of them.

    Every exception is caught (``BaseException``: a ``TypeError`` from a
    callback, a ``KeyboardInterrupt`` too), so the ranks always meet in the
    closing all-gather instead of waiting out the process-group timeout.
    """
    error: BaseException | None = None
    result: Any = None
    try:
        result = fn()
    except BaseException as e:  # noqa: BLE001 - any failure must reach the other ranks
        error = e
    check_all(error, what)
    return result
