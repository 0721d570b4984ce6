"""Who sends which bytes to whom when chunks come from peers' memory: a pure, balanced schedule.

Every rank computes the same schedule from the same gathered requests, so
point-to-point sends and receives match without further talk. Each requested
byte range travels once to each rank that asked for it, from the holder whose
ranks have sent the fewest bytes so far (ties: the lowest rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tenplex_megatron.plan.planner import PlanError


@dataclass(frozen=True, order=True)
class PeerKey:
    """A stored item peers send: one tensor (``name``) of one rank file (``file``)."""

    file: str
    name: str

    def __str__(self) -> str:
        return f"{self.file}:{self.name}"


@dataclass(frozen=True)
class PeerRequest:
    """Bytes ``[lo, hi)`` of item ``key`` that a rank needs from a peer (what ranks gather, as JSON)."""

    key: PeerKey
    lo: int
    hi: int

    def to_json(self) -> dict[str, Any]:
        return {"file": self.key.file, "name": self.key.name, "lo": self.lo, "hi": self.hi}

    @staticmethod
    def from_json(d: dict[str, Any]) -> PeerRequest:
        return PeerRequest(PeerKey(str(d["file"]), str(d["name"])), int(d["lo"]), int(d["hi"]))


@dataclass(frozen=True)
class RankRequests:
    """Every byte range one rank needs from its peers (gathered, so that every rank schedules the same transfers)."""

    requests: tuple[PeerRequest, ...]

    def to_json(self) -> list[dict[str, Any]]:
        return [q.to_json() for q in self.requests]

    @classmethod
    def from_json(cls, d: list[dict[str, Any]]) -> RankRequests:
        return cls(tuple(PeerRequest.from_json(q) for q in d))


@dataclass(frozen=True)
class Transfer:
    """``hi - lo`` bytes of stored item ``key`` from ``sender`` to ``receiver``."""

    sender: int
    receiver: int
    key: PeerKey
    lo: int
    hi: int

    @property
    def nbytes(self) -> int:
        return self.hi - self.lo


def schedule(requests: dict[int, list[PeerRequest]], senders: dict[PeerKey, list[int]]) -> list[Transfer]:
    """Transfers serving every request: ``requests[rank]``: the byte ranges it needs; ``senders[key]``: the ranks
    able to send ``key`` (on a node that holds it). Raises PlanError naming a key no rank can send."""
    load: dict[int, int] = {}
    out = []
    for receiver in sorted(requests):
        for req in requests[receiver]:
            who = [s for s in senders.get(req.key, []) if s != receiver]
            if not who:
                raise PlanError(f"{req.key}: no live rank holds it to send to rank {receiver}")
            s = min(who, key=lambda r: (load.get(r, 0), r))
            load[s] = load.get(s, 0) + req.hi - req.lo
            out.append(Transfer(s, receiver, req.key, req.lo, req.hi))
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
