"""Stop on notice: SIGTERM (what schedulers send before taking GPUs, and what torchrun's elastic agent sends its
workers before restarting them for a node that joined or left) makes every rank save and exit at the next
iteration boundary.

The handler only sets a flag; :meth:`StopOnSignal.agreed` is a collective (one
all-reduce of a byte per rank per iteration) so that every rank stops after the
same iteration even when the signal reached them at different moments.
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist


class StopOnSignal:
    """Context manager: while active, the given signals are recorded instead of ending the process."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,)):
        self.signals = signals
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

    def __enter__(self) -> StopOnSignal:
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def agreed(self) -> bool:
        """Collective: True on every rank if any rank has received a signal."""
        flag = torch.tensor([1 if self.received is not None else 0], dtype=torch.int32,
                            device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else "a peer's signal"
