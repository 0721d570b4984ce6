"""The README's demo, end to end: a chain of restarts (TP2 -> TP1 -> PP2) continues the reference loss curve.

This is also the test of a checkpoint written by a job that was itself resumed
(load, train, save, load again), which single-restart cases cannot cover.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.harness import ROOT

pytestmark = pytest.mark.dist


def test_demo_elastic_chain(tmp_path) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "demo.py"), "--out", str(tmp_path / "demo"),
                        "--steps-per-phase", "4"],  # the README's demo runs 10: the same chain, fewer steps
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "tp=2,pp=1,dp=1   tp=1,pp=1,dp=1" in p.stdout
    assert "tp=1,pp=1,dp=1   tp=1,pp=2,dp=1" in p.stdout
    worst = float(p.stdout.split("largest relative difference: ")[1].split()[0])
    assert worst < 1e-5
    assert (tmp_path / "demo_loss.png").stat().st_size > 10_000
