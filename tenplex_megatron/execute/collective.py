"""Small collectives over torch.distributed: JSON all-gather and errors gathered from every rank.

JSON travels as bytes in tensors (nothing is pickled). :func:`check_all` turns
a failure on any rank into one error, raised on every rank, that lists each
failing rank and its reason, so no rank hangs waiting for a failed peer.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


class RankFailure(RuntimeError):
    """One or more ranks failed; the message lists each rank and its reason."""


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


def check_all(error: BaseException | None, what: str) -> None:
    """Collective: raise on every rank if any rank passed an error, listing all of them."""
    msg = None if error is None else f"{type(error).__name__}: {error}"
    msgs = all_gather_json(msg)
    failed = [(r, m) for r, m in enumerate(msgs) if m is not None]
    if failed:
        lines = "\n".join(f"  rank {r}: {m}" for r, m in failed)
        raise RankFailure(f"{what} failed on {len(failed)} rank(s):\n{lines}") from error
