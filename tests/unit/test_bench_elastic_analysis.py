"""What ``benchmarks.elastic`` makes of a replay (benchmarks/kit/elastic_analysis.py): progress, throughput, repeats,
loss deviation and a change's breakdown, from hand-made metrics, worker lifetimes and timeline lines."""

from __future__ import annotations

import json

import pytest

from benchmarks.kit.agents import WorkerSpan
from benchmarks.kit.elastic_analysis import (
    Change,
    breakdown,
    loss_deviation,
    progress,
    repeated_iterations,
    throughput,
    timelines,
)


def _m(it: int, t: float, loss: float = 1.0) -> dict:
    return {"iteration": it, "time": t, "loss": loss}


def test_progress_throughput_and_repeats_count_each_iteration_once() -> None:
    metrics = [_m(1, 100.5), _m(2, 101.0), _m(3, 101.5), _m(2, 110.0), _m(3, 110.5), _m(4, 111.0)]
    assert progress(metrics) == [(100.5, 1), (101.0, 2), (101.5, 3), (111.0, 4)]
    assert repeated_iterations(metrics) == 2
    # windows of 5 s from t0=100: 3 new iterations in [100, 105), none in [105, 110), 1 in [110, 115); 8 samples each
    assert throughput(metrics, 100.0, 8, 5.0) == [(0.0, 3 * 8 / 5), (5.0, 0.0), (10.0, 8 / 5)]
    ref = {1: 1.0, 2: 2.0, 3: 1.0, 4: 4.0}
    assert loss_deviation([_m(2, 0, 2.0), _m(4, 0, 4.4)], ref) == pytest.approx(0.1)


def test_breakdown_splits_a_change_into_its_phases() -> None:
    log = "noise\n> tenplex-megatron: timeline " + json.dumps(
        {"process_start": 20.0, "process_group": 26.0, "loaded": 27.5, "load_seconds": 0.5, "first_iteration": 28.0})
    old = "> tenplex-megatron: timeline " + json.dumps(
        {"process_start": 1.0, "process_group": 5.0, "first_iteration": 6.0})
    lines = timelines([log, old])
    assert [x["process_start"] for x in lines] == [1.0, 20.0]
    spans = [WorkerSpan(1, 0, 1.0, 12.0),  # the survivor: it saw the failure and exited at 12
             WorkerSpan(2, 1, 1.0, 10.2),  # the lost node's worker (killed at the change)
             WorkerSpan(3, 0, 20.0)]  # the new one
    b = breakdown(Change(10.0, 2, 1), spans, lines)
    assert b == pytest.approx({"detect": 2.0, "rendezvous+spawn": 8.0, "imports+process group": 6.0, "build": 1.0,
                               "plan+re-shard": 0.5, "first step": 0.5, "total": 18.0})
    assert breakdown(Change(10.0, 2, 1), spans, lines, next_change=25.0) is None  # superseded before its first step
    assert breakdown(Change(30.0, 1, 2), spans, lines) is None  # no restart after it


def test_an_in_place_change_is_timed_from_the_call_that_followed_it() -> None:
    start = {"process_start": 1.0, "process_group": 5.0, "first_iteration": 6.0, "inprocess_call": 0}
    again = {"process_start": 1.0, "process_group": 11.5, "loaded": 12.5, "load_seconds": 0.25,
             "first_iteration": 13.0, "inprocess_call": 1}  # the same process, called again after the fault
    lines = timelines(["> tenplex-megatron: timeline " + json.dumps(x) for x in (start, again)])
    b = breakdown(Change(10.0, 2, 1), [WorkerSpan(1, 0, 1.0)], lines)
    assert b == pytest.approx({"detect": 1.5, "rendezvous+spawn": 0.0, "imports+process group": 0.0, "build": 0.75,
                               "plan+re-shard": 0.25, "first step": 0.5, "total": 3.0})
    assert breakdown(Change(10.0, 2, 1), [], lines, next_change=12.0) is None  # superseded before its first step
    assert breakdown(Change(20.0, 1, 2), [], lines) is None  # nothing followed it


def _ml(it: int, t: float, dp: int, mbs: int) -> dict:
    return {"iteration": it, "time": t, "layout": {"tp": 1, "pp": 1, "dp": dp}, "micro_batch_size": mbs}


def test_the_simulator_s_inputs_from_a_replay_skip_gaps_across_restarts_and_sort_changes_by_kind() -> None:
    from benchmarks.kit.elastic_sim import iteration_times, restart_costs

    # two processes at DP=2 (0.5 s and 0.7 s per iteration) with a restart between, then DP=1 at 1.0 s
    metrics = [_ml(1, 10.0, 2, 4), _ml(2, 10.5, 2, 4), _ml(3, 11.0, 2, 4),
               _ml(3, 40.0, 2, 4), _ml(4, 40.7, 2, 4), _ml(5, 60.0, 1, 8), _ml(6, 61.0, 1, 8)]
    times = iteration_times(metrics, starts=[20.0, 50.0])
    assert times == {2: {"tp=1,pp=1,dp=2,mbs=4": pytest.approx((0.5 + 0.5 + 0.7) / 3)},
                     1: {"tp=1,pp=1,dp=1,mbs=8": pytest.approx(1.0)}}
    b = {"detect": 2.0, "total": 12.0}
    changes = [{"before": 0, "after": 2, "breakdown": {"detect": 0.0, "total": 20.0}},
               {"before": 2, "after": 1, "breakdown": None},  # folded into the next change
               {"before": 1, "after": 2, "breakdown": b},
               {"before": 2, "after": 1, "breakdown": {"detect": 4.0, "total": 16.0}}]
    c = restart_costs(changes, iteration_s=1.0, save_every=5)
    assert (c.start_s, c.detect_notice_s, c.detect_failure_s) == (19.0, 2.0, 4.0)
    assert c.restart_s == pytest.approx(((12 - 2 - 1) + (16 - 4 - 1)) / 2)
    assert c.save_every == 5 and c.save_s == 0.0
