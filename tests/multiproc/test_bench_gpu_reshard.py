"""Smoke test of ``python -m benchmarks.gpu_reshard`` on the CPU (one plain-python launch, tiny model): every system
runs, loads the same bytes (the parallel reader, staged, per-piece and megatron-core dist_checkpointing), every
writer saves and snapshots the same file, the limits are measured and the RATIO lines print."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.harness import ROOT

pytestmark = [pytest.mark.dist, pytest.mark.bench]


def test_bench_gpu_reshard_cpu_tiny(tmp_path) -> None:
    out = tmp_path / "bench.json"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "benchmarks.gpu_reshard", "--device", "cpu",
                        "--models", "tiny", "--reps", "1", "--dir", str(tmp_path), "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    row = json.loads(out.read_text())["rows"][0]
    assert not [k for k in row if k.endswith("_error")], row
    assert row["identical"] == {"staged==parallel": True, "direct==parallel": True, "mcore==parallel": True,
                                **{f"{k} {s}==parallel": True for k in ("save", "snapshot") for s in ("staged", "direct")}}
    for limit in ("storage_read", "parallel_cold_read", "parallel_warm_read", "h2d", "d2h", "write_fsync", "shm_copy"):
        assert row[f"{limit}_gbps"] > 0
    assert row["dst_bytes"] > 0 and row["file_bytes"] >= row["dst_bytes"] // 2
    for system in ("parallel", "staged", "direct", "mcore"):
        for temp in ("warm", "cold"):
            assert row[f"{system}_{temp}_gbps"] > 0
    for temp in ("warm", "cold"):
        assert f"RATIO load_bandwidth_{temp} tiny:tp2pp1-tp4pp1 parallel/limit = " in p.stdout
        for peer in ("staged", "direct", "mcore"):
            assert f"RATIO load_time_{temp} tiny:tp2pp1-tp4pp1 parallel/{peer} = " in p.stdout
    for kind in ("save", "snapshot"):
        assert f"RATIO {kind}_bandwidth tiny:tp2pp1-tp4pp1 parallel/limit = " in p.stdout
