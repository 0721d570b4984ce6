"""Who sends which bytes to whom when chunks come from peers' memory: a pure, balanced schedule.

Every rank computes the same schedule from the same gathered requests, so
point-to-point sends and receives match without further talk. Each requested
byte range travels once to each rank that asked for it, from the holder whose
ranks have sent the fewest bytes so far (ties: the lowest rank).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Transfer:
    """``hi - lo`` bytes of stored item ``key`` (a rank file's tensor) from ``sender`` to ``receiver``."""

    sender: int
    receiver: int
    key: str
    lo: int
    hi: int

    @property
    def nbytes(self) -> int:
        return self.hi - self.lo


def schedule(requests: dict[int, list[tuple[str, int, int]]], senders: dict[str, list[int]]) -> list[Transfer]:
    """Transfers serving every request: ``requests[rank]`` = (key, lo, hi) byte ranges it needs; ``senders[key]``:
    the ranks able to send ``key`` (on a node that holds it). Raises ValueError naming a key no rank can send."""
    load: dict[int, int] = {}
    out = []
    for receiver in sorted(requests):
        for key, lo, hi in requests[receiver]:
            who = [s for s in senders.get(key, []) if s != receiver]
            if not who:
                raise ValueError(f"{key}: no live rank holds it to send to rank {receiver}")
            s = min(who, key=lambda r: (load.get(r, 0), r))
            load[s] = load.get(s, 0) + hi - lo
            out.append(Transfer(s, receiver, key, lo, hi))
    return out


def merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, overlapping or touching [lo, hi) ranges merged."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out
