"""The re-sharding benchmark runs end to end at its smallest size: every system's load reproduces the losses.

Speed is not asserted here (benchmarks measure, tests check); this keeps
``python -m benchmarks.reshard`` working and its correctness checks honest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.harness import ROOT

pytestmark = [pytest.mark.dist, pytest.mark.bench]


def test_bench_reshard_tiny_runs_and_every_system_loads_correctly(tmp_path) -> None:
    out = tmp_path / "bench.json"
    p = subprocess.run(
        [sys.executable, "-m", "benchmarks.reshard", "--models", "tiny", "--transitions",
         "tp2-dp2", "--reps", "1", "--out", str(out), "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT),
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    run = json.loads(out.read_text())["runs"][0]
    for system in ("tenplex", "tenplex_noverify", "mcore", "central", "tenplex_cold", "mcore_cold", "central_cold",
                   "adopt", "adopt_cold"):  # adopt: Megatron's dp_reshardable checkpoint read by tenplex at TP1 x DP2
        assert run["check"][system]["ok"], (system, run["check"][system])
    assert run["mcoredp_load_route"].startswith("none") and "mcoredp_load" not in run and run["mcoredp_save"]
    assert run["tenplex_load"]["bytes"] > 0 and run["raw_read_GBps"] > 0 and run["memory_copy_GBps"] > 0
    assert len(run["own_bytes"]["save"]) == 2 and all(b > 0 for b in run["own_bytes"]["save"])
    for line in ("RATIO load_time tiny:tp2-dp2 tenplex/mcore = ", "RATIO load_time tiny:tp2-dp2 tenplex/central = ",
                 "RATIO load_bandwidth tiny:tp2-dp2 tenplex/raw_read = ", "RATIO load_time_cold tiny:tp2-dp2 tenplex/mcore = ",
                 "RATIO save_peak_mem tiny:tp2-dp2 tenplex/own_shard = ", "RATIO adopt_load_time tiny:tp2-dp2 tenplex/mcore = ",
                 "RATIO adopt_load_peak_rss tiny:tp2-dp2 tenplex/mcore = ", "RATIO bytes_read tiny:tp2-dp2 tenplex/destination = "):
        assert line in p.stdout, p.stdout[-3000:]


@pytest.mark.slow  # about 50 CPU-seconds more than make test's budget leaves: pytest -m slow tests/multiproc
def test_bench_reshard_moe_row_restarts_at_a_new_ep(tmp_path) -> None:
    """The MoE row (issue #35): a mixture of experts saved at EP2 x expert DP2 and loaded at EP4 by tenplex, by
    megatron-core's own fully_reshardable load and by tenplex adopting megatron-core's dp_reshardable save (the
    chained dense + expert optimizer's buckets), all reproducing the saving job's losses, with its RATIO lines."""
    out = tmp_path / "bench.json"
    p = subprocess.run(
        [sys.executable, "-m", "benchmarks.reshard", "--moe-only", "--moe-models", "tiny-moe", "--moe-transitions",
         "ep2-ep4", "--reps", "1", "--out", str(out), "--workdir", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT),
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    (run,) = json.loads(out.read_text())["runs"]
    assert (run["model"], run["num_experts"], run["from"], run["to"]) == ("tiny-moe", 4, [1, 1, 4, 2], [1, 1, 4, 4])
    for system in ("tenplex", "tenplex_noverify", "mcore", "central", "adopt", "tenplex_cold", "mcore_cold",
                   "central_cold", "adopt_cold"):
        assert run["check"][system]["ok"], (system, run["check"][system])
    assert run["adopt_load"] and run["mcoredp_save"] and "mcoredp_load" not in run
    assert run["mcoredp_load_route"].startswith("none")
    for line in ("RATIO load_time tiny-moe:ep2-ep4 tenplex/mcore = ", "RATIO load_time_cold tiny-moe:ep2-ep4 tenplex/mcore = ",
                 "RATIO save_time tiny-moe:ep2-ep4 tenplex/mcore = ", "RATIO bytes_read tiny-moe:ep2-ep4 tenplex/destination = "):
        assert line in p.stdout, p.stdout[-3000:]
