"""Smoke test of ``python -m benchmarks.deepspeed`` in its smallest mode (tiny GPT-2, ZeRO-2, DP 2 -> 1, 3 reps).

Checks only that the bench runs end to end, writes its JSON and PNG with the
expected keys, prints its RATIO lines, and that its own correctness check
(fp32 master and Adam moments bit-identical across DeepSpeed's universal
route, tenplex's direct load of DeepSpeed's files, tenplex's own
checkpoint and its host-memory snapshot) passed. No timing is asserted: the machine is shared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.harness import ROOT

pytestmark = [pytest.mark.dist, pytest.mark.bench]
BENCH = ["-m", "benchmarks.deepspeed"]


def test_bench_deepspeed_tiny(tmp_path) -> None:
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, *BENCH, "--model", "tiny", "--reps", "3", "--json", str(out_json),
                        "--png", str(out_png), "--workdir", str(tmp_path / "work")],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    res = json.loads(out_json.read_text())
    assert {"config", "save", "convert", "load", "reshard", "checks", "ratios", "wall_s"} <= res.keys()
    assert res["checks"]["passed"], res["checks"]["problems"]
    assert res["checks"]["tensors_compared"] > 0
    assert res["config"]["transition"] == "zero2-dp2to1" and res["config"]["reps"] == 3
    assert set(res["save"]) == {"ds_save", "ds_save_fsync", "tenplex", "tenplex_memory"}
    assert set(res["load"]) == {"ds_universal", "tenplex_direct", "tenplex", "tenplex_memory"}
    assert res["save"]["tenplex_memory"]["bytes_written"] > 0  # into the nodes' memory
    for d in (*res["save"].values(), *res["load"].values(), res["convert"]):
        assert {"median_s", "min_s", "max_s", "reps_s"} <= d.keys() and len(d["reps_s"]) == 3
    for d in res["load"].values():
        assert {"peak_rss_per_rank", "bytes_read"} <= d.keys() and d["global_steps"] == 1
    assert res["save"]["tenplex"]["bytes_written"] > 0 and res["convert"]["disk_bytes"] > 0
    assert "reshard_time zero2-dp2to1 tenplex_direct/ds_universal" in res["ratios"]
    assert "disk_bytes zero2-dp2to1 tenplex_direct/ds_universal" in res["ratios"]
    for key in ("save_time zero2-dp2to1 tenplex_memory/ds_save", "load_time zero2-dp2to1 tenplex_memory/tenplex",
                "reshard_time zero2-dp2to1 tenplex_memory/ds_universal"):
        assert key in res["ratios"], key
    ratio_lines = [line for line in p.stdout.splitlines() if line.startswith("RATIO ")]
    assert len(ratio_lines) == len(res["ratios"])
    assert "correctness: PASSED" in p.stdout
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
