"""The simulator (``plan/simulate.py``) fed what a replay measured, to predict the replay's time to target. Pure Python.

From one policy's replay: seconds per iteration of every layout it ran (the mean gap between consecutive
iterations of one process, periodic saves included), and its restart costs by kind of change, from the
breakdowns: a start (from nothing: the launch, or after idling), a planned change (a grow: its workers save, then
stop) and a lost node. The re-shard's measured seconds stay inside the restart (on a CPU with a tiny model its
fixed costs dominate its bytes). The simulator then replays the same trace, policy and target; the prediction is
compared with the measured time to target (``tests/multiproc/test_bench_elastic.py`` checks within 15%).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from tenplex_megatron.plan.autolayout import candidate_key
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.layout_files import LayoutTable
from tenplex_megatron.plan.sim.gpt_catalogue import GPTDims
from tenplex_megatron.plan.simulate import Costs, Job, Policy, Simulator, scale_trace
from tenplex_megatron.plan.trace import Trace

#: the simulator's policy kind for each of the benchmark's policies (``tenplex`` is auto or measure: the caller's)
KINDS = {"dp_only": "dp_only", "table": "table"}


def _key(m: Mapping[str, Any]) -> tuple[int, str]:
    lay = m["layout"]
    layout = ParallelLayout(lay["tp"], lay["pp"], lay["dp"])
    return layout.world_size, candidate_key(layout, m["micro_batch_size"])


def iteration_times(metrics: Sequence[Mapping[str, Any]], starts: Sequence[float]) -> dict[int, dict[str, float]]:
    """Mean seconds per iteration by world size and candidate key: gaps between consecutive iterations of one
    process (no process start between them)."""
    gaps: dict[tuple[int, str], list[float]] = defaultdict(list)
    ms = sorted(metrics, key=lambda m: m["time"])
    for a, b in zip(ms, ms[1:]):
        if b["iteration"] != a["iteration"] + 1 or _key(a) != _key(b):
            continue
        if any(a["time"] < s < b["time"] for s in starts):
            continue
        gaps[_key(a)].append(b["time"] - a["time"])
    out: dict[int, dict[str, float]] = defaultdict(dict)
    for (world, key), g in gaps.items():
        out[world][key] = statistics.fmean(g)
    return dict(out)


def restart_costs(changes: Sequence[Mapping[str, Any]], iteration_s: float, save_every: int) -> Costs:
    """Costs by kind of change from the replay's breakdowns (a kind never measured borrows the nearest one's)."""
    start, notice, failure, restart = [], [], [], []
    for c in changes:
        b = c.get("breakdown")
        if not b:
            continue
        if c["before"] == 0:
            start.append(b["total"] - iteration_s)
            continue
        (notice if c["after"] > c["before"] else failure).append(b["detect"])
        restart.append(b["total"] - b["detect"] - iteration_s)
    start_s = statistics.fmean(start) if start else 0.0
    restart_s = statistics.fmean(restart) if restart else start_s
    notice_s = statistics.fmean(notice) if notice else (statistics.fmean(failure) if failure else 0.0)
    failure_s = statistics.fmean(failure) if failure else notice_s
    return Costs(start_s=max(start_s, 0.0), restart_s=max(restart_s, 0.0), detect_failure_s=max(failure_s, 0.0),
                 detect_notice_s=max(notice_s, 0.0), storage_bandwidth=1e9, network_bandwidth=1e9,
                 save_every=save_every, save_s=0.0, measure_trial_s=0.0, shrink="failure")


def predict(run: Mapping[str, Any], kind: str, trace: Trace, dims: GPTDims, global_batch_size: int, target: int,
            time_scale: float, first_iteration_clock: bool, save_every: int, table: LayoutTable | None,
            model_parallel: tuple[int, int], make_vocab_size_divisible_by: int, memory_gb: float | None,
            measured_times: Mapping[int, Mapping[str, float]] | None = None) -> dict[str, Any]:
    """The simulator's time to target for one replayed policy, fed that replay's measurements; what it used."""
    times = {int(w): dict(t) for w, t in (measured_times or {}).items()}
    for world, by_key in iteration_times(run["metrics"], run.get("starts", [])).items():
        times.setdefault(world, {}).update(by_key)
    all_times = [s for by_key in times.values() for s in by_key.values()]
    costs = restart_costs(run["changes"], statistics.fmean(all_times) if all_times else 0.0, save_every)
    job = Job(dims, global_batch_size, target, memory_gb=memory_gb, distributed_optimizer=False,
              make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    sim = Simulator(job, costs, trace.gpus_per_node, times)
    policy = Policy(run["policy"], kind, table if kind == "table" else None,
                    model_parallel if kind == "dp_only" else None)
    r = sim.run(scale_trace(trace, time_scale), policy, first_iteration_clock=first_iteration_clock)
    return {"time_to_target": r.time_to_target, "layouts": list(r.layouts), "restarts": r.restarts,
            "redone_iterations": r.redone_iterations, "modelled_times": r.modelled_times,
            "idle_gpu_hours": r.idle_gpu_hours,
            "costs": {k: getattr(costs, k) for k in ("start_s", "restart_s", "detect_failure_s", "detect_notice_s")},
            "times": {str(w): t for w, t in sorted(times.items())}}
