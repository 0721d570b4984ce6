"""Medians and summaries of repetitions, the same in every benchmark.

A system's measurements are ``reps[repetition][rank]`` records (:func:`benchmarks.kit.measure.timed`). A repetition's time
is the max over ranks (the collective call is done when the slowest rank is); the figure reported is the median
over repetitions. Memory is per rank, its worst repetition: the peak RSS, and the growth during the call (peak less
the RSS just before that call), for RSS and for anonymous memory. Byte counts are summed over ranks (median over
repetitions).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Reps = list[list[dict[str, Any]]]  # [repetition][rank] -> record


def per_rep(reps: Reps, key: str, how: Callable[[list[float]], float] = max) -> list[float]:
    """For each repetition, ``how`` (max, sum) over ranks of ``key``."""
    return [how([r[key] for r in rep]) for rep in reps]


def total(reps: Reps, key: str) -> int | None:
    """Median over repetitions of the sum over ranks of ``key``; None when a rank has no such count."""
    if any(r.get(key) is None for rep in reps for r in rep):
        return None
    return int(statistics.median(per_rep(reps, key, sum)))


@dataclass(frozen=True)
class Summary:
    """A system's repetitions, reduced: times (max over ranks) and each rank's worst memory."""

    times: list[float]  # per repetition
    rss_peak_per_rank: list[int]
    rss_growth_per_rank: list[int]
    anon_growth_per_rank: list[int]

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def summarize(reps: Reps) -> Summary:
    world = len(reps[0])

    def worst(fn: Callable[[dict[str, Any]], int]) -> list[int]:
        return [max(fn(rep[k]) for rep in reps) for k in range(world)]

    return Summary(per_rep(reps, "seconds"), worst(lambda r: r["rss_peak"]),
                   worst(lambda r: r["rss_peak"] - r["rss_before"]),
                   worst(lambda r: r.get("anon_peak", 0) - r.get("anon_before", 0)))


def bandwidth(reps: Reps) -> dict[str, Any]:
    """All ranks' bytes over the median time (max over ranks): a physical limit's figure, in GB/s."""
    times = per_rep(reps, "seconds")
    out: dict[str, Any] = {"seconds": statistics.median(times), "seconds_all": times, "bytes": total(reps, "bytes")}
    out["GBps"] = out["bytes"] / out["seconds"] / 1e9
    return out


def ratio(a: float, b: float) -> float:
    """``a / b``; infinite for a positive ``a`` over zero, 1 for zero over zero."""
    return a / b if b else float("inf") if a else 1.0
