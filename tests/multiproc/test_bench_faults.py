"""Smoke test of ``python -m benchmarks.faults --quick`` on one fault (a worker SIGKILLed between writing its shard and
the commit): the table and the JSON come out, and the target holds (no checkpoint, no iteration beyond S lost)."""

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
                        "kill@save.tensors", "--out", str(out), "--keep", str(tmp_path / "runs")], env=env,
                       capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "SIGKILL worker @ save.tensors" in p.stdout and "ckpts lost" in p.stdout
    got = json.loads(out.read_text())
    (row,) = got["rows"]
    assert row["checkpoints_lost"] == 0 and row["iterations_lost_beyond_interval"] == 0, row
    assert row["durable_mb_rank0"] > 0 and row["seconds_to_first_iteration"] > 0, row
    assert got["machine"]["commit"] and got["machine"]["save_interval"] == 5
