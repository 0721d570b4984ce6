"""Smoke test of ``python -m benchmarks.planning``: both parts run end to end and print their figures (the chunk
steps' medians, the layout search's candidates and CPU seconds); the figures themselves are measured, not checked."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.harness import ROOT

pytestmark = [pytest.mark.bench]


def _run(*args: str) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "benchmarks.planning", *args], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    return p.stdout


def test_bench_planning_chunks_and_autolayout(tmp_path) -> None:
    out = _run("--chunks", "1000", "--repeat", "1", "--out", str(tmp_path / "p.json"))
    assert "comb: read + check + plan" in out and (tmp_path / "p.json").exists()
    out = _run("--autolayout", "--repeat", "1")
    m = re.search(r"(\d+) candidates ranked in ([\d.]+) s of CPU", out)
    assert m and int(m.group(1)) > 20000, out
