"""The fault benchmark's rows (``benchmarks/faults.py``; Megatron-LM's, ``benchmarks/kit/faults_mlm.py``): what a fault
cost, and what both read from an in-place run's logs (whether the survivors kept their processes, the timeouts
used)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

from tenplex_megatron.frontdoor.inprocess import InprocessSettings

PIDS_RE = re.compile(r"ranks started, pids ((?:\d+:\d+ ?)+)")
STATUSES_RE = re.compile(r"exit statuses ((?:\d+:-?\d+ ?)+)")
CALL_RE = re.compile(r"in place: call (\d+): rank \d+ of \d+ \(initial rank (\d+), pid (\d+)\)")


@dataclass(frozen=True)
class Row:
    """One fault's cost."""

    fault: str
    checkpoints_lost: int
    iterations_lost_beyond_interval: int | None  # None: no restart was needed
    durable_mb_rank0: float | None
    seconds_to_first_iteration: float | None  # in place: to the first iteration at the new layout
    note: str = ""
    in_place: bool = False  # the survivors continued in their processes (NVRx)
    survivors_kept: bool | None = None  # in place: every rank called again is the process started for it
    survivors_ended: tuple[int, ...] = ()  # in place: ranks not hit by the fault that NVRx ended all the same
    ratio_to_restart: float | None = None  # in place: seconds to 1st iteration over the process restart's
    iterations_lost: int | None = None  # the newest iteration done at the fault minus the one resumed from


class RunDir(Protocol):
    """What a row's builder needs of a fault's run (``benchmarks.faults.Run``): its working directory."""

    root: str


def inplace_timeouts(seconds: float) -> str:
    """The in-place timeouts used, as the note says them."""
    t = InprocessSettings(timeout=seconds)
    return f"collective timeout {t.timeout:g} s, NVRx soft/hard {t.soft:g}/{t.hard:g} s"


def survivors(logs: str, lost: set[int]) -> tuple[bool, tuple[int, ...]]:
    """Whether every rank called again in place is the process its launcher started (the same pid), and the ranks
    not ``lost`` that were ended by a signal all the same (NVRx's hard timeout: a survivor stuck in a collective)."""
    started, statuses = {}, {}
    for m in PIDS_RE.finditer(logs):  # one line per launcher (node): initial rank -> pid
        started.update({int(r): int(p) for r, p in (x.split(":") for x in m.group(1).split())})
    for m in STATUSES_RE.finditer(logs):
        statuses.update({int(r): int(c) for r, c in (x.split(":") for x in m.group(1).split())})
    again = {(int(i), int(p)) for c, i, p in CALL_RE.findall(logs) if c != "0"}
    kept = bool(again) and all(started.get(i) == p for i, p in again)
    return kept, tuple(sorted(r for r, c in statuses.items() if c < 0 and r not in lost))
