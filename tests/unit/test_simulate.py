"""The trace simulator (plan/simulate.py) and ``python -m tenplex_megatron simulate``: pure, fast.

Each expected time is worked out here from the inputs the test gives (iteration seconds, costs, trace times),
never a figure copied from a run; the re-shard cost is checked against the planner's own dry run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tenplex_megatron.plan.autolayout import candidate_key
from tenplex_megatron.plan.layout import ParallelLayout
from tenplex_megatron.plan.layout_files import parse_layout_table
from tenplex_megatron.plan.sim.dry_run import dry_run
from tenplex_megatron.plan.sim.gpt_catalogue import load_model
from tenplex_megatron.plan.simulate import (
    Costs,
    Job,
    Policy,
    SimulationError,
    Simulator,
    failure_trace,
    repeat_trace,
    throughput_series,
)
from tenplex_megatron.plan.trace import Trace, TraceEvent, parse_trace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = load_model("tiny")  # 2 layers, 4 heads: TP and PP up to 2
GBS = 8


def _trace(*events: tuple[float, int], end: float | None = None) -> Trace:
    return Trace("t", 1, tuple(TraceEvent(float(t), g, g) for t, g in events), "", end)


def _table(rows: dict[int, tuple[int, int, int, int]]) -> Policy:
    doc = {"version": 1, "layouts": {str(w): {"tp": tp, "pp": pp, "dp": dp, "micro_batch_size": m}
                                     for w, (tp, pp, dp, m) in rows.items()}}
    return Policy("table", "table", parse_layout_table(json.dumps(doc), "t.json", TINY, global_batch_size=GBS))


def _key(tp: int, pp: int, dp: int, mbs: int) -> str:
    return candidate_key(ParallelLayout(tp, pp, dp), mbs)


# a table and measured times: one row per world size, its seconds per iteration
TABLE = _table({1: (1, 1, 1, 1), 2: (1, 2, 1, 1), 4: (1, 2, 2, 1)})
TIMES = {1: {_key(1, 1, 1, 1): 0.4}, 2: {_key(1, 2, 1, 1): 0.25}, 4: {_key(1, 2, 2, 1): 0.1}}
COSTS = Costs(start_s=7.0, restart_s=5.0, detect_failure_s=3.0, detect_notice_s=2.0, save_every=10, save_s=0.0,
              storage_bandwidth=1e12, network_bandwidth=1e12)


def _sim(target: int, costs: Costs = COSTS, times: dict | None = None, **job: object) -> Simulator:
    return Simulator(Job(TINY, GBS, target, distributed_optimizer=False, make_vocab_size_divisible_by=16, **job),
                     costs, 1, TIMES if times is None else times)


def test_a_fixed_allocation_takes_the_start_and_target_times_the_measured_iteration() -> None:
    r = _sim(100).run(_trace((0, 4)), TABLE)
    assert r.time_to_target == pytest.approx(COSTS.start_s + 100 * TIMES[4][_key(1, 2, 2, 1)])
    assert r.restarts == 0 and r.redone_iterations == 0 and not r.modelled_times
    assert r.samples_per_s == pytest.approx(100 * GBS / r.time_to_target)
    assert r.idle_gpu_hours == pytest.approx(4 * COSTS.start_s / 3600)  # the start-up: no GPU trains


def test_periodic_saves_add_their_seconds_between_iterations() -> None:
    costs = Costs(**{**COSTS.__dict__, "save_s": 1.5})
    r = _sim(35, costs).run(_trace((0, 4)), TABLE)
    saves = 3  # after iterations 10, 20 and 30 (the one after 35 comes after the target)
    assert r.time_to_target == pytest.approx(costs.start_s + 35 * 0.1 + saves * 1.5)


def test_a_lost_node_redoes_the_work_since_the_last_save_and_pays_detection_restart_and_reshard() -> None:
    it4, it2 = 0.1, 0.25
    lost_at = COSTS.start_s + 25 * it4 + 0.05  # iteration 25 done, the 26th under way; last save after 20
    r = _sim(100).run(_trace((0, 4), (lost_at, 2)), TABLE)
    assert r.redone_iterations == 5 and r.restarts == 1
    src, dst = ParallelLayout(1, 2, 2), ParallelLayout(1, 2, 1)
    d = dry_run(TINY, src, dst, False, 1, 16)
    reshard = max(d.read_bytes.values()) / COSTS.storage_bandwidth  # one GPU per node: all from other nodes
    assert r.reshard_seconds[-1] == pytest.approx(max(
        (b - d.cross_node[k]) / COSTS.storage_bandwidth + d.cross_node[k] / COSTS.network_bandwidth
        for k, b in d.read_bytes.items()))
    assert reshard > 0
    back = lost_at + COSTS.detect_failure_s + COSTS.restart_s + r.reshard_seconds[-1]
    assert r.time_to_target == pytest.approx(back + (100 - 20) * it2)


def test_a_grow_saves_first_and_loses_nothing() -> None:
    at = COSTS.start_s + 30 * 0.25 + 0.1  # 30 iterations done at 2 GPUs
    r = _sim(100).run(_trace((0, 2), (at, 4)), TABLE)
    assert r.redone_iterations == 0 and r.restarts == 1
    back = at + COSTS.detect_notice_s + COSTS.restart_s + r.reshard_seconds[-1]
    assert r.time_to_target == pytest.approx(back + 70 * 0.1)
    assert r.layouts == (_key(1, 2, 1, 1), _key(1, 2, 2, 1))


def test_with_notice_a_shrink_saves_first_too() -> None:
    costs = Costs(**{**COSTS.__dict__, "shrink": "notice"})
    at = costs.start_s + 25 * 0.1 + 0.05
    r = _sim(100, costs).run(_trace((0, 4), (at, 2)), TABLE)
    assert r.redone_iterations == 0
    assert r.time_to_target == pytest.approx(at + costs.detect_notice_s + costs.restart_s + r.reshard_seconds[-1]
                                             + 75 * 0.25)


def test_a_change_during_a_restart_folds_into_it() -> None:
    lost = COSTS.start_s + 20 * 0.1 + 0.01  # just after the save at 20: nothing to redo
    back = lost + 1.0  # long before the restart (3 + 5 s) is done
    r = _sim(100).run(_trace((0, 4), (lost, 2), (back, 4)), TABLE)
    assert r.restarts == 2 and r.redone_iterations == 0
    # the restart begins again at the grow: no save (nothing trains), detection of a planned change
    assert r.time_to_target == pytest.approx(back + COSTS.detect_notice_s + COSTS.restart_s + r.reshard_seconds[-1]
                                             + 80 * 0.1)
    assert [s.state for s in r.segments] == ["restart", "train", "restart", "restart", "train"]


def test_dp_only_idles_where_its_model_parallel_degree_does_not_fit_and_counts_the_idle_gpus() -> None:
    dp_only = Policy("dp_only", "dp_only", model_parallel=(1, 2))
    at1, at2 = 10.0, 40.0
    times = {**TIMES, 2: {_key(1, 2, 1, m): 0.25 for m in (1, 2, 4, 8)}}  # whichever micro-batch dp_only takes
    sim = _sim(400, times=times)
    r = sim.run(_trace((0, 2), (at1, 1), (at2, 2)), dp_only)
    idle = [s for s in r.segments if s.state == "idle"]
    assert len(idle) == 1 and (idle[0].t0, idle[0].t1, idle[0].allocated) == (at1, at2, 1)
    assert r.idle_gpu_hours == pytest.approx(sum((s.allocated - s.training) * (s.t1 - s.t0)
                                                 for s in r.segments) / 3600)
    assert r.idle_gpu_hours >= 1 * (at2 - at1) / 3600
    t = sim.run(_trace((0, 2), (at1, 1), (at2, 2)), TABLE)  # the table runs at 1 GPU: sooner
    assert t.time_to_target < r.time_to_target
    assert sim.choose(dp_only, 1) is None and sim.choose(dp_only, 3).world == 2  # the largest multiple of TP x PP


def test_measure_pays_its_trials_once_per_world_size_and_runs_the_fastest_measured() -> None:
    sim = _sim(10 ** 6, times={})
    auto, measure = Policy("auto", "auto"), Policy("measure", "measure")
    a, m = sim.choose(auto, 2), sim.choose(measure, 2)
    assert m.trial_s > 0 and not m.measured  # no times file: modelled, and said so
    # with a times file where the model's third choice is the fastest, measure takes it and auto does not
    ranked = [c for c in sim._ranking(2, None) if c.usable][:3]
    times = {2: {c.key: 1.0 for c in ranked[:2]} | {ranked[2].key: 0.5}}
    sim2 = _sim(1000, times=times)
    got = sim2.choose(measure, 2)
    assert got.key == ranked[2].key and got.seconds == 0.5 and got.measured
    assert got.trial_s == pytest.approx(3 * COSTS.measure_trial_s + 4 * (1.0 + 1.0 + 0.5))
    assert sim2.choose(auto, 2).key == a.key == ranked[0].key
    r = sim2.run(_trace((0, 2), (100, 1), (200, 2)), measure)
    restarts = [x for x in r.segments if x.state == "restart"]
    first, back = restarts[0], restarts[-1]
    assert first.t1 - first.t0 == pytest.approx(COSTS.start_s + got.trial_s)
    assert back.t1 - back.t0 < got.trial_s  # world size 2 again: no second trial


def test_repeat_and_the_throughput_series_cover_the_run() -> None:
    tr = repeat_trace(_trace((0, 4), (50, 2), end=100), 3)
    assert [e.t for e in tr.events] == [0, 50, 100, 150, 200, 250] and tr.end == 300
    r = _sim(2000).run(tr, TABLE)
    series = throughput_series(r, 10.0)
    done = sum(v * 10.0 for _, v in series) / GBS
    assert done == pytest.approx(r.iterations + r.redone_iterations, rel=0.02)


def test_bad_inputs_name_what_is_wrong() -> None:
    with pytest.raises(SimulationError, match="table policy needs its layout table"):
        Policy("t", "table")
    with pytest.raises(SimulationError, match="dp_only needs the fixed"):
        Policy("d", "dp_only")
    with pytest.raises(SimulationError, match="unknown kind 'fast'"):
        Policy("x", "fast")
    with pytest.raises(SimulationError, match="storage_bandwidth must be > 0"):
        Costs(storage_bandwidth=0)
    with pytest.raises(SimulationError, match="shrink must be one of"):
        Costs(shrink="maybe")
    with pytest.raises(SimulationError, match="target iteration"):
        _sim(0)


def test_a_month_of_node_failures_on_10000_gpus() -> None:
    """The scale the simulator is for (its speed is measured in docs/simulate.md, not timed here)."""
    dims = load_model("gpt3-175b")
    trace = failure_trace("month", 10_000, 8, days=30, node_mtbf_hours=24 * 250, repair_hours=4, seed=1)
    assert len(trace.events) > 100
    sim = Simulator(Job(dims, 1536, 10 ** 5, memory_gb=80), Costs(), 8)
    results = [sim.run(trace, Policy("auto", "auto")), sim.run(trace, Policy("dp", "dp_only", model_parallel=(8, 16)))]
    for r in results:
        assert r.modelled_times and r.estimated_bytes  # no times file; 10,000 GPUs: beyond exact planning
        assert r.restarts > 0 and r.idle_gpu_hours > 0
        worlds = {s.training for s in r.segments if s.state == "train"}
        assert worlds and max(worlds) <= 10_000


def test_failure_traces_round_trip_through_the_trace_format() -> None:
    from tenplex_megatron.plan.simulate import trace_to_json

    tr = failure_trace("f", 64, 8, days=2, node_mtbf_hours=48, repair_hours=6, seed=3)
    again = parse_trace(json.dumps(trace_to_json(tr)), "f.json")
    assert [e.gpus for e in again.events] == [e.gpus for e in tr.events]
    assert all(e.gpus % 8 == 0 and 0 <= e.gpus <= 64 for e in tr.events)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tenplex_megatron", "simulate", *args], capture_output=True,
                          text=True, cwd=ROOT, env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"}, timeout=120)


def test_the_cli_prints_every_policy_and_ratio_lines_and_writes_versioned_json(tmp_path) -> None:
    out = tmp_path / "r.json"
    p = _cli("--trace", os.path.join(ROOT, "configs", "traces", "tenplex_gpt3xl.json"), "--model", "gpt3-xl",
             "--gpus-per-node", "4", "--time-scale", "60", "--global-batch-size", "128", "--target-at", "table=298", "--repeat", "2",
             "--policies", "table,dp_only,auto", "--table", os.path.join(ROOT, "configs", "layouts",
                                                                         "tenplex_gpt3xl.json"),
             "--memory-gb", "16", "--shrink", "notice", "--out", str(out))
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    assert doc["version"] == 1 and [x["policy"] for x in doc["policies"]] == ["table", "dp_only", "auto"]
    dp_only = doc["policies"][1]
    assert all(k.startswith("tp=2,pp=4,") for k in dp_only["layouts"])  # the table's TP x PP at 16 GPUs, fixed
    assert any(s[2] == "idle" and s[3] == 4 for s in dp_only["segments"])  # 4 GPUs: TP x PP = 8 cannot run
    for peer in ("dp_only", "auto"):
        assert f"RATIO sim_time_to_target tenplex_gpt3xl table/{peer} = " in p.stdout
    assert "iteration times modelled" in p.stdout


def test_the_cli_names_a_missing_table_and_a_policy_without_one(tmp_path) -> None:
    p = _cli("--trace", os.path.join(ROOT, "configs", "traces", "quick.json"), "--model", "tiny",
             "--global-batch-size", "8", "--target-iteration", "10", "--policies", "table")
    assert p.returncode == 2 and "--policies table needs --table FILE.json" in p.stderr
    missing = str(tmp_path / "nope.json")
    p = _cli("--trace", os.path.join(ROOT, "configs", "traces", "quick.json"), "--model", "tiny",
             "--global-batch-size", "8", "--target-iteration", "10", "--policies", "table", "--table", missing)
    assert p.returncode == 2 and missing in p.stderr and "Traceback" not in p.stderr
