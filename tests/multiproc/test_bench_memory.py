"""The host-memory benchmark runs end to end at its smallest size (``--quick``): its report is whole and its checks hold.

Speed is not asserted here (benchmarks measure, tests check); this keeps
``python -m benchmarks.memory`` working: every load reproduces the saved losses,
the restart from memory after a node's loss reads nothing from durable storage,
and a "cold" restart really found the checkpoint's pages evicted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.harness import ROOT

pytestmark = [pytest.mark.dist, pytest.mark.bench]


def test_bench_memory_quick_runs_and_every_restart_loads_correctly(tmp_path) -> None:
    out = tmp_path / "bench.json"
    mem = tmp_path / "mem"
    p = subprocess.run(
        [sys.executable, "-m", "benchmarks.memory", "--quick", "--out", str(out),
         "--replication-rate", "1",
         "--workdir", str(tmp_path), "--memdir", "/dev/shm" if os.path.isdir("/dev/shm") else str(mem)],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT),
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    run = json.loads(out.read_text())["runs"][0]
    loads = ("memory_live", "memory", "durable", "durable_cold", "mcore", "mcore_cold")
    for system in loads:
        assert run["check"][system]["ok"], (system, run["check"][system])
        x = run[system]
        assert x["seconds"] > 0 and x["whole"] == pytest.approx(run["startup"] + x["seconds"] + run["first_step"])
    assert run["startup"] > 0 and run["first_step"] > 0
    # node 1's memory is gone: its rank received its part from node 0; nothing came from durable storage
    assert run["memory"]["from_durable"] == 0 and run["memory"]["received"] > 0
    # before: every node alive, each holding every rank file (K=2 on 2 nodes): all of it memory-mapped locally
    assert run["memory_live"]["from_durable"] == 0 and run["memory_live"]["received"] == 0
    assert run["durable"]["from_durable"] > 0 and run["durable_cold"]["from_durable"] > 0
    assert run["durable_cold"]["cached_before"] == 0 and run["mcore_cold"]["cached_before"] == 0
    assert run["durable"]["cached_before"] is None
    for s in ("memcpy", "snapshot", "tenplex_sync", "mcore_async"):
        assert run[s]["seconds"] > 0, s
    assert run["mcore_async"]["total"] >= run["mcore_async"]["seconds"]
    assert "copy" in run["snapshot"]["phases"] and sum(run["snapshot"]["phases"].values()) > 0
    assert min(run["steps"]["alone"], run["steps"]["during"], run["steps"]["during_mcore"]) > 0
    lo, hi = run["steps"]["alone_range"]  # the spread of the steps alone: the noise a slowdown is read against
    assert 0 < lo <= run["steps"]["alone"] <= hi
    # unlimited with the durable copy, unlimited replication alone, (--replication-rate 1) capped, and auto
    unlimited, alone, capped, auto = run["steps"]["windows"]
    assert [w["persist"] for w in (unlimited, alone, capped, auto)] == [True, False, True, True]
    assert unlimited["rate"] == alone["rate"] == auto["rate"] == 0 and capped["rate"] == 1 and capped["background"] > 0
    assert auto["pace"] == 0.5 and unlimited["pace"] == alone["pace"] == capped["pace"] == 0
    # auto: the replication paced to take half the time since the snapshot before (a window's at least)
    assert auto["since_last_snapshot"][0] > 0 and auto["background"] >= 0.5 * auto["since_last_snapshot"][0]
    for w in (unlimited, alone, capped, auto):  # --quick: 1 repetition; a window takes a step even if its background is done
        assert len(w["steps"]) == len(w["slowdowns"]) == 1 and w["steps"][0] >= 1
        assert w["before"] > 0 and w["slowdown"] == pytest.approx(w["during"] / w["before"])
        assert w["slowdowns"][0] == pytest.approx(w["slowdown"])  # one window: its ratio is the kind's
    assert capped["steps"][0] <= 8 * 2  # --quick: 2 steps, a window of at most 8x
    # each node sent its rank file no faster than 1 MB/s: that file holds at least half the rank's own shard (the
    # writer assignment splits only what both ranks hold)
    assert capped["background"] >= 0.5 * min(run["own_bytes"]) / 1e6
    assert len(run["own_bytes"]) == 2 and all(b > 0 for b in run["own_bytes"])
    for line in ("RATIO save_stall tiny tenplex/memcpy = ", "RATIO step_slowdown tiny tenplex/alone = ",
                 "RATIO step_slowdown_capped tiny tenplex/alone = ",
                 "RATIO step_slowdown_replication_only tiny tenplex/alone = ",
                 "RATIO step_slowdown_auto tiny tenplex/alone = ",
                 "RATIO restart_load tiny tenplex/durable_cold = ", "RATIO restart_whole tiny tenplex/durable_cold = ",
                 "RATIO restart_whole tiny tenplex/mcore_cold = ",
                 "RATIO restart_load_live tiny tenplex/durable_cold = ", "RATIO restart_whole_live tiny tenplex/mcore = ",
                 "BYTES from_durable_after_node_loss tiny memory = 0 "):
        assert line in p.stdout, p.stdout[-3000:]

