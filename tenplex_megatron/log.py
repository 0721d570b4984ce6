"""The library's one logger, ``tenplex_megatron`` (each module a child of it): one prefix, ``> tenplex:``, and
rank 0 only below WARNING, so a 1,024-rank job logs a restart once; information to stdout (beside Megatron-LM's
own lines), warnings and errors to stderr. The CLI and the reference trainer print; the library logs. A program that configures logging itself calls :func:`propagate` to receive the records instead.

The rank is torch.distributed's once a process group exists, else torchrun's ``RANK``; this module imports no
torch (the planning layer logs too).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TextIO

ROOT = "tenplex_megatron"
PREFIX = "> tenplex: "
EVERY_RANK = "tenplex_every_rank"  # a record's attribute: information that every rank says (its own pid, its rank)


def rank() -> int:
    """This process's global rank: torch.distributed's when initialised (torch already imported), else ``RANK``."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    value = os.environ.get("RANK", "0")
    return int(value) if value.isdigit() else 0  # NVRx's in-process restart sets "None" in a rank it let go


class RankZeroFilter(logging.Filter):
    """Records below WARNING from rank 0 only (but those :func:`every_rank` marks); warnings and errors from every
    rank."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or rank() == 0 or getattr(record, EVERY_RANK, False)


class PrefixFormatter(logging.Formatter):
    """``> tenplex: message``; a warning says so, and a rank other than 0 names itself."""

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        if record.exc_info:
            msg += "\n" + self.formatException(record.exc_info)
        r = rank()
        where = f"[rank {r}] " if r else ""
        level = "" if record.levelno < logging.WARNING else f"{record.levelname.lower()}: "
        return f"{PREFIX}{where}{level}{msg}"


class _Below(logging.Filter):
    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < self.level


class _StdStreamHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stdout`` or ``sys.stderr`` is when a record comes (a program or a test that swaps
    them, pytest's capture, gets the lines), not the stream of the moment the handler was made."""

    def __init__(self, name: str) -> None:
        self._std = name
        super().__init__()

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return getattr(sys, self._std)

    @stream.setter
    def stream(self, value: object) -> None:  # StreamHandler's __init__ and setStream: the name decides
        pass


def _handler(stream: str, level: int, *filters: logging.Filter) -> logging.Handler:
    handler = _StdStreamHandler(stream)
    handler.setLevel(level)
    handler.setFormatter(PrefixFormatter())
    for f in filters:
        handler.addFilter(f)
    handler._tenplex = True  # type: ignore[attr-defined]
    return handler


_PROPAGATE: list[bool] = [False]  # set by propagate(): the program's own handlers get the records


def _configure() -> logging.Logger:
    root = logging.getLogger(ROOT)
    if not _PROPAGATE[0] and not any(getattr(h, "_tenplex", False) for h in root.handlers):
        root.addHandler(_handler("stdout", logging.INFO, RankZeroFilter(), _Below(logging.WARNING)))
        root.addHandler(_handler("stderr", logging.WARNING))
        root.setLevel(logging.INFO)
        root.propagate = False
    return root


def get(name: str) -> logging.Logger:
    """The logger of one part of the library, ``tenplex_megatron.<name>``, the package's handler set up once."""
    _configure()
    return logging.getLogger(f"{ROOT}.{name}")


def every_rank(logger: logging.Logger, msg: str) -> None:
    """Information each rank says of itself (a re-form's new rank and pid, which tests and operators match per
    process), past the rank-0 filter."""
    logger.info("%s", msg, extra={EVERY_RANK: True})


def propagate(on: bool = True) -> None:
    """Hand the records to the root logger's handlers (a program that configures logging), without ours."""
    _PROPAGATE[0] = on
    root = logging.getLogger(ROOT)
    for h in [h for h in root.handlers if getattr(h, "_tenplex", False)]:
        root.removeHandler(h)
    root.propagate = on
    _configure()
