"""Replay a GPU-allocation trace on paper: per policy, the layout at every allocation, time to a target. Pure Python.

What ``python -m tenplex_megatron simulate`` runs, and what is checked against ``benchmarks/elastic.py``'s real
replays. For each policy the trace's allocation changes are walked in time order:

* the policy's layout for the allocation (:class:`Policy`): ``auto`` (the throughput model's best, as
  ``--tenplex-layout auto``), ``measure`` (the model's best three timed, the fastest kept, as ``--tenplex-layout
  measure``, its trials paid at every new world size), ``dp_only`` (the Tenplex paper's baseline: TP x PP fixed,
  only DP scales) or ``table`` (a user's layout file). A policy runs on the most whole nodes, up to the allocation,
  at which one of its layouts is usable (the rest idle);
* that layout's seconds per iteration: from a times file (``tenplex_layout_times.json``, which ``--tenplex-layout
  measure`` writes: "measured") or the throughput model of ``plan/autolayout.py`` ("modelled");
* a change of layout costs the time to stop the old workers (a lost node: failure detection; a planned change:
  the workers save, then stop), the restart (rendezvous, spawn, imports, build, first step) and the re-shard: the
  planner's exact bytes per destination rank (``plan/sim/dry_run.py``, up to ``exact_bytes_max_gpus``; beyond,
  the busiest rank's state bytes at the slower bandwidth) over the storage bandwidth (bytes written on the rank's
  own node) and the network bandwidth (bytes from other nodes); the slowest rank sets the time;
* a lost node (``shrink="failure"``: the allocation shrank) loses the work since the last periodic save, which is
  redone; a planned change (a grow, or any change with ``shrink="notice"``) saves first; a change that comes while
  a restart is under way folds into it (the restart begins again at the change). A lost node is taken to be one
  the job runs on: the job restarts (on a spare node, where the allocation has one) even if its layout holds.

Out (:class:`PolicyResult`): the time to the target iteration (from the launch), samples per second over time,
idle GPU-hours (allocated GPUs not training: restarts, GPUs a layout cannot use), restarts, redone iterations, and
whether any iteration time or re-shard size was modelled. Choices and re-shard sizes are cached per world size and
layout pair: a 10,000-GPU trace of a month runs in seconds.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tenplex_megatron.errors import TenplexError
from tenplex_megatron.plan.autolayout import (
    DEFAULT_MICRO_BATCH_SIZES,
    Hardware,
    LayoutCandidate,
    LayoutChoice,
    candidate_key,
    estimate_memory,
    estimate_time,
    rank_layouts,
)
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.layout_choice import MEASURE_TIMED, MEASURE_TRIALS, MEASURE_WARMUP, to_measure
from tenplex_megatron.plan.layout_files import LayoutTable
from tenplex_megatron.plan.sim.dry_run import dry_run
from tenplex_megatron.plan.sim.gpt_catalogue import GPTDims
from tenplex_megatron.plan.trace import Trace, TraceEvent

RESULT_VERSION = 1
POLICY_KINDS = ("auto", "measure", "dp_only", "table")
SHRINK_MODES = ("failure", "notice")


class SimulationError(TenplexError, ValueError):
    """Inputs the simulator cannot run with (a policy without its table, a bad cost); the message says which."""


@dataclass(frozen=True)
class Job:
    """The model and what stays fixed across restarts: global batch, target iteration, memory budget per rank."""

    dims: GPTDims
    global_batch_size: int
    target_iteration: int
    memory_gb: float | None = None
    distributed_optimizer: bool = True
    micro_batch_sizes: tuple[int, ...] = DEFAULT_MICRO_BATCH_SIZES
    make_vocab_size_divisible_by: int = 128
    hardware: Hardware = Hardware()


@dataclass(frozen=True)
class Costs:
    """Seconds and bandwidths of a change (see the module's docstring); bandwidths in bytes/s per rank.

    ``start_s``: a launch (or a start after idling) to the first iteration, the checkpoint load excluded;
    ``restart_s``: from the old workers' exit to the first iteration, the re-shard excluded; ``detect_failure_s``:
    a lost node until the survivors' workers stopped; ``detect_notice_s``: a planned change until the workers
    stopped, their save excluded (``save_s``, or a rank's state bytes over the storage bandwidth when None);
    ``save_every``: iterations between periodic saves; ``measure_trial_s``: building one ``measure`` candidate.
    """

    start_s: float = 60.0
    restart_s: float = 60.0
    detect_failure_s: float = 30.0
    detect_notice_s: float = 5.0
    storage_bandwidth: float = 2e9
    network_bandwidth: float = 12.5e9
    save_every: int = 100
    save_s: float | None = None
    measure_trial_s: float = 20.0
    shrink: str = "failure"
    exact_bytes_max_gpus: int = 1024

    def __post_init__(self) -> None:
        for name in ("start_s", "restart_s", "detect_failure_s", "detect_notice_s", "measure_trial_s"):
            if not getattr(self, name) >= 0:
                raise SimulationError(f"{name} must be >= 0 seconds, got {getattr(self, name)!r}")
        for name in ("storage_bandwidth", "network_bandwidth"):
            if not getattr(self, name) > 0:
                raise SimulationError(f"{name} must be > 0 bytes/s, got {getattr(self, name)!r}")
        if self.save_s is not None and not self.save_s >= 0:
            raise SimulationError(f"save_s must be >= 0 seconds or None, got {self.save_s!r}")
        if not isinstance(self.save_every, int) or self.save_every < 1:
            raise SimulationError(f"save_every must be a positive number of iterations, got {self.save_every!r}")
        if self.shrink not in SHRINK_MODES:
            raise SimulationError(f"shrink must be one of {', '.join(SHRINK_MODES)}, got {self.shrink!r}")


@dataclass(frozen=True)
class Policy:
    """A layout policy: ``kind`` auto, measure, dp_only (with ``model_parallel`` = (TP, PP)) or table (``table``)."""

    name: str
    kind: str
    table: LayoutTable | None = None
    model_parallel: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.kind not in POLICY_KINDS:
            raise SimulationError(f"policy {self.name!r}: unknown kind {self.kind!r} (known: {', '.join(POLICY_KINDS)})")
        if self.kind == "table" and self.table is None:
            raise SimulationError(f"policy {self.name!r}: a table policy needs its layout table")
        if self.kind == "dp_only" and self.model_parallel is None:
            raise SimulationError(f"policy {self.name!r}: dp_only needs the fixed (TP, PP)")


@dataclass(frozen=True)
class Choice:
    """What a policy runs at an allocation: world size, layout, micro-batch size, seconds per iteration."""

    world: int
    layout: ParallelLayout
    micro_batch_size: int
    seconds: float
    measured: bool
    trial_s: float = 0.0  # measure: the trials at this world size, paid on its first visit

    @property
    def key(self) -> str:
        return candidate_key(self.layout, self.micro_batch_size)


@dataclass(frozen=True)
class Segment:
    """``t0`` to ``t1`` seconds from the launch: ``state`` train, restart or idle; GPUs allocated and training."""

    t0: float
    t1: float
    state: str
    allocated: int
    training: int
    samples_per_s: float
    layout: str | None = None


@dataclass(frozen=True)
class PolicyResult:
    """One policy's run through the trace (times in seconds from the launch)."""

    policy: str
    kind: str
    target_iteration: int
    global_batch_size: int
    time_to_target: float | None
    iterations: int
    segments: tuple[Segment, ...] = field(repr=False)
    restarts: int
    redone_iterations: int
    idle_gpu_hours: float
    layouts: tuple[str, ...]
    modelled_times: bool
    estimated_bytes: bool
    reshard_seconds: tuple[float, ...]

    @property
    def samples_per_s(self) -> float | None:
        """Mean samples per second to the target (None: not reached)."""
        if not self.time_to_target:
            return None
        return self.target_iteration * self.global_batch_size / self.time_to_target

    def to_json(self) -> dict[str, Any]:
        return {"policy": self.policy, "kind": self.kind, "time_to_target": self.time_to_target,
                "samples_per_s": self.samples_per_s, "iterations": self.iterations, "restarts": self.restarts,
                "redone_iterations": self.redone_iterations, "idle_gpu_hours": self.idle_gpu_hours,
                "layouts": list(self.layouts), "modelled_times": self.modelled_times,
                "estimated_bytes": self.estimated_bytes, "reshard_seconds": list(self.reshard_seconds),
                "segments": [[s.t0, s.t1, s.state, s.allocated, s.training, s.samples_per_s, s.layout]
                             for s in self.segments]}


def scale_trace(trace: Trace, time_scale: float) -> Trace:
    """The trace with every time multiplied by ``time_scale`` (wall seconds per trace second)."""
    if not time_scale > 0:
        raise SimulationError(f"time scale must be > 0, got {time_scale!r}")
    events = tuple(TraceEvent(e.t * time_scale, e.gpus, e.nodes) for e in trace.events)
    return Trace(trace.name, trace.gpus_per_node, events, trace.description,
                 None if trace.end is None else trace.end * time_scale)


def regroup_trace(trace: Trace, gpus_per_node: int) -> Trace:
    """The trace's nodes with ``gpus_per_node`` GPUs each (a CPU-scaled trace of one process per node, read as GPUs)."""
    if not isinstance(gpus_per_node, int) or gpus_per_node < 1:
        raise SimulationError(f"GPUs per node must be a positive integer, got {gpus_per_node!r}")
    events = tuple(TraceEvent(e.t, e.nodes * gpus_per_node, e.nodes) for e in trace.events)
    return Trace(trace.name, gpus_per_node, events, trace.description, trace.end)


def repeat_trace(trace: Trace, times: int) -> Trace:
    """The trace played ``times`` times in a row (it needs its ``end``: where the next copy begins)."""
    if trace.end is None:
        raise SimulationError(f"trace {trace.name}: repeating it needs its end time")
    if not isinstance(times, int) or times < 1:
        raise SimulationError(f"repeat count must be a positive integer, got {times!r}")
    events = tuple(TraceEvent(e.t + i * trace.end, e.gpus, e.nodes) for i in range(times) for e in trace.events)
    return Trace(trace.name, trace.gpus_per_node, events, trace.description, trace.end * times)


def truncate_trace(trace: Trace, end: float) -> Trace:
    """The trace up to ``end`` seconds (the allocation is gone then)."""
    events = tuple(e for e in trace.events if e.t < end)
    if not events:
        raise SimulationError(f"trace {trace.name}: nothing before {end!r} s")
    return Trace(trace.name, trace.gpus_per_node, events, trace.description,
                 end if trace.end is None else min(end, trace.end))


def failure_trace(name: str, gpus: int, gpus_per_node: int, days: float, node_mtbf_hours: float,
                  repair_hours: float, seed: int = 0) -> Trace:
    """A trace of node failures and repairs: each node fails after an exponential time (mean ``node_mtbf_hours``)
    and returns ``repair_hours`` later; deterministic for a ``seed``. Ends after ``days``."""
    if gpus % gpus_per_node:
        raise SimulationError(f"{gpus} GPUs is not a whole number of nodes of {gpus_per_node}")
    rng = random.Random(seed)
    horizon = days * 86400.0
    changes: list[tuple[float, int]] = []
    for _ in range(gpus // gpus_per_node):
        t = rng.expovariate(1 / (node_mtbf_hours * 3600))
        while t < horizon:
            changes.append((t, -1))
            t += repair_hours * 3600
            if t < horizon:
                changes.append((t, +1))
            t += rng.expovariate(1 / (node_mtbf_hours * 3600))
    nodes = gpus // gpus_per_node
    events = [TraceEvent(0.0, gpus, nodes)]
    for t, d in sorted(changes):
        nodes += d
        if t <= events[-1].t:
            events[-1] = TraceEvent(events[-1].t, nodes * gpus_per_node, nodes)
        else:
            events.append(TraceEvent(t, nodes * gpus_per_node, nodes))
    desc = (f"{gpus} GPUs ({gpus_per_node} per node), {days:g} days; each node fails after an exponential time "
            f"with mean {node_mtbf_hours:g} h and is back {repair_hours:g} h later (seed {seed})")
    return Trace(name, gpus_per_node, tuple(events), desc, horizon)


def trace_to_json(trace: Trace) -> dict[str, Any]:
    """A trace as the versioned JSON ``plan/trace.py`` reads."""
    doc: dict[str, Any] = {"version": 1, "name": trace.name, "description": trace.description,
                           "gpus_per_node": trace.gpus_per_node,
                           "events": [{"t": round(e.t, 3), "gpus": e.gpus} for e in trace.events]}
    if trace.end is not None:
        doc["end"] = round(trace.end, 3)
    return doc


class Simulator:
    """Simulates policies on one job, machine and cost model; caches choices and re-shard times across policies."""

    def __init__(self, job: Job, costs: Costs, gpus_per_node: int,
                 times: Mapping[int, Mapping[str, float]] | None = None) -> None:
        if not isinstance(job.target_iteration, int) or job.target_iteration < 1:
            raise SimulationError(f"the target iteration must be a positive integer, got {job.target_iteration!r}")
        self.job, self.costs, self.gpus_per_node = job, costs, gpus_per_node
        self.times = {int(w): dict(t) for w, t in (times or {}).items()}
        self._choices: dict[tuple[Policy, int], Choice | None] = {}
        self._rankings: dict[tuple[int, tuple[int, int] | None], tuple[LayoutCandidate, ...]] = {}
        self._reshard: dict[tuple[ParallelLayout, ParallelLayout], tuple[float, bool]] = {}
        self._save: dict[tuple[ParallelLayout, int], float] = {}

    # -- layouts ---------------------------------------------------------------------------------------------
    def _may_factor(self, world: int, mp: tuple[int, int] | None) -> bool:
        """A cheap necessary test: some TP (within a node) x PP (dividing the layers) x DP (dividing the batch)."""
        d, gbs = self.job.dims, self.job.global_batch_size
        tps = [mp[0]] if mp else [t for t in range(1, self.gpus_per_node + 1) if d.num_attention_heads % t == 0]
        pps = [mp[1]] if mp else [p for p in range(1, d.num_layers + 1) if d.num_layers % p == 0]
        for tp in tps:
            for pp in pps:
                if world % (tp * pp) == 0 and gbs % (world // (tp * pp)) == 0:
                    return True
        return False

    def _ranking(self, world: int, mp: tuple[int, int] | None) -> tuple[LayoutCandidate, ...]:
        key = (world, mp)
        if key not in self._rankings:
            j = self.job
            self._rankings[key] = rank_layouts(
                j.dims, world, self.gpus_per_node, j.global_batch_size, memory_gb=j.memory_gb,
                micro_batch_sizes=j.micro_batch_sizes, fixed={"tp": mp[0], "pp": mp[1]} if mp else None,
                hardware=j.hardware, distributed_optimizer=j.distributed_optimizer,
                make_vocab_size_divisible_by=j.make_vocab_size_divisible_by)
        return self._rankings[key]

    def seconds(self, world: int, layout: ParallelLayout, mbs: int) -> tuple[float, bool]:
        """Seconds per iteration and whether measured (the times file), else the throughput model's."""
        got = self.times.get(world, {}).get(candidate_key(layout, mbs))
        if got is not None:
            return got, True
        j = self.job
        return estimate_time(j.dims, layout, mbs, j.global_batch_size, self.gpus_per_node, hardware=j.hardware,
                             distributed_optimizer=j.distributed_optimizer,
                             make_vocab_size_divisible_by=j.make_vocab_size_divisible_by).total, False

    def choose(self, policy: Policy, gpus: int) -> Choice | None:
        """The policy's choice for an allocation of ``gpus`` (None: nothing usable: the job idles)."""
        key = (policy, gpus)
        if key not in self._choices:
            self._choices[key] = self._choose(policy, gpus)
        return self._choices[key]

    def _choose(self, policy: Policy, gpus: int) -> Choice | None:
        if policy.kind == "table":
            assert policy.table is not None
            rows = [r for r in policy.table.rows if r.world_size <= gpus]
            if not rows:
                return None
            row = rows[-1]
            s, measured = self.seconds(row.world_size, row.layout, row.micro_batch_size)
            return Choice(row.world_size, row.layout, row.micro_batch_size, s, measured)
        mp = policy.model_parallel if policy.kind == "dp_only" else None
        for world in range(gpus - gpus % self.gpus_per_node, 0, -self.gpus_per_node):  # whole nodes, most first
            if not self._may_factor(world, mp):
                continue
            usable = [c for c in self._ranking(world, mp) if c.usable]
            if not usable:
                continue
            if policy.kind == "measure":
                return self._measure(world, usable)
            best = usable[0]
            s, measured = self.seconds(world, best.layout, best.micro_batch_size)
            return Choice(world, best.layout, best.micro_batch_size, s, measured)
        return None

    def _measure(self, world: int, usable: Sequence[LayoutCandidate]) -> Choice:
        """``--tenplex-layout measure``: the model's best ``MEASURE_TRIALS`` timed, the fastest kept."""
        trials = to_measure(LayoutChoice(world, usable[0], tuple(usable)), {}, MEASURE_TRIALS)
        timed = [(self.seconds(world, c.layout, c.micro_batch_size), c) for c in trials]
        (s, measured), best = min(timed, key=lambda x: (x[0][0], x[1].key))
        trial_s = sum(self.costs.measure_trial_s + (MEASURE_WARMUP + MEASURE_TIMED) * t for (t, _), _ in timed)
        return Choice(world, best.layout, best.micro_batch_size, s, all(m for (_, m), _ in timed), trial_s)

    # -- costs -----------------------------------------------------------------------------------------------
    def reshard_seconds(self, src: ParallelLayout | None, dst: Choice) -> tuple[float, bool]:
        """Seconds the slowest destination rank reads for, and whether the bytes were estimated (not planned)."""
        if src is None:
            return 0.0, False
        key = (src, dst.layout)
        if key not in self._reshard:
            c, j = self.costs, self.job
            if max(src.world_size, dst.world) <= c.exact_bytes_max_gpus:
                r = dry_run(j.dims, src, dst.layout, j.distributed_optimizer, self.gpus_per_node,
                            j.make_vocab_size_divisible_by)
                cross = r.cross_node or {}
                secs = max((b - cross.get(rank, 0)) / c.storage_bandwidth + cross.get(rank, 0) / c.network_bandwidth
                           for rank, b in r.read_bytes.items())
                self._reshard[key] = (secs, False)
            else:
                m = estimate_memory(j.dims, dst.layout, dst.micro_batch_size, j.global_batch_size,
                                    distributed_optimizer=j.distributed_optimizer,
                                    make_vocab_size_divisible_by=j.make_vocab_size_divisible_by)
                self._reshard[key] = ((m.weights + m.optimizer) / min(c.storage_bandwidth, c.network_bandwidth), True)
        return self._reshard[key]

    def save_seconds(self, choice: Choice) -> float:
        """One periodic save: ``Costs.save_s``, or a rank's share of the state over the storage bandwidth."""
        if self.costs.save_s is not None:
            return self.costs.save_s
        key = (choice.layout, choice.micro_batch_size)
        if key not in self._save:
            j = self.job
            m = estimate_memory(j.dims, choice.layout, choice.micro_batch_size, j.global_batch_size,
                                distributed_optimizer=j.distributed_optimizer,
                                make_vocab_size_divisible_by=j.make_vocab_size_divisible_by)
            self._save[key] = (m.weights / choice.layout.dp + m.optimizer) / self.costs.storage_bandwidth
        return self._save[key]

    # -- the replay ------------------------------------------------------------------------------------------
    def run(self, trace: Trace, policy: Policy, *, first_iteration_clock: bool = False) -> PolicyResult:
        """Walk ``trace`` with ``policy`` (``first_iteration_clock``: the trace's t=0 is the first iteration)."""
        return _Run(self, trace, policy, first_iteration_clock).result()


class _Run:
    """One policy's walk through a trace: the state between allocation changes."""

    def __init__(self, sim: Simulator, trace: Trace, policy: Policy, first_iteration_clock: bool) -> None:
        self.sim, self.policy, self.c = sim, policy, sim.costs
        self.target = sim.job.target_iteration
        self.gbs = sim.job.global_batch_size
        self.cur: Choice | None = None
        self.ready: float | None = None  # when the current layout trains (None: idle)
        self.done = 0  # iterations completed by the running job
        self.saved, self.saved_layout = 0, None
        self.visited: set[int] = set()
        self.segments: list[Segment] = []
        self.reached: float | None = None
        self.restarts = self.redone = 0
        self.used: list[str] = []
        self.modelled = self.estimated = False
        self.reshards: list[float] = []
        first = sim.choose(policy, trace.events[0].gpus)
        offset = 0.0
        if first_iteration_clock and first is not None:
            offset = self.c.start_s + first.trial_s + first.seconds
        events = [(0.0, trace.events[0].gpus)] + [(e.t + offset, e.gpus) for e in trace.events[1:]]
        end = None if trace.end is None else trace.end + offset
        alloc = 0
        for i, (t, gpus) in enumerate(events):
            if self.reached is not None:
                break
            self._change(t, alloc, gpus, first=i == 0)
            alloc = gpus
            nxt = events[i + 1][0] if i + 1 < len(events) else (end if end is not None else math.inf)
            self._advance(t, nxt, alloc)

    def _start(self, t: float, new: Choice, base: float) -> None:
        reshard, estimated = self.sim.reshard_seconds(self.saved_layout, new)
        self.estimated |= estimated
        self.reshards.append(reshard)
        trial = new.trial_s if new.world not in self.visited else 0.0
        self.visited.add(new.world)
        self.cur, self.ready = new, t + base + reshard + trial

    def _change(self, t: float, before: int, gpus: int, first: bool) -> None:
        new = self.sim.choose(self.policy, gpus)
        if first:
            if new is not None:
                self._start(t, new, self.c.start_s)
            return
        failure = self.c.shrink == "failure" and gpus < before
        if new == self.cur and not (failure and self.cur is not None):
            return  # the layout holds (GPUs it left idle came, or left with notice)
        training = self.cur is not None and self.ready is not None and t >= self.ready
        detect = 0.0
        if self.cur is not None:
            if training and failure:
                self.redone += self.done - self.saved
                self.done = self.saved
            elif training:
                self.saved, self.saved_layout = self.done, self.cur.layout
            detect = self.c.detect_failure_s if failure else self.c.detect_notice_s + (
                self.sim.save_seconds(self.cur) if training else 0.0)
        if new is None:
            self.cur = self.ready = None
            self.done = self.saved
            return
        if self.cur is None:
            self._start(t, new, self.c.start_s)
        else:
            self.restarts += 1
            self._start(t, new, detect + self.c.restart_s)

    def _iteration_done(self, start: float, p0: int, m: int, it: float, k: int, save: float) -> float:
        """When iteration ``m`` completes, training from ``p0`` at ``start`` (saves after multiples of ``k``)."""
        return start + (m - p0) * it + save * ((m - 1) // k - p0 // k)

    def _advance(self, t: float, nxt: float, alloc: int) -> None:
        if self.cur is None or self.ready is None:
            self._segment(t, nxt, "idle", alloc, 0, 0.0)
            return
        if self.ready >= nxt:
            self._segment(t, nxt, "restart", alloc, 0, 0.0)
            return
        if self.ready > t:
            self._segment(t, self.ready, "restart", alloc, 0, 0.0)
        start, cur, p0 = max(t, self.ready), self.cur, self.done
        it, k, save = cur.seconds, self.c.save_every, self.sim.save_seconds(cur)
        at_target = self._iteration_done(start, p0, self.target, it, k, save)
        rate = self.gbs * k / (k * it + save)
        self.modelled |= not cur.measured  # only layouts that train count (a folded restart's choice does not)
        if at_target <= nxt:
            self.reached = at_target
            self.done = self.target
            self._segment(start, at_target, "train", alloc, cur.world, rate, cur.key)
            return
        # the iterations completed by nxt (binary search on the monotone completion time)
        lo, hi = p0, self.target
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._iteration_done(start, p0, mid, it, k, save) <= nxt:
                lo = mid
            else:
                hi = mid - 1
        self.done = lo
        j = lo // k * k
        if j > p0 and self._iteration_done(start, p0, j, it, k, save) + save <= nxt:
            self.saved, self.saved_layout = j, cur.layout
        elif j - k > p0:
            self.saved, self.saved_layout = j - k, cur.layout
        self._segment(start, nxt, "train", alloc, cur.world, rate, cur.key)

    def _segment(self, t0: float, t1: float, state: str, alloc: int, training: int, rate: float,
                 layout: str | None = None) -> None:
        if layout is not None and layout not in self.used:
            self.used.append(layout)
        if t1 > t0:
            self.segments.append(Segment(t0, t1, state, alloc, training, rate, layout))

    def result(self) -> PolicyResult:
        idle = sum((s.allocated - s.training) * (s.t1 - s.t0) for s in self.segments if math.isfinite(s.t1)) / 3600
        return PolicyResult(self.policy.name, self.policy.kind, self.target, self.gbs, self.reached, self.done,
                            tuple(self.segments), self.restarts, self.redone, idle, tuple(self.used), self.modelled,
                            self.estimated, tuple(self.reshards))


def throughput_series(result: PolicyResult, window: float) -> list[tuple[float, float]]:
    """(window start, mean samples/s in the window) over the run, for plots and tables."""
    end = result.time_to_target or max((s.t1 for s in result.segments if math.isfinite(s.t1)), default=0.0)
    out = []
    n = max(1, math.ceil(end / window))
    for i in range(n):
        a, b = i * window, min((i + 1) * window, end)
        got = sum(s.samples_per_s * max(0.0, min(b, s.t1) - max(a, s.t0)) for s in result.segments)
        out.append((a, got / (b - a) if b > a else 0.0))
    return out
