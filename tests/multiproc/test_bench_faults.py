"""Smoke test of ``python -m benchmarks.faults --quick`` on two faults (a worker SIGKILLed between writing its shard and
the commit; rank 0 SIGKILLed in place under NVRx): the table and the JSON come out, and the target holds (no
checkpoint, no iteration beyond S lost)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.harness import ROOT

pytestmark = [pytest.mark.dist, pytest.mark.bench]


def test_bench_faults_quick(tmp_path) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, "-m", "benchmarks.faults", "--quick", "--faults",
                        "kill@save.tensors,inprocess@rank0", "--out", str(out), "--keep", str(tmp_path / "runs")],
                       env=env, capture_output=True, text=True, timeout=700)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "SIGKILL worker @ save.tensors" in p.stdout and "ckpts lost" in p.stdout
    got = json.loads(out.read_text())
    row, inplace = got["rows"]
    assert row["checkpoints_lost"] == 0 and row["iterations_lost_beyond_interval"] == 0, row
    assert row["durable_mb_rank0"] > 0 and row["seconds_to_first_iteration"] > 0, row
    # rank 0 lost in place: the survivor kept its process and every byte came from host memory
    assert inplace["fault"] == "SIGKILL rank 0, in place (NVRx)" and "survivor's process kept" in inplace["note"]
    assert inplace["checkpoints_lost"] == 0 and inplace["iterations_lost_beyond_interval"] == 0, inplace
    assert inplace["durable_mb_rank0"] == 0 and inplace["seconds_to_first_iteration"] > 0, inplace
    assert got["machine"]["commit"] and got["machine"]["save_interval"] == 5
