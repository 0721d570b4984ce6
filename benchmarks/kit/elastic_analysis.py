"""What a replayed trace did, from what the trainer and the agents left behind. Pure Python (no torch).

Inputs: the ``--tenplex-metrics`` lines (iteration, loss, layout, wall time), the trainer's ``> tenplex-megatron:
timeline {...}`` lines (process start, process group, checkpoint loaded and its load seconds, first
iteration; one per (re)start, printed by rank 0), the times the benchmark changed the allocation and the
worker processes' lifetimes (:class:`benchmarks.kit.agents.WorkerSpan`). Outputs: progress (the first time each
iteration was done), samples per second in time windows, each change's breakdown and the loss deviation
from an uninterrupted run.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

TIMELINE = "> tenplex-megatron: timeline "
PHASES = ("detect", "rendezvous+spawn", "imports+process group", "build", "plan+re-shard", "first step")


@dataclass(frozen=True)
class Change:
    """The benchmark set the allocation from ``before`` to ``after`` nodes at wall time ``t``."""

    t: float
    before: int
    after: int


def timelines(logs: Iterable[str]) -> list[dict[str, float]]:
    """Every timeline the trainer logged in ``logs`` (texts), oldest process first."""
    out = [json.loads(line.split(TIMELINE, 1)[1]) for text in logs for line in text.splitlines() if TIMELINE in line]
    return sorted(out, key=lambda t: t["process_start"])


def progress(metrics: Sequence[Mapping[str, Any]]) -> list[tuple[float, int]]:
    """(wall time, iteration) each time the job reached an iteration it had not reached before."""
    out, best = [], 0
    for m in sorted(metrics, key=lambda m: m["time"]):
        if m["iteration"] > best:
            best = m["iteration"]
            out.append((m["time"], best))
    return out


def throughput(metrics: Sequence[Mapping[str, Any]], t0: float, global_batch: int,
               window: float) -> list[tuple[float, float]]:
    """(window start from ``t0``, samples per second of new iterations in that window), every window to the end."""
    prog = progress(metrics)
    if not prog:
        return []
    n = int((prog[-1][0] - t0) // window) + 1
    counts = [0] * n
    for t, _ in prog:
        counts[int((t - t0) // window)] += 1
    return [(i * window, c * global_batch / window) for i, c in enumerate(counts)]


def repeated_iterations(metrics: Sequence[Mapping[str, Any]]) -> int:
    """Iterations run more than once (work lost to failures: redone from the newest checkpoint)."""
    return len(metrics) - len({m["iteration"] for m in metrics})


def loss_deviation(metrics: Sequence[Mapping[str, Any]], reference: Mapping[int, float]) -> float:
    """The largest relative difference of any iteration's loss (repeats included) from the reference's."""
    return max((abs(m["loss"] - reference[m["iteration"]]) / abs(reference[m["iteration"]]) for m in metrics),
               default=0.0)


def breakdown(change: Change, spans: Sequence[Any], lines: Sequence[Mapping[str, float]],
              next_change: float | None = None) -> dict[str, float] | None:
    """Seconds of each phase from ``change`` to the first iteration after it (None: no restart followed it, or
    the next change, at wall time ``next_change``, came before that first iteration).

    detect: until the workers that were running after the change (survivors of a lost node, or the old group
    on a grow, which saves on the agent's SIGTERM first) had exited; rendezvous+spawn: until the new rank 0
    started; then the trainer's own timeline: imports and process group, building the model, the load (plan
    and re-shard from the newest checkpoint), the first iteration. In place (``--tenplex-inprocess``: no new
    process; the timeline of the call that followed the change): detect covers the fault's detection, NVRx's restart
    and the new process group, and rendezvous+spawn and imports are 0.
    """
    again = sorted((x for x in lines if x.get("inprocess_call") and x["process_group"] > change.t),
                   key=lambda x: x["process_group"])
    nxt = [x for x in lines if x["process_start"] > change.t]
    if again and (not nxt or again[0]["process_group"] < nxt[0]["process_start"]):
        t = again[0]
        if next_change is not None and t["first_iteration"] > next_change:
            return None
        loaded, load = t.get("loaded", t["process_group"]), t.get("load_seconds", 0.0)
        return {"detect": t["process_group"] - change.t, "rendezvous+spawn": 0.0, "imports+process group": 0.0,
                "build": loaded - t["process_group"] - load, "plan+re-shard": load,
                "first step": t["first_iteration"] - loaded, "total": t["first_iteration"] - change.t}
    if not nxt:
        return None
    t = nxt[0]
    if next_change is not None and t["first_iteration"] > next_change:
        return None
    old = [s for s in spans if s.seen <= change.t and (s.gone is None or s.gone > change.t)]
    stopped = max((s.gone for s in old if s.gone is not None and s.gone <= t["process_start"]), default=change.t)
    loaded = t.get("loaded", t["process_group"])
    load = t.get("load_seconds", 0.0)
    return {"detect": stopped - change.t, "rendezvous+spawn": t["process_start"] - stopped,
            "imports+process group": t["process_group"] - t["process_start"],
            "build": loaded - t["process_group"] - load, "plan+re-shard": load,
            "first step": t["first_iteration"] - loaded, "total": t["first_iteration"] - change.t}
