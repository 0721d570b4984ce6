"""Fault injection points for the crash-safety tests (inert unless TENPLEX_FAULT is set).

``TENPLEX_FAULT=<point>[@<rank>][#<iteration>][:<kind>]`` makes rank ``<rank>``
(every rank if omitted) fail at ``<point>`` (of the save of ``<iteration>``, if
given): kind ``kill`` (default) SIGKILLs the process, ``enospc`` raises
``OSError(ENOSPC)``, ``error`` raises ``RuntimeError``. Points:
``save.tensors`` (shard file half written), ``save.metadata`` (metadata written,
not renamed), ``save.commit`` (just before the rename), ``load.read``.
"""

from __future__ import annotations

import errno
import os
import signal


def maybe_fail(point: str, rank: int, iteration: int | None = None) -> None:
    spec = os.environ.get("TENPLEX_FAULT")
    if not spec:
        return
    where, _, kind = spec.partition(":")
    where, _, it = where.partition("#")
    name, _, r = where.partition("@")
    if name != point or (r != "" and int(r) != rank):
        return
    if it != "" and iteration is not None and int(it) != iteration:
        return
    kind = kind or "kill"
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "enospc":
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"injected at {point}")
    raise RuntimeError(f"injected fault at {point} on rank {rank}")
