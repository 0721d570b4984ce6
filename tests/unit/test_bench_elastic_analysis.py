"""What bench_elastic.py makes of a replay (scripts/bench/elastic_analysis.py): progress, throughput, repeats,
loss deviation and a change's breakdown, from hand-made metrics, worker lifetimes and timeline lines."""

from __future__ import annotations

import json

import pytest

from scripts.bench.agents import WorkerSpan
from scripts.bench.elastic_analysis import (
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
