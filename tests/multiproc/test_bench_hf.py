"""Smoke test of ``python -m benchmarks.hf --quick``: tiny GPT-2 and Llama, every step runs, RATIO lines printed, and the
round trip transformers -> TP2 x PP2 tenplex checkpoint -> transformers is bit-exact (the script checks it)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.harness import ROOT

pytestmark = [pytest.mark.dist, pytest.mark.bench]


def test_bench_hf_quick(tmp_path) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "benchmarks.hf", "--quick", "--workdir",
                        str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    for model in ("gpt2-tiny", "llama-tiny"):
        assert "round trip exact: " in p.stdout and f"{model}/hf" in p.stdout
        for what in ("export", "import"):
            assert f"RATIO seconds {what} {model} tenplex/plain = " in p.stdout
            assert f"RATIO peak_anon {what} {model} tenplex/plain = " in p.stdout
