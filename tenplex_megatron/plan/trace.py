"""GPU-allocation traces for the elastic benchmark (``configs/traces/*.json``): parse and check. Pure Python.

A trace says when the job's allocation changes and to what, in seconds from its start::

    {"version": 1, "name": "shrink_grow", "gpus_per_node": 1,
     "events": [{"t": 0, "gpus": 4}, {"t": 60, "gpus": 2}, {"t": 120, "gpus": 4}]}

An event gives ``gpus`` or ``nodes`` (``nodes x gpus_per_node`` GPUs); the first
is at t=0 and times strictly increase. The last count holds until ``end``
(optional, after the last event: the allocation is gone) or until the run ends.
Every error names the file, line and column.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from tenplex_megatron.errors import TenplexError
from tenplex_megatron.plan.json_pos import JSONFileError, Path, loads_located, where
from tenplex_megatron.plan.versioned import VersionedFormat

TRACE_VERSION = 1
_TOP_FIELDS = frozenset({"version", "name", "description", "gpus_per_node", "events", "end"})


class TraceError(TenplexError, ValueError):
    """A trace file that does not parse or holds a malformed event; the message names the line and column."""


TRACE_FORMAT = VersionedFormat('a trace: {"version": 1, "events": [...]}', "version", (TRACE_VERSION,), TraceError)


@dataclass(frozen=True)
class TraceEvent:
    """From ``t`` seconds on, the job has ``gpus`` GPUs on ``nodes`` nodes."""

    t: float
    gpus: int
    nodes: int


@dataclass(frozen=True)
class Trace:
    """A named allocation trace: events in time order, the first at t=0."""

    name: str
    gpus_per_node: int
    events: tuple[TraceEvent, ...]
    description: str = ""
    end: float | None = None

    @property
    def max_gpus(self) -> int:
        return max(e.gpus for e in self.events)

    def gpus_at(self, t: float) -> int:
        """The GPU count in force at ``t`` seconds."""
        current = self.events[0].gpus
        for e in self.events:
            if e.t > t:
                break
            current = e.gpus
        return current


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def parse_trace(text: str, name: str) -> Trace:
    """Parse trace JSON; :class:`TraceError` naming ``name``, the line and the column of what is wrong."""
    try:
        doc, pos = loads_located(text, name)
    except JSONFileError as e:
        raise TraceError(str(e)) from None

    def fail(path: Path, msg: str) -> TraceError:
        return TraceError(f"{where(name, pos, path)}: {msg}")

    TRACE_FORMAT.check(doc, where(name, pos, ()), where(name, pos, ("version",)))
    extra = sorted(set(doc) - _TOP_FIELDS)
    if extra:
        raise fail((extra[0],), f"unknown field {extra[0]!r} (known: {', '.join(sorted(_TOP_FIELDS))})")
    per_node = doc.get("gpus_per_node", 1)
    if not _positive_int(per_node):
        raise fail(("gpus_per_node",), f"gpus_per_node must be a positive integer, got {per_node!r}")
    for field in ("name", "description"):
        if not isinstance(doc.get(field, ""), str):
            raise fail((field,), f"{field} must be a string")
    events = doc.get("events")
    if not isinstance(events, list) or not events:
        raise fail(("events",), "events must be a non-empty list of {\"t\": seconds, \"gpus\": N} or {\"t\": .., \"nodes\": N}")
    out: list[TraceEvent] = []
    for i, ev in enumerate(events):
        path: Path = ("events", i)
        if not isinstance(ev, dict):
            raise fail(path, f"event {i}: expected an object {{\"t\": seconds, \"gpus\": N}}, got {ev!r}")
        extra = sorted(set(ev) - {"t", "gpus", "nodes"})
        if extra:
            raise fail((*path, extra[0]), f"event {i}: unknown field {extra[0]!r} (an event has t and gpus or nodes)")
        t = ev.get("t")
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise fail((*path, "t"), f"event {i}: t must be a number of seconds >= 0, got {t!r}")
        if ("gpus" in ev) == ("nodes" in ev):
            raise fail(path, f"event {i}: give exactly one of gpus and nodes")
        count_field = "gpus" if "gpus" in ev else "nodes"
        count = ev[count_field]
        if not _positive_int(count):
            raise fail((*path, count_field), f"event {i}: {count_field} must be a positive integer, got {count!r}")
        if count_field == "gpus" and count % per_node:
            raise fail((*path, "gpus"), f"event {i}: {count} GPUs is not a whole number of nodes of {per_node}")
        gpus = count if count_field == "gpus" else count * per_node
        if not out and t != 0:
            raise fail((*path, "t"), f"event {i}: the first event must be at t=0, got {t!r}")
        if out and t <= out[-1].t:
            raise fail((*path, "t"), f"event {i}: t={t!r} is not after the previous event's t={out[-1].t!r}")
        out.append(TraceEvent(float(t), gpus, gpus // per_node))
    end = doc.get("end")
    if end is not None and (isinstance(end, bool) or not isinstance(end, (int, float)) or not end > out[-1].t
                            or not math.isfinite(end)):
        raise fail(("end",), f"end must be a number of seconds after the last event (t={out[-1].t!r}), got {end!r}")
    default_name = os.path.splitext(os.path.basename(name))[0]
    return Trace(doc.get("name", default_name), per_node, tuple(out), doc.get("description", ""),
                 None if end is None else float(end))


def load_trace(path: str) -> Trace:
    """Read and check the trace file at ``path`` (see :func:`parse_trace`)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise TraceError(f"{path}: cannot read: {e.strerror}") from None
    return parse_trace(text, path)
