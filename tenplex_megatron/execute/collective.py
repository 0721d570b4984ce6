"""Collectives over torch.distributed: JSON all-gather and the phase runner that keeps every rank in step.

JSON travels as bytes in tensors (nothing is pickled). Every phase of a save
or a load runs through :func:`run_phase` or :func:`gather_records` (as PyTorch
DCP's ``_DistWrapper`` does): the phase's local work runs on each rank, whatever
it raises, of any type, is caught, and the outcome (the local result or the
error, as a :class:`~tenplex_megatron.errors.Failure` record: kind, type and
message) travels in the phase's one collective, so every rank raises the same
:class:`RankFailure` naming each failing rank with the exception's type and
message; a reader tests a failure's ``kind``, never its words. The local work
must contain no collective of its own: a rank that failed before it would
leave its peers in a mismatched collective. What a gathering phase returns is
a typed :class:`Record` from every rank (a frozen dataclass that travels as
JSON), never a bare dict.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from tenplex_megatron.errors import Failure, TenplexError

T = TypeVar("T")
R = TypeVar("R", bound="Record")


class Record(Protocol):
    """A phase's typed per-rank result: a frozen dataclass that travels as JSON (``to_json``/``from_json``)."""

    def to_json(self) -> Any: ...

    @classmethod
    def from_json(cls: type[R], d: Any) -> R: ...


class RankFailure(TenplexError, RuntimeError):
    """One or more ranks failed a phase; the message lists each rank with its exception's type and message."""

    def __init__(self, message: str, failures: dict[int, Failure]):
        super().__init__(message)
        self.failures = failures  # rank -> its failure (kind, type, message)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_json(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (JSON-serialisable), in rank order."""
    return [json.loads(b) for b in _all_gather_bytes(json.dumps(obj).encode())]


def _all_gather_bytes(data: bytes) -> list[bytes]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [data]
    dev = _device()
    size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, size)
    n = int(max(int(s) for s in sizes))
    buf = torch.zeros(n, dtype=torch.uint8, device=dev)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    bufs = [torch.zeros_like(buf) for _ in sizes]
    dist.all_gather(bufs, buf)
    return [b[: int(s)].cpu().numpy().tobytes() for b, s in zip(bufs, sizes)]


def broadcast_json(obj: Any, src: int) -> Any:
    """Rank ``src``'s ``obj`` (JSON-serialisable) on every rank (others pass anything, e.g. None)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    dev = _device()
    data = json.dumps(obj).encode() if rank() == src else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    dist.broadcast(size, src)
    buf = torch.zeros(int(size), dtype=torch.uint8, device=dev)
    if rank() == src:
        buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    dist.broadcast(buf, src)
    return json.loads(buf.cpu().numpy().tobytes())


#: the most characters of a failure's words that travel (the rest cut to " [...]")
DESCRIBE_LIMIT = 2000


def _describe(error: BaseException) -> Failure:
    return Failure.of(error, DESCRIBE_LIMIT)


def _raise_failures(what: str, failed: dict[int, Failure], error: BaseException | None) -> None:
    if failed:
        lines = "\n".join(f"  rank {r}: {m}" for r, m in failed.items())
        raise RankFailure(f"{what} failed on {len(failed)} rank(s):\n{lines}", failed) from error


def check_all(error: BaseException | None, what: str) -> None:
    """Collective: raise on every rank if any rank passed an error, listing all of them."""
    got = all_gather_json(None if error is None else _describe(error).to_json())
    _raise_failures(what, {r: Failure.from_json(d) for r, d in enumerate(got) if d is not None}, error)


def _gather_phase(what: str, fn: Callable[[], Any]) -> list[Any]:
    """Collective: run ``fn`` (local work, JSON result) on every rank and return every rank's result in rank order;
    if it raised anything on any rank, raise on all of them. Result and error share the one all-gather."""
    error: BaseException | None = None
    try:
        payload = json.dumps({"ok": fn()}).encode()
    except BaseException as e:  # noqa: BLE001 - any failure must reach the other ranks
        error = e
        payload = json.dumps({"error": _describe(e).to_json()}).encode()
    got = [json.loads(b) for b in _all_gather_bytes(payload)]
    _raise_failures(what, {r: Failure.from_json(g["error"]) for r, g in enumerate(got) if "error" in g}, error)
    return [g["ok"] for g in got]


def gather_records(what: str, fn: Callable[[], R], kind: type[R]) -> list[R]:
    """Collective: run ``fn`` (local work, no collective inside) on every rank and return every rank's ``kind`` record
    in rank order (it travels as its JSON); if ``fn`` raised anything on any rank, raise on all of them. Result and
    error share the one all-gather."""
    return [kind.from_json(d) for d in _gather_phase(what, lambda: fn().to_json())]


def run_phase(what: str, fn: Callable[[], T]) -> T:
    """Collective: run ``fn`` (local work, no collective inside) on every rank; if it raised anything on any rank,
    raise on all of them.

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
