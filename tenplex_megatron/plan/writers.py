"""Who writes which chunk at save: every distinct chunk once, spread over the ranks holding it. Pure.

DP (and TP) replicas hold identical chunks; writing each once, by the least
loaded of its holders, keeps any rank from writing the whole replicated state
and needs no gather onto DP rank 0. A chunk with no main replica (megatron's
``replica_id`` all zeros), e.g. the tied output embedding on the last pipeline
stage, is a copy of another tensor's chunk and is not written at all.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from tenplex_megatron.plan.ptc import Chunk


@dataclass(frozen=True)
class Holding:
    """Rank ``rank`` holds ``chunk`` (``main``: it is megatron's main replica), ``nbytes`` big."""

    rank: int
    chunk: Chunk
    main: bool
    nbytes: int


def assign_writers(holdings: list[Holding]) -> dict[Chunk, int]:
    """Map each chunk that has a main replica to the rank that writes it, balancing bytes."""
    holders: dict[Chunk, list[Holding]] = defaultdict(list)
    for h in holdings:
        holders[h.chunk].append(h)
    groups = [(c, hs) for c, hs in holders.items() if any(h.main for h in hs)]
    groups.sort(key=lambda g: (-g[1][0].nbytes, g[0].key, g[0].offsets, g[0].flat_range))
    written: dict[int, int] = defaultdict(int)
    out: dict[Chunk, int] = {}
    for chunk, hs in groups:
        rank = min({h.rank for h in hs}, key=lambda r: (written[r], r))
        written[rank] += hs[0].nbytes
        out[chunk] = rank
    return out
